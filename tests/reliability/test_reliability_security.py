# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Security from inside a pool on the test bed (docs/reliability.md): the sandbox's hostile-code
list (tests/integration/sandbox/test_sandbox_hostile.py) as one ActionBatch through a pool, what a
running action can see of another through /proc, memory and disk limits, and the control plane
(sandbox pods without a ServiceAccount token, the pool's NetworkPolicy, the gateway across
namespaces). The operator's RBAC against the calls it makes is
tests/e2e/test_operator.py::test_the_operators_rbac_is_exactly_what_it_uses (the audit log).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from chaos import (
    agent_running,
    host_pods,
    live_agents,
    make_pool,
    record,
    submit,
    wait_complete,
)
from operator_harness import Operator, post_run_code, trainer_token
from testbed import REPO, Cluster

from arl_tangram.sandbox import seccomp

sys.path.insert(0, str(REPO / "tests" / "integration" / "sandbox"))
from test_sandbox_hostile import (
    DAEMON,
    ESCAPE_WRITES,
    FD_EXHAUSTION,
    FLOOD,
    FORK_BOMB,
    MEMORY_BOMB,
)

DISK_FILL = (
    "n = 0\n"
    "try:\n"
    "    with open('big', 'wb') as f:\n"
    "        for _ in range(4096):\n"
    "            f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
    "    print('WROTE_MB', n)\n"
    "except OSError as e:\n"
    "    print('STOPPED_AT_MB', n, type(e).__name__)\n"
)
# Files under the per-file limit, one after another, 192 MB in all: past the pool's workdir limit.
DISK_MANY = (
    "total = 0\n"
    "try:\n"
    "    for k in range(4):\n"
    "        with open(f'f{k}', 'wb') as f:\n"
    "            for _ in range(48):\n"
    "                f.write(b'x' * (1 << 20)); total += 1\n"
    "    print('TOTAL_MB', total)\n"
    "except OSError as e:\n"
    "    print('STOPPED_AT_MB', total, type(e).__name__)\n"
)
KILL_ALL = (
    "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\nprint('survived')\n"
)
TOKEN = (
    "import os\n"
    "p = '/var/run/secrets/kubernetes.io/serviceaccount/token'\n"
    "print('TOKEN', os.path.exists(p), 'KSH', 'KUBERNETES_SERVICE_HOST' in os.environ)\n"
)
SECRET = "s3cr3t-7f1d"
HOLDER = (
    "import os, sys, time\n"
    "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(8)', 'ARGV-" + SECRET + "'],"
    " {'TOKEN_ENV': 'ENV-" + SECRET + "'})\n"
)
SNOOPER = (
    "import os, time\n"
    "time.sleep(3)\n"
    "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
    "argv = env = 0\n"
    "for p in pids:\n"
    "    try:\n"
    "        argv += b'ARGV-" + SECRET + "' in open(f'/proc/{p}/cmdline', 'rb').read()\n"
    "    except OSError:\n"
    "        pass\n"
    "    try:\n"
    "        env += b'ENV-" + SECRET + "' in open(f'/proc/{p}/environ', 'rb').read()\n"
    "    except OSError:\n"
    "        pass\n"
    "print('PIDS', len(pids), 'ARGV', argv, 'ENV', env)\n"
)


