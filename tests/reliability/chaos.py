# mypy: disable-error-code="no-untyped-call,attr-defined"
"""What the reliability tests share: pools and batches on the test bed, the agents' own counters,
the operator's metrics, restarting a test-bed component with its own flags, and the row of numbers
each test records for docs/reliability.md (artifacts/reliability/rows/<test>.json)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from operator_harness import Operator, Replica, batch_manifest, pool_manifest
from testbed import REPO, Cluster, condition, http_get_json, wait_for

GROUP, VERSION = "tangram.arl.dev", "v1alpha1"
POOL_LABEL = "tangram.arl.dev/pool"
AGENT_PORT = 8080
ROWS = REPO / "artifacts" / "reliability" / "rows"


def record(test: str, **numbers: Any) -> None:
    """The numbers a row of docs/reliability.md quotes, as this run measured them."""
    ROWS.mkdir(parents=True, exist_ok=True)
    (ROWS / f"{test}.json").write_text(json.dumps(numbers, indent=1, sort_keys=True, default=str))
    print(f"reliability row {test}: {json.dumps(numbers, sort_keys=True, default=str)}")


def create(cluster: Cluster, ns: str, plural: str, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, ns, plural, body)


def make_pool(cluster: Cluster, ns: str, name: str, hosts: int, **spec: Any) -> None:
    """A pool held at ``hosts`` ready hosts (min = max), waited on."""
    scaling = {"minHosts": hosts, "maxHosts": hosts, **spec.pop("scaling", {})}
    create(cluster, ns, "actionpools", pool_manifest(name, scaling=scaling, **spec))
    wait_for(
        cluster.custom.list_namespaced_custom_object,
        lambda o: o.get("status", {}).get("hostsReady", 0) >= hosts,
        group=GROUP,
        version=VERSION,
        namespace=ns,
        plural="actionpools",
        field_selector=f"metadata.name={name}",
        description=f"{hosts} hosts of pool {name} ready",
        timeout=180,
    )


def batch_where(
    cluster: Cluster, ns: str, name: str, check: Callable[[dict[str, Any]], bool], what: str, timeout: float
) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        cluster.custom.list_namespaced_custom_object,
        check,
        group=GROUP,
        version=VERSION,
        namespace=ns,
        plural="actionbatches",
        field_selector=f"metadata.name={name}",
        description=f"ActionBatch {name} {what}",
        timeout=timeout,
    )
    return found


def counts(o: dict[str, Any]) -> dict[str, int]:
    c: dict[str, int] = (o.get("status") or {}).get("counts") or {}
    return c


def wait_complete(cluster: Cluster, ns: str, name: str, timeout: float = 300) -> dict[str, Any]:
    return batch_where(cluster, ns, name, lambda o: condition(o, "Complete") == "True", "Complete", timeout)


def submit(cluster: Cluster, ns: str, name: str, actions: list[dict[str, Any]], **spec: Any) -> None:
    create(cluster, ns, "actionbatches", batch_manifest(name, actions, **spec))


def echo_actions(n: int, pool: str, seconds: float = 0.0, prefix: str = "a") -> list[dict[str, Any]]:
    """Actions whose output names them, so a result can be checked against its own action."""
    code = "import time, sys; time.sleep({s}); print('{p}{i}', {i} * {i})"
    return [
        {
            "id": f"{prefix}{i}",
            "type": "code",
            "target": pool,
            "payload": {"language": "python", "code": code.format(s=seconds, p=prefix, i=i)},
        }
        for i in range(n)
    ]


def expected_output(prefix: str, i: int) -> str:
    return f"{prefix}{i} {i * i}"


def host_pods(cluster: Cluster, ns: str, pool: str | None = None) -> list[dict[str, Any]]:
    selector = f"{POOL_LABEL}={pool}" if pool else POOL_LABEL
    listed = json.loads(
        cluster.core.list_namespaced_pod(ns, label_selector=selector, _preload_content=False).data
    )
    items: list[dict[str, Any]] = listed["items"]
    return items


def live_agents(cluster: Cluster, ns: str, pool: str | None = None) -> dict[str, str]:
    """Pod name -> address of each host pod that is not being deleted."""
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in host_pods(cluster, ns, pool)
        if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp")
    }


def agent_outcomes(ip: str) -> int:
    """Actions this agent ran to an end (its own counters)."""
    return int(sum(http_get_json(f"http://{ip}:{AGENT_PORT}/v1/health")["outcomes"].values()))


def agents_ran(cluster: Cluster, ns: str, pool: str | None = None) -> dict[str, int]:
    return {name: agent_outcomes(ip) for name, ip in live_agents(cluster, ns, pool).items()}


def agent_running(ip: str) -> list[Any]:
    running: list[Any] = http_get_json(f"http://{ip}:{AGENT_PORT}/v1/actions")["running"]
    return running


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)$")


def metrics(replica: Replica) -> dict[str, float]:
    """The replica's Prometheus samples, ``name{labels}`` -> value."""
    out: dict[str, float] = {}
    for line in replica.get("/metrics").decode().splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and all(w in k for w in want))


