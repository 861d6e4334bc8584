"""Where the memory guard reads what is left, and what it counts an action holding (memguard)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arl_tangram.sandbox import memguard
from arl_tangram.sandbox.memguard import MemorySource


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    4000000 kB\n"


def test_a_v2_container_with_a_limit_is_watched_by_its_cgroup(tmp_path: Path) -> None:
    """In a container with its own cgroup namespace its cgroup is the root: its limit is the pod's
    memory, and inactive file pages (reclaimed before anything is killed) are not counted used."""
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/\n",
            "proc/meminfo": MEMINFO,
            "cg/memory.max": f"{8 << 30}\n",
            "cg/memory.current": f"{7 << 30}\n",
            "cg/memory.stat": f"anon {5 << 30}\nfile {2 << 30}\ninactive_file {1 << 30}\nactive_file 0\n",
        },
    )
    source = memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert source == MemorySource("cgroup2", str(tmp_path / "cg"), own=str(tmp_path / "cg"))
    assert memguard.left(source) == (2 << 30, 8 << 30)
    assert memguard.used_own(source) == 6 << 30


def test_a_v2_cgroup_without_a_limit_is_the_hosts_memory(tmp_path: Path) -> None:
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/kubepods/x\n",
            "proc/meminfo": MEMINFO,
            "cg/kubepods/x/memory.max": "max\n",
        },
    )
    proc = str(tmp_path / "proc")
    source = memguard.find_source(proc, str(tmp_path / "cg"))
    assert source == MemorySource("host")
    assert memguard.left(source, proc) == (4000000 << 10, 16000000 << 10)


def test_a_v1_memory_cgroup_with_a_limit_and_one_without(tmp_path: Path) -> None:
    limited = "12:memory:/kubepods/pod1/c1\n11:cpu,cpuacct:/kubepods/pod1/c1\n"
    _tree(
        tmp_path,
        {
            "proc/self/cgroup": limited,
            "cg/memory/kubepods/pod1/c1/memory.limit_in_bytes": f"{4 << 30}\n",
            "cg/memory/kubepods/pod1/c1/memory.usage_in_bytes": f"{3 << 30}\n",
            "cg/memory/kubepods/pod1/c1/memory.stat": f"cache 1\ntotal_inactive_file {512 << 20}\n",
        },
    )
    source = memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert source.kind == "cgroup1"
    assert memguard.left(source) == ((4 << 30) - (3 << 30) + (512 << 20), 4 << 30)
    # No limit (a number near 2**63): the host's memory is what runs out.
    (tmp_path / "cg/memory/kubepods/pod1/c1/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg")) == MemorySource("host")


def test_the_reserve_is_a_share_of_the_memory_unless_set() -> None:
    assert memguard.reserve_of(-1, 16 << 30) == int((16 << 30) * memguard.RESERVE_SHARE)
    assert memguard.reserve_of(-1, 256 << 20) == memguard.MIN_RESERVE
    assert memguard.reserve_of(500, 16 << 30) == 500 << 20
    assert memguard.reserve_of(0, 16 << 30) == 0


def _status(uid: int, rss_kb: int | None, threads: int = 1, name: bytes = b"x") -> bytes:
    rss = f"VmRSS:\t{rss_kb} kB\n".encode() if rss_kb is not None else b""
    return (
        b"Name:\t"
        + name
        + f"\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n".encode()
        + rss
        + f"Threads:\t{threads}\n".encode()
    )


def test_a_uids_processes_are_summed_and_others_ignored(tmp_path: Path) -> None:
    files = {
        "1/status": _status(0, 5000),
        "10/status": _status(1001, 100),
        "11/status": _status(1001, 200),
        "12/status": _status(1002, 300),
        "13/status": _status(1001, None),  # a zombie: no resident memory
        # A name in any bytes (prctl PR_SET_NAME) does not hide a process.
        "14/status": _status(1002, 50, name=b"h\xc3\xa9\xff"),
        # Its first thread gone, another running: the memory is seen through the live thread's task.
        "15/status": _status(1001, None, threads=2),
        "15/task/15/status": _status(1001, None),
        "15/task/16/status": _status(1001, 400),
        "self/status": _status(1001, 999999),
    }
    for name, data in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert memguard.uid_held({1001, 1002, 1003}, str(tmp_path)) == {
        1001: (700 << 10, 0),
        1002: (350 << 10, 0),
        1003: (0, 0),
    }


def test_file_cache_is_not_counted_as_used_and_a_parents_v1_limit_holds(tmp_path: Path) -> None:
    """The kernel reclaims file cache, active or not, before it kills: an action reading a large
    file twice must not look like one taking the container's memory."""
    stat = f"active_file {1 << 30}\ninactive_file {1 << 30}\nanon {1 << 30}\n"
    _tree(
        tmp_path,
        {"v2/memory.max": f"{4 << 30}\n", "v2/memory.current": f"{3 << 30}\n", "v2/memory.stat": stat},
    )
    assert memguard.left(MemorySource("cgroup2", str(tmp_path / "v2"))) == (3 << 30, 4 << 30)
    stat1 = (
        f"hierarchical_memory_limit {2 << 30}\ntotal_active_file {256 << 20}\n"
        f"total_inactive_file {256 << 20}\ntotal_rss {1 << 30}\n"
    )
    _tree(
        tmp_path,
        {
            "v1/memory.limit_in_bytes": f"{8 << 30}\n",
            "v1/memory.usage_in_bytes": f"{1536 << 20}\n",
            "v1/memory.stat": stat1,
        },
    )
    assert memguard.left(MemorySource("cgroup1", str(tmp_path / "v1"))) == (1 << 30, 2 << 30)