def _cgroup_fs() -> str:
    """cgroup2 when the unified hierarchy is mounted (a memory limit per action is possible)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if parts[1] == "/sys/fs/cgroup":
            return parts[2]
    return "none"


def _code(aid: str, code: str, timeout_s: int = 20) -> dict[str, Any]:
    return {
        "id": aid,
        "type": "code",
        "target": "sec",
        "timeoutSeconds": timeout_s,
        "payload": {"language": "python", "code": code},
    }


def test_hostile_code_through_a_pool_is_contained_and_the_host_survives(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    make_pool(cluster, namespace, "sec", hosts=1, limits={"memory": "256Mi", "workdir": "128Mi"})
    [(host, ip)] = live_agents(cluster, namespace, "sec").items()
    actions = [
        _code("fork-bomb", FORK_BOMB, timeout_s=3),
        _code("memory-bomb", MEMORY_BOMB),
        _code("daemon", DAEMON),
        _code("flood", FLOOD),
        _code("escape-writes", ESCAPE_WRITES),
        _code("fd-exhaustion", FD_EXHAUSTION),
        _code("kill-all", KILL_ALL),
        _code("disk-fill", DISK_FILL, timeout_s=60),
        _code("disk-many-files", DISK_MANY, timeout_s=60),
        _code("token", TOKEN),
        _code("after", "print('fine')"),
    ]
    submit(cluster, namespace, "hostile", actions)
    batch = wait_complete(cluster, namespace, "hostile", timeout=300)
    r = {x["id"]: x for x in batch["status"]["results"]}
    out = {k: (v.get("output") or "") for k, v in r.items()}
    assert r["fork-bomb"]["state"] == "Failed" and r["fork-bomb"]["reason"] == "Timeout", r["fork-bomb"]
    assert r["memory-bomb"]["state"] == "Failed" and r["memory-bomb"]["reason"] == "OutOfMemory", r[
        "memory-bomb"
    ]
    assert r["daemon"]["state"] == "Succeeded" and out["daemon"].strip() == "parent done"
    assert r["flood"]["state"] == "Succeeded" and r["flood"]["truncated"] is True
    wrote = [line for line in out["escape-writes"].splitlines() if line.startswith("WROTE")]
    assert wrote == ["WROTE /tmp/tangram-escape", "WROTE /dev/shm/tangram-escape"], out["escape-writes"]
    assert r["fd-exhaustion"]["state"] == "Failed"
    assert "survived" in out["kill-all"]
    assert "STOPPED_AT_MB" in out["disk-fill"], out["disk-fill"]
    # Files under the per-file limit add up to the workdir's (limits.workdir), and stop there.
    many = out["disk-many-files"].split()
    assert many[0] == "STOPPED_AT_MB" and 120 <= int(many[1]) <= 128 and many[2] == "OSError", many
    assert "TOKEN False" in out["token"], out["token"]
    assert r["after"]["state"] == "Succeeded" and out["after"].strip() == "fine"
    # The same host, alive, running nothing, and its agent never restarted.
    pods = host_pods(cluster, namespace, "sec")
    assert [p["metadata"]["name"] for p in pods] == [host]
    assert all(cs.get("restartCount", 0) == 0 for cs in pods[0]["status"]["containerStatuses"])
    assert agent_running(ip) == []
    record(
        "security-hostile-through-pool",
        actions=len(actions),
        outcomes={k: f"{v['state']}/{v.get('reason') or '-'}" for k, v in r.items()},
        disk_fill=out["disk-fill"].strip(),
        disk_many_files=out["disk-many-files"].strip(),
        cgroup_fs=_cgroup_fs(),
        token=out["token"].strip(),
    )


def test_what_an_action_sees_of_another_through_proc(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Two actions on one host at once: the snooper looks through /proc for the holder's argv and
    environment, and sees neither: its /proc is its own PID namespace's (its init and itself)."""
    make_pool(cluster, namespace, "sec", hosts=1)
    submit(cluster, namespace, "proc", [_code("holder", HOLDER), _code("snooper", SNOOPER)])
    batch = wait_complete(cluster, namespace, "proc", timeout=120)
    r = {x["id"]: x for x in batch["status"]["results"]}
    assert r["holder"]["state"] == "Succeeded", r["holder"]
    seen = (r["snooper"].get("output") or "").split()
    record("security-proc-visibility", snooper=" ".join(seen))
    assert seen[:2] == ["PIDS", "2"], r["snooper"]
    assert seen[seen.index("ARGV") + 1] == "0", f"another action's command line is visible: {seen}"
    assert seen[seen.index("ENV") + 1] == "0", f"another action's environment is visible: {seen}"


def test_sandbox_pods_have_no_token_and_the_pools_network_policy_denies_egress(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    make_pool(cluster, namespace, "sec", hosts=1)
    [pod] = host_pods(cluster, namespace, "sec")
    assert pod["spec"].get("automountServiceAccountToken") is False
    mounts = [m["mountPath"] for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])]
    assert not [m for m in mounts if "serviceaccount" in m], mounts
    pols = json.loads(cluster.kubectl("get", "networkpolicy", "-n", namespace, "-o", "json").stdout)["items"]
    mine = [p for p in pols if p["spec"]["podSelector"]["matchLabels"].get("tangram.arl.dev/pool") == "sec"]
    assert len(mine) == 1, pols
    spec = mine[0]["spec"]
    assert "Egress" in spec["policyTypes"] and spec.get("egress", []) == [], spec
    assert [p["port"] for rule in spec["ingress"] for p in rule["ports"]] == [8080]
    record(
        "security-token-and-networkpolicy",
        policy=mine[0]["metadata"]["name"],
        policyTypes=spec["policyTypes"],
    )


def _call(port: int, ns: str, token: str | None) -> int:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    return post_run_code(port, ns, "sec", {"code": "print(1)", "language": "python"}, auth)[0]


