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
        most = max(seen, key=len)
        assert len(most) == len(CORES), f"scaled to {len(most)} hosts on {len(CORES)} cores"
        for hosts in seen:
            held = list(itertools.chain.from_iterable(h["cores"] for h in hosts))
            assert len(held) == len(set(held)) and set(held) <= set(CORES), hosts
        wait_until(lambda: up.hosts(POOL) == [], 60, "the pool to go back to zero hosts when idle")
