"""The local runtime against the Runtime protocol, with real agent processes: a host starts, is
observed ready with its agent answering on its address, drains, and is deleted leaving nothing of its
pid or uids; hosts get disjoint cores and uid ranges; a host whose agent dies is observed failed with
the reason; a host that does not fit the free cores is not started."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from up_harness import leftovers, pool_doc, uid_base_for_test

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.runtime.interface import Runtime
from arl_tangram.runtime.local import LocalRuntime

CORES = sorted(os.sched_getaffinity(0))[:2]


def config(name: str = "py", cpu: int = 1) -> PoolConfig:
    doc = pool_doc(name)
    doc["metadata"].update(namespace="default", generation=1)
    doc["spec"]["template"]["resources"]["cpu"] = str(cpu)
    return pool_config(ActionPool.model_validate(doc), uid=f"uid-{name}")


async def _health(address: str) -> dict[str, object]:
    async with aiohttp.ClientSession() as http, http.get(f"http://{address}/v1/health") as resp:
        assert resp.status == 200
        body: dict[str, object] = await resp.json()
        return body


def test_a_host_lives_and_goes_through_the_protocol(tmp_path: Path) -> None:
    async def main() -> None:
        runtime = LocalRuntime(tmp_path, CORES, uid_base=uid_base_for_test())
        protocol: Runtime = runtime  # the controllers' interface, checked by mypy too
        pool = config()
        await protocol.create_host(pool, "py-a", None)
        await protocol.create_host(pool, "py-a", None)  # a retried create is one host
        assert [h.phase for h in protocol.hosts(pool.key)] == ["starting"]
        seen = await runtime.wait_started("py-a")
        assert seen.phase == "ready" and seen.address is not None and seen.node == "local"
        assert seen.cpu_millicores == 1000 and seen.template_hash == pool.template_hash
        health = await _health(seen.address)
        assert health["cores"] == {"total": 1, "busy": 0, "ids": [CORES[0]]}
        await protocol.set_draining(pool, "py-a", True)
        assert protocol.hosts(pool.key)[0].phase == "draining"
        await protocol.set_draining(pool, "py-a", False)
        assert protocol.hosts(pool.key)[0].phase == "ready"
        host = runtime.host("py-a")
        assert host is not None
        await protocol.delete_host(pool, "py-a")
        await protocol.delete_host(pool, "py-a")  # gone already: nothing to do
        assert protocol.hosts(pool.key) == []
        assert leftovers([host.proc.pid], [host.uids]) == []

    asyncio.run(main())


def test_hosts_get_disjoint_cores_and_uids_and_never_more_cores_than_given(tmp_path: Path) -> None:
    async def main() -> None:
        runtime = LocalRuntime(tmp_path, CORES, uid_base=uid_base_for_test())
        pool = config()
        try:
            for i in range(len(CORES) + 1):
                await runtime.create_host(pool, f"py-{i}", None)
            hosts = [runtime.host(f"py-{i}") for i in range(len(CORES))]
            assert all(h is not None for h in hosts)
            assert runtime.host(f"py-{len(CORES)}") is None, "no free core: not started"
            cores = [c for h in hosts if h for c in h.cores]
            assert sorted(cores) == CORES
            ranges = sorted((h.uids for h in hosts if h), key=lambda r: r.start)
            assert all(a.stop <= b.start for a, b in itertools.pairwise(ranges))
            await runtime.delete_host(pool, f"py-{len(CORES)}")  # it waited for room: just forgotten
            await runtime.delete_host(pool, "py-0")
            await runtime.create_host(pool, "py-again", None)  # the freed core and uids are reused
            again = runtime.host("py-again")
            assert again is not None and hosts[0] is not None
            assert again.cores == hosts[0].cores and again.uids == hosts[0].uids
        finally:
            await runtime.close()
        assert runtime.all_hosts() == []

    asyncio.run(main())


def test_a_host_that_does_not_fit_waits_saying_why_and_starts_when_room_frees(tmp_path: Path) -> None:
    """It was dropped with a log line: its pool said Healthy and its actions waited for ever. Now it
    is observed as a pod no node has room for (starting, on no node, ``pending`` saying why)."""

    async def main() -> None:
        runtime = LocalRuntime(tmp_path, CORES[:1], uid_base=uid_base_for_test())
        shared, dedicated = config("py"), config("ded")
        try:
            await runtime.create_host(shared, "py-0", None)
            await runtime.create_host(dedicated, "ded-0", None)
            await runtime.create_host(dedicated, "ded-0", None)  # a retried create is one host
            assert runtime.host("ded-0") is None, "no free core: not started"
            [waiting] = runtime.hosts(dedicated.key)
            assert waiting.phase == "starting" and waiting.node == "" and waiting.address is None
            assert waiting.pending is not None
            assert "needs 1 core(s) and 0 of the 1" in waiting.pending and shared.key in waiting.pending
            assert [h.name for h in runtime.all_hosts()] == ["py-0", "ded-0"]
            await runtime.set_draining(dedicated, "ded-0", True)
            assert runtime.hosts(dedicated.key)[0].phase == "draining"
            await runtime.set_draining(dedicated, "ded-0", False)
            await runtime.delete_host(shared, "py-0")  # its core is free: the waiting host takes it
            started = runtime.host("ded-0")
            assert started is not None and started.cores == (CORES[0],)
            assert (await runtime.wait_started("ded-0")).phase == "ready"
        finally:
            await runtime.close()
        assert runtime.all_hosts() == []

    asyncio.run(main())


def test_a_host_whose_agent_dies_is_observed_failed(tmp_path: Path) -> None:
    async def main() -> None:
        runtime = LocalRuntime(tmp_path, CORES[:1], uid_base=uid_base_for_test())
        pool = config()
        try:
            await runtime.create_host(pool, "py-dies", None)
            assert (await runtime.wait_started("py-dies")).phase == "ready"
            host = runtime.host("py-dies")
            assert host is not None
            os.kill(host.proc.pid, signal.SIGKILL)
            for _ in range(200):  # the runtime polls its process: wait for it to notice
                if runtime.hosts(pool.key)[0].phase == "failed":
                    break
                await asyncio.sleep(0.05)
            failed = runtime.hosts(pool.key)[0]
            assert failed.phase == "failed" and failed.failure and "exited -9" in failed.failure
            assert failed.address is None
        finally:
            await runtime.close()

    asyncio.run(main())


def test_closing_with_an_action_running_lets_each_agent_stop_by_itself(tmp_path: Path) -> None:
    """``tangram up`` stopping with an action still running: the agent waited for its request to be
    answered (as a pod's does) past the stop's grace, was SIGKILLed (``did not stop within 20s``)
    and left its workdirs behind. Its actions are killed first now: it answers, and exits itself."""
    if os.geteuid() != 0:
        pytest.skip("actions run under the hosts' own uids only as root")

    async def main() -> None:
        runtime = LocalRuntime(tmp_path, CORES[:1], uid_base=uid_base_for_test())
        pool = config()
        answers: list[int] = []
        try:
            await runtime.create_host(pool, "py-busy", None)
            seen = await runtime.wait_started("py-busy")
            host = runtime.host("py-busy")
            assert host is not None and seen.address is not None

            async def long_action() -> None:
                body = {"code": "import time; time.sleep(50)", "language": "python", "run_timeout": 55}
                url = f"http://{seen.address}/run_code"
                async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
                    answers.append(resp.status)

            call = asyncio.create_task(long_action())
            for _ in range(600):  # until the action's own process runs under the host's uids
                if leftovers([], [host.uids]):
                    break
                await asyncio.sleep(0.05)
            assert leftovers([], [host.uids]), "the action never started"
        finally:
            await runtime.close()
        await asyncio.wait_for(call, 60)
        assert host.proc.returncode == 0, f"the agent was killed: exit {host.proc.returncode}"
        assert answers == [200]
        assert not (host.root / "work").exists(), "the agent's workdirs were left behind"
        assert leftovers([host.proc.pid], [host.uids]) == []

    asyncio.run(main())
