"""A pod's hostname on the test bed's node: what its containers see (bwrap's UTS namespace and the
HOSTNAME variable) is kubelet's, so a pod name over 63 characters still starts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from node_runner.worker import PodWorker

POOL = "p" + "a" * 61 + "z"  # the longest name an ActionPool may have
HOST = f"{POOL}-1a2b3c"  # one of its host pods: 70 characters


def _worker(tmp_path: Path) -> PodWorker:
    runner: Any = SimpleNamespace(
        core=None,
        state_dir=tmp_path,
        bwrap="/usr/bin/bwrap",
        path_env="/usr/bin:/bin",
        api_host="127.0.0.1",
        api_port=6443,
        host_ip="127.0.0.1",
        node_capacity=lambda node: {"cpu": "4"},
    )
    container = {"name": "agent", "image": "img:1"}
    pod = {
        "metadata": {"name": HOST, "namespace": "ns", "uid": "u-1"},
        "spec": {"nodeName": "tb-cpu-0", "containers": [container]},
    }
    return PodWorker(runner, pod)


def test_a_pod_name_over_63_characters_is_cut_to_kubelets_hostname(tmp_path: Path) -> None:
    worker = _worker(tmp_path)
    worker.dir.mkdir(parents=True)  # as the worker's start makes it
    (c,) = worker.containers
    argv = worker._wrap(c, ["true"])
    assert argv[argv.index("--hostname") + 1] == POOL
    assert worker._env(c)["HOSTNAME"] == POOL
