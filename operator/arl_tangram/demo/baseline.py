"""Pod-per-trajectory, really run: a sandbox agent process per trajectory, started on demand.

This is the layout trainers use today: when a trajectory issues its first action it gets a sandbox
of its own (a pod; here a local agent process through the same :class:`LocalRuntime` that
``tangram up`` uses, so its start-up cost is this machine's, measured, not a number assumed), with
fixed cores it holds through every think time until the trajectory ends. The machine holds as many
such sandboxes at once as its cores allow; a trajectory whose turn comes when none is free waits
for one, and that wait is part of its first action's completion time.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from arl_tangram.demo.pools import ACTION_TIMEOUT_S, CORES_PER_TRAJECTORY, dedicated_pool
from arl_tangram.demo.records import ActionRecord, Hold, RunRecord
from arl_tangram.demo.workload import Trajectory
from arl_tangram.dispatch.agent import AgentClient
from arl_tangram.runtime.local import LocalRuntime
from arl_tangram.runtime.pods import new_host_name


async def run_dedicated(
    trajectories: Sequence[Trajectory],
    cores: Sequence[int],
    state_dir: Path,
    uid_base: int,
    on_action: Callable[[], None] = lambda: None,
) -> RunRecord:
    """The rollout with one dedicated sandbox per trajectory (see the module docstring)."""
    pool = dedicated_pool(len(cores))
    runtime = LocalRuntime(state_dir, cores, uid_base=uid_base)
    agent = AgentClient()
    slots = asyncio.Semaphore(len(cores) // CORES_PER_TRAJECTORY)
    record = RunRecord(
        "dedicated",
        f"pod per trajectory ({CORES_PER_TRAJECTORY} core each)",
        len(cores),
    )
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    async def trajectory(traj: Trajectory) -> None:
        await asyncio.sleep(traj.turns[0].think_s)  # the LLM writes the first turn
        issued = now()
        async with slots:
            name = new_host_name(pool)
            held_from = now()
            await runtime.create_host(pool, name, None)
            seen = await runtime.wait_started(name)
            host = runtime.host(name)
            if seen.phase != "ready" or host is None:
                raise RuntimeError(f"the sandbox of {traj.name} did not start: {seen.failure}")
            record.startup_s.append(now() - held_from)
            try:
                sid = await agent.create_session(host.address, persistent=False, ttl_s=600)
                for i, turn in enumerate(traj.turns):
                    if i > 0:
                        await asyncio.sleep(turn.think_s)  # the LLM thinks; the sandbox waits, held
                        issued = now()
                    body, _ = await agent.execute(
                        host.address,
                        {"runtime": "python", "code": turn.code},
                        key=secrets.token_hex(8),
                        cores=host.cores,
                        wire="native",
                        timeout_s=ACTION_TIMEOUT_S,
                        session_id=sid,
                    )
                    exit_code = body.get("exit_code")
                    record.actions.append(
                        ActionRecord(
                            traj.name,
                            i,
                            turn.kind,
                            issued,
                            now() - issued,
                            float(body.get("wall_s") or 0.0),
                            exit_code if isinstance(exit_code, int) else None,
                            name,
                            host.cores,
                        )
                    )
                    if turn.kind == "test":
                        record.rewards[traj.name] = 1.0 if exit_code == 0 else 0.0
                    on_action()
                await agent.close_session(host.address, sid)
                if len(record.rewards) == len(trajectories):
                    record.rollout_s = now()
            finally:
                await runtime.delete_host(pool, name)
                record.holds.append(Hold(held_from, now(), len(host.cores), name))

    try:
        await asyncio.gather(*(trajectory(t) for t in trajectories))
    finally:
        await runtime.close()
        await agent.close()
    record.rollout_s = record.rollout_s or now()
    return record
