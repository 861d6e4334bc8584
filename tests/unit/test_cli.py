"""The ``tangram`` command: every listed command reaches a real entry point; bad commands are named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arl_tangram import cli

TANGRAM = Path(sys.executable).parent / "tangram"
NAMES = [*cli.COMMANDS, *(f"bench {b}" for b in cli.BENCH)]


def test_help_lists_every_command_with_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    helps = {**cli.COMMANDS, **{f"bench {b}": t for b, t in cli.BENCH.items()}}
    listed = {
        line.split("  ")[1].strip(): line.split("  ", 2)[-1].strip() for line in lines if line[:2] == "  "
    }
    assert listed == {name: text for name, (_, text) in helps.items()}


def test_every_command_answers_help_as_tangram() -> None:
    """Each target imports, parses its options and says it is ``tangram NAME``: the installed console
    script, one process per command (they run side by side: each imports its own stack)."""
    procs = {
        name: subprocess.Popen(
            [str(TANGRAM), *name.split(), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name in NAMES
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"tangram {name} --help: {err}"
        assert out.startswith(f"usage: tangram {name} "), f"tangram {name} --help: {out[:200]}"


def test_unknown_command_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_unknown_bench_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "frobnicate"]) == 2
    assert f"choose one of {', '.join(cli.BENCH)}" in capsys.readouterr().err


def test_no_command_prints_the_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith("usage: tangram COMMAND")
