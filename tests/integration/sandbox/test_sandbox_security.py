"""What an action can reach of the host and of other actions: its own /proc, and the system calls no
program needs (issue 15's sandbox rows; docs/reliability.md).

Real actions in a real agent, as root here (a uid per action, a PID namespace per action, private
mounts), from the C fork loop and from the Python one.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sandbox_agent_harness import C_BUILT, Agent, start_agent, stop_agent, wait_until

SECRET = "s3cr3t-51f0"

# Holds a secret in its command line and its environment, and waits to be killed.
HOLDER = (
    "import os, sys\n"
    "os.execve(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', 'ARGV-" + SECRET + "'],"
    " {'TOKEN_ENV': 'ENV-" + SECRET + "'})\n"
)
# Looks for it through /proc: every process it can see there, the first PIDs of any namespace, and
# the holder's PID on the host (HOLDER_PIDS, filled in by the test).
SNOOPER = (
    "import json, os\n"
    "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
    "argv = env = 0\n"
    "for p in [*range(1, 1024), *HOLDER_PIDS]:\n"
    "    for name in ('cmdline', 'environ'):\n"
    "        try:\n"
    "            data = open(f'/proc/{p}/{name}', 'rb').read()\n"
    "        except OSError:\n"
    "            continue\n"
    "        argv += b'ARGV-" + SECRET + "' in data\n"
    "        env += b'ENV-" + SECRET + "' in data\n"
    "print(json.dumps({'pids': pids, 'me': os.getpid(), 'self': os.readlink('/proc/self'),\n"
    "                  'argv': argv, 'env': env}))\n"
)


def _host_pids_with(marker: bytes) -> list[int]:
    """Host PIDs whose command line holds ``marker`` (the test runs as root, outside the sandbox)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as fh:
                    if marker in fh.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def test_an_action_sees_only_its_own_processes_in_proc(loop_agent: Agent) -> None:
    """Two actions at once: the holder keeps a secret in its argv and environment; the snooper,
    running meanwhile, finds neither through /proc. Its /proc is its own PID namespace's: itself as
    PID 2 under its init, and /proc/<its getpid()> is itself."""
    marker = f"ARGV-{SECRET}".encode()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(loop_agent.execute, HOLDER, timeout_s=60)
        wait_until(lambda: _host_pids_with(marker), what="the holder to run")
        holders = _host_pids_with(marker)
        snooper = f"HOLDER_PIDS = {holders!r}\n" + SNOOPER
        seen = json.loads(str(loop_agent.execute(snooper)["stdout"]))
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
        assert held.result(timeout=60)["signal"] == signal.SIGKILL
    assert (seen["argv"], seen["env"]) == (0, 0), seen
    assert seen["pids"] == [1, 2] and seen["me"] == 2 and seen["self"] == "2", seen


def test_an_action_dumpable_as_outside_still_cannot_reach_its_init(loop_agent: Agent) -> None:
    """A Python action is dumpable, as a program is after its execve outside (its own /proc files
    are its own): its init, which reports its status, stays out of its reach (another uid's)."""
    code = (
        "import ctypes, json, os\nlibc = ctypes.CDLL(None, use_errno=True)\nseen = {}\n"
        "seen['dumpable'] = libc.prctl(3, 0, 0, 0, 0)\n"
        "seen['attach'] = (libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"
        "for name in ('environ', 'mem'):\n"
        "    try:\n        open('/proc/1/' + name, 'rb').read(1)\n        seen[name] = 'read'\n"
        "    except OSError as e:\n        seen[name] = e.errno\n"
        "print(json.dumps(seen))\n"
    )
    ran = loop_agent.execute(code)
    assert ran["status"] == "ok", ran
    seen = json.loads(str(ran["stdout"]))
    assert seen["dumpable"] == 1, seen
    assert seen["attach"] == [-1, errno.EPERM], seen
    assert (seen["environ"], seen["mem"]) == (errno.EACCES, errno.EACCES), seen


# System V shared memory through libc (the standard library has no binding): a segment made under
# a key and left behind (no IPC_RMID), and a look for that key. Each prints what it found.
SHM_KEY = 0x7A11C0DE
_SHM = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
    f"KEY = {SHM_KEY:#x}\n"
)
SHM_MAKER = _SHM + (
    "sid = libc.shmget(KEY, 1 << 20, 0o1666)\n"  # IPC_CREAT, readable and writable by all
    "ctypes.memmove(libc.shmat(sid, None, 0), b'SECRET-OF-A', 11)\n"
    "print(sid)\n"
)
SHM_LOOKER = _SHM + "print(libc.shmget(KEY, 0, 0))\n"


def _host_shm(key: int) -> bool:
    """Whether the host's IPC namespace (this test's) holds a segment under ``key``."""
    with open("/proc/sysvipc/shm") as fh:
        return any(int(line.split()[0]) == key for line in fh.readlines()[1:])


