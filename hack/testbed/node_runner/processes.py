"""A container's processes from the host's side: what runs in the child before exec, stopping a
process group with a grace period, and the PID records cluster-down uses after a runner died."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from . import isolation

Process = subprocess.Popen[bytes]


def in_child(cores: tuple[int, ...], die_with_runner: bool) -> Callable[[], None]:
    """Popen's preexec_fn: the container's CPU affinity (inherited by all it starts), and without
    bubblewrap death with the runner."""

    def child() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        if die_with_runner:
            isolation.set_pdeathsig()

    return child


def record_pid(path: Path, pid: int) -> None:
    """Writes "PID STARTTIME" (field 22 of /proc/PID/stat), so cluster-down can tell the process from a
    later one that reuses its PID."""
    start = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    path.write_text(f"{pid} {start}\n")


def stop(procs: Sequence[Process], grace: float) -> None:
    """SIGTERM to each process group, SIGKILL to those still there after `grace` seconds; returns
    once all have exited (their return codes are on the Popen objects)."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