def test_memory_in_a_memfd_is_counted_once_however_many_descriptors_hold_it() -> None:
    """A memfd is memory in no process's address space until it is mapped: written with write(2)
    it is past every RLIMIT_AS, so the guard counts it from the descriptors open."""
    before = memguard._memfds("/proc/self/fd", set())
    fd = os.memfd_create("guard-test")
    try:
        os.write(fd, b"x" * (1 << 20))
        again = os.dup(fd)
        try:
            assert memguard._memfds("/proc/self/fd", set()) - before == 1 << 20
        finally:
            os.close(again)
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad", ["not a number\n", ""])
def test_an_unreadable_cgroup_is_passed_over(tmp_path: Path, bad: str) -> None:
    _tree(tmp_path, {"proc/self/cgroup": "0::/\n", "cg/memory.max": bad})
    assert memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg")) == MemorySource("host")


def test_file_pages_a_process_maps_are_not_what_it_holds(tmp_path: Path) -> None:
    """Mapped file pages are cache the kernel reclaims, which the process's end would not give back:
    resident counts anonymous and shared memory, proportional likewise (a kernel without the split
    falls back to the totals)."""
    split = (
        b"Uid:\t1001\t1001\t1001\t1001\nVmRSS:\t1000 kB\n"
        b"RssAnon:\t100 kB\nRssFile:\t850 kB\nRssShmem:\t50 kB\n"
    )
    rollup = "Rss: 1000 kB\nPss: 900 kB\nPss_Anon: 80 kB\nPss_File: 800 kB\nPss_Shmem: 20 kB\n"
    _tree(tmp_path, {"20/smaps_rollup": rollup, "21/smaps_rollup": "Rss: 70 kB\nPss: 60 kB\n"})
    (tmp_path / "20/status").write_bytes(split)
    (tmp_path / "21/status").write_bytes(_status(1001, 70))
    assert memguard.uid_held({1001}, str(tmp_path)) == {1001: ((150 + 70) << 10, 0)}
    assert memguard.pss(1001, str(tmp_path)) == (100 + 60) << 10