def test_actions_share_no_ipc_objects_with_each_other_or_the_host(loop_agent: Agent) -> None:
    """System V shared memory (and semaphores, message queues, POSIX queues) lives in the IPC
    namespace: in the host's, one action's segment was another's to read, and outlived it (and
    the agent), holding memory past any limit. Each action and session has its own now. A
    session's interpreter keeps its namespace between calls, so its segment is there while other
    actions look (without needing two actions at once): they find none under its key, the host
    neither; the session finds its own again; a plain action's goes with it."""
    session = loop_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        first = loop_agent.execute(SHM_MAKER, session_id=session)
        assert first["status"] == "ok" and int(str(first["stdout"]).strip()) >= 0, first
        looker = loop_agent.execute(SHM_LOOKER)
        assert looker["status"] == "ok" and str(looker["stdout"]).strip() == "-1", looker
        assert not _host_shm(SHM_KEY), "the session's segment is in the host's namespace"
        again = loop_agent.execute(SHM_LOOKER, session_id=session)
        assert str(again["stdout"]).strip() == str(first["stdout"]).strip(), (first, again)
        made = loop_agent.execute(SHM_MAKER)
        assert made["status"] == "ok" and int(str(made["stdout"]).strip()) >= 0, made
        assert str(loop_agent.execute(SHM_LOOKER)["stdout"]).strip() == "-1"
        assert not _host_shm(SHM_KEY), "an action's segment outlived it on the host"
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{session}", timeout=10)
        _remove_host_shm(SHM_KEY)  # what a failure left in the host's namespace must not stay there


