"""Volumes made real as files, pod IPs, node status, and the log selection of `kubectl logs`."""

from __future__ import annotations

from pathlib import Path

import pytest
from node_runner.api import ConfigError, Json
from node_runner.container import Container
from node_runner.kubelet_api import log_run_index, select_log
from node_runner.network import IpPool
from node_runner.node import node_labels, node_status
from node_runner.volumes import prepare_volumes

POD: Json = {
    "metadata": {"name": "web-0", "namespace": "prod", "uid": "u-1"},
    "spec": {
        "volumes": [
            {"name": "scratch", "emptyDir": {}},
            {
                "name": "conf",
                "configMap": {"name": "settings", "items": [{"key": "mode", "path": "sub/mode.txt"}]},
            },
            {"name": "keys", "secret": {"secretName": "keys"}},
            {
                "name": "info",
                "downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]},
            },
            {
                "name": "sa",
                "projected": {
                    "sources": [
                        {
                            "serviceAccountToken": {
                                "path": "token",
                                "audience": "api",
                                "expirationSeconds": 600,
                            }
                        },
                        {"configMap": {"name": "settings", "items": [{"key": "ca", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "x"}}]}},
                    ]
                },
            },
            {"name": "claim", "persistentVolumeClaim": {"claimName": "data"}},
        ]
    },
}
OBJECTS = {("configMap", "settings"): {"mode": "fast", "ca": "CERT"}, ("secret", "keys"): {"id": "k1"}}


def _lookup(kind: str, name: str, optional: bool) -> dict[str, str] | None:
    if (kind, name) in OBJECTS:
        return OBJECTS[(kind, name)]
    if optional:
        return None
    raise ConfigError(f'{kind} "{name}" not found')


def test_volumes_become_files_with_their_read_only_flags(tmp_path: Path) -> None:
    tokens: list[tuple[str | None, int]] = []

    def token(audience: str | None, expiration: int) -> str:
        tokens.append((audience, expiration))
        return "TOKEN"

    volumes, problems = prepare_volumes(POD, tmp_path, _lookup, lambda path: f"<{path}>", token)
    assert {name: ro for name, (_, ro) in volumes.items()} == {
        "scratch": False, "conf": True, "keys": True, "info": True, "sa": True, "claim": False,
    }  # fmt: skip
    assert (volumes["conf"][0] / "sub" / "mode.txt").read_text() == "fast"
    assert not (volumes["conf"][0] / "ca").exists()  # items select keys
    assert (volumes["keys"][0] / "id").read_text() == "k1"
    assert (volumes["info"][0] / "name").read_text() == "<metadata.name>"
    sa = volumes["sa"][0]
    assert [(sa / f).read_text() for f in ("token", "ca.crt", "namespace")] == ["TOKEN", "CERT", "<x>"]
    assert tokens == [("api", 600)]
    assert problems == ["volume claim: unsupported volume type ['persistentVolumeClaim']"]


def test_a_missing_config_map_holds_the_pod_with_its_name(tmp_path: Path) -> None:
    pod = {**POD, "spec": {"volumes": [{"name": "c", "configMap": {"name": "absent"}}]}}
    with pytest.raises(ConfigError, match='configMap "absent" not found'):
        prepare_volumes(pod, tmp_path, _lookup, str, lambda a, e: "")
    optional = {
        **POD,
        "spec": {"volumes": [{"name": "c", "configMap": {"name": "absent", "optional": True}}]},
    }
    volumes, _ = prepare_volumes(optional, tmp_path, _lookup, str, lambda a, e: "")
    assert list(volumes["c"][0].iterdir()) == []


def test_ip_pool_gives_distinct_addresses_and_reuses_released_ones_last() -> None:
    pool = IpPool("127.9.9.0/30")  # two usable addresses
    a = pool.allocate("pod-a")
    b = pool.allocate("pod-b")
    assert {a, b} == {"127.9.9.1", "127.9.9.2"}
    assert pool.allocate("pod-a") == a  # idempotent per pod
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate("pod-c")
    pool.release("pod-a")
    assert pool.allocate("pod-c") == a
    pool.release("pod-b")
    assert pool.allocate("pod-b-again", wanted=b) == b  # a restarted runner keeps a pod's address


def test_node_status_reports_capacity_as_allocatable_and_ready() -> None:
    spec = {"name": "tb-cpu-0", "capacity": {"cpu": 16, "memory": "64Gi"}, "labels": {"zone": "a"}}
    status = node_status(spec, "127.0.0.1", 10250, "bwrap")
    assert status["capacity"] == status["allocatable"] == {"cpu": "16", "memory": "64Gi"}
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "KubeletReady")
    assert status["daemonEndpoints"] == {"kubeletEndpoint": {"Port": 10250}}
    assert status["nodeInfo"]["containerRuntimeVersion"] == "testbed://bwrap"
    labels = node_labels(spec)
    assert labels["kubernetes.io/hostname"] == "tb-cpu-0" and labels["zone"] == "a"


@pytest.mark.parametrize(
    ("state", "restarts", "previous", "index"),
    [
        ({"running": {}}, 0, False, 0),
        ({"running": {}}, 2, False, 2),
        ({"running": {}}, 2, True, 1),
        ({"waiting": {"reason": "CrashLoopBackOff"}}, 3, False, 2),  # the last run's output
        ({"terminated": {}}, 0, False, 0),
        ({"running": {}}, 0, True, -1),  # no previous run
    ],
)
def test_log_run_index(state: Json, restarts: int, previous: bool, index: int) -> None:
    c = Container({"name": "main"}, False, state=state, restart_count=restarts)
    assert log_run_index(c, previous) == index


def test_select_log_applies_tail_then_limit() -> None:
    data = b"one\ntwo\nthree\n"
    assert select_log(data, "", "") == data
    assert select_log(data, "2", "") == b"two\nthree\n"
    assert select_log(data, "0", "") == b""
    assert select_log(data, "2", "5") == b"two\nt"
    assert select_log(data, "x", "y") == data  # not numbers: ignored
