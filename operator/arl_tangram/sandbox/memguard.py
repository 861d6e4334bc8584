"""The host's memory guard: when the memory the agent's container (or machine) has left falls below
a reserve, the action holding the most of it is killed, before the kernel or the kubelet kills the
whole host with every action on it.

An action's memory limit (``RLIMIT_AS``) bounds each of its processes, not their sum: eight children
of 200 MB each run under a limit of 256 MB, a process may raise its own (only the soft limit is set,
as outside: zygote_wire.SOFT_ONLY), and memory an action writes to a ``memfd`` or a System V
segment it has detached is in none of its processes' address spaces. None of that may take the host
down. A memory cgroup per action would bound it exactly, but an agent in a pod has no cgroup tree of
its own to make them in, so the guard watches the one number that matters: what is left.

Where it looks (``MemorySource``): the container's memory cgroup when it has a limit (v2:
``memory.max`` against ``memory.current`` less its inactive file pages, which the kernel reclaims
before it kills; v1: ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` likewise), else the
machine's ``MemAvailable``. A limited parent seen from here (a pod's cgroup, which its containers
share) is read too, and the least left anywhere is what is left. Pure parsing here; the fork server
owns the timing and the killing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# A v1 cgroup without a limit reports one near 2**63 (rounded to pages).
_V1_UNLIMITED = 1 << 62
# The reserve when none is set: this share of the memory watched, and at least MIN_RESERVE.
RESERVE_SHARE = 0.05
MIN_RESERVE = 64 << 20
# An action holding less is never killed for the host's memory: it is not what took it (a fresh
# Python action holds about 10 MB), and killing it would give back too little to matter.
MIN_VICTIM = 32 << 20


@dataclass(frozen=True)
class MemorySource:
    """Where the memory left is read: ``kind`` is ``cgroup2``, ``cgroup1`` or ``host``; ``path``
    the nearest cgroup directory with a limit (empty for the host), and ``above`` the limited
    ancestors seen from here: what is left is the least left at any of them (a pod's limit, or a
    parent's, is shared with sibling containers)."""

    kind: str
    path: str = ""
    above: tuple[str, ...] = ()
    own: str = ""  # this process's own cgroup (limited or not): what its processes use, alone


def _read(path: str) -> str:
    # Latin-1 takes any byte: a process may name itself in any bytes (prctl PR_SET_NAME), and a
    # status that failed to decode would hide its memory.
    with open(path, encoding="latin-1") as fh:
        return fh.read()


def _stat_value(text: str, key: str) -> int:
    """``key``'s value in a ``memory.stat`` or ``/proc/meminfo`` text (0 when absent)."""
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name.rstrip(":") == key:
            return int(rest.split()[0])
    return 0


def _limited(kind: str, d: str) -> bool:
    try:
        if kind == "cgroup2":
            limit = _read(f"{d}/memory.max").strip()
            return limit != "max" and int(limit) > 0
        return int(_read(f"{d}/memory.limit_in_bytes")) < _V1_UNLIMITED
    except (OSError, ValueError):
        return False


def find_source(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> MemorySource:
    """The memory cgroup this process is in, or its nearest ancestor, where one has a limit (with
    the limited ones above it that can be read); else the host."""
    try:
        lines = _read(f"{proc}/self/cgroup").splitlines()
    except OSError:
        return MemorySource("host")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one hierarchy
            kind, base = "cgroup2", cgroup_root
        elif "memory" in controllers.split(","):
            kind, base = "cgroup1", f"{cgroup_root}/memory"
        else:
            continue
        # Its own directory, then each parent up to the root. In a container with its own cgroup
        # namespace the path is "/": its root is its own, and nothing above it is seen.
        parts = [p for p in path.split("/") if p]
        chain = [base + "".join(f"/{p}" for p in parts[:n]) for n in range(len(parts), -1, -1)]
        limited = [d for d in chain if _limited(kind, d)]
        if limited:
            usage = "memory.current" if kind == "cgroup2" else "memory.usage_in_bytes"
            own = next((d for d in chain if os.path.exists(f"{d}/{usage}")), "")
            return MemorySource(kind, limited[0], tuple(limited[1:]), own)
    return MemorySource("host")


def _used_at(kind: str, d: str) -> int:
    """What cgroup ``d`` uses, less its file cache: file cache, active or not, is what the kernel
    reclaims before it kills anything; tmpfs and memfd pages are on the anonymous lists, so they
    stay counted."""
    if kind == "cgroup2":
        used = int(_read(f"{d}/memory.current"))
        stat = _read(f"{d}/memory.stat")
        used -= _stat_value(stat, "active_file") + _stat_value(stat, "inactive_file")
    else:
        used = int(_read(f"{d}/memory.usage_in_bytes"))
        stat = _read(f"{d}/memory.stat")
        used -= _stat_value(stat, "total_active_file") + _stat_value(stat, "total_inactive_file")
    return max(used, 0)


def _left_at(kind: str, d: str) -> tuple[int, int]:
    if kind == "cgroup2":
        limit = int(_read(f"{d}/memory.max"))
    else:
        limit = int(_read(f"{d}/memory.limit_in_bytes"))
        # A parent's limit below this cgroup's own holds; where the parent cannot be read (no
        # ``above``), this cgroup's own use against it is the best estimate there is.
        limit = min(limit, _stat_value(_read(f"{d}/memory.stat"), "hierarchical_memory_limit") or limit)
    return limit - _used_at(kind, d), limit


def left(source: MemorySource, proc: str = "/proc") -> tuple[int, int]:
    """(bytes left, bytes in all) at ``source``: the least left at its cgroup and the limited ones
    above it, and the smallest limit; raises OSError where it cannot be read."""
    if source.kind in ("cgroup2", "cgroup1"):
        seen = [_left_at(source.kind, d) for d in (source.path, *source.above)]
        return min(free for free, _ in seen), min(limit for _, limit in seen)
    meminfo = _read(f"{proc}/meminfo")
    return _stat_value(meminfo, "MemAvailable") << 10, _stat_value(meminfo, "MemTotal") << 10


def used_own(source: MemorySource) -> int | None:
    """The memory this process's own cgroup uses, less file cache (None: no such figure, as on a
    host without a limit): unlike what is left at the level that binds, it does not grow with a
    sibling container's use or another tenant's."""
    if not source.own:
        return None
    try:
        return _used_at(source.kind, source.own)
    except (OSError, ValueError):
        return None


def in_use(source: MemorySource, free: int, total: int) -> int:
    """The memory the guard counts as the agent's and its actions': its own cgroup's use where
    there is one (``used_own``), else what is in use at ``source`` (``free`` and ``total`` as
    ``left`` read them)."""
    used = used_own(source)
    return total - free if used is None else used


def reserve_of(setting_mb: int, total: int) -> int:
    """The reserve in bytes: ``setting_mb`` MB, or where it is negative (the default) a share of
    ``total``; 0 turns the guard off."""
    if setting_mb >= 0:
        return setting_mb << 20
    return max(MIN_RESERVE, int(total * RESERVE_SHARE))


def uid_held(uids: set[int], proc: str = "/proc") -> dict[int, tuple[int, int]]:
    """The memory (bytes) each of ``uids`` (real uid) holds in its processes: (their resident
    memory, the memfds they have open or mapped), the second memory in no address space until
    mapped (each counted once). Read only when memory is short: one pass over every process's
    ``status``, and the open files and mappings of these uids' processes."""
    return processes_held(uids, proc)[0]


def processes_held(uids: set[int], proc: str = "/proc") -> tuple[dict[int, tuple[int, int]], int]:
    """``uid_held``'s figures, and the resident memory of every other process (the agent's own,
    or anything else on the machine the guard watches): memory seen, whoever holds it."""
    resident = dict.fromkeys(uids, 0)
    in_memfds = dict.fromkeys(uids, 0)
    memfds: dict[int, set[tuple[int, int]]] = {uid: set() for uid in uids}
    others = 0
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        found = _process(f"{proc}/{name}")
        if found is None:
            continue
        uid, rss, task = found
        if uid not in resident:
            others += rss
            continue
        resident[uid] += rss
        in_memfds[uid] += _memfds(f"{task}/fd", memfds[uid])
        in_memfds[uid] += _mapped_memfds(f"{proc}/{name}", memfds[uid])
    return {uid: (resident[uid], in_memfds[uid]) for uid in uids}, others


def _status(path: str) -> tuple[int | None, int | None, int]:
    """(real uid, resident bytes, threads) from a ``status`` file (None where it has no such line).
    Resident means anonymous and shared memory (``RssAnon`` + ``RssShmem``): the file pages it maps
    are cache the kernel reclaims, and its end would not give them back (``VmRSS`` where a kernel
    has no such split)."""
    uid = vm_rss = None
    split: int | None = None
    threads = 1
    for line in _read(path).splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[1])
        elif line.startswith("VmRSS:"):
            vm_rss = int(line.split()[1]) << 10
        elif line.startswith(("RssAnon:", "RssShmem:")):
            split = (split or 0) + (int(line.split()[1]) << 10)
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return uid, (split if split is not None and vm_rss is not None else vm_rss), threads


def _process(pid_dir: str) -> tuple[int, int, str] | None:
    """(uid, resident bytes, the task directory whose ``fd`` lists its files) of a process, or None
    when it is gone or holds no memory. A process whose first thread has exited while others run
    shows neither memory nor files there: a live thread's task directory does (threads that exit
    as they are read are passed over, not the process)."""
    try:
        uid, rss, threads = _status(f"{pid_dir}/status")
        if uid is None:
            return None
        if rss is not None:
            return uid, rss, pid_dir
        if threads <= 1:
            return None  # a zombie
        tids = os.listdir(f"{pid_dir}/task")
    except (OSError, ValueError):
        return None  # gone meanwhile
    for tid in tids:
        task = f"{pid_dir}/task/{tid}"
        try:
            _, rss, _ = _status(f"{task}/status")
        except (OSError, ValueError):
            continue  # this thread is gone; another may not be
        if rss is not None:
            return uid, rss, task
    return None


def pss(uid: int, proc: str = "/proc") -> int | None:
    """The proportional memory (bytes) of ``uid``'s processes, anonymous and shared as ``_status``
    counts it: pages shared after a fork counted once, where resident memory counts them in each
    process. None where a process's ``smaps_rollup`` cannot be read (no CAP_SYS_PTRACE over
    another uid)."""
    total = 0
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        found = _process(f"{proc}/{name}")
        if found is None or found[0] != uid:
            continue
        try:
            text = _read(f"{found[2]}/smaps_rollup")
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError:
            return None
        if "Pss_Anon:" in text:
            total += (_stat_value(text, "Pss_Anon") + _stat_value(text, "Pss_Shmem")) << 10
        else:  # a kernel before 5.7 has no split
            total += _stat_value(text, "Pss") << 10
    return total


def _memfds(fd_dir: str, seen: set[tuple[int, int]]) -> int:
    """The bytes in the memfds open in ``fd_dir`` that are not in ``seen`` (which gains them)."""
    total = 0
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return 0
    for fd in names:
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith("/memfd:"):
                continue
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _mapped_memfds(pid_dir: str, seen: set[tuple[int, int]]) -> int:
    """The bytes in the memfds mapped in ``pid_dir``'s process and not in ``seen`` (which gains
    them): a memfd mapped and then closed is in no descriptor, and what it holds beyond the pages
    touched through the mapping is in no resident count either. Its size is read through
    ``map_files`` (CAP_SYS_ADMIN); 0 where that cannot be read."""
    total = 0
    try:
        lines = _read(f"{pid_dir}/maps").splitlines()
    except OSError:
        return 0
    for line in lines:
        if "/memfd:" not in line:
            continue
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/memfd:"):
            continue
        try:
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            key = (os.makedev(major, minor), int(fields[4]))
            if key in seen:
                continue
            st = os.stat(f"{pid_dir}/map_files/{fields[0]}")
        except (OSError, ValueError):
            continue
        seen.add(key)
        total += st.st_blocks * 512
    return total


def tmpfs_under(root: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The tmpfs mount points below ``root`` (the workdirs, each a tmpfs of its own) in this
    process's mount namespace."""
    prefix = root.rstrip("/") + "/"
    found: list[str] = []
    try:
        lines = _read(mountinfo).splitlines()
    except OSError:
        return []
    for line in lines:
        mine, _, theirs = line.partition(" - ")
        fields = mine.split(" ")
        if len(fields) < 5 or not theirs.startswith("tmpfs "):
            continue
        # The kernel escapes space, tab, newline and backslash in octal.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if point.startswith(prefix) and point not in found:
            found.append(point)  # once: mounts stacked on one point show the top one
    return found


def fs_used(fd_or_path: int | str) -> int:
    """The bytes a filesystem (a tmpfs) holds, by descriptor or path; 0 where it cannot be read."""
    try:
        st = os.fstatvfs(fd_or_path) if isinstance(fd_or_path, int) else os.statvfs(fd_or_path)
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize
