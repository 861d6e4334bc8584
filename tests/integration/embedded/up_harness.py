"""``tangram up`` as a real subprocess, as a user runs it, and what it started.

Its output is read by a thread into a queue, so that a test waits for a line with a deadline
instead of blocking on a pipe; what each pool's hosts are (pids, cores, uid ranges) comes from the
embedded gateway's own ``GET /v1/pools``.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from arl_tangram.runtime.local import UID_BLOCK, processes_of_uids


@dataclass
class Up:
    """A running ``tangram up``: its process, gateway URL and every line it printed so far."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str] = field(default_factory=list)

    def pools(self) -> dict[str, dict[str, Any]]:
        items = requests.get(self.url + "/v1/pools", timeout=10).json()["items"]
        return {f"{i['namespace']}/{i['name']}": i for i in items}

    def hosts(self, pool: str) -> list[dict[str, Any]]:
        hosts: list[dict[str, Any]] = self.pools()[pool]["hosts"]
        return hosts

    def output(self) -> str:
        return "".join(self.lines)


def pool_doc(name: str = "py", **scaling: Any) -> dict[str, Any]:
    """A one-core-per-host ActionPool as a user would write it (``scaling`` overrides its scaling)."""
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": name},
        "spec": {
            "template": {"image": "local", "resources": {"cpu": "1", "memory": "2Gi"}},
            "languages": ["python", "bash"],
            "limits": {"timeoutSeconds": 60, "memory": "1Gi", "maxCores": 1},  # verl asks 1024 MB
            "scaling": {"minHosts": 1, "maxHosts": 1, "warmHosts": 0, **scaling},
        },
    }


def wait_until(predicate: Callable[[], object], deadline_s: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something true; fail naming ``what`` after the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # a poll interval, not synchronisation
    raise AssertionError(f"timed out after {deadline_s:g}s waiting for {what}")


_UID_BASES = itertools.count()


def uid_base_for_test() -> int:
    """A fresh base at each call: runs alive at once (a module's fixture and a test's own) must not
    share uids, and tangram up refuses a range another run holds. Disjoint from the sandbox
    harness's range (100000 + (pid % 400) * 200) and from other test processes."""
    return 500_000 + (os.getpid() % 200) * 200_000 + (next(_UID_BASES) % 20) * UID_BLOCK


@contextmanager
def tangram_up(
    *files: Path, extra: tuple[str, ...] = (), start_timeout_s: float = 60, own_uid_base: bool = True
) -> Iterator[Up]:
    """Start ``tangram up -f FILES --port 0`` and wait for its gateway line; SIGINT at the end.
    ``own_uid_base``: pass this test's --uid-base (else tangram up picks a free range itself)."""
    argv = [sys.executable, "-m", "arl_tangram", "up", "--port", "0"]
    if own_uid_base:
        argv += ["--uid-base", str(uid_base_for_test())]
    for f in files:
        argv += ["-f", str(f)]
    proc = subprocess.Popen(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    up = Up(proc, "")
    collector: list[threading.Thread] = []
    try:
        end = time.monotonic() + start_timeout_s
        while not up.url:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
            if line is None:
                raise AssertionError(f"tangram up exited {proc.wait()} before serving:\n{up.output()}")
            up.lines.append(line)
            if "gateway on " in line:
                up.url = line.split("gateway on ", 1)[1].split()[0]

        def collect() -> None:
            while (line := lines.get()) is not None:
                up.lines.append(line)

        collector.append(threading.Thread(target=collect, daemon=True))
        collector[0].start()
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for t in collector:
            t.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def leftovers(pids: list[int], uid_ranges: list[range]) -> list[str]:
    """What of ``pids`` and of processes under ``uid_ranges`` is still alive (zombies count)."""
    alive = [f"pid {p}" for p in pids if Path(f"/proc/{p}").exists()]
    for uids in uid_ranges:
        alive += [f"pid {p} (uid in {uids.start}..{uids.stop})" for p in processes_of_uids(uids)]
    return alive
