"""``prefix-router``: serve the gateway, run the demo, simulate replicas, load-test."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from router import __version__
from router.config import Config, ConfigError, add_arguments, dump_yaml, load_config
from router.ops.command_line import (
    DEBUG_ENV,
    OneLineParser,
    UsageError,
    check_can_listen,
    check_file,
    check_tokenizer,
    listen_error,
    run,
)

if TYPE_CHECKING:
    from aiohttp import web

DESCRIPTION = """\
An OpenAI-compatible gateway for vLLM fleets that routes each request to the replica most
likely to hold its prompt's prefix in its KV cache (token-exact, salt-aware), without piling
the fleet's traffic onto one replica."""


def _serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except ConfigError as e:
        raise UsageError(e.problems) from None
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    listed = config.discovery.replicas + config.disaggregation.decode_replicas
    named = config.discovery.discovery_dns or config.disaggregation.pd_decode_dns
    if not listed and not named:
        raise UsageError(
            "no replicas: pass --replica URL (repeatable), set replicas in --config, "
            "PREFIX_ROUTER_REPLICAS, or discovery_dns (to try it without vLLM: "
            "prefix-router demo)"
        )
    # Checked now, not after seconds of tokenizer loading and replica probing.
    check_tokenizer("--tokenizer", config.routing.tokenizer)
    check_file("--api-keys-file", config.auth.api_keys_file)
    try:
        from router.tenancy.table import load_table

        load_table(config)  # --auth's missing settings now, all at once, before starting
    except ConfigError as e:
        raise UsageError(e.problems) from None
    if config.server.ext_proc_port is not None:
        from router.ext_proc import missing

        if (needed := missing()) is not None:  # gRPC and Envoy's protos are an extra
            raise UsageError(needed)
    check_can_listen(config.server.host, config.server.port, reuse_port=config.server.workers > 1)
    if config.server.metrics_port:
        check_can_listen(config.server.host, config.server.metrics_port, flag="--metrics-port")
    if config.server.ext_proc_port:
        check_can_listen(config.server.host, config.server.ext_proc_port, flag="--ext-proc-port")
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.server.workers > 1 and not config.fleet.redis_url:
        logging.getLogger("prefix_router").warning(
            "%d workers without redis_url: each worker learns its own prefix map, so a "
            "prefix seen by one worker is unknown to the others (set redis_url to share it)",
            config.server.workers,
        )
    print(
        f"prefix-router {__version__} starting on http://{config.server.host}:{config.server.port} "
        f"(policy {config.routing.policy}, {len(config.discovery.replicas)} replicas, {config.server.workers} "
        f"worker{'s' if config.server.workers > 1 else ''})",
        flush=True,
    )
    if config.server.workers == 1:
        return _run_worker(config)
    return _run_workers(config)


def _run_worker(config: Config) -> int:
    """One gateway process: its own event loop (uvloop when installed) and app."""
    from router.http.app import build_app
    from router.ops.admin import SERVED_EXTENSIONS

    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        app = build_app(config, extensions=SERVED_EXTENSIONS)
    except ConfigError as e:
        raise UsageError(e.problems) from None
    _log_lifecycle(app, config)
    app.on_startup.append(_freeze_start_up_objects)  # after the gateway's own start
    try:
        _run_app(app, config, loop)
    except OSError as e:  # lost a race for the port checked free at start
        raise UsageError(listen_error(config.server.host, config.server.port, e)) from None
    return 0


async def _freeze_start_up_objects(app: web.Application) -> None:
    """What start-up built (the tokenizer, the template, ~100k objects of transformers) lives
    as long as the process: out of the collector's sight, a full collection no longer stalls
    the event loop for ~80-250 ms walking it."""
    import gc

    gc.freeze()


def _log_lifecycle(app: web.Application, config: Config) -> None:
    """Log the drain and the stop (SIGTERM or SIGINT starts both); "gateway ready" is the
    start."""
    log = logging.getLogger("prefix_router")

    async def draining(app: web.Application) -> None:
        log.info(
            "shutting down: no new connections; in-flight requests have %gs to finish",
            config.server.shutdown_grace_s,
        )

    async def stopped(app: web.Application) -> None:
        log.info("stopped")

    app.on_shutdown.insert(0, draining)
    app.on_cleanup.append(stopped)


def _run_app(app: web.Application, config: Config, loop: asyncio.AbstractEventLoop) -> None:
    from router.http.app import run_app

    run_app(app, config, loop)  # aiohttp's run_app, with the gateway's connection limits


