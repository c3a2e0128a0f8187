"""The gateway without replicas, for the offline commands (``prefix-router explain``,
``prefix-router diagnose``): the live path's rendering, salt policy and hashing, with the
tokenizer found as ``serve`` finds it (``--tokenizer``, else the bodies' model; a model id
with a bundled tokenizer needs no Hugging Face cache)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator

from router.api.convert import CONVERTERS
from router.config import ConfigError, load_config
from router.gateway import Gateway
from router.models.loading import load_renderer, tokenizer_source
from router.ops.command_line import UsageError, at_least, check_file, check_tokenizer


def check_flags(tokenizer: str | None, block_size: int, config_file: str | None) -> None:
    """The flags, checked before any body is read or the tokenizer's seconds of loading.
    Raises ``ConfigError``."""
    try:
        check_tokenizer("--tokenizer", tokenizer)
        check_file("--config", config_file)
        at_least("--block-size", block_size, 1)
    except UsageError as e:
        raise ConfigError(str(e)) from None


def read_lines(path: str) -> Iterator[str]:
    """The lines of ``path`` ('-': standard input), read as they are consumed. Raises
    ``ConfigError`` when it cannot be opened."""
    name = "standard input" if path == "-" else path
    try:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise ConfigError(f"cannot read {name}: {e.strerror}") from None

    def lines() -> Iterator[str]:
        with stream:
            try:
                yield from stream
            except OSError as e:
                raise ConfigError(f"cannot read {name}: {e.strerror or e}") from None

    return lines()


def model_of(lines: Iterator[str]) -> tuple[str | None, Iterator[str]]:
    """The first ``model`` a request body names (what ``serve`` learns from its replicas),
    and the lines again: those read to find it, then the rest, still unread."""
    seen: list[str] = []
    found = None
    for line in lines:
        seen.append(line)
        try:
            body = json.loads(line)
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
            found = str(body["model"])
            break
    return found, itertools.chain(seen, lines)


def open_offline(command: str, a: argparse.Namespace) -> tuple[Gateway, Iterator[str]] | None:
    """``prefix-router COMMAND``'s offline gateway and its input's lines, from its flags
    (``tokenizer``, ``block_size``, ``config``, ``file``), the tokenizer it chose said on
    stderr; None once it has said on stderr why it cannot start (exit 2)."""
    try:
        check_flags(a.tokenizer, a.block_size, a.config)
        model, lines = (
            model_of(read_lines(a.file)) if not a.tokenizer else (None, read_lines(a.file))
        )
        gateway = offline_gateway(a.tokenizer, a.block_size, a.config, model)
    except ConfigError as e:
        print(f"prefix-router {command}: {e}", file=sys.stderr)
        return None
    print(f"prefix-router {command}: tokenizer {gateway.tokenizer_source}", file=sys.stderr)
    return gateway, lines


def offline_gateway(
    tokenizer: str | None, block_size: int, config_file: str | None, model: str | None = None
) -> Gateway:
    """A gateway with no replicas, rendering with ``tokenizer`` or else ``model``'s.
    Raises ``ConfigError``."""
    check_flags(tokenizer, block_size, config_file)
    if not tokenizer and not model:
        raise ConfigError(
            "no --tokenizer given and no request body names its model; pass --tokenizer "
            "DIR_OR_MODEL_ID"
        )
    config = load_config(
        argparse.Namespace(config=config_file), tokenizer=tokenizer, block_size=block_size
    )
    renderer = load_renderer(tokenizer, model, config.limits.max_prompt_chars)
    gateway = Gateway(config, renderer, converters=CONVERTERS)
    gateway.tokenizer_source = tokenizer_source(tokenizer, model)
    return gateway
