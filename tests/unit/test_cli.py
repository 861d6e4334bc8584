"""The ``tangram`` command: every listed command reaches a real entry point; bad commands are named."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
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


def test_ctrl_c_before_a_command_serves_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C while a command still reads its input or imports its modules (a second or two of
    ``tangram up``'s start) ends it with one line and status 130, as a shell reports an interrupt:
    it printed a page of KeyboardInterrupt traceback from deep in an import. The spec file is a
    named pipe the test holds open without writing, so that the interrupt comes while ``tangram
    up`` is reading it, before any event loop or signal handler of its own.

    Ctrl-C is what a terminal sends; a test run started in the background (``make test &``, as CI
    may be) ignores SIGINT, and its children inherit that: Python then installs no handler and the
    interrupt would never come. The child is given the default, as a terminal's would have."""
    spec = tmp_path / "pool.yaml"
    os.mkfifo(spec)
    proc = subprocess.Popen(
        [sys.executable, "-m", "arl_tangram", "up", "-f", str(spec), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # Opening the write end without blocking succeeds once the reader has it open.
        deadline = time.monotonic() + 60
        while True:
            try:
                writer = os.open(spec, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as exc:
                assert exc.errno == errno.ENXIO and time.monotonic() < deadline, exc
                time.sleep(0.05)
        try:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            os.close(writer)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err == "tangram up: interrupted\n", err