def _run_workers(config: Config) -> int:
    """``workers`` processes on one port (SO_REUSEPORT: the kernel spreads connections). The
    parent forwards SIGINT/SIGTERM and exits with the first non-zero status."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_worker_process, args=(config,), name=f"worker-{i}")
        for i in range(config.server.workers)
    ]
    for p in procs:
        p.start()

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    for p in procs:
        p.join()
        status = status or (p.exitcode or 0)
    return status


def _worker_process(config: Config) -> None:
    """A ``workers > 1`` child: its errors are one line too, and its status is the exit code."""
    sys.exit(run("prefix-router serve", lambda: _run_worker(config)))


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# Subcommands built into the gateway, each parsed by its module's own ``main(argv)``.
DELEGATED = {
    "explain": ("router.ops.explain", "print token ids and block hashes for request bodies"),
    "diagnose": (
        "router.ops.diagnose",
        "explain a low prefix-cache hit rate from captured requests",
    ),
}

# Subcommands other packages add (the demo, the vLLM simulator and the load tests, which live
# above the gateway and import it, never the other way round). Each entry point names an
# object with a ``help`` line that is called with the subcommand's argv and returns an exit
# status: it parses its own flags, so nested subcommands and their --help stay the plugin's.
PLUGIN_GROUP = "prefix_router.commands"
PLUGIN_HINT = (
    "The demo, the simulated vLLM replicas and the load tests (prefix-router demo | replica |\n"
    "loadtest) are not installed here; they come with the load-test tools:\n"
    "  pip install '.[loadtest]'   (in a prefix-router checkout)"
)


class Command(Protocol):
    help: str

    def __call__(self, argv: list[str]) -> int: ...


def _plugin_entry_points() -> list[EntryPoint]:
    """The group's entry points from the installed metadata; when there are none, the same
    table read from the pyproject.toml of the source tree this package was imported from.

    Why the fallback: metadata is written at install time, so an uninstalled checkout (or an
    editable install made before the table existed) has none, yet the table is right there.
    Reading it keeps pyproject.toml the one declaration of the plugins, and router/ never
    names the packages that provide them."""
    found = list(entry_points(group=PLUGIN_GROUP))
    if found:
        return found
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # the backport, when installed (pytest and mypy bring it)
            import tomli as tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
    except (ImportError, OSError, ValueError):  # no tomli (3.10), no file, bad TOML
        return []
    if project.get("name") != "prefix-router":
        return []
    table = project.get("entry-points", {}).get(PLUGIN_GROUP, {})
    return [EntryPoint(name, value, PLUGIN_GROUP) for name, value in table.items()]


def plugin_commands() -> dict[str, Command]:
    """The installed plugin commands by name; one that cannot be imported is left out (and
    ``prefix-router --help`` says how to get it)."""
    commands: dict[str, Command] = {}
    # By name: installed metadata and pyproject.toml need not list them in the same order.
    for ep in sorted(_plugin_entry_points(), key=lambda ep: ep.name):
        if ep.name in DELEGATED or ep.name == "serve" or ep.name in commands:
            continue  # a plugin never shadows a built-in command
        try:
            command = ep.load()
        except ImportError:
            continue
        if callable(command):
            commands[ep.name] = command
    return commands


def _delegate(command: str, argv: list[str]) -> int:
    import importlib

    main = importlib.import_module(DELEGATED[command][0]).main
    return int(main(argv) or 0)


def build_parser(commands: Mapping[str, Command] | None = None) -> argparse.ArgumentParser:
    """The top-level parser; ``commands``: the plugin commands to list (default: discover)."""
    if commands is None:
        commands = plugin_commands()
    parser = OneLineParser(
        prog="prefix-router",
        description=DESCRIPTION,
        epilog=None if commands else PLUGIN_HINT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"prefix-router {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="tracebacks instead of one-line errors",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the gateway in front of vLLM replicas",
        description="Run the gateway. Every option is also a config-file "
        "key (--config) and a PREFIX_ROUTER_* environment variable; flags "
        "win over the environment, which wins over the file.",
    )
    add_arguments(serve)
    serve.set_defaults(func=_serve)

    # Parsed by the subcommand's own parser (see main); listed here for --help.
    for name, command in commands.items():
        sub.add_parser(name, help=getattr(command, "help", None), add_help=False)
    for name, (_, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # transformers announces at import that PyTorch is absent; the gateway only needs tokenizers.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "--debug" in argv:  # any command: tracebacks instead of one-line errors
        argv.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    name = argv[0] if argv else ""
    prog = f"prefix-router {name}" if name and not name.startswith("-") else "prefix-router"
    if name in DELEGATED:
        return run(prog, lambda: _delegate(name, argv[1:]))
    # `serve` needs no plugin: the gateway process never imports one.
    commands = {} if argv[:1] == ["serve"] else plugin_commands()
    if name in commands:
        return run(prog, lambda: int(commands[name](argv[1:]) or 0))
    if argv and not commands and name != "serve" and not name.startswith("-"):
        print(f"prefix-router: no command {name!r} here.\n{PLUGIN_HINT}", file=sys.stderr)
        return 2
    parser = build_parser(commands)

    def parsed() -> int:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args))

    return run(prog, parsed)


if __name__ == "__main__":
    sys.exit(main())