def test_the_gateway_refuses_no_token_no_rbac_and_other_namespaces(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    make_pool(cluster, namespace, "sec", hosts=1)
    other = f"{namespace[:50]}-other"
    cluster.kubectl("create", "namespace", other)
    try:
        theirs = trainer_token(cluster, other)  # RBAC in the other namespace only
        mine = trainer_token(cluster, namespace)
        no_rbac = cluster.kubectl(
            "create", "token", "default", "-n", namespace, "--audience=tangram-gateway"
        ).stdout.strip()
        wrong_audience = cluster.kubectl("create", "token", "trainer", "-n", namespace).stdout.strip()
        port = operator.leader().port
        got = {
            "rbac": _call(port, namespace, mine),
            "none": _call(port, namespace, None),
            "garbage": _call(port, namespace, "not-a-token"),
            "wrong-audience": _call(port, namespace, wrong_audience),
            "no-rbac": _call(port, namespace, no_rbac),
            "other-namespace": _call(port, namespace, theirs),
        }
    finally:
        cluster.kubectl("delete", "namespace", other, "--wait=false")
    record("security-gateway-authz", statuses=got)
    assert got == {
        "rbac": 200,
        "none": 401,
        "garbage": 401,
        "wrong-audience": 401,
        "no-rbac": 403,
        "other-namespace": 403,
    }


SESSION_A = "import os\nopen('mine.txt', 'w').write('A-" + SECRET + "')\nprint(os.getcwd())\n"


def _session_b(a_cwd: str) -> str:
    return (
        "import os\n"
        f"a = {a_cwd!r}\n"
        "print('CWD', os.getcwd(), 'SAME', os.getcwd() == a)\n"
        "for what, f in [('READ', lambda: open(os.path.join(a, 'mine.txt')).read()),\n"
        "                ('LIST', lambda: os.listdir(a)),\n"
        "                ('PARENT', lambda: os.listdir(os.path.dirname(a)))]:\n"
        "    try:\n"
        "        print(what, 'OK', f())\n"
        "    except OSError as e:\n"
        "        print(what, 'refused', type(e).__name__)\n"
    )


def test_a_session_cannot_see_another_sessions_files_on_the_same_host(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    from arl_tangram.client import TangramClient

    make_pool(cluster, namespace, "sec", hosts=1)
    token = trainer_token(cluster, namespace)
    client = TangramClient(
        f"http://127.0.0.1:{operator.leader().port}", namespace=namespace, pool="sec", token=token
    )
    with client.session() as a, client.session() as b:
        first = a.run_code(SESSION_A)
        assert first.ok, first
        a_cwd = first.stdout.strip()
        seen = b.run_code(_session_b(a_cwd))
        assert seen.ok, seen
        again = a.run_code("print(open('mine.txt').read())")
    lines = {line.split()[0]: line for line in seen.stdout.splitlines() if line.strip()}
    record("security-session-isolation", a_cwd=a_cwd, b_sees=seen.stdout.strip().splitlines())
    assert again.stdout.strip() == "A-" + SECRET, "a session lost its own file"
    assert "SAME False" in lines["CWD"], lines
    assert "refused" in lines["READ"], f"session B read session A's file: {lines['READ']}"
    assert "refused" in lines["LIST"], f"session B listed session A's workdir: {lines['LIST']}"


# x86_64 numbers: every call the actions' seccomp filter refuses (sandbox/seccomp.py, the one list).
# EPERM: refused by the filter; ENOSYS or anything else: the call got past it to the kernel.
SYSCALLS = {name: nr for group in seccomp.DENIED_X86_64.values() for name, nr in group.items()}
PROBE = (
    "import ctypes, json, platform\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"calls = {SYSCALLS!r}\n"
    "out = {}\n"
    "for name, nr in calls.items():\n"
    "    ctypes.set_errno(0)\n"
    "    rc = libc.syscall(nr, 0, 0, 0, 0, 0)\n"
    "    out[name] = 0 if rc >= 0 else ctypes.get_errno()\n"
    "print('ARCH', platform.machine())\n"
    "print(json.dumps(out))\n"
)


def test_which_calls_no_program_needs_an_action_may_make(
    cluster: Cluster, namespace: str, operator: Operator
) -> None:
    """Every call of the actions' seccomp filter, made from an action in a pool: each answers EPERM
    from the filter (before the kernel looks at its arguments), and the host reports the filter."""
    import errno

    make_pool(cluster, namespace, "sec", hosts=1)
    submit(cluster, namespace, "syscalls", [_code("probe", PROBE)])
    batch = wait_complete(cluster, namespace, "syscalls", timeout=120)
    [r] = batch["status"]["results"]
    assert r["state"] == "Succeeded", r
    arch, answers = (r.get("output") or "").strip().splitlines()
    if arch.split()[1] != "x86_64":
        pytest.skip(f"the probe's syscall numbers are x86_64's, not {arch}")
    got = json.loads(answers)
    through = {k: errno.errorcode.get(v, str(v)) or "allowed" for k, v in got.items() if v != errno.EPERM}
    record("security-syscalls", calls=len(got), not_refused=through)
    assert through == {}, "calls the filter let through"