def finished_by_state(replica: Replica, pool_key: str) -> dict[str, float]:
    """tangram_actions_total of one pool by state, as the replica counts them."""
    samples = metrics(replica)
    states: dict[str, float] = {}
    for k, v in samples.items():
        if k.startswith("tangram_actions_total{") and f'pool="{pool_key}"' in k:
            state = re.search(r'state="([^"]*)"', k)
            if state:
                states[state.group(1)] = states.get(state.group(1), 0) + v
    return states


def process_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def processes_under(path: Path) -> list[int]:
    """PIDs whose working directory or command line lies under ``path`` (a pod's state directory):
    an orphaned agent or action would show up here."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(str(path)) or str(path) in cmdline:
            found.append(int(proc.name))
    return found


# ---- test-bed components ----------------------------------------------------------------------


def _start_time(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(") ", 1)[1].split()[19]


def restart_component(cluster_dir: Path, component: str, down_s: float = 0.0) -> float:
    """SIGKILLs a test-bed component (``etcd``, ``kube-apiserver``, ...) and starts it again with the
    same command line, environment and working directory, as cluster-up started it (its own
    session, output appended to its log), recording the new PID so cluster-down still stops it.
    Returns how long it was down until its health answered again."""
    [pid_file] = list((cluster_dir / "pids").glob(f"*-{component}"))
    pid, start = pid_file.read_text().split()
    assert _start_time(int(pid)) == start, (
        f"{component}'s recorded PID {pid} is not the one cluster-up started"
    )
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    env = dict(
        kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv
    )
    cwd = os.readlink(f"/proc/{pid}/cwd")
    t0 = time.monotonic()
    os.killpg(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and _start_time(int(pid)) == start:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
        if state == "Z":
            break
        assert time.monotonic() < deadline, f"{component} (pid {pid}) survived SIGKILL"
        time.sleep(0.05)
    if down_s:
        time.sleep(down_s)  # the outage itself: the component stays dead this long on purpose
    with open(cluster_dir / "logs" / f"{component}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pid_file.write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
    kubeconfig = cluster_dir / "kubeconfig"
    deadline = time.monotonic() + 120
    while (
        subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig), "get", "--raw", "/readyz"],
            capture_output=True,
            check=False,
            timeout=30,
        ).returncode
        != 0
    ):
        assert proc.poll() is None, f"{component} exited after its restart: see its log"
        assert time.monotonic() < deadline, f"the API server not ready 120 s after restarting {component}"
        time.sleep(0.3)
    return time.monotonic() - t0


class Partition:
    """Cuts the operator off one host: the host pod's address is removed from ``lo``, so nothing
    reaches its agent (the agent and its actions keep running); ``heal`` puts it back. Needs
    CAP_NET_ADMIN, as the test bed's pod addresses do."""

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.cut = False

    def __enter__(self) -> Partition:
        subprocess.run(["ip", "addr", "del", f"{self.ip}/32", "dev", "lo"], check=True, capture_output=True)
        self.cut = True
        return self

    def heal(self) -> None:
        if self.cut:
            subprocess.run(
                ["ip", "addr", "add", f"{self.ip}/32", "dev", "lo"], check=True, capture_output=True
            )
            self.cut = False

    def __exit__(self, *exc: object) -> None:
        self.heal()


def leader(op: Operator) -> Replica:
    return op.leader()


def wait_until(check: Callable[[], bool], description: str, timeout: float = 120) -> None:
    """Polls ``check`` until it holds; fails naming ``description`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {description}"
        time.sleep(0.2)
