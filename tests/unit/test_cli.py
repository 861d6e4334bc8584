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


@pytest.mark.parametrize("name", NAMES)
def test_every_command_answers_help_as_tangram(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each target imports, parses its options and calls itself ``tangram NAME``."""
    with pytest.raises(SystemExit) as done:
        cli.main([*name.split(), "--help"])
    assert done.value.code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tangram {name} "), out[:200]


def test_the_console_script_is_installed() -> None:
    result = subprocess.run([str(TANGRAM), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: tangram COMMAND"), result.stderr


def test_unknown_command_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_unknown_bench_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "frobnicate"]) == 2
    assert f"choose one of {', '.join(cli.BENCH)}" in capsys.readouterr().err


def test_no_command_prints_the_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith("usage: tangram COMMAND")