def _remove_host_shm(key: int) -> None:
    """Remove the host's segment under ``key`` (this test runs as root), if there is one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sid = libc.shmget(key, 0, 0)
    if sid >= 0:
        libc.shmctl(sid, 0, None)  # IPC_RMID


def test_proc_stays_each_actions_own_through_a_namespaces_whole_life(loop_agent: Agent) -> None:
    """One action after another reuses a pooled mount namespace: each mounts its own /proc over the
    last one's (an unmount would wait for an RCU grace period, its core idle), until the namespace
    has served MNTNS_USES actions and a fresh one takes over, so the mounts never pile up further.
    Every action's /proc shows its own PID namespace (and the seccomp test shows none can unmount
    it to reach what is below)."""
    from arl_tangram.sandbox.forkserver import MNTNS_USES

    code = (
        "import os\n"
        "kinds = [line.split(' - ')[1].split()[0] for line in open('/proc/self/mountinfo')]\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "print(kinds.count('proc'), pids, os.getpid())\n"
    )
    counts = []
    for _ in range(MNTNS_USES + 8):
        body = loop_agent.execute(code)
        assert body["status"] == "ok", body
        procs, rest = body["stdout"].split(" ", 1)
        assert rest.startswith("[1, 2] 2"), body["stdout"]
        counts.append(int(procs))
    # Sequential actions take the namespace given back last: the count climbs by one per action, and
    # falls back once that namespace has been retired.
    assert max(counts) <= MNTNS_USES + 1, counts
    assert any(b < a for a, b in itertools.pairwise(counts)), counts


# Tries every call the filter refuses (with harmless arguments: each would fail anyway, or do
# nothing, were it allowed, so a miss shows as some other errno, never as harm), plus the namespace
# flags of clone and unshare and clone3; prints {name: errno}.
PROBE = (
    "import ctypes, json, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def call(nr, *args):\n"
    "    ctypes.set_errno(0)\n"
    "    got = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])\n"
    "    return ctypes.get_errno() if got == -1 else 0\n"
    "out = {name: call(nr, 0, 0, 0, 0, 0) for name, nr in CALLS.items()}\n"
    "out['unshare(CLONE_NEWUSER)'] = call(272, 0x10000000)\n"
    "out['unshare(CLONE_NEWNET)'] = call(272, 0x40000000)\n"
    "out['clone(CLONE_NEWUSER)'] = call(56, 0x10000000 | 17, 0, 0, 0, 0)\n"
    "out['clone3'] = call(435, 0, 0)\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os._exit(7)\n"
    "out['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
    "print(json.dumps(out))\n"
)


def _probe(agent: Agent, **fields: object) -> dict[str, int]:
    from arl_tangram.sandbox import seccomp

    calls = {name: nr for group in seccomp.DENIED_X86_64.values() for name, nr in group.items()}
    out = agent.execute(f"CALLS = {calls!r}\n" + PROBE, **fields)
    assert out["status"] == "ok", out
    result: dict[str, int] = json.loads(str(out["stdout"]))
    return result


def test_the_calls_no_program_needs_are_refused_and_ordinary_ones_work(loop_agent: Agent) -> None:
    """Each refused call answers EPERM (the program carries on, as a probing program expects);
    clone3 answers ENOSYS, upon which libc falls back to clone; fork still works."""
    health = requests.get(loop_agent.url + "/v1/health", timeout=10).json()
    if not health["isolation"]["seccomp"]:
        pytest.fail(f"no seccomp filter here: {health['isolation']['notes']}")
    got = _probe(loop_agent)
    assert got.pop("clone3") == errno.ENOSYS
    assert got.pop("fork") == 7
    assert {name: code for name, code in got.items() if code != errno.EPERM} == {}
    # Threads (clone3 falling back to clone) and subprocesses, as programs use them.
    code = (
        "import subprocess, sys, threading\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(subprocess.run([sys.executable, '-c', 'print(6*7)'], capture_output=True, text=True).stdout)\n"
    )
    out = loop_agent.execute(code)
    assert (out["status"], out["stdout"]) == ("ok", "thread\n42\n\n"), out


def test_a_session_interpreter_is_filtered_too(loop_agent: Agent) -> None:
    sid = loop_agent.post("/v1/sessions", {"persistent": True}).json()["session_id"]
    try:
        got = _probe(loop_agent, session_id=sid)
        assert got["keyctl"] == got["bpf"] == got["unshare(CLONE_NEWUSER)"] == errno.EPERM, got
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)


def test_no_seccomp_turns_the_filter_off(tmp_path: Path) -> None:
    """``--no-seccomp``: health says so, and keyctl is no longer refused by a filter."""
    running = start_agent(tmp_path / "work", "--no-seccomp")
    try:
        iso = requests.get(running.url + "/v1/health", timeout=10).json()["isolation"]
        assert iso["seccomp"] is False
        assert any("--no-seccomp" in note for note in iso["notes"]), iso["notes"]
        assert _probe(running)["keyctl"] != errno.EPERM
    finally:
        stop_agent(running)


LEAVE = (
    "import os, sys\n"
    "for path in WHERE:\n"
    "    try:\n"
    "        with open(path, 'a') as f:\n"
    "            f.write('left by ' + str(os.getuid()))\n"
    "        print('wrote', path)\n"
    "    except OSError as exc:\n"
    "        print('refused', path, exc.errno)\n"
)
# What a program does to its own files, each as outside: across directories too (a rename, a hard
# link), which Landlock refuses (EXDEV) unless it is told they may.
OWN_FILES = (
    "import os, shutil, tempfile\n"
    "os.makedirs('a/b'); os.rmdir('a/b'); os.mkdir('c')\n"
    "with open('a/f', 'w') as f:\n"
    "    f.write('x')\n"
    "os.rename('a/f', 'c/f'); os.link('c/f', 'linked'); os.symlink('linked', 'sym')\n"
    "with tempfile.NamedTemporaryFile('w', delete=False) as t:\n"
    "    t.write('y')\n"
    "shutil.move(t.name, 'a/t'); shutil.move('c', '/dev/shm/c'); os.truncate('linked', 0)\n"
    "os.mkfifo('/tmp/fifo')\n"
    "print(open('/dev/shm/c/f').read(), open('a/t').read(), os.path.getsize('linked'), end=' ')\n"
    "print(os.path.islink('sym'))\n"
)


@pytest.mark.parametrize("loop", ["c", "python"])
def test_no_world_writable_place_of_the_image_is_shared_between_actions(tmp_path: Path, loop: str) -> None:
    """An image's world-writable directories and files beyond the ones covered by name (php's
    /var/lib/php/sessions, mode 1733; Kubernetes' /dev/termination-log, 0666) held what one action
    wrote for the next to read, after both had ended, and let any fill the disk. An action's
    writes are confined (Landlock) to its workdir, /tmp and /dev/shm, and devices: elsewhere they
    are refused as a directory it may not write is outside (EACCES), and a missing path is still
    ENOENT (a read-only mount said EROFS for both, and a program expecting FileNotFoundError got
    OSError)."""
    if os.geteuid() != 0:
        pytest.skip("mount namespaces need root")
    if loop == "c" and not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    shared = Path(f"/var/lib/tangram-shared-{os.getpid()}")
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    open_file = Path(f"/var/lib/tangram-open-{os.getpid()}")
    open_file.write_text("")
    open_file.chmod(0o666)
    # A file in /dev, where devices are written: as Kubernetes' /dev/termination-log (0666).
    dev_file = Path(f"/dev/tangram-open-{os.getpid()}")
    dev_file.write_text("")
    dev_file.chmod(0o666)
    agent = start_agent(tmp_path / "work", "--fork-loop", loop)
    try:
        if not requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["landlock"]:
            pytest.skip("no Landlock (ABI 2) here: the agent's health says why")
        where = [str(shared / "note"), str(open_file), str(dev_file)]
        first = agent.execute(f"WHERE = {where!r}\n" + LEAVE)
        assert first["status"] == "ok", first
        assert str(first["stdout"]).splitlines() == [f"refused {p} {errno.EACCES}" for p in where], first
        assert not (shared / "note").exists() and open_file.read_text() == dev_file.read_text() == ""
        own = ["out.txt", "/tmp/t", "/dev/shm/s", "/dev/null", "/no/such/dir/f"]
        second = agent.execute(f"WHERE = {own!r}\n" + LEAVE)
        want = [f"wrote {p}" for p in own[:-1]] + [f"refused /no/such/dir/f {errno.ENOENT}"]
        assert str(second["stdout"]).splitlines() == want, second
        third = agent.execute(OWN_FILES)
        assert (third["status"], third["stdout"]) == ("ok", "x y 0 True\n"), third
    finally:
        stop_agent(agent)
        shutil.rmtree(shared, ignore_errors=True)
        open_file.unlink()
        dev_file.unlink()
