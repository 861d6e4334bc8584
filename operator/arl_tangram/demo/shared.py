"""ARL-Tangram, really run: the rollout through ``tangram up``'s gateway onto one shared pool.

``tangram up`` is started as its own process (exactly as a user starts it) on a pool whose one host
holds the machine's cores; each trajectory opens a session through the gateway and its actions
are queued and scheduled by the dispatcher, each granted its own cores only while it runs. At the
end the process gets SIGINT (Ctrl-C) and must stop every agent it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import yaml

from arl_tangram.client import AsyncTangramClient, code_action
from arl_tangram.demo.pools import ACTION_TIMEOUT_S, NAMESPACE, SHARED_POOL, shared_pool_doc
from arl_tangram.demo.records import ActionRecord, Hold, RunRecord
from arl_tangram.demo.workload import Trajectory

UP_START_TIMEOUT_S = 120.0
UP_STOP_TIMEOUT_S = 60.0


@dataclass
class RunningUp:
    """A ``tangram up`` process and its gateway URL."""

    proc: subprocess.Popen[str]
    url: str
    log: Path

    def pools(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/v1/pools", timeout=10) as resp:
            items: list[dict[str, Any]] = json.loads(resp.read())["items"]
            return items


def _read_url(stdout: IO[str], log: IO[str], deadline: float) -> str:
    marker = "gateway on "
    for line in stdout:
        log.write(line)
        log.flush()
        if marker in line:
            return line.split(marker, 1)[1].split()[0]
        if time.monotonic() > deadline:
            break
    raise RuntimeError("tangram up stopped before it printed its gateway URL")


async def start_up(out_dir: Path, cores: Sequence[int], uid_base: int) -> RunningUp:
    """Write the shared pool's YAML and start ``tangram up`` on it; wait for a ready host."""
    spec = out_dir / "shared-pool.yaml"
    spec.write_text(yaml.safe_dump(shared_pool_doc(len(cores)), sort_keys=False))
    log_path = out_dir / "tangram-up.log"
    argv = [
        sys.executable, "-m", "arl_tangram", "up", "-f", str(spec), "--port", "0",
        "--cores", ",".join(map(str, cores)), "--uid-base", str(uid_base), "--log-level", "WARNING",
    ]  # fmt: skip
    proc = await asyncio.to_thread(
        subprocess.Popen,
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    log = log_path.open("w")
    deadline = time.monotonic() + UP_START_TIMEOUT_S
    try:
        url = await asyncio.to_thread(_read_url, proc.stdout, log, deadline)
    except BaseException:
        proc.kill()
        raise
    # Keep draining its output into the log, so that it never blocks on a full pipe.
    asyncio.get_running_loop().run_in_executor(None, _drain, proc.stdout, log)
    up = RunningUp(proc, url, log_path)
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(f"{url}/v1/pools") as resp:
                    items = (await resp.json())["items"]
                if all((i.get("status") or {}).get("hostsReady", 0) >= 1 for i in items):
                    return up
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tangram up's pool did not become ready (see {log_path})")
                await asyncio.sleep(0.1)  # a poll interval while the host starts
    except BaseException:
        await asyncio.to_thread(stop_up, up)  # Ctrl-C: it stops what it started
        raise


def _drain(stdout: IO[str], log: IO[str]) -> None:
    with log, contextlib.suppress(ValueError, OSError):
        for line in stdout:
            log.write(line)
            log.flush()


def stop_up(up: RunningUp) -> tuple[int, list[int]]:
    """SIGINT, as Ctrl-C; returns its exit status and the agent pids still alive after it."""
    try:
        pids = [h["pid"] for item in up.pools() for h in item["hosts"]]
    except OSError:  # it no longer answers (it exited): there is nothing to list
        pids = []
    up.proc.send_signal(signal.SIGINT)
    try:
        code = up.proc.wait(timeout=UP_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        up.proc.kill()
        code = up.proc.wait()
    alive = [p for p in pids if _alive(p)]
    return code, alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "zombie" not in fh.read()
    except OSError:
        return False


async def run_shared(
    up: RunningUp,
    trajectories: Sequence[Trajectory],
    machine_cores: int,
    on_action: Callable[[], None] = lambda: None,
) -> RunRecord:
    """The rollout through the gateway (see the module docstring)."""
    record = RunRecord("tangram", "ARL-Tangram (shared pool)", machine_cores)
    host_cores = sum(len(h["cores"]) for item in up.pools() for h in item["hosts"])
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    async with AsyncTangramClient(up.url, namespace=NAMESPACE, pool=SHARED_POOL, token="") as client:

        async def trajectory(traj: Trajectory) -> None:
            await asyncio.sleep(traj.turns[0].think_s)  # the LLM writes the first turn
            async with client.session() as session:
                for i, turn in enumerate(traj.turns):
                    if i > 0:
                        await asyncio.sleep(turn.think_s)  # the LLM thinks; no core is held
                    issued = now()
                    result = await session.run(
                        code_action(turn.code, kind=turn.kind, timeout_s=ACTION_TIMEOUT_S, units=(1, 1))
                    )
                    record.actions.append(
                        ActionRecord(
                            traj.name,
                            i,
                            turn.kind,
                            issued,
                            now() - issued,
                            result.duration_seconds,
                            result.exit_code,
                            result.host,
                            tuple(result.cores),
                        )
                    )
                    if turn.kind == "test":
                        record.rewards[traj.name] = 1.0 if result.exit_code == 0 else 0.0
                    on_action()

        await asyncio.gather(*(trajectory(t) for t in trajectories))
    record.rollout_s = now()
    # The shared host holds its cores for the whole rollout, as its pod would in a cluster.
    record.holds.append(Hold(0.0, record.rollout_s, host_cores, "shared host"))
    return record
