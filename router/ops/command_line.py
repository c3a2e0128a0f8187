"""Wrong input answered in one line: the parser, the error type and the checks every
``prefix-router`` command shares, so none of them answers a typo with a traceback.

A command raises :class:`UsageError` with a message naming the cause and the fix; its
``main`` runs under :func:`run`, which prints ``PROG: MESSAGE`` on stderr and
returns 2. ``--debug`` (or ``PREFIX_ROUTER_DEBUG=1``) lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

DEBUG_ENV = "PREFIX_ROUTER_DEBUG"


class UsageError(Exception):
    """Wrong input or environment; the message is one line: the cause, then the fix. Several
    problems found at once (a config's) are one line each, all reported together."""

    def __init__(self, message: str | list[str]) -> None:
        self.problems = [message] if isinstance(message, str) else list(message)
        super().__init__("\n".join(self.problems))


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line(text: object) -> str:
    """``text`` on one line (a multi-line message joined with "; ")."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (argparse prints the usage first), with
    a did-you-mean for a misspelt flag."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message += _flag_hints(self, message.split(":", 1)[1].split())
        self.exit(2, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of ``parser`` and of its subcommands' parsers."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def _flag_hints(parser: argparse.ArgumentParser, given: list[str]) -> str:
    known = _option_strings(parser)
    hints = []
    for arg in given:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    return f" ({'; '.join(hints)})" if hints else ""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; descriptions and epilogs kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def run(prog: str, main: Callable[[], int]) -> int:
    """``main()``'s status. Wrong input (a UsageError, a ``SystemExit("message")``) or an
    exception escaping the command: one line on stderr and 2 (with ``--debug``: the
    traceback). argparse's own exits (``--help``, a bad flag) pass through as SystemExit."""
    try:
        return main()
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        return _fail(prog, e.code.removeprefix(f"{prog}: ").removeprefix("prefix-router: "))
    except UsageError as e:
        if debug():
            raise
        if len(e.problems) > 1:
            return _fail_all(prog, e.problems)
        return _fail(prog, str(e))
    except Exception as e:
        if debug():
            raise
        return _fail(prog, f"{type(e).__name__}: {e} (rerun with --debug for the traceback)")


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: {one_line(message)}", file=sys.stderr, flush=True)
    return 2


def _fail_all(prog: str, problems: list[str]) -> int:
    lines = [f"{prog}: {len(problems)} problems, all of them listed:"]
    lines += [f"  - {one_line(p)}" for p in problems]
    print("\n".join(lines), file=sys.stderr, flush=True)
    return 2


# -- checks shared by the commands -----------------------------------------------------------


def at_least(name: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise UsageError(f"{name} must be at least {low:g}, got {value:g}")


def positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise UsageError(f"{name} must be positive, got {value:g}")


def check_port(name: str, port: int, *, allow_zero: bool = False) -> None:
    if not (0 if allow_zero else 1) <= port <= 65535:
        low = "0 (any free port)" if allow_zero else "1"
        raise UsageError(f"{name} must be {low}..65535, got {port}")


def check_can_listen(
    host: str, port: int, *, flag: str = "--port", reuse_port: bool = False
) -> None:
    """Bind ``host:port`` and let go, before seconds of start-up are spent on a port that is
    taken. SO_REUSEADDR as aiohttp sets it, so a port in TIME_WAIT is not reported taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(
            f"cannot listen on {host!r}: {e.strerror}; pass --host 127.0.0.1 (this machine) "
            "or 0.0.0.0 (every interface)"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port and hasattr(socket, "SO_REUSEPORT"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise UsageError(listen_error(host, port, e, flag)) from None


def listen_error(host: str, port: int, e: OSError, flag: str = "--port") -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is already in use: stop what holds it "
            f"(ss -ltnp 'sport = :{port}') or pass {flag} with a free port"
        )
    if e.errno == errno.EACCES:
        return f"no permission to listen on port {port}: ports below 1024 need root; pass {flag} 1024 or above"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: not an address of this machine; pass --host 127.0.0.1 or 0.0.0.0"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def check_file(flag: str, path: str | None, what: str = "file") -> None:
    if path is None or path == "-":
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such {what}; give the path of an existing one")
    if what == "file" and p.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file")


def check_tokenizer(flag: str, name: str | None) -> None:
    """A tokenizer given as a path must be a directory holding tokenizer.json (a model id
    is looked up by whoever loads it)."""
    if not name:
        return
    looks_like_path = name.startswith(("/", "./", "../", "~")) or Path(name).expanduser().exists()
    if not looks_like_path:
        return
    p = Path(name).expanduser()
    if not p.is_dir():
        raise UsageError(
            f"{flag} {name}: no such directory; give a directory with tokenizer.json and "
            "tokenizer_config.json, or a model id in the local Hugging Face cache"
        )
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise UsageError(
            f"{flag} {name}: no tokenizer.json or tokenizer_config.json in that directory"
        )
