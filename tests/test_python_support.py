"""Honest Python support: CI runs the suite on the lowest and the highest Python pyproject
admits, and the few 3.11+ APIs the gateway uses go through router/core/compat.py."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from router.core import compat

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def admitted() -> list[tuple[int, int]]:
    classifiers = PROJECT["project"]["classifiers"]
    found = [re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c) for c in classifiers]
    return sorted((3, int(m.group(1))) for m in found if m)


def test_ci_runs_the_lowest_and_the_highest_admitted_python() -> None:
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PROJECT["project"]["requires-python"])
    assert floor is not None
    versions = admitted()
    # The classifiers name every minor version from the floor up, with no gap.
    assert versions[0] == (int(floor.group(1)), int(floor.group(2)))
    assert [m for _, m in versions] == list(range(versions[0][1], versions[-1][1] + 1))
    out = subprocess.run(
        [str(ROOT / ".ci" / "run"), "--print-matrix"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    assert out == [f"{a}.{b}" for a, b in (versions[0], versions[-1])]
    assert (3, 13) in versions  # the newest CPython this project is tested on


def test_this_python_is_one_pyproject_admits() -> None:
    assert sys.version_info[:2] in admitted()


def test_mypy_checks_against_the_lowest_python() -> None:
    """mypy flags a 3.11+ API (asyncio.timeout, TaskGroup, ...) in router/ on its own."""
    floor = PROJECT["project"]["requires-python"].removeprefix(">=")
    assert PROJECT["tool"]["mypy"]["python_version"] == floor


def test_the_test_script_names_a_missing_interpreter() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "test.sh"), "--python", "/nonexistent/python3.99"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "no Python interpreter '/nonexistent/python3.99'" in done.stderr


async def test_compat_timeout_raises_what_asyncio_raises_and_reschedules() -> None:
    loop = asyncio.get_running_loop()
    never = asyncio.Event()
    with pytest.raises(asyncio.TimeoutError):  # the class 3.10's wait_for raises too
        async with compat.timeout(0.01):
            await never.wait()
    # Rescheduled past its first deadline, the block finishes.
    done = asyncio.Event()
    loop.call_later(0.05, done.set)
    async with compat.timeout(0.01) as deadline:
        deadline.reschedule(loop.time() + 60)
        await done.wait()
    assert done.is_set()