def test_threads_that_end_as_they_are_read_do_not_hide_their_process(tmp_path: Path) -> None:
    """A process whose first thread has exited, with threads coming and going: one gone between the
    listing and the read is passed over, not the whole process."""
    (tmp_path / "30/task").mkdir(parents=True)
    (tmp_path / "30/status").write_bytes(_status(1001, None, threads=7))
    for tid in range(40, 47):
        (tmp_path / f"30/task/{tid}").mkdir()
    # The live thread is the one listed last, so that gone ones are read before it; the others are
    # listed, gone by the time their status is read.
    live = os.listdir(tmp_path / "30/task")[-1]
    (tmp_path / f"30/task/{live}/status").write_bytes(_status(1001, 300))
    assert memguard.uid_held({1001}, str(tmp_path)) == {1001: (300 << 10, 0)}


@pytest.mark.parametrize("kind", ["cgroup2", "cgroup1"])
def test_a_limited_parent_that_siblings_share_is_what_is_left(tmp_path: Path, kind: str) -> None:
    """A pod's cgroup limits its containers together: what is left is the least left at any limited
    level seen, the siblings' use counted there; and a container with no limit of its own is held
    by its pod's."""
    # Each hierarchy's files: the limit, the use, and a stat with no file cache.
    base, line, limit_file, usage_file, stat = {
        "cgroup2": (
            tmp_path / "cg",
            "0::/kubepods/pod1/c1\n",
            "memory.max",
            "memory.current",
            "inactive_file 0\n",
        ),
        "cgroup1": (
            tmp_path / "cg/memory",
            "7:memory:/kubepods/pod1/c1\n",
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "total_inactive_file 0\n",
        ),
    }[kind]

    def level(d: str, limit: str, used: int) -> dict[str, str]:
        return {f"{d}/{limit_file}": limit, f"{d}/{usage_file}": str(used), f"{d}/memory.stat": stat}

    root = str(base.relative_to(tmp_path))
    files = {"proc/self/cgroup": line}
    files |= level(f"{root}/kubepods/pod1/c1", str(4 << 30), 1 << 30)
    files |= level(f"{root}/kubepods/pod1", str(5 << 30), (9 << 30) // 2)  # a sibling uses 3.5 GB
    _tree(tmp_path, files)
    source = memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg"))
    own = str(base / "kubepods/pod1/c1")
    assert source == MemorySource(kind, own, (str(base / "kubepods/pod1"),), own)
    assert memguard.left(source) == (1 << 29, 4 << 30)
    # What the agent's own cgroup uses, without the sibling's 3.5 GB: what the guard's count of
    # memory it cannot place is taken from.
    assert memguard.used_own(source) == 1 << 30
    unlimited = "max" if kind == "cgroup2" else "9223372036854771712"
    _tree(tmp_path, level(f"{root}/kubepods/pod1/c1", unlimited, 1 << 30))
    source = memguard.find_source(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert source == MemorySource(kind, str(base / "kubepods/pod1"), own=own)
    assert memguard.left(source) == (1 << 29, 5 << 30)
    assert memguard.used_own(source) == 1 << 30


def test_the_workdirs_are_the_tmpfs_mounts_below_the_root(tmp_path: Path) -> None:
    """Each workdir is a tmpfs of its own below the agent's root: those are what the guard sums as
    seen beside the running actions, read from the mount table (names escaped as the kernel does)."""
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "40 30 0:40 / /w/root/a1 rw,relatime shared:5 - tmpfs tmpfs rw,size=1024k\n"
        "41 30 0:41 / /w/root/my\\040dir rw,relatime master:7 - tmpfs tmpfs rw\n"
        "42 30 0:42 / /w/root/a1 rw,relatime - tmpfs tmpfs rw\n"
        "43 30 8:1 / /w/root/disk rw,relatime - ext4 /dev/sda1 rw\n"
        "44 30 0:44 / /w/rootless rw - tmpfs tmpfs rw\n"
        "45 30 0:45 / /w/root rw - tmpfs tmpfs rw\n"
    )
    assert memguard.tmpfs_under("/w/root", str(info)) == ["/w/root/a1", "/w/root/my dir"]
    assert memguard.tmpfs_under("/w/root", str(tmp_path / "missing")) == []
