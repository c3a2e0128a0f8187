"""Every command answers wrong input, a missing file, a taken port or an unreachable
dependency with one line on stderr naming the cause, exit status 2 and no traceback.

Run in-process through ``router.cli.main`` (what ``prefix-router`` runs); a subprocess only
where the process's own exit matters (the taken port, --debug)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import cli
from router.core.bundled import tokenizer_dir

ROOT = Path(__file__).resolve().parent.parent
TOK = str(tokenizer_dir())
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens on loopback there


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# (argv, words the one line must contain)
CASES: list[tuple[list[str], list[str]]] = [
    # serve
    (["serve", "--port", "abc"], ["--port", "int"]),
    (["serve", "--port", "70000", "--replica", DEAD], ["port", "65535"]),
    (["serve"], ["no replicas", "--replica"]),
    (["serve", "--replica", "10.0.0.1:8000"], ["http://"]),
    (["serve", "--replica", DEAD, "--tokenizer", "/nope"], ["/nope", "no such directory"]),
    (["serve", "--replica", DEAD, "--config", "/nope.yaml"], ["/nope.yaml", "not found"]),
    (["serve", "--replica", DEAD, "--api-keys-file", "/nope.yaml"], ["/nope.yaml", "no such"]),
    (["serve", "--replica", DEAD, "--policy", "fastest"], ["fastest"]),
    (["serve", "--bogus-flag"], ["unrecognized", "--bogus-flag"]),
    # demo
    (["demo", "--gpu-blocks", "0"], ["--gpu-blocks", "at least 1"]),
    (["demo", "--policies", "bogus"], ["bogus", "ttft"]),
    (["demo", "--replicas", "0"], ["--replicas", "at least 1"]),
    (["demo", "--rate", "0"], ["--rate", "positive"]),
    (["demo", "--replicas", "x"], ["--replicas", "int"]),
    # replica (and its alias loadtest sim)
    (["replica", "--tokenizer", "/nope"], ["/nope", "no such directory"]),
    (["replica", "--port", "70000"], ["--port", "65535"]),
    (["replica", "--port", "65535", "--count", "2"], ["past port 65535"]),
    (["replica", "--count", "0"], ["--count", "at least 1"]),
    (["replica", "--block-size", "0"], ["--block-size", "positive"]),
    (["replica", "--prefill-tokens-per-s", "0"], ["--prefill-tokens-per-s", "positive"]),
    (["replica", "--log-level", "loud"], ["--log-level", "loud"]),
    (["loadtest", "sim", "--port", "-1"], ["--port", "65535"]),
    # loadtest run / compare
    (["loadtest"], ["required", "command"]),
    (["loadtest", "run", "--workload", "preamble", "--concurrency", "0"], ["--concurrency"]),
    (["loadtest", "run", "--workload", "bogus"], ["--workload", "bogus"]),
    (["loadtest", "run", "--workload", "preamble"], ["--replica", "--sim"]),
    (["loadtest", "run", "--workload", "preamble", "--sim", "0"], ["--sim", "at least 1"]),
    (["loadtest", "run", "--workload", "preamble", "--max-seconds", "0"], ["--max-seconds"]),
    (
        ["loadtest", "run", "--workload", "trace", "--trace", "/nope.jsonl", "--sim", "1"],
        ["/nope.jsonl", "no such file"],
    ),
    (["loadtest", "run", "--workload", "preamble", "--trace", TOK], ["--trace", "trace only"]),
    (["loadtest", "run", "--workload", "preamble", "--replica", "host:1"], ["not a URL"]),
    (
        ["loadtest", "run", "--workload", "preamble", "--gateway", DEAD, "--replica", DEAD],
        ["cannot reach --gateway", DEAD],
    ),
    (["loadtest", "run", "--workload", "preamble", "--replica", DEAD], ["cannot reach", DEAD]),
    (["loadtest", "compare", "--workload", "preamble", "--policies", "fastest"], ["fastest"]),
    (["loadtest", "compare", "--workload", "preamble"], ["--policies", "--targets"]),
    (["loadtest", "compare", "--workload", "preamble", "--targets", "gw"], ["NAME=URL"]),
    (["loadtest", "compare", "--workload", "multi_tenant", "--position", "last"], ["preamble"]),
    # explain / diagnose
    (["explain"], ["cannot read standard input"]),  # pytest's stdin cannot be read
    (["explain", "--tokenizer", "/nope"], ["/nope", "no such directory"]),
    (["explain", "/nope.jsonl", "--tokenizer", TOK], ["/nope.jsonl"]),
    (["explain", "--tokenizer", TOK, "--block-size", "0"], ["--block-size", "at least 1"]),
    (["explain", "--tokenizer", TOK, "--config", "/nope.yaml"], ["/nope.yaml"]),
    (["diagnose", "/nope.jsonl", "--tokenizer", TOK], ["/nope.jsonl", "cannot read"]),
    (["diagnose", "--tokenizer", TOK], ["file"]),
    (["diagnose", "x.jsonl", "--tokenizer", "/nope"], ["/nope"]),
    (["no-such-command"], ["no-such-command"]),
]


def status_of(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse exits on its own errors
        return e.code if isinstance(e.code, int) else 2


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_wrong_input_is_one_line(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    status = status_of(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert status == 2, (status, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err + out
    assert lines[0].startswith("prefix-router"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def run(*argv: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``prefix-router argv`` in a subprocess (``code``: a script to run instead of the
    module, with ``argv`` as its arguments)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFIX_ROUTER_DEBUG", None)
    entry = ["-c", code] if code is not None else ["-m", "router.cli"]
    return subprocess.run(
        [sys.executable, *entry, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_serve_on_a_taken_port_says_so_before_starting(taken_port: int) -> None:
    res = run("serve", "--replica", DEAD, "--port", str(taken_port))
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert f"port {taken_port} on 127.0.0.1 is already in use" in line and "--port" in line
    assert "gateway ready" not in res.stderr and "starting" not in res.stdout


def test_metrics_port_taken(taken_port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    res = run("serve", "--replica", DEAD, "--port", str(free), "--metrics-port", str(taken_port))
    assert res.returncode == 2
    (line,) = res.stderr.strip().splitlines()
    assert "already in use" in line and "--metrics-port" in line


def test_replica_on_a_taken_port(taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert status_of(["replica", "--port", str(taken_port)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"port {taken_port}" in line and "already in use" in line


def test_debug_shows_the_traceback() -> None:
    res = run("--debug", "replica", "--tokenizer", "/nope")
    assert res.returncode != 0 and "Traceback" in res.stderr and "UsageError" in res.stderr
    plain = run("replica", "--tokenizer", "/nope")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr


def test_help_names_the_real_programs_and_no_markup(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, prog in [
        (["replica", "--help"], "usage: prefix-router replica"),
        (["loadtest", "--help"], "usage: prefix-router loadtest"),
        (["loadtest", "compare", "--help"], "usage: prefix-router loadtest compare"),
        (["demo", "--help"], "usage: prefix-router demo"),
        (["explain", "--help"], "usage: prefix-router explain"),
        (["diagnose", "--help"], "usage: prefix-router diagnose"),
        (["serve", "--help"], "usage: prefix-router serve"),
    ]:
        assert status_of(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(prog), (argv, out[:80])
        assert "python -m" not in out and "``" not in out and "::" not in out, argv
        flat = " ".join(out.split())  # argparse wraps lines where the text happens to end
        if argv[0] == "demo":
            assert "(default: 2048)" in flat and "(default: ring_spill,round_robin)" in flat
        if argv[0] == "explain":
            assert "(default: 16)" in flat
        if argv[1:2] == ["compare"]:
            assert "client-side until" not in out
        if argv[0] == "serve":
            assert "32 MiB" in out


def test_loadtest_runs_without_the_pytorch_notice(tmp_path: Path) -> None:
    """transformers announces on import that PyTorch is absent; the tools only tokenize."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    res = subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "--workload", "preamble", "--sim", "1"]
        + ["--sim-instant", "--max-requests", "2", "--quiet", "--no-ideal"]
        + ["--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "PyTorch" not in res.stderr, res.stderr
