"""The gateway without replicas, for the offline commands (``prefix-router explain``,
``prefix-router diagnose``): the live path's rendering, salt policy and hashing."""

from __future__ import annotations

import argparse

from router.config import ConfigError, load_config
from router.gateway import Gateway
from router.loading import load_renderer
from router.usage import UsageError, at_least, check_file, check_tokenizer


def offline_gateway(tokenizer: str, block_size: int, config_file: str | None) -> Gateway:
    """A gateway with no replicas. Raises ``ConfigError``."""
    try:  # before the tokenizer's seconds of loading
        check_tokenizer("--tokenizer", tokenizer)
        check_file("--config", config_file)
        at_least("--block-size", block_size, 1)
    except UsageError as e:
        raise ConfigError(str(e)) from None
    config = load_config(
        argparse.Namespace(config=config_file), tokenizer=tokenizer, block_size=block_size
    )
    return Gateway(config, load_renderer(tokenizer, None, config.max_prompt_chars))
