"""The one-way house: router/ never imports loadtest/; ``prefix-router demo | replica |
loadtest`` are plugin commands the CLI discovers, absent (with a hint) when loadtest is not
importable, and the simulator runs without the [loadtest] extra (as in the gateway image)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from router import cli

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = ["demo", "loadtest", "replica"]


def run_cli(*argv: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``prefix-router ARGV`` in a fresh interpreter on this tree, with the modules in
    ``block`` made unimportable (as if not installed)."""
    code = (
        "import sys\n"
        f"for m in {list(block)!r}: sys.modules[m] = None\n"
        "from router.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_router_never_imports_loadtest() -> None:
    offenders = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args:  # import_module("loadtest...")
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    func = node.func
                    fname = getattr(func, "attr", getattr(func, "id", ""))
                    if fname in ("import_module", "__import__"):
                        names = [arg.value]
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                for n in names
                if n == "loadtest" or n.startswith("loadtest.")
            ]
    assert not offenders, offenders


def test_pyproject_declares_the_plugin_commands_and_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    table = project["entry-points"][cli.PLUGIN_GROUP]
    assert sorted(table) == PLUGINS
    for name, value in table.items():
        command = EntryPoint(name, value, cli.PLUGIN_GROUP).load()
        assert callable(command) and command.help
    extras = project["optional-dependencies"]
    assert "prefix-router[loadtest]" in extras["test"]
    plotting = {"matplotlib", "tqdm"}
    assert plotting <= {d.split(">")[0].split("=")[0] for d in extras["loadtest"]}
    assert not [d for d in project["dependencies"] if d.split(">")[0] in plotting]


def test_help_lists_the_plugin_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert list(cli.plugin_commands()) == PLUGINS
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert listed == ["serve", *PLUGINS, "explain", "diagnose"]
    assert "simulated replicas + the gateway vs round robin" in out
    assert cli.PLUGIN_HINT not in out


def test_plugin_commands_parse_their_own_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replica", "--count", "0"]) == 2
    assert "--count must be at least 1" in capsys.readouterr().err
    for argv, prog in [
        (["replica", "--help"], "usage: prefix-router replica"),
        (["loadtest", "sim", "--help"], "usage: prefix-router loadtest sim"),
        (["loadtest", "run", "--help"], "--workload"),
        (["demo", "--help"], "usage: prefix-router demo"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        assert prog in capsys.readouterr().out, argv


def test_commands_absent_without_loadtest() -> None:
    helped = run_cli("--help", block=("loadtest",))
    assert helped.returncode == 0, helped.stderr
    listed = [line.split()[0] for line in helped.stdout.splitlines() if line.startswith("    ")]
    assert listed == ["serve", "explain", "diagnose"]
    assert "pip install '.[loadtest]'" in helped.stdout
    demo = run_cli("demo", block=("loadtest",))
    assert demo.returncode == 2
    assert "no command 'demo'" in demo.stderr and "pip install '.[loadtest]'" in demo.stderr
    # The gateway itself does not care.
    serve = run_cli("serve", "--print-config", "--replica", "http://x:1", block=("loadtest",))
    assert serve.returncode == 0 and "replicas:" in serve.stdout, serve.stderr


def test_simulator_runs_without_the_loadtest_extra() -> None:
    """The gateway image has no matplotlib or tqdm; its simulator (compose.sim.yaml) must work
    and the demo must say what to install."""
    block = ("matplotlib", "tqdm")
    replica = run_cli("replica", "--help", block=block)
    assert replica.returncode == 0 and "--num-gpu-blocks" in replica.stdout, replica.stderr
    demo = run_cli("demo", block=block)
    assert demo.returncode == 2
    assert "needs tqdm" in demo.stderr and "pip install '.[loadtest]'" in demo.stderr
    lt = run_cli("loadtest", "run", block=block)
    assert lt.returncode == 2 and "matplotlib" in lt.stderr and "tqdm" in lt.stderr


def test_demo_end_to_end() -> None:
    """The README's first command, shrunk (it had no test): a simulated replica process and a
    gateway process, one policy, a handful of requests; all answered, the comparison printed.
    Most of its time is three processes loading the tokenizer."""
    res = run_cli(
        "demo",
        "--replicas",
        "1",
        "--tenants",
        "2",
        "--conversations",
        "3",
        "--max-requests",
        "9",
        "--rate",
        "50",
        "--think-time-s",
        "0.01",
        "--policies",
        "ttft",
    )
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("prefix-router (ttft)"))
    ok, lost = (int(x) for x in row.split()[-2:])
    assert ok == 9 and lost == 0
    assert "fleet hit rate:" in res.stdout
