"""A pool of ``tangram up`` scales as its spec says, within the cores it was given: from zero to
as many one-core hosts as there are cores (never the spec's larger maximum, never two hosts on one
core) while actions wait, and back to zero once idle for ``idleTimeoutSeconds``."""

from __future__ import annotations

import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import yaml
from up_harness import pool_doc, tangram_up, wait_until

POOL = "default/scaler"
CORES = sorted(os.sched_getaffinity(0))[:2]


def test_scales_up_within_the_machines_cores_and_back_to_zero(tmp_path: Path) -> None:
    doc = pool_doc("scaler", minHosts=0, maxHosts=len(CORES) + 2, maxStarting=4, idleTimeoutSeconds=3)
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(doc))
    cores = ",".join(map(str, CORES))
    with tangram_up(tmp_path / "pool.yaml", extra=("--cores", cores)) as up:
        status = wait_until(lambda: up.pools()[POOL]["status"], 30, "the pool's first status")
        assert status["replicas"] == 0, "minHosts 0: no host before the first action"
        seen: list[list[dict[str, Any]]] = []

        def action(i: int) -> dict[str, Any]:
            body = {"code": f"import time; time.sleep(1.5); print({i})", "language": "python"}
            resp = requests.post(up.url + "/run_code?pool=scaler", json=body, timeout=120)
            return dict(resp.json())

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(action, i) for i in range(6 * len(CORES))]
            while not all(f.done() for f in futures):
                seen.append(up.hosts(POOL))
                time.sleep(0.05)  # a poll interval while the actions run, not synchronisation
        for i, f in enumerate(futures):
            answer = f.result()
            assert answer["status"] == "Success" and answer["run_result"]["stdout"] == f"{i}\n", answer
        # Started hosts only: one asked for in a stale round waits for a core (listed, no pid).
        most = max(([h for h in hosts if h["pid"]] for hosts in seen), key=len)
        assert len(most) == len(CORES), f"scaled to {len(most)} hosts on {len(CORES)} cores"
        for hosts in seen:
            held = list(itertools.chain.from_iterable(h["cores"] for h in hosts))
            assert len(held) == len(set(held)) and set(held) <= set(CORES), hosts
        wait_until(lambda: up.hosts(POOL) == [], 60, "the pool to go back to zero hosts when idle")


def test_a_dedicated_pool_with_no_free_core_says_why_and_its_actions_are_refused(tmp_path: Path) -> None:
    """A shared pool holds the one core; a dedicated pool's host cannot start. It was dropped with a
    log line: the pool said Healthy and its actions waited for ever. Now the host is listed as
    waiting, with why, at once; the pool is not Ready, naming the cores; and its actions are refused
    with that message, as a pool no node has room for is in a cluster."""
    shared = pool_doc("busy")
    dedicated = pool_doc("ded")
    dedicated["spec"]["mode"] = "dedicated"
    del dedicated["spec"]["scaling"]
    (tmp_path / "pools.yaml").write_text(yaml.safe_dump_all([shared, dedicated]))
    with tangram_up(tmp_path / "pools.yaml", extra=("--cores", str(CORES[0]))) as up:
        wait_until(lambda: up.pools()["default/busy"]["status"]["hostsReady"] == 1, 60, "the shared host")
        action = {"namespace": "default", "type": "code", "target": "ded", "payload": {"code": "print(1)"}}
        refused = requests.post(up.url + "/v1/actions", json=action, timeout=120)
        assert refused.status_code == 503, refused.text
        assert "needs 1 core(s) and 0 of the 1" in refused.json()["error"], refused.text
        assert "default/busy" in refused.json()["error"], "who holds the cores"
        [host] = up.hosts("default/ded")
        assert host["pid"] is None and host["cores"] == [] and "needs 1 core(s)" in host["pending"]
        ready = {c["type"]: c for c in up.pools()["default/ded"]["status"]["conditions"]}
        assert ready["Ready"]["status"] == "False" and "needs 1 core(s)" in ready["Ready"]["message"]
        assert ready["Degraded"]["status"] == "True", ready["Degraded"]
        # verl's shape: 504 (the status it retries) with SandboxFusion's SandboxError, at once now.
        sf = requests.post(
            up.url + "/run_code?pool=ded", json={"code": "print(1)", "language": "python"}, timeout=60
        )
        assert sf.status_code == 504 and sf.json()["status"] == "SandboxError", sf.text
        assert f"host {host['name']} cannot start yet" in up.output()
