"""The warm fork server: two single-threaded processes that start one child per action.

The agent starts it with ``python -m arl_tangram.sandbox.forkserver FD CONFIG`` where FD is one
end of a socketpair. It enters its own network and mount namespaces and then splits in two (the
zygote is a fresh interpreter it starts, not a fork of it: see ``_spawn_zygote``):

- the **zygote** pre-imports the configured modules once (so an action pays for ``fork``, not for
  interpreter start-up and imports) and does nothing but fork: it takes a request and the action's
  descriptors, forks the child into a fresh PID namespace, hands back a pidfd, and reports each
  child's exit status. Its loop touches a few dozen pages between two forks; every page a forking
  process writes after a fork is a copy-on-write fault, and the bookkeeping below, done here,
  cost about 230 of them per action.
- the **manager** (the process the agent started) serves frames (see ``wire``) from the agent:
  ``run`` queues the action until the cores it wants are free (this process owns the host's
  cores), then has the zygote fork it; the child sets up its cores, uid, workdir and rlimits and
  then either runs Python code in-process or ``execve``s a command (bash, pytest). Output is read
  from pipes here, capped, and returned with the exit status. ``interp_run`` / ``interp_stop``: a
  session's persistent interpreter (a forked child that keeps its globals between calls, like a
  notebook kernel); each call gets fresh pipes passed over a socket.

The two run on different cores at once: the manager's bookkeeping for one action overlaps the
zygote's fork of the next.

This module is the manager. Beside it: ``zygote`` (the forking process), ``zygote_wire`` (the
requests and records between the two, shared with the C loop in ``_zygote.c``), ``child`` (an
action's process: its set-up, its namespace's init, running it) and ``reaping`` (leftover processes
and a session interpreter's company). Nothing here imports aiohttp or the agent. The zygote imports none
of this module: it must stay small, because every action pays for copying its page tables.
"""

from __future__ import annotations

# Lean imports on purpose: this process forks now and then (PrivateTmp.make, the probes), and shares
# the fork server's core with the zygote. No typing, dataclasses, json, selectors, contextlib or
# traceback.
import heapq
import marshal
import os
import re
import secrets
import select
import signal
import socket
import struct
import sys
import time
import types
from collections import deque

from arl_tangram.sandbox import isolation, memguard, seccomp, wire
from arl_tangram.sandbox.child import MAIN_FILES, holds_module, set_private_copies, set_tmp_files, source_of
from arl_tangram.sandbox.cores import CorePool
from arl_tangram.sandbox.lean import suppress
from arl_tangram.sandbox.reaping import (
    all_stopped,
    company_of,
    descendants,
    kill_uid,
    rss_kb,
    sweep_without_pidns,
    unreaped_children,
)
from arl_tangram.sandbox.zygote import base_env
from arl_tangram.sandbox.zygote_wire import (
    DATAGRAM_MAX,
    REQUEST_IN_MEMFD,
    encode_request,
    parse_record,
    recv_with_fds,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from arl_tangram.sandbox.messages import RunMessage

READ_CHUNK = 65536
ANSWER = wire.SESSION_ANSWER
EOF_GRACE_S = 0.5  # after the action's process is gone, how long to wait for its pipes to close
UNREAPED_GRACE_S = wire.UNREAPED_GRACE_S
# How long the uid of a call given up on is swept (``kill_uid``): what is left of it is zombies and
# processes stuck in the kernel, which no kill ends, so the sweep runs to this bound every time.
UNREAPED_SWEEP_S = 0.2
# Output is read when the action has ended, or from this long after its start on. Reading as it
# comes woke this process for every write and close of a short action, each wake-up placing it on
# the action's core behind the action (the kernel puts a woken reader beside its writer), while the
# other core sat idle: 14% of the machine, measured. A pipe holds 64 KiB, so a short action that
# writes more waits at most this long for its first read.
PIPE_WATCH_DELAY_S = 0.005
# The most processes a session's persistent interpreter keeps between calls (``_freeze``), the
# exited ones it has not reaped included (``_on_ctrl``).
COMPANY_MAX = 64
# How often stopped sessions are checked for having run again (``_check_frozen``).
FROZEN_CHECK_S = 0.2
# Python code up to this size is compiled here (see _main_file); larger code, in its own child,
# where the compile's time counts against the action and blocks no other action.
COMPILE_HERE_MAX = 32 << 10
# Code objects kept by source text (see _main_file): the same program is often run many times in a
# row (one solution against each of a problem's tests).
COMPILED_KEPT = 128
# Actions a pooled mount namespace serves before it is dropped for a fresh one. Each action mounts
# its own /proc over the last one's there, without unmounting that (see _zygote.c's own_proc): the
# namespace holds one more /proc per action (each keeping its dead PID namespace's few kilobytes),
# and all go at once when it is dropped. Dropping one (the manager's last handle on it closed) waits
# for one RCU grace period here, and making the next (PrivateTmp.make) costs about a millisecond.
MNTNS_USES = 64
# How often the memory left is read while actions run (memguard): an action faulting in memory as
# fast as a core can (a few GB/s) takes a few hundred MB more before the next look.
GUARD_PERIOD_S = 0.1
# How long the guard waits where memory is short but no action is seen to hold it: a look reads
# every process's status, a few milliseconds on a busy host.
GUARD_IDLE_S = 1.0
# How often, at most, the memory in use while no action runs is read (_guard_baseline).
GUARD_BASE_S = 1.0
# How long after a kill the guard waits, at most, for the victim's workdir to be detached (the
# agent does it once it has the reply).
GUARD_SETTLE_S = 10.0
# The most proportional-memory reads in one look (each is a pass over /proc).
GUARD_PSS_READS = 4
# The most of an action's input written to its pipe in one turn of the loop (``_feed``): a pipe's
# default capacity.
STDIN_CHUNK = 64 << 10
# A workdir with more entries than this is not listed on this loop (``_shadows``).
SHADOW_SCAN_MAX = 64
# What a tmpfs directory's size grows by with each entry (see PrivateTmp).
BOGO_DIRENT_SIZE = 20
# How runtimes say they ran out of memory, each as a line of stderr begins it.
# Anywhere in the text, a program's own words ("ValueError: out of memory", a source line echoed
# with a SyntaxError) made an ordinary failure memory_limit_exceeded.
_MEMORY_LINES = re.compile(
    rb"^(?:"
    # Python's exception, numpy's subclass, as a traceback's last line (an exception group's too)
    rb"[ |+]*(?:MemoryError|numpy\.(?:_?core\.)?_exceptions\._ArrayMemoryError)(?::|$)"
    rb"|(?:[\w.]+\.)?\w*(?:Error|Exception): \[Errno 12\] "  # ENOMEM raised (Python's OSError)
    rb"|terminate called after throwing an instance of 'std::bad_alloc'"  # C++
    rb"|Exception in thread \".*\" java\.lang\.OutOfMemoryError"  # Java
    rb"|java\.lang\.OutOfMemoryError"
    rb"|fatal error: (?:runtime: )?(?:out of memory|cannot allocate memory)"  # Go, above its stacks
    rb"|runtime: out of memory: "
    rb"|FATAL ERROR: .*JavaScript heap out of memory"  # Node
    rb"|(?:Uncaught )?RangeError: Array buffer allocation failed"
    rb"|memory allocation of \d+ bytes failed"  # Rust
    rb"|Out of memory!"  # Perl
    rb"|.*: x(?:malloc|realloc): .*cannot allocate \d+ bytes"  # bash
    # perror's ENOMEM (a shell's fork, a C program's), not an exception's message
    rb"|(?![\w.]*(?:Error|Exception):)[\w./: -]+: [Cc]annot allocate memory$"
    rb")",
    re.MULTILINE,
)


def _read_pipe(fd: int) -> bytes | None:
    """One read of an output pipe: its bytes, ``b""`` at its end (or an error), None when nothing
    is there now."""
    try:
        return os.read(fd, READ_CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


class _Poller:
    """The part of ``selectors`` we need, on ``epoll`` directly."""

    __slots__ = ("data", "epoll")

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.data: dict[int, tuple[str, Any]] = {}

    def register(self, fd: int, data: tuple[str, Any], events: int = select.EPOLLIN) -> None:
        self.epoll.register(fd, events)
        self.data[fd] = data

    def unregister(self, fd: int) -> None:
        if self.data.pop(fd, None) is not None:
            self.epoll.unregister(fd)

    def select(self, timeout: float | None) -> list[tuple[int, tuple[str, Any]]]:
        events = self.epoll.poll(-1 if timeout is None else timeout)
        return [(fd, self.data[fd]) for fd, _ in events if fd in self.data]


class Call:
    """One action in flight: its process (or the session interpreter serving it) and its output."""

    __slots__ = (
        "cancelled",
        "cap",
        "cores",
        "cpu_s",
        "deadline",
        "done",
        "ended_at",
        "err",
        "err_truncated",
        "evicted_mb",
        "evicted_over",
        "exit_code",
        "exited",
        "id",
        "interp",
        "interp_ended",
        "interp_evicted",
        "interp_ran_frozen",
        "interp_restarted",
        "interp_stopped",
        "interp_unreaped",
        "main_file",
        "max_rss_kb",
        "memory_limit",
        "memory_limited",
        "mntns",
        "netns",
        "nonce",
        "open_pipes",
        "out",
        "out_truncated",
        "pgid_fallback",
        "pid",
        "pidfd",
        "pipes",
        "pipes_at_start",
        "remove_workdir",
        "setup_failed",
        "signal",
        "started",
        "stdin_feed",
        "timed_out",
        "uid",
        "unreaped",
        "watching",
        "workdir",
    )

    def __init__(
        self,
        id: int,
        pid: int,
        pidfd: int,
        cap: int,
        deadline: float,
        started: float,
        pgid_fallback: bool,
        memory_limited: bool,
        interp: Interp | None = None,
        interp_restarted: bool = False,
        interp_evicted: bool = False,
    ) -> None:
        self.id = id
        self.pid = pid
        self.pidfd = pidfd
        self.cap = cap
        self.deadline = deadline
        self.started = started
        self.pgid_fallback = pgid_fallback
        self.memory_limited = memory_limited
        self.memory_limit = 0  # bytes, the action's own (0: not known)
        self.evicted_over = False  # killed by the guard holding more than its own limit
        self.interp = interp
        self.interp_restarted = interp_restarted
        self.interp_evicted = interp_evicted  # the one before was stopped while idle, for memory
        self.interp_ran_frozen = False  # the one before was stopped for running between calls
        self.interp_stopped = False
        self.interp_unreaped = False  # it went holding too many exited processes (``_on_ctrl``)
        self.interp_ended = False  # its interpreter ended during it, unanswered: never a success
        self.nonce = -1  # a session call's, which its answer carries (``_answer_of``)
        self.out = bytearray()
        self.err = bytearray()
        self.out_truncated = False
        self.err_truncated = False
        self.open_pipes = 2
        self.pipes: list[int] = []
        self.pipes_at_start: tuple[int, int] = (-1, -1)  # (stdout, stderr) read ends
        self.exited = False
        self.exit_code: int | None = None
        self.setup_failed = False  # its sandbox's set-up failed (the zygote's flag, not the status)
        self.signal: int | None = None
        self.timed_out = False
        self.unreaped = False  # answered without the zygote's exit record (``ForkServer._give_up``)
        self.cancelled = False  # killed by the agent's cancel frame
        self.netns = -1  # the network namespace it runs in, from the pool (-1: the fork server's)
        self.mntns: PrivateTmp | None = None  # its mount namespace (private /tmp), from the pool
        self.cpu_s: float | None = None
        self.max_rss_kb: int | None = None
        self.ended_at: float | None = None
        self.done = False
        self.remove_workdir: str | None = None
        self.main_file: str | None = None  # the file its Python code was written to
        self.cores: list[int] = []
        self.uid: int | None = None
        self.watching = False  # its pipes are in the poller (see PIPE_WATCH_DELAY_S)
        # Its input still to write (``ForkServer._feed``): the pipe's write end and what is left.
        self.stdin_feed: tuple[int, memoryview] | None = None
        # Killed by the memory guard (_guard_memory): what it held then, in MB.
        self.evicted_mb: int | None = None
        self.workdir: str | None = None  # a fresh action's own tmpfs, which its end gives back

    def stream_of(self, fd: int) -> str:
        """``"out"`` or ``"err"``: which of the action's streams the read end ``fd`` is."""
        return "out" if fd == self.pipes_at_start[0] else "err"


class PrivateTmp:
    """A mount namespace whose /tmp and /dev/shm are private tmpfs mounts (see _take_mntns), with
    handles on both directories, through which the manager sees whether an action left anything."""

    __slots__ = ("expected", "ns", "shm", "sizes", "tmp", "uses")

    def __init__(self, ns: int, tmp: int, shm: int) -> None:
        self.ns = ns
        self.tmp = tmp
        self.shm = shm
        self.uses = 0  # actions it has served (see MNTNS_USES)
        # What they hold when fresh: the path to the workdir root's mount point, where that lies
        # under one of them (by default under /dev/shm).
        self.expected = self._listing()
        # On tmpfs a directory's size is 20 bytes per entry in it, "." and ".." included (the
        # kernel's BOGO_DIRENT_SIZE), so
        # one fstat each tells whether an action left anything: a listing of both cost this
        # process 8 system calls and two sets per action, on the core it shares with the zygote.
        # An action cannot swap an entry for another of its own (the fresh entries are root's, in
        # sticky directories, and the mount point cannot go), so an equal count is an equal listing.
        # Where the sizes do not say that (another filesystem's rules), the listing is compared.
        sizes = self._sizes()
        counts = tuple(BOGO_DIRENT_SIZE * (2 + len(names)) for names in self.expected)
        self.sizes = sizes if sizes == counts else None

    def _listing(self) -> tuple[set[str], set[str]]:
        return set(os.listdir(self.tmp)), set(os.listdir(self.shm))

    def _sizes(self) -> tuple[int, int]:
        return os.fstat(self.tmp).st_size, os.fstat(self.shm).st_size

    @classmethod
    def make(cls, root: str, size: int) -> PrivateTmp:
        """Set one up in a short-lived child of ours (the manager stays where it is)."""
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(ready_r)
                os.close(done_w)
                from arl_tangram.sandbox.child import private_tmp

                private_tmp(root + "/x", size)
                os.write(ready_w, b"1")
                os.read(done_r, 1)  # until the manager has its handles
                code = 0
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(done_r)
        try:
            if os.read(ready_r, 1) != b"1":
                raise OSError(1, "the mount namespace could not be set up")
            ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            tmp = os.open(f"/proc/{pid}/root/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            shm = os.open(f"/proc/{pid}/root/dev/shm", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(ready_r)
            os.close(done_w)
            os.waitpid(pid, 0)
        return cls(ns, tmp, shm)

    def clean(self) -> bool:
        """Whether the action left /tmp and /dev/shm as it found them (empty)."""
        try:
            if self.sizes is not None:
                return self._sizes() == self.sizes
            return self._listing() == self.expected
        except OSError:
            return False

    def close(self) -> None:
        for fd in (self.ns, self.tmp, self.shm):
            os.close(fd)


class Interp:
    """A session's persistent interpreter."""

    __slots__ = (
        "alive",
        "call",
        "company",
        "ctrl",
        "evicted",
        "frozen",
        "key",
        "last_used",
        "memory_limit",
        "netns",
        "pid",
        "pidfd",
        "ran_frozen",
        "rbuf",
        "sid",
        "stopped_own",
        "stray",
        "uid",
    )

    def __init__(
        self, sid: str, pid: int, pidfd: int, ctrl: socket.socket, uid: int | None, netns: int = -1
    ) -> None:
        self.sid = sid
        self.netns = netns  # its network namespace, from the pool (back to it when it is gone)
        self.uid = uid
        self.pid = pid
        self.pidfd = pidfd
        self.ctrl = ctrl
        self.rbuf = bytearray()
        self.call: Call | None = None
        self.alive = True
        self.frozen = False  # stopped (SIGSTOP) between calls: it keeps threads of its own
        # The processes it started that live on between calls, stopped with it: pid -> pidfd.
        self.company: dict[int, int] = {}
        # Read ends of earlier calls' output pipes that those processes still write to ->
        # "out" or "err": what comes goes to the call running then, as a kernel's stray output.
        self.stray: dict[int, str] = {}
        self.stopped_own: set[int] = set()  # of its company, those stopped by the program itself
        self.memory_limit = 0  # bytes, its session's (a call's ``memory``)
        self.ran_frozen = False  # stopped for running between calls (``_check_frozen``)
        self.last_used = time.monotonic()  # its last call's start: the least recent goes first
        self.evicted = False  # stopped while idle for the host's memory (``_evict_idle``)
        # Its key, the first bytes it reads (before any of the session's code runs): its answers
        # carry their MAC under it (``_answer_of``).
        self.key = secrets.token_bytes(wire.SESSION_KEY_SIZE)


class ForkServer:
    """The fork server's state and event loop (see the module docstring)."""

    def __init__(self, sock: int, config: dict[str, Any]) -> None:
        self.sock = sock
        self.config = config
        self.rbuf = bytearray()
        self.calls: dict[int, Call] = {}
        self.timers: list[tuple[float, int]] = []
        self.interps: dict[str, Interp] = {}
        self.iso = isolation.Isolation()
        self.outq: list[bytes] = []
        self.pool = CorePool(list(config.get("cores", [])))
        self.queue: deque[RunMessage] = deque()
        self.private_tmp = False  # per action (see _zygote.c's private_tmp), set in ``prepare``
        self.netns_free: list[int] = []  # network namespaces ready for actions (_fill_netns_pool)
        self.netns_stats: dict[int, tuple[int, ...]] = {}  # each one's sockstat files (netns_idle)
        self.netns_own: frozenset[tuple[str, str]] = frozenset()  # the counts read (own_socket_counts)
        self.netns_home = -1  # the fork server's own network namespace, while there is a pool
        self.mntns_free: list[PrivateTmp] = []  # mount namespaces with a private /tmp (_take_mntns)
        self.mntns_failed = False
        self.tmp_root = ""  # the workdir root, bound back into each private /dev/shm
        self.tmp_bytes = 0  # each private tmpfs's size (0: the kernel's default, half the memory)
        # Where the memory left is read and the reserve kept (memguard; None: no guard), when it is
        # next read, and the action it last killed until that one has exited.
        self.guard: tuple[memguard.MemorySource, int] | None = None
        self.guard_at = 0.0
        self.frozen_check_at = 0.0  # next look at stopped sessions (``_check_frozen``)
        self.frozen_any = False  # some session may be stopped (set at each freeze)
        self.guard_victim: Call | None = None
        # The memory in use while no action ran (_guard_baseline), and when it is next read.
        self.guard_base = 0
        self.guard_base_at = 0.0
        self.guard_settle = 0.0  # until when the last victim's workdir is waited for
        self.compiled: dict[str, types.CodeType] = {}  # source -> its code object (_main_file)
        # Made in ``prepare``, after the zygote is started: it must inherit none of them.
        self.zy: _ZygoteLink
        self.sel: _Poller
        self.devnull: int
        self.rchunk: memoryview

    # ---- start-up ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Enter namespaces and start the zygote (which pre-imports the configured modules); say
        hello to the agent."""
        if self.config.get("infra_cores"):
            # Where this process and the zygote run (actions are pinned to their own grants): apart
            # from the agent's HTTP loop (see config.infra_cores).
            with suppress(OSError):
                os.sched_setaffinity(0, self.config["infra_cores"])
        self.iso = isolation.enter_private_namespaces(
            bool(self.config.get("network_allowed")),
            list(self.config.get("writable", [])),
            list(self.config.get("readable", [])),
            pid_namespace=not self.config.get("no_pid_namespace"),
            workdir_mounts=bool(self.config.get("workdir_mounts")),
        )
        try:
            # Once here instead of in every child: it is inherited by every fork and exec and can
            # never be unset, so no action (nor anything it executes) can gain privileges through a
            # set-uid program. The fork server itself never executes anything.
            isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
        except OSError as exc:
            self.iso.notes = (*self.iso.notes, f"no_new_privs failed ({exc.strerror})")
        self._prepare_seccomp()
        if not self.iso.pid_namespace:
            # Without namespaces, orphaned action processes come to us (not to the host's init, which
            # may reap late), so that a clean-up can wait until they are really gone. (Not
            # inherited by the zygote: the orphans of its children come here.)
            with suppress(OSError):
                isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)
        self._start_guard()
        self.private_tmp = bool(self.config.get("private_tmp")) and self.iso.private_tmp
        if self.private_tmp and self.iso.pid_namespace:
            # Each action's /proc its own PID namespace's (mounted in the child: see own_proc).
            why_not = isolation.probe_own_proc()
            self.iso.own_proc = why_not is None
            if why_not is not None:
                self.iso.notes = (*self.iso.notes, f"no /proc per action ({why_not})")
        if self.iso.per_action_uid:
            # Each action its own System V and POSIX IPC objects (made in the child, about 20 us):
            # in the host's, one action's shared memory or message queue was another's to read,
            # and outlived it (segments of hundreds of MB, past its memory limit and the agent).
            why_not = isolation.probe_own_ipc()
            self.iso.own_ipc = why_not is None
            if why_not is not None:
                self.iso.notes = (*self.iso.notes, f"no IPC namespace per action ({why_not})")
            elif (why_not := isolation.probe_ipc_bounds(self.iso.own_proc)) is not None:
                # The kernel's defaults then stay: System V memory up to the host's (child.bound_ipc).
                note = f"System V memory per action not bounded by its limit ({why_not})"
                self.iso.notes = (*self.iso.notes, note)
        # Each action's writes confined to its workdir, /tmp and /dev/shm (isolation.restrict_writes).
        why_not = isolation.probe_landlock()
        self.iso.landlock = why_not is None
        if why_not is not None:
            note = f"writes not confined to the workdir, /tmp and /dev/shm ({why_not})"
            self.iso.notes = (*self.iso.notes, note)
        self.tmp_root = (self.config.get("writable") or [""])[0]
        self.tmp_bytes = int(self.config.get("tmp_bytes") or 0)
        tmp_files = (
            int(self.config.get("tmp_bytes_per_file") or 0),
            int(self.config.get("tmp_min_files") or 0),
        )
        set_tmp_files(*tmp_files)  # for the namespaces made ahead (PrivateTmp.make)
        set_private_copies(self.config.get("private_copies") or ())  # and their copies
        self.zy = _ZygoteLink.start(self.config, self.iso.pid_namespace, self.sock)
        self._fill_netns_pool()
        if self.zy.notes:
            self.iso.notes = (*self.iso.notes, *self.zy.notes)
        self.iso.fork_loop = self.zy.loop
        self.sel = _Poller()
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        # Into one buffer kept for the process's life: os.read's fresh megabyte would be an mmap, a
        # page fault, an mremap and a munmap per read.
        self.rchunk = memoryview(bytearray(1 << 20))
        hello = {"op": "hello", "pid": os.getpid(), "isolation": self.iso.as_dict()}
        self.send({**hello, "zygote_vm_kb": isolation.vm_size_kb(self.zy.pid)})
        self.flush()

    def _prepare_seccomp(self) -> None:
        """Decide whether actions run under the seccomp filter (seccomp.py); the zygote's children
        install it (``seccomp_program`` in the config the zygote is started with)."""
        if not self.config.get("seccomp", True):
            self.iso.notes = (*self.iso.notes, "no seccomp filter for actions (turned off: --no-seccomp)")
            return
        why_not = None
        if not seccomp.supported():
            why_not = f"no table for {os.uname().machine}"
        elif not isolation.no_new_privs():
            why_not = "no_new_privs is not set"
        else:
            program = seccomp.program()
            why_not = isolation.probe_seccomp(program)
        if why_not is not None:
            self.iso.notes = (*self.iso.notes, f"no seccomp filter for actions ({why_not})")
            return
        self.config["seccomp_program"] = program
        self.iso.seccomp = True

    def _fill_netns_pool(self) -> None:
        """Network namespaces for actions, made now so that an action pays nothing for its own.

        Each action enters one (loopback up, nothing else): ports, abstract unix sockets and
        loopback traffic are its own. One goes back to the pool when its action's exit record
        comes, that is when every process of the action is gone (its PID namespace is empty), so
        nothing of the last holder is in it. As many as there are cores, plus a few: an action
        holds at least one core, so actions alone never drain the pool; a session's persistent
        interpreter holds one for its life, and beyond those one is made on the spot.
        Where actions have no PID namespace (nothing proves a namespace empty) or may use the
        network, they share the fork server's namespace, as before.
        """
        if not (self.iso.network_namespace and self.iso.pid_namespace):
            return
        try:
            self.netns_home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            for _ in range(len(self.pool.cores) + 4):
                self.netns_free.append(self._new_netns())
        except OSError as exc:
            for fd in self.netns_free:
                self._drop_netns(fd)
            self.netns_free = []
            self.netns_home = -1
            self.iso.notes = (*self.iso.notes, f"no network namespace per action ({exc.strerror})")
            return
        self.iso.netns_per_action = True
        try:
            self.netns_own = isolation.own_socket_counts(self.netns_home)
        except OSError as exc:
            self.iso.notes = (
                *self.iso.notes,
                f"network namespaces reused unchecked for sockets ({exc.strerror})",
            )
            return
        if ("TCP", "tw") not in self.netns_own:
            note = "this kernel counts TIME_WAIT for the host only: a port an action left in it may be busy"
            self.iso.notes = (*self.iso.notes, f"{note} for the next action in its network namespace")

    def _take_mntns(self) -> PrivateTmp | None:
        """A mount namespace whose /tmp and /dev/shm are fresh private tmpfs mounts, made ahead.

        Making one per action in the child (unshare, two mounts, and their teardown at its end)
        cost about a third of the throughput at concurrency 16, measured. These are made once and
        reused: one goes back at its action's exit record (every process of it gone) when its
        /tmp and /dev/shm are empty again, which they are unless the action wrote there; one it
        wrote in is dropped (the next comes from a fresh one). ``None``: make it in the child.
        """
        if self.mntns_free:
            return self.mntns_free.pop()
        try:
            return PrivateTmp.make(self.tmp_root, self.tmp_bytes)
        except OSError as exc:
            if not self.mntns_failed:
                self.mntns_failed = True
                self.iso.notes = (*self.iso.notes, f"no mount namespace pool ({exc.strerror})")
            return None

    def _give_back_mntns(self, mnt: PrivateTmp) -> None:
        mnt.uses += 1
        if mnt.uses < MNTNS_USES and mnt.clean() and len(self.mntns_free) < len(self.pool.cores) + 4:
            self.mntns_free.append(mnt)
        else:
            mnt.close()

    def _take_netns(self) -> int:
        if self.netns_home < 0:
            return -1
        if self.netns_free:
            return self.netns_free.pop()
        return self._new_netns()

    def _new_netns(self) -> int:
        fd, stats = isolation.loopback_netns(self.netns_home)
        self.netns_stats[fd] = stats
        return fd

    def _drop_netns(self, fd: int) -> None:
        for opened in (fd, *self.netns_stats.pop(fd, ())):
            os.close(opened)

    def _give_back_netns(self, fd: int) -> None:
        """A namespace whose every process is gone goes back to the pool if it holds no socket
        either (``isolation.netns_idle``: a port in TIME_WAIT kept the next action there from
        binding it, without SO_REUSEADDR, for a minute). One that does is dropped (the kernel
        frees it once its sockets are gone) and a fresh one takes its place, so that the pool
        stays as full and an action start pays nothing for it."""
        if isolation.netns_idle(self.netns_stats.get(fd, ()), self.netns_own):
            self.netns_free.append(fd)
            return
        self._drop_netns(fd)
        with suppress(OSError):  # else made on the spot by the next start that finds none
            self.netns_free.append(self._new_netns())

    def _start_guard(self) -> None:
        """The memory guard (memguard), unless it is turned off or cannot tell actions apart."""
        setting = int(self.config.get("memory_reserve_mb", -1))
        if setting == 0:
            return
        if not self.iso.per_action_uid:
            why = "actions share one uid, so whose processes hold the memory cannot be told"
            self.iso.notes = (*self.iso.notes, f"no memory guard ({why})")
            return
        source = memguard.find_source()
        try:
            _, total = memguard.left(source)
        except (OSError, ValueError) as exc:
            why = f"the {source.kind}'s memory cannot be read: {exc}"
            self.iso.notes = (*self.iso.notes, f"no memory guard ({why})")
            return
        reserve = memguard.reserve_of(setting, total)
        self.guard = (source, reserve)
        self._guard_baseline()
        self.iso.memory_guard = {"source": source.kind, "reserve_mb": reserve >> 20, "total_mb": total >> 20}

    # ---- the loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the agent closes its end of the socket."""
        os.set_blocking(self.sock, False)
        self.sel.register(self.sock, ("agent", None))
        self.sel.register(self.zy.sock.fileno(), ("zygote", None))
        while True:
            timeout = None
            if self.zy.pending:
                timeout = 0.0  # exit records taken in while waiting for a fork: handle them now
            elif self.timers:
                timeout = max(0.0, self.timers[0][0] - time.monotonic())
            if self.guard is not None and self.calls:
                wait = max(0.0, self.guard_at - time.monotonic())
                timeout = wait if timeout is None else min(timeout, wait)
            if self.frozen_any:
                wait = max(0.0, self.frozen_check_at - time.monotonic())
                timeout = wait if timeout is None else min(timeout, wait)
            for fd, data in self.sel.select(timeout):
                if self.sel.data.get(fd) is not data:
                    # Closed earlier in this turn (its number perhaps reused already by an action
                    # started since): the event was for what is gone.
                    continue
                kind, owner = data
                if kind == "agent":
                    if not self._on_agent():
                        return
                elif kind == "zygote":
                    if not self.zy.drain():
                        return  # the zygote is gone: the agent starts a new fork server
                elif kind == "ctrl":
                    self._on_ctrl(owner)
                elif kind == "stdin":
                    self._feed(owner)
                elif kind == "stray":
                    self._on_stray(fd, owner)
                else:
                    self._on_pipe(fd, kind, owner)
            self._process_exits()
            self._fire_timers()
            self._guard_memory()
            self._check_frozen()
            self._drain()  # cores freed by this turn's exits go to the next actions now
            self.flush()

    def send(self, message: dict[str, Any]) -> None:
        """Queue one frame for the agent; ``flush`` writes all of a loop iteration's frames at once
        (one system call and one wake-up of the agent instead of one per action)."""
        self.outq.append(wire.encode(message))

    def flush(self) -> None:
        """Write the queued frames (blocking: the agent always reads)."""
        if not self.outq:
            return
        view = memoryview(b"".join(self.outq))
        self.outq.clear()
        # Usually the socket buffer takes it all at once: no switch to blocking and back (two
        # ioctls) for that.
        with suppress(BlockingIOError):
            view = view[os.write(self.sock, view) :]
        if not view:
            return
        os.set_blocking(self.sock, True)
        try:
            while view:
                view = view[os.write(self.sock, view) :]
        finally:
            os.set_blocking(self.sock, False)

    def _on_agent(self) -> bool:
        try:
            size = os.readv(self.sock, [self.rchunk])
        except BlockingIOError:
            return True
        if not size:
            return False
        self.rbuf += self.rchunk[:size]
        msg: Any  # a frame of messages.py: RunMessage, InterpStop or Cancel, told apart by "op"
        for msg in wire.decode_frames(self.rbuf):
            op = msg.get("op")
            try:
                if op in ("run", "interp_run"):
                    self.queue.append(msg)
                elif op == "interp_stop":
                    self._stop_interp(msg["sid"])
                    self.send({"id": msg["id"], "stopped": True})
                elif op == "cancel":
                    self.send({"id": msg["id"], "found": self._cancel(msg["target"])})
            except Exception as exc:  # report, never die: the agent awaits an answer for this id
                self.send({"id": msg.get("id"), "sandbox_error": f"{exc.__class__.__name__}: {exc}"})
        self._drain()
        return True

    def _cancel(self, target: int) -> bool:
        """Kill action ``target`` and everything it started (its answer then says ``cancelled``),
        or drop it from the queue if it has not started; ``False`` when it is not here (it ended)."""
        call = self.calls.get(target)
        if call is not None:
            if not call.exited:
                call.cancelled = True
                self._kill(call)
            return True
        for msg in self.queue:
            if msg.get("id") == target:
                self.queue.remove(msg)
                self.send({"id": target, "cancelled": True, "cores": [], "busy_cores": self.pool.busy})
                return True
        return False

    # ---- cores ------------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Start queued actions, in arrival order, while their cores are free.

        The fork server owns the cores: an action's cores are free again the moment its process
        is reaped, and the next action is forked in the same loop turn, with no round trip to the
        agent in between (which on two cores cost a third of the throughput).

        An action granted exact cores (the operator's scheduler sends the grant, and may send the
        next action for a core while the one before still runs there) waits for those cores only:
        it starts ahead of earlier actions waiting for other cores, never ahead of an earlier one
        that wants one of its cores. An action asking for a number of cores keeps strict order: it,
        and everything behind it, waits until enough cores are free, so a wide one is not starved.
        """
        queue = self.queue
        waited: set[int] = set()  # cores that earlier, still waiting, actions granted exactly want
        i = 0
        while i < len(queue):
            msg = queue[i]
            want = msg["want"]
            if isinstance(want, int):
                cores = None if waited else self.pool.take(want)
                if cores is None:
                    return
            elif waited.intersection(want) or (cores := self.pool.take(want)) is None:
                waited.update(want)
                i += 1
                continue
            del queue[i]
            msg["cores"] = cores
            msg["env"]["TANGRAM_CORES"] = ",".join(map(str, cores))
            try:
                if msg["op"] == "run":
                    self._start_run(msg)
                else:
                    self._start_interp_run(msg)
            except Exception as exc:
                self.pool.release(cores)
                self.send({"id": msg.get("id"), "sandbox_error": f"{exc.__class__.__name__}: {exc}"})

    # ---- starting actions -------------------------------------------------------------------------
    def _stdin_fd(self, data: bytes | None) -> tuple[int, int, memoryview]:
        """The action's standard input: the read end of a pipe, as a program reads its input
        outside a sandbox (SandboxFusion's runner feeds a pipe), its write end and what is left to
        write through it. What the pipe holds (64 KiB by default: nearly every input) is written
        now and the write end closed (-1); the rest is fed as the program reads (``_feed``).

        A regular file here (a memfd) let programs pass that fail there: ``os.read(0,
        os.fstat(0).st_size)`` (a pipe's size is 0), ``mmap(0, 0)``, ``sys.stdin.seek(0)``. Growing
        the pipe to hold it all instead spent the user's pipe quota (``pipe-user-pages-soft``),
        past which every new pipe of the agent, its output pipes too, gets two pages.

        No input is a pipe too, at its end at once: /dev/null here (a character device, seekable)
        sent programs that look at their input (``[ -p /dev/stdin ]``, ``fstat``, ``fseek``) down
        another branch than a pipe does."""
        if not data:
            r, w = os.pipe2(os.O_CLOEXEC)
            os.close(w)
            return r, -1, memoryview(b"")
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            os.set_blocking(r, True)  # the program's reads block, as on any pipe
            try:
                written = os.write(w, data)
            except BlockingIOError:
                written = 0
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        if written >= len(data):
            os.close(w)
            return r, -1, memoryview(b"")
        return r, w, memoryview(data)[written:]

    def _start_feed(self, call: Call, w: int, rest: memoryview) -> None:
        """Feed the rest of the call's input as its program reads (after the call is tracked: a
        registration that fails must not leave a running action untracked). Where the poller
        cannot take the pipe, the program gets what the pipe held, then end of input."""
        if w < 0:
            return
        try:
            self.sel.register(w, ("stdin", call), select.EPOLLOUT)
        except OSError:
            os.close(w)
            return
        call.stdin_feed = (w, rest)

    def _feed(self, call: Call) -> None:
        """Write more of the call's input as its program reads (the pipe has room again); close
        the write end once all is written or nobody reads (the program ended or closed it)."""
        feed = call.stdin_feed
        if feed is None:
            return
        w, rest = feed
        try:
            rest = rest[os.write(w, rest[:STDIN_CHUNK]) :]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: no reader left (anything else would recur: end it alike)
            rest = rest[:0]
        if rest:
            call.stdin_feed = (w, rest)
        else:
            self._end_feed(call)

    def _end_feed(self, call: Call) -> None:
        if call.stdin_feed is not None:
            w = call.stdin_feed[0]
            call.stdin_feed = None
            self.sel.unregister(w)
            os.close(w)

    def _make_workdir(self, msg: RunMessage) -> bool:
        """Whether the workdir is new (else the agent made it, with the request's files)."""
        # Here rather than in the child: a few system calls in this process, instead of the child's
        # copy-on-write faults on every Python object the same work touches there.
        if msg.get("workdir_made"):
            return True  # the agent mounted it (workfiles.make_workdir), empty
        uid = msg.get("uid")
        try:
            os.mkdir(msg["workdir"], 0o700)
            if uid is not None:
                os.chown(msg["workdir"], uid, uid)
        except FileExistsError:
            return False
        return True

    def _shadows(self, workdir: str) -> bool:
        """Whether the workdir holds a module of the program's named as one the zygote holds
        (``json.py``, a ``heapq/`` package): the code then runs from the child's own compile,
        whose path forgets those modules first (``child.unshadow``). A workdir is listed only
        while it is small; a larger one (an action may have filled it: this loop never walks
        that) is asked about each name instead."""
        names = self.zy.shadowable
        if not names:
            return False
        try:
            with os.scandir(workdir) as entries:
                for n, entry in enumerate(entries):
                    if n >= SHADOW_SCAN_MAX:
                        break
                    stem = entry.name.removesuffix(".py")
                    if stem in names and holds_module(workdir, stem):
                        return True
                else:
                    return False
        except OSError:
            return False
        return any(holds_module(workdir, name) for name in names)

    def _main_file(self, msg: RunMessage, fresh: bool) -> None:
        """Name the file Python code runs from (``python main.py``, see child._run_python_and_exit)
        and compile the code for it, here.

        Compiling in the child cost about 100 copy-on-write faults there (the compiler's memory
        is all fresh), a third of a short action's; here it is a fraction of that in CPU, and the
        child only unmarshals the code object. Anything the compiler would say (an error, a
        warning) is left to the child, which says it on the action's stderr exactly as Python does.
        """
        workdir = msg["workdir"]
        name = MAIN_FILES[0]
        if not fresh:
            # The request brought files: take the first name none of them has.
            free = [n for n in MAIN_FILES if not os.path.lexists(workdir + "/" + n)]
            if not free:
                return  # every name taken: it runs as ``python -c`` would
            name = free[0]
        path = workdir + "/" + name
        msg["main_file"] = path
        code = msg["code"]
        if len(code) > COMPILE_HERE_MAX or (not fresh and self._shadows(workdir)):
            return
        kept = self.compiled.pop(code, None)
        if kept is None:
            import warnings  # here, in the manager only (the zygote never imports this module)

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # a warning must be the action's to print: see above
                    # dont_inherit: not this module's ``from __future__`` (``python file.py`` has none).
                    # From the main file's bytes, as ``python main.py`` reads it: a leading BOM
                    # and a coding declaration mean what they mean there (child.source_of).
                    kept = compile(source_of(code), path, "exec", dont_inherit=True)
            except Exception:
                return  # the child compiles it again and reports the error as Python would
            if len(self.compiled) >= COMPILED_KEPT:
                del self.compiled[next(iter(self.compiled))]  # the least recently used
        self.compiled[code] = kept
        msg["compiled"] = marshal.dumps(_with_filename(kept, path))

    def _start_run(self, msg: RunMessage) -> None:
        fresh = self._make_workdir(msg)
        if msg.get("argv") is None:
            self._main_file(msg, fresh)
        opened: list[int] = []
        try:
            stdin_fd, stdin_w, stdin_rest = self._stdin_fd(msg.get("stdin"))
            if stdin_fd != self.devnull:
                opened.append(stdin_fd)
            if stdin_w >= 0:
                opened.append(stdin_w)
            r_out, w_out, r_err, w_err = _output_pipes()
            opened += [r_out, w_out, r_err, w_err]
            fds = [w_out, w_err] if stdin_fd == self.devnull else [w_out, w_err, stdin_fd]
            _hand_over(msg.get("uid"), fds)
            # A private /tmp and /dev/shm needs what the fork server's own mount namespace needed
            # (and root, which an action of its own uid implies).
            private = self.private_tmp and msg.get("uid") is not None
            mnt = self._take_mntns() if private else None
            msg["private_tmp"] = private and mnt is None  # made in the child (a cold pool only)
            msg["own_proc"] = private and self.iso.own_proc
            msg["own_ipc"] = self.iso.own_ipc and msg.get("uid") is not None
            msg["landlock"] = self.iso.landlock
            if mnt is not None:
                msg["mntns"] = True
                fds.append(mnt.ns)
            netns = self._take_netns()
            if netns >= 0:
                msg["netns"] = True
                fds.append(netns)
            started = time.monotonic()
            try:
                pid, pidfd = self.zy.spawn(msg, fds)
            except BaseException:
                if netns >= 0:
                    self.netns_free.append(netns)  # nothing entered it
                if mnt is not None:
                    self.mntns_free.append(mnt)
                raise
        except BaseException:
            # Out of descriptors or processes: report it (the caller does), leak nothing.
            for fd in opened:
                os.close(fd)
            raise
        os.close(w_out)
        os.close(w_err)
        if stdin_fd != self.devnull:
            os.close(stdin_fd)
        call = Call(
            id=msg["id"],
            pid=pid,
            pidfd=pidfd,
            cap=int(msg["cap"]),
            deadline=started + float(msg["timeout"]),
            started=started,
            pgid_fallback=not self.iso.pid_namespace,
            memory_limited=bool(msg.get("limits", {}).get("as")),
        )
        call.cores = msg["cores"]
        call.memory_limit = int(msg.get("memory") or 0)
        call.netns = netns
        call.mntns = mnt
        if msg.get("remove_workdir"):
            call.remove_workdir = msg["workdir"]
        call.uid = msg.get("uid")
        if msg.get("remove_workdir") or msg.get("in_session"):
            # Removed at the end where the workdir stays (a session's) or goes at once; a fresh
            # workdir kept for its fetch or detached whole keeps it as the program left it (its
            # fullness, and what a descriptor kept of it may gain, are the program's doing).
            call.main_file = msg.get("main_file")
        if msg.get("workdir_tmpfs"):
            call.workdir = msg["workdir"]
        self.zy.owners[pid] = call
        self._track(call, r_out, r_err, watch=False)
        self._start_feed(call, stdin_w, stdin_rest)
        heapq.heappush(self.timers, (started + PIPE_WATCH_DELAY_S, call.id))

    def _track(self, call: Call, r_out: int, r_err: int, watch: bool = True) -> None:
        if not self.calls:
            self._guard_baseline()
        self.calls[call.id] = call
        call.pipes = [r_out, r_err]
        call.pipes_at_start = (r_out, r_err)
        if watch:
            self._watch(call)
        heapq.heappush(self.timers, (call.deadline, call.id))

    def _watch(self, call: Call) -> None:
        """Read the call's output as it comes from now on."""
        call.watching = True
        for fd in call.pipes:
            self.sel.register(fd, (call.stream_of(fd), call))

    def _start_interp_run(self, msg: RunMessage) -> None:
        sid = msg["sid"]
        interp = self.interps.get(sid)
        restarted = evicted = ran_frozen = False
        if interp is None or not interp.alive:
            restarted = interp is not None
            evicted = interp is not None and interp.evicted
            ran_frozen = interp is not None and interp.ran_frozen
            interp = self._spawn_interp(msg)
        elif interp.frozen:
            self._thaw(interp, msg["cores"])
        stdin_fd, stdin_w, stdin_rest = self._stdin_fd(msg.get("stdin"))
        try:
            r_out, w_out, r_err, w_err = _output_pipes()
        except BaseException:
            for fd in (stdin_fd, stdin_w):
                if fd >= 0 and fd != self.devnull:
                    os.close(fd)
            raise
        _hand_over(interp.uid, [w_out, w_err] if stdin_fd == self.devnull else [w_out, w_err, stdin_fd])
        # The interpreter was forked for an earlier call: it takes this call's cores and environment
        # (TANGRAM_CORES, TANGRAM_DOP...) itself before running the code.
        # The call's nonce comes back with its answer, with their MAC (``_answer_of``).
        nonce = secrets.randbits(62)
        payload = marshal.dumps({"code": msg["code"], "cores": msg["cores"], "env": msg["env"]})
        started = time.monotonic()
        try:
            # Bounded: an interpreter whose code stopped reading its control socket must not be able
            # to stall this loop (the call then runs into its timeout, which kills the interpreter).
            interp.ctrl.settimeout(2.0)
            header = wire.SESSION_CALL.pack(len(payload), nonce)
            socket.send_fds(interp.ctrl, [header], [stdin_fd, w_out, w_err])
            interp.ctrl.sendall(payload)
        except OSError:
            # A dead interpreter: its exit is reported through the pidfd like any other exit.
            pass
        finally:
            interp.ctrl.setblocking(False)
            os.close(w_out)
            os.close(w_err)
            if stdin_fd != self.devnull:
                os.close(stdin_fd)
        call = Call(
            id=msg["id"],
            pid=interp.pid,
            pidfd=interp.pidfd,
            cap=int(msg["cap"]),
            deadline=started + float(msg["timeout"]),
            started=started,
            pgid_fallback=not self.iso.pid_namespace,
            memory_limited=bool(msg.get("limits", {}).get("as")),
            interp=interp,
            interp_restarted=restarted,
            interp_evicted=evicted,
        )
        call.interp_ran_frozen = ran_frozen
        interp.last_used = started
        call.cores = msg["cores"]
        call.memory_limit = int(msg.get("memory") or 0)
        call.nonce = nonce
        interp.call = call
        self._track(call, r_out, r_err)
        self._start_feed(call, stdin_w, stdin_rest)

    def _spawn_interp(self, msg: RunMessage) -> Interp:
        self._make_workdir(msg)
        # Its own /tmp and /dev/shm and /proc, as an action's: they live as long as the interpreter
        # (its files stay between calls, like the workdir's), so none is pooled.
        private = self.private_tmp and msg.get("uid") is not None
        # Made as the pool's are (PrivateTmp.make: with its copies of the shared files readers
        # lock, child.set_private_copies), at the session's memory limit, and never pooled; where
        # that fails, in the child as before.
        mnt = self._session_mntns(msg) if private else None
        msg["private_tmp"] = private and mnt is None
        msg["mntns"] = mnt is not None
        msg["own_proc"] = private and self.iso.own_proc
        msg["own_ipc"] = self.iso.own_ipc and msg.get("uid") is not None
        msg["landlock"] = self.iso.landlock
        # And a network namespace of its own with loopback up, as an action's, from the pool: it
        # goes back when the interpreter is gone (its PID namespace's first process: all of it).
        netns = self._take_netns()
        msg["netns"] = netns >= 0
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Each read of its answers says which process wrote them (``_on_ctrl``).
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            fds = [child.fileno()]
            if mnt is not None:
                fds.append(mnt.ns)  # the namespaces come last, the mount one before the network's
            if netns >= 0:
                fds.append(netns)
            pid, pidfd = self.zy.spawn(msg, fds, interp=True)
        except BaseException:
            parent.close()
            if netns >= 0:
                self.netns_free.append(netns)  # nothing entered it
            raise
        finally:
            child.close()
            if mnt is not None:
                mnt.close()  # the interpreter's own now, gone with it
        interp = Interp(sid=msg["sid"], pid=pid, pidfd=pidfd, ctrl=parent, uid=msg.get("uid"), netns=netns)
        interp.memory_limit = int(msg.get("memory") or 0)
        with suppress(OSError):  # one that is gone already: its exit is reported like any other
            parent.sendall(interp.key)
        parent.setblocking(False)
        self.interps[interp.sid] = interp
        self.zy.owners[pid] = interp
        self.sel.register(parent.fileno(), ("ctrl", interp))
        return interp

    def _session_mntns(self, msg: RunMessage) -> PrivateTmp | None:
        """A mount namespace for a session's interpreter, its /tmp and /dev/shm of the session's
        memory limit (what the child's would hold, ``written`` in child.child_main); None: make it
        in the child."""
        limits = msg.get("limits", {})
        size = int(limits.get("written") or limits.get("data") or limits.get("as") or 0)
        try:
            return PrivateTmp.make(self.tmp_root, size)
        except OSError as exc:
            if not self.mntns_failed:
                self.mntns_failed = True
                self.iso.notes = (*self.iso.notes, f"no mount namespace pool ({exc.strerror})")
            return None

    def _stop_interp(self, sid: str) -> None:
        interp = self.interps.pop(sid, None)
        if interp is not None:
            self._kill_interp(interp)

    def _kill_interp(self, interp: Interp) -> None:
        """Kill the interpreter and all it started, and reap it now: a closed session leaves no
        process behind, and a stopped interpreter is known dead before the session's next call."""
        if interp.alive:
            with suppress(OSError):
                signal.pidfd_send_signal(interp.pidfd, signal.SIGKILL)
            status = None
            with suppress(EOFError):  # a lost zygote: this process ends soon after
                status = self.zy.wait_exit(interp)[1]
            self._interp_gone(interp, status)
        if not self.iso.pid_namespace and interp.uid is not None:
            # What the interpreter started, now that no namespace takes it down.
            kill_uid(interp.uid, self._tracked_pids())

    def _freeze(self, interp: Interp) -> str | None:
        """SIGSTOP the interpreter and every process below it (in its PID namespace, where nothing
        leaves it), and wait until every thread of them has stopped; one forked meanwhile is
        stopped in turn. ``"processes"`` when not all of it stopped in time: it must go."""
        with suppress(OSError):
            signal.pidfd_send_signal(interp.pidfd, signal.SIGSTOP)
        company = interp.company
        deadline = time.monotonic() + 0.05
        while True:
            if self.iso.pid_namespace:
                for pid in descendants(interp.pid):
                    if pid in company:
                        continue
                    # One the program stopped itself stays stopped at the next call.
                    if all_stopped(pid):
                        interp.stopped_own.add(pid)
                    try:
                        # By pidfd: the pid of one that ends is not this one's to signal later.
                        company[pid] = os.pidfd_open(pid)
                        signal.pidfd_send_signal(company[pid], signal.SIGSTOP)
                    except OSError:
                        continue  # gone already
            if len(company) > COMPANY_MAX:
                # Each kept process holds a pidfd here, and its memory and a slot of the host's
                # processes until the session ends: past this, the interpreter goes as before.
                self._release_company(interp)
                return "processes"
            # Once all are stopped none can fork or signal: what is there then is all there is.
            if (
                all_stopped(interp.pid)
                and all(all_stopped(pid) for pid in company)
                and (not self.iso.pid_namespace or set(descendants(interp.pid)) <= company.keys())
            ):
                break
            if time.monotonic() >= deadline:
                self._release_company(interp)
                return "processes"
            time.sleep(0.0002)
        interp.frozen = True
        self.frozen_any = True
        return None if self.iso.pid_namespace else company_of(interp.pid)

    def _check_frozen(self) -> None:
        """Every FROZEN_CHECK_S: a stopped session that runs again between calls (a timer of its
        own that raises SIGCONT undoes a SIGSTOP; nothing else outside it can) is stopped for good:
        its interpreter goes with all it started, and its next call is told why."""
        now = time.monotonic()
        if not self.frozen_any or now < self.frozen_check_at:
            return
        self.frozen_check_at = now + FROZEN_CHECK_S
        self.frozen_any = any(i.alive and i.frozen for i in self.interps.values())
        for interp in [i for i in self.interps.values() if i.alive and i.frozen]:
            if all_stopped(interp.pid) and all(all_stopped(pid) for pid in interp.company):
                continue
            interp.ran_frozen = True
            self._kill_interp(interp)

    def _thaw(self, interp: Interp, cores: list[int]) -> None:
        """Move every thread of a frozen interpreter and of the processes it started to the call's
        cores, then let them run."""
        for pid in (interp.pid, *interp.company):
            with suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with suppress(OSError):
                        os.sched_setaffinity(int(tid), cores)
        for pid, pidfd in interp.company.items():
            if pid not in interp.stopped_own:
                with suppress(OSError):
                    signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        with suppress(OSError):
            signal.pidfd_send_signal(interp.pidfd, signal.SIGCONT)
        self._release_company(interp)
        interp.frozen = False

    @staticmethod
    def _release_company(interp: Interp) -> None:
        for pidfd in interp.company.values():
            os.close(pidfd)
        interp.company.clear()
        interp.stopped_own.clear()

    def _tracked_pids(self) -> set[int]:
        tracked = {c.pid for c in self.calls.values()} | {i.pid for i in self.interps.values() if i.alive}
        tracked.add(self.zy.pid)
        return tracked

    # ---- events -----------------------------------------------------------------------------------
    def _on_pipe(self, fd: int, kind: str, call: Call) -> bool:
        """Read once from an output pipe; whether there may be more to read right away."""
        data = _read_pipe(fd)
        if data is None:
            return False
        if not data:
            self._close_pipe(fd, call)
            return False
        self._take(call, kind, data)
        return True

    @staticmethod
    def _take(call: Call, kind: str, data: bytes) -> None:
        """Add what a pipe gave to the call's output, within its cap."""
        buf = call.out if kind == "out" else call.err
        room = call.cap - len(buf)
        if room >= len(data):
            buf += data
        else:
            # Keep reading (and dropping) so the program is not blocked on a full pipe.
            if room > 0:
                buf += data[:room]
            if kind == "out":
                call.out_truncated = True
            else:
                call.err_truncated = True

    def _on_stray(self, fd: int, interp: Interp) -> None:
        """Output of a session's kept processes on an earlier call's pipe: the running call's, as
        in a notebook (nothing runs between calls, so nothing is lost then but what no call takes)."""
        data = _read_pipe(fd)
        if data is None:
            return
        if not data:
            self._drop_stray(interp, fd)
            return
        call = interp.call
        if call is not None and not call.done:
            self._take(call, interp.stray[fd], data)

    def _drain_strays(self, call: Call, interp: Interp) -> None:
        """What the kept processes wrote during the call and is still in their pipes: the call's
        (its end does not wait for theirs: they are stopped, or gone)."""
        for fd in list(interp.stray):
            while fd in interp.stray:
                data = _read_pipe(fd)
                if data is None:
                    break
                if not data:
                    self._drop_stray(interp, fd)
                else:
                    self._take(call, interp.stray[fd], data)

    def _drop_stray(self, interp: Interp, fd: int) -> None:
        self.sel.unregister(fd)
        os.close(fd)
        del interp.stray[fd]

    def _keep_as_stray(self, call: Call) -> None:
        """At the end of a call whose processes are kept (``_freeze``): what its pipes hold now is
        the call's; the pipes stay open for what those processes write in later calls (closed,
        their writes failed with EPIPE and a pool's worker or a server died of it)."""
        interp = call.interp
        assert interp is not None
        for fd in call.pipes:
            kind = call.stream_of(fd)
            ended = False
            while not ended:
                data = _read_pipe(fd)
                if data is None:
                    break
                ended = not data
                self._take(call, kind, data)
            self.sel.unregister(fd)  # (nothing when the call's output was not watched yet)
            if ended:
                os.close(fd)
            else:
                self.sel.register(fd, ("stray", interp))
                interp.stray[fd] = kind
        call.pipes = []

    def _close_pipe(self, fd: int, call: Call) -> None:
        self.sel.unregister(fd)
        os.close(fd)
        call.pipes.remove(fd)
        call.open_pipes -= 1
        self._maybe_finish(call)

    def _process_exits(self) -> None:
        """Handle the zygote's exit records (its children are ours to account for)."""
        pending = self.zy.pending
        while pending:
            self._on_exit(*pending.popleft())

    def _on_exit(
        self,
        owner: Call | Interp,
        status: int | None,
        cpu_s: float | None,
        max_rss_kb: int | None,
        setup_failed: bool,
    ) -> None:
        if isinstance(owner, Interp):
            self._interp_gone(owner, status)
            return
        call = owner
        if call.exited:
            return
        os.close(call.pidfd)
        call.exited = True
        call.ended_at = time.monotonic()
        if call.netns >= 0:
            # Its PID namespace is empty now: no process of it is left in its network namespace.
            self._give_back_netns(call.netns)
            call.netns = -1
        if call.mntns is not None:
            self._give_back_mntns(call.mntns)
            call.mntns = None
        # The action's own status, as its init reported it (when it ran under one and got that far).
        true_status = self.zy.statuses.pop(call.id, None)
        self._set_status(call, status if true_status is None else true_status)
        call.cpu_s = cpu_s
        call.max_rss_kb = max_rss_kb
        call.setup_failed = setup_failed
        if call.pgid_fallback:
            sweep_without_pidns(call.pid, call.id, call.uid, self._tracked_pids())
        if not call.watching:
            # What it wrote waits in its pipes, closed by now unless something else holds them.
            for fd in list(call.pipes):
                while self._on_pipe(fd, call.stream_of(fd), call):
                    pass
            if call.open_pipes:
                self._watch(call)
        if call.open_pipes:
            heapq.heappush(self.timers, (call.ended_at + EOF_GRACE_S, call.id))
        self._maybe_finish(call)

    def _set_status(self, call: Call, status: int | None) -> None:
        if status is None:
            return
        if os.WIFSIGNALED(status):
            call.signal = os.WTERMSIG(status)
            call.exit_code = -call.signal
        else:
            call.exit_code = os.waitstatus_to_exitcode(status)

    def _interp_gone(self, interp: Interp, status: int | None) -> None:
        if not interp.alive:
            return
        interp.alive = False
        self.sel.unregister(interp.ctrl.fileno())
        self._release_company(interp)
        for fd in list(interp.stray):
            self._drop_stray(interp, fd)
        os.close(interp.pidfd)
        interp.ctrl.close()
        if interp.netns >= 0:
            self._give_back_netns(interp.netns)
            interp.netns = -1
        call = interp.call
        if call is not None and not call.exited:
            call.exited = True
            call.ended_at = time.monotonic()
            # A call's status is its answer; an interpreter that ends without one (``os._exit(0)``
            # in the call, or in agent code it replaced) has not passed it.
            call.interp_ended = True
            self._set_status(call, status)
            if call.open_pipes:
                heapq.heappush(self.timers, (call.ended_at + EOF_GRACE_S, call.id))
            self._maybe_finish(call)

    def _on_ctrl(self, interp: Interp) -> None:
        try:
            chunk, ancillary, _, _ = interp.ctrl.recvmsg(65536, CREDENTIALS_SPACE)
        except BlockingIOError:
            return
        except OSError:
            chunk, ancillary = b"", []
        if not chunk:
            return  # the pidfd reports the death
        # Written by the interpreter's own process, or not its loop's answer: another process
        # holding the control socket (one the program started, to pass on the true answer changed).
        forged = _sender_of(ancillary) != interp.pid
        interp.rbuf += chunk
        if len(interp.rbuf) < ANSWER.size and not forged:
            return  # the rest of the answer comes with the next read
        # Exactly one answer, read as two integers (``wire.SESSION_ANSWER``): never unmarshalled.
        reply = bytes(interp.rbuf) if len(interp.rbuf) == ANSWER.size and not forged else None
        interp.rbuf.clear()
        call = interp.call
        exit_code = _answer_of(reply, call, interp.key)
        if exit_code is None or call is None:
            # Not the loop's one answer to the call waiting: a frame the program wrote on the
            # control socket itself (it shares the interpreter's process), malformed, too big,
            # or for no call, or from another process. The interpreter is no longer trusted: it
            # goes (the next call gets a fresh one), and the call waiting, if any, fails. (A list
            # frame crashed this loop for every action; {"exit_code": 0} passed a failing call and
            # let it run on past its timeout.)
            if call is not None and not call.exited:
                call.interp_stopped = True
            self._kill_interp(interp)
            return
        call.exited = True
        call.ended_at = time.monotonic()
        call.exit_code = exit_code
        call.max_rss_kb = rss_kb(interp.pid)
        # What the call left running in the interpreter would run on after its answer, past
        # its timeout and without a CPU limit, on cores handed to the next actions.
        company = company_of(interp.pid)
        if company == "threads" or (company == "processes" and self.iso.pid_namespace):
            # Threads (a BLAS pool, an executor) and processes (a multiprocessing pool, a server
            # it started) are part of the session's state, as in a notebook's kernel: the whole
            # interpreter and all it started are stopped until its next call, which moves them to
            # its own cores. (The interpreter went with its variables at any process left.)
            company = self._freeze(interp)
        if (
            company != "processes"
            and self.iso.pid_namespace
            and len(interp.company) + unreaped_children(interp.pid) > COMPANY_MAX
        ):
            # The interpreter is its PID namespace's first process, so every orphan of what it
            # started (a double fork, a shell's `cmd &`) becomes its child, and nothing reaps
            # those when they exit: Python waits only for its own. Each zombie holds a slot of
            # the uid's processes (``--nproc``) for the session's life, and past it every fork of
            # a later call failed (EAGAIN). Reaping them here could take the exit status of a
            # child of the program's own that it waits for later (nothing tells the two apart),
            # so, like too many processes kept, they go with the interpreter: the next call gets
            # a fresh one and is told why.
            self._release_company(interp)
            interp.frozen = False
            call.interp_unreaped = True
            company = "processes"
        if company == "processes":
            # Not all of it could be stopped (it forks without end; without a PID namespace one
            # may have left the session): the interpreter goes (its PID namespace takes the rest
            # down), and the next call gets a fresh one.
            call.interp_stopped = True
            self._kill_interp(interp)
        elif interp.company:
            # Its kept processes hold the call's pipes: no end of them comes. All of them are
            # stopped, so what they wrote is in the pipes now: the call ends at once with it
            # (waiting for an end cost each such call EOF_GRACE_S).
            self._finish(call)
            return
        if call.open_pipes:
            heapq.heappush(self.timers, (call.ended_at + EOF_GRACE_S, call.id))
        self._maybe_finish(call)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, call_id = heapq.heappop(self.timers)
            call = self.calls.get(call_id)
            if call is None or call.done:
                continue
            if not call.exited:
                if not call.watching:
                    self._watch(call)
                if call.timed_out and now >= call.deadline + UNREAPED_GRACE_S and call.interp is None:
                    self._give_up(call)
                elif now >= call.deadline and not call.timed_out:
                    call.timed_out = True
                    self._kill(call)
                    heapq.heappush(self.timers, (call.deadline + UNREAPED_GRACE_S, call.id))
            elif call.ended_at is not None and now >= call.ended_at + EOF_GRACE_S:
                # Something outside the action's namespace still holds its pipes: stop waiting.
                self._finish(call)

    def _guard_memory(self) -> None:
        """Every GUARD_PERIOD_S while actions run: where less memory is left than the reserve, kill
        the running action that holds the most (``_held``: what its end gives back), unless that is
        less than ``memguard.MIN_VICTIM`` or less than the memory in use that the guard cannot
        place (``unseen``), less the reserve. One at a time: the next look comes a period after
        that one has exited and its workdir is detached, when its memory is back.

        Why the second bound: what the guard cannot see (memfds passed over a socket, kernel memory)
        belongs to some action, not necessarily the one it sees holding the most, and killing
        that one and then the next innocent gives nothing back. An action is only killed for
        holding more than everything unplaced (within the reserve: the figure it is taken from
        is as old as the last idle spell), which it then surely ranks above; otherwise the guard
        looks again each GUARD_IDLE_S (the kernel's OOM killer, which action processes are
        first for, is the last resort). A kill that gave back less than was counted shows up as
        more unseen at the next look, so the same bound stops a second wrong kill."""
        if self.guard is None or not self.calls:
            return
        now = time.monotonic()
        if now < self.guard_at:
            return
        self.guard_at = now + GUARD_PERIOD_S
        if self.guard_victim is not None:
            victim = self.guard_victim
            if not victim.exited:
                return
            # Its workdir gives its memory back only once the agent has detached it, after the
            # reply; until then memory is still short for want of it, and the next look would take
            # the next largest action for the one to kill.
            if victim.workdir is not None and now < self.guard_settle and os.path.ismount(victim.workdir):
                return
            self.guard_victim = None
            return
        source, reserve = self.guard
        try:
            free, total = memguard.left(source)
        except (OSError, ValueError):
            return
        if free >= reserve:
            return
        running: dict[int, Call] = {}
        for c in self.calls.values():
            uid = _uid_of(c)
            if uid is not None and not c.exited:
                running[uid] = c
        try:
            held, idle, others = self._holders(running)
        except OSError:  # /proc unreadable for now (out of descriptors or memory): look again later
            return
        resting = others + sum(idle.values())
        # What the agent's own cgroup uses (not a pod's, whose sibling containers' use is not the
        # actions'), beyond the memory that was neither seen nor the actions' while no action ran,
        # less all that is seen now. Up to the reserve of it is taken for that figure's error (it
        # is older than this look where actions never stop).
        unseen = memguard.in_use(source, free, total) - self.guard_base - sum(held.values()) - resting
        # An action holding more than its own limit is the cause: the largest of those goes first
        # (the largest holder of all went, an innocent within its limit among them). Otherwise
        # idle interpreters go before a running action (only where the memory short is memory the
        # guard sees: what it cannot place is some action's, and an idle session is none), then
        # the largest holder.
        over = [u for u, c in running.items() if c.memory_limit and held[u] > c.memory_limit]
        if not over and unseen - reserve < memguard.MIN_VICTIM and self._evict_idle(idle, reserve - free):
            return
        uid = max(over or held, key=held.__getitem__, default=None)
        if uid is None or held[uid] < max(memguard.MIN_VICTIM, unseen - reserve):
            self.guard_at = now + GUARD_IDLE_S
            return
        victim = running[uid]
        victim.evicted_mb = held[uid] >> 20
        victim.evicted_over = uid in over
        self._kill(victim)
        self.guard_victim = victim
        self.guard_settle = now + GUARD_SETTLE_S

    def _evict_idle(self, idle: dict[int, int], short: int) -> bool:
        """Where sessions' idle interpreters hold at least what is ``short`` of the reserve, stop
        them, least recently used first, until that much is given back: an idle interpreter's
        variables are a cache its next call is told it lost (``interp_evicted``), where a running
        action killed is a call failed for memory its own limit allowed. (Idle interpreters were
        counted only beside, and a host filled by a hundred idle sessions killed each action that
        came, well within its limit.) Whether any was stopped."""
        if sum(idle.values()) < short:
            return False  # they cannot make up for it: the action that holds the most goes
        by_uid = {i.uid: i for i in self.interps.values() if i.alive and i.uid in idle}

        def order(uid: int) -> tuple[int, float]:
            # Those holding more than their session's own limit first (memory parked in processes
            # kept between calls), the largest of them first; then the least recently used.
            interp = by_uid[uid]
            over = interp.memory_limit and idle[uid] > interp.memory_limit
            return (0, -idle[uid]) if over else (1, interp.last_used)

        freed = 0
        for uid in sorted(by_uid, key=order):
            if freed >= short:
                break
            interp = by_uid[uid]
            interp.evicted = True
            self._kill_interp(interp)
            freed += idle[uid]
        return freed > 0

    def _guard_baseline(self) -> None:
        """The memory in use that is neither seen nor the actions': what is in use while no action
        runs, less what the guard sees then (every process's, idle sessions', workdirs), so that
        none of those counts as unseen later, however it grows. Read as the first action starts
        after an idle spell, at most once per GUARD_BASE_S."""
        now = time.monotonic()
        if self.guard is None or now < self.guard_base_at:
            return
        self.guard_base_at = now + GUARD_BASE_S
        source = self.guard[0]
        with suppress(OSError, ValueError):
            self.guard_base = memguard.in_use(source, *memguard.left(source)) - self._held({})[1]

    def _held(self, running: dict[int, Call]) -> tuple[dict[int, int], int]:
        held, idle, others = self._holders(running)
        return held, others + sum(idle.values())

    def _holders(self, running: dict[int, Call]) -> tuple[dict[int, int], dict[int, int], int]:
        """What each running action (by uid) would give back at its end: its processes' memory
        (proportional, pages shared after a fork once, where that can be read), their memfds, its
        private /tmp and /dev/shm (a session's interpreter's, seen through its root), and a fresh
        action's workdir. And the memory the guard sees beside: every other process's (the agent's
        own among them), idle sessions' interpreters (their processes, /tmp and /dev/shm) and every
        other workdir (each a tmpfs below the root)."""
        idle = {
            i.uid: i for i in self.interps.values() if i.alive and i.uid is not None and i.uid not in running
        }
        processes, others = memguard.processes_held(set(running) | set(idle))
        held: dict[int, int] = {}
        for uid, call in running.items():
            resident, in_memfds = processes[uid]
            held[uid] = resident + in_memfds
            if call.mntns is not None:
                held[uid] += memguard.fs_used(call.mntns.tmp) + memguard.fs_used(call.mntns.shm)
            elif call.interp is not None:
                held[uid] += self._interp_tmp(call.interp.pid)
            if call.workdir is not None:
                held[uid] += memguard.fs_used(call.workdir)
        # Proportional memory is at most resident memory, so it is read from the largest down, until
        # the next can no longer outrank the largest found: an action whose resident memory is
        # pages shared by many forks is not taken for the one that holds the most.
        best = 0
        for uid in sorted(held, key=held.__getitem__, reverse=True)[:GUARD_PSS_READS]:
            if held[uid] <= best:
                break
            proportional = memguard.pss(uid)
            if proportional is not None:
                held[uid] += proportional - processes[uid][0]
            best = max(best, held[uid])
        idle_held = {uid: sum(processes[uid]) + self._interp_tmp(i.pid) for uid, i in idle.items()}
        counted = {c.workdir for c in running.values() if c.workdir is not None}
        if self.tmp_root:
            others += sum(
                memguard.fs_used(d) for d in memguard.tmpfs_under(self.tmp_root) if d not in counted
            )
        return held, idle_held, others

    def _interp_tmp(self, pid: int) -> int:
        """A session interpreter's private /tmp and /dev/shm (none where it has no mounts of its own:
        its /tmp is then the host's)."""
        if not self._own_mounts(pid):
            return 0
        root = f"/proc/{pid}/root"
        return memguard.fs_used(root + "/tmp") + memguard.fs_used(root + "/dev/shm")

    @staticmethod
    def _own_mounts(pid: int) -> bool:
        """Whether ``pid`` has a mount namespace of its own (else its /tmp is the host's)."""
        try:
            return os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        except OSError:
            return False

    def _give_up(self, call: Call) -> None:
        """Answer a call killed at its deadline whose exit record has not come since (see
        ``UNREAPED_GRACE_S``): its cores and pipes go back, its namespaces are dropped rather than
        pooled (something of it may be left in them), what its uid still runs is killed, and a late
        record is ignored (``_on_exit``). A fresh call only: a session's interpreter is its own."""
        call.exited = True
        call.unreaped = True
        call.ended_at = time.monotonic()
        os.close(call.pidfd)
        # Forgotten: a record that never comes left the call (its output buffers) here for good; a
        # late one finds no owner and is dropped.
        self.zy.owners.pop(call.pid, None)
        self.zy.statuses.pop(call.id, None)
        if call.netns >= 0:
            self._drop_netns(call.netns)
            call.netns = -1
        if call.mntns is not None:
            call.mntns.close()
            call.mntns = None
        if call.uid is not None:
            kill_uid(call.uid, self._tracked_pids(), UNREAPED_SWEEP_S)
        self._finish(call)

    def _kill(self, call: Call) -> None:
        with suppress(OSError):
            signal.pidfd_send_signal(call.pidfd, signal.SIGKILL)
        if call.pgid_fallback:
            with suppress(OSError):
                os.killpg(call.pid, signal.SIGKILL)

    def _maybe_finish(self, call: Call) -> None:
        if call.exited and call.open_pipes == 0 and not call.done:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        call.done = True
        self._end_feed(call)
        self.pool.release(call.cores)
        if call.interp is not None and call.interp.stray:
            self._drain_strays(call, call.interp)
        if call.interp is not None and call.interp.alive and call.interp.company:
            self._keep_as_stray(call)
        for fd in call.pipes:
            self.sel.unregister(fd)
            os.close(fd)
        call.pipes = []
        self.calls.pop(call.id, None)
        if call.interp is not None and call.interp.call is call:
            call.interp.call = None
        memory_error = call.memory_limited and call.exit_code not in (0, None) and not call.timed_out
        if memory_error and call.evicted_mb is None:
            # All of what was kept: a runtime says it anywhere (Go's fatal error comes after what the
            # program wrote, above every goroutine's stack). Only a failure under a limit is read.
            memory_error = _MEMORY_LINES.search(call.err) is not None
        end = call.ended_at if call.ended_at is not None else time.monotonic()
        reply = {
            "id": call.id,
            "exit_code": call.exit_code,
            "signal": call.signal,
            "timed_out": call.timed_out,
            "unreaped": call.unreaped,
            "cancelled": call.cancelled,
            "stdout": bytes(call.out),
            "stderr": bytes(call.err),
            "stdout_truncated": call.out_truncated,
            "stderr_truncated": call.err_truncated,
            "wall_s": end - call.started,
            "cpu_s": call.cpu_s,
            "max_rss_kb": call.max_rss_kb,
            "memory_error": memory_error or call.evicted_mb is not None,
            "memory_evicted_mb": call.evicted_mb,
            "memory_evicted_over_limit": call.evicted_over,
            "setup_error": call.setup_failed and call.interp is None,
            "interp_restarted": call.interp_restarted,
            "interp_evicted": call.interp_evicted,
            "interp_ran_frozen": call.interp_ran_frozen,
            "interp_stopped": call.interp_stopped,
            "interp_unreaped": call.interp_unreaped,
            "interp_ended": call.interp_ended,
            "workdir_removed": False,
            "cores": call.cores,
            "busy_cores": self.pool.busy,
        }
        if call.main_file is not None:
            # The file the code ran from is the call's, not the workdir's: under ``python main.py``
            # nobody finds an earlier call's program beside theirs. In a session's workdir it was
            # left, so each call took the next free name, and from the fourth on there was none
            # (``__file__`` undefined, tracebacks from ``<string>``).
            with suppress(OSError):
                os.unlink(call.main_file)
        if call.remove_workdir is not None:
            # The common case (nothing left behind) costs one rmdir here; anything else goes to the
            # agent's janitor thread so that this loop never walks a tree an action filled.
            try:
                os.rmdir(call.remove_workdir)
                reply["workdir_removed"] = True
            except FileNotFoundError:
                reply["workdir_removed"] = True
            except OSError:
                pass
        self.send(reply)


class _ZygoteLink:
    """The manager's end of the zygote: fork requests out, pidfds and exit records back.

    A datagram socket (SOCK_SEQPACKET) keeps each request together with the descriptors it carries.
    Records back (as tuples): ``("s", id, pid)`` with the child's pidfd, ``("e", id, message)`` when
    the fork failed, ``("x", pid, status, cpu_s, max_rss_kb, setup_failed)`` when a child exited
    (the zygote, its parent, reaps it), and ``("w", id, status)`` from a PID namespace's init: the
    wait status of the action under it (the truth; the init's own exit status can only approximate it).

    An exit record is matched to its call (``owners``) the moment it is read, even while waiting
    for a fork: the pid is free again once reaped, and the very fork being waited for may reuse it.
    """

    __slots__ = ("base_env", "loop", "notes", "owners", "pending", "pid", "shadowable", "sock", "statuses")

    def __init__(
        self, sock: socket.socket, pid: int, ready: tuple[Any, ...], base_env: dict[str, str]
    ) -> None:
        self.sock = sock
        self.pid = pid
        self.notes: list[str] = list(ready[1])
        self.loop: str = ready[2]  # "c" or "python"
        # Modules the zygote holds that a file of the program's would shadow (child.shadowable).
        self.shadowable: frozenset[str] = frozenset(ready[3])
        self.base_env = base_env  # the zygote's own environment
        self.owners: dict[int, Any] = {}  # pid -> the Call or Interp whose process it is
        # (owner, status, cpu_s, max_rss_kb, setup_failed) to handle
        self.pending: deque[tuple[Any, ...]] = deque()
        self.statuses: dict[int, int | None] = {}  # action id -> its true wait status (its init's report)

    @classmethod
    def start(cls, config: dict[str, Any], pid_namespace: bool, agent_fd: int) -> _ZygoteLink:
        """Start the zygote (see ``_spawn_zygote``) and wait until it has imported its modules."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = _spawn_zygote(theirs.fileno(), config, pid_namespace, agent_fd)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        data = ours.recv(1 << 16)
        if not data:
            raise RuntimeError("the zygote exited while starting")
        if data[:1] == b"F":
            raise RuntimeError(data[1:].decode("utf-8", "replace"))
        return cls(ours, pid, parse_record(data), base_env(config))

    def spawn(self, msg: RunMessage, fds: list[int], interp: bool = False) -> tuple[int, int]:
        """Have the zygote fork the child for ``msg`` with ``fds``; returns (pid, pidfd)."""
        request = encode_request(msg, interp, self.base_env)
        extra: list[int] = []
        if len(request) > DATAGRAM_MAX:
            memfd = os.memfd_create("request", os.MFD_CLOEXEC)
            extra.append(memfd)
            os.write(memfd, request)
            request = REQUEST_IN_MEMFD + struct.pack("<qQ", int(msg["id"]), len(request))
        try:
            socket.send_fds(self.sock, [request], fds + extra)
        finally:
            for fd in extra:
                os.close(fd)
        while True:
            record, got = self._recv(0)
            if record[0] == "x":
                self._exited(record)
                continue
            if record[0] == "w":
                self.statuses[record[1]] = record[2]
                continue
            # One request at a time: the first answer that is not an exit record is this one's.
            if record[0] == "s" and got:
                return int(record[2]), got[0]
            for fd in got:
                os.close(fd)
            raise OSError(str(record[2]))

    def drain(self) -> bool:
        """Take in the records waiting (without blocking); ``False`` once the zygote is gone."""
        while True:
            try:
                record, got = self._recv(socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except (EOFError, OSError):
                return False
            for fd in got:
                os.close(fd)
            if record[0] == "x":
                self._exited(record)
            elif record[0] == "w":
                self.statuses[record[1]] = record[2]

    def wait_exit(self, owner: Any) -> tuple[Any, ...]:
        """Block until ``owner``'s process (killed just now) is reported gone; returns its
        (owner, status, cpu_s, max_rss_kb, setup_failed), taken out of ``pending``."""
        while True:
            for entry in self.pending:
                if entry[0] is owner:
                    self.pending.remove(entry)
                    return entry
            record, got = self._recv(0)
            for fd in got:
                os.close(fd)
            if record[0] == "x":
                self._exited(record)

    def _exited(self, record: tuple[Any, ...]) -> None:
        _, pid, status, cpu_s, max_rss_kb, setup_failed = record
        owner = self.owners.pop(pid, None)
        if owner is not None:
            self.pending.append((owner, status, cpu_s, max_rss_kb, setup_failed))

    def _recv(self, flags: int) -> tuple[tuple[Any, ...], list[int]]:
        data, fds, _ = recv_with_fds(self.sock, 4096, 1, flags)
        if not data:
            raise EOFError("the zygote exited")
        return parse_record(data), fds


# Every signal a process may set a disposition for (SIGKILL and SIGSTOP have none to reset).
_DEFAULTED_SIGNALS = tuple(sorted(signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}))


def _spawn_zygote(fd: int, config: dict[str, Any], pid_namespace: bool, agent_fd: int) -> int:
    """Start the zygote as a fresh interpreter (``python -c``, zygote.main) on ``fd``.

    Not a fork of this process: the zygote would hold every module the manager imported (socket,
    select, heapq, this module...) that no action needs, and every fork of it and every child's
    exit pays for each megabyte and each mapping it holds. A fresh one imports what it needs and
    its preloads: 1.4 MiB of memory and 15 mappings fewer (with the default preloads, measured).
    It inherits what this process set up for it: the namespaces, no_new_privs and the cores.
    ``-c`` rather than ``-m``: runpy and the parts of importlib it brings are 9 modules and 0.2 MiB
    more in the zygote.
    """
    os.set_inheritable(fd, True)
    try:
        # The modules the interpreter starts with are taken before ours come (child.note_shadowable).
        start = (
            "import sys; m = [*sys.modules]; "
            "from arl_tangram.sandbox.zygote import main; main(sys.argv[1:], m)"
        )
        argv = [sys.executable, "-c", start, str(fd), marshal.dumps(config).hex()]
        # The agent's socket is the manager's alone: the agent must see it close when the manager
        # is gone, zygote or not.
        # Every signal at its default and none blocked, as a program started from a shell has
        # them: the zygote's are every action's, and a disposition inherited from whoever
        # started the agent (a background job's SIGINT ignored) made `os.kill(os.getpid(),
        # SIGINT)` a success where `python main.py` dies of it.
        return os.posix_spawn(
            sys.executable,
            [*argv, "1" if pid_namespace else "0"],
            os.environ,
            file_actions=[(os.POSIX_SPAWN_CLOSE, agent_fd)],
            setsigdef=_DEFAULTED_SIGNALS,
            setsigmask=(),
        )
    finally:
        os.set_inheritable(fd, False)


def _with_filename(code: types.CodeType, path: str) -> types.CodeType:
    """``code`` as if compiled from ``path``: its own file name and that of every code object in
    it (functions, classes, comprehensions), which tracebacks and ``inspect`` read."""
    consts = code.co_consts
    if any(isinstance(c, types.CodeType) for c in consts):
        consts = tuple(_with_filename(c, path) if isinstance(c, types.CodeType) else c for c in consts)
        return code.replace(co_filename=path, co_consts=consts)
    return code.replace(co_filename=path)


def _answer_of(reply: bytes | None, call: Call | None, key: bytes) -> int | None:
    """The exit status in ``reply`` when it is the interpreter loop's answer to ``call``, the call
    waiting: exactly ``ANSWER`` of its nonce, a status and their MAC under the interpreter's
    ``key``; else None."""
    if call is None or call.exited or reply is None:
        return None
    nonce, code, mac = ANSWER.unpack(reply)
    if nonce != call.nonce or not 0 <= code <= 255 or mac != wire.session_mac(key, nonce, code):
        return None
    return int(code)


# Room for one SCM_CREDENTIALS message (struct ucred: pid, uid, gid).
CREDENTIALS = struct.Struct("=iII")
CREDENTIALS_SPACE = socket.CMSG_SPACE(CREDENTIALS.size)


def _sender_of(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The pid of the process that wrote what was read (SO_PASSCRED), as this process sees it."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= CREDENTIALS.size:
            pid: int = CREDENTIALS.unpack_from(data)[0]
            return pid
    return None


def _uid_of(call: Call) -> int | None:
    """The uid a call's processes run as: its own, or its session's interpreter's."""
    return call.uid if call.interp is None else call.interp.uid


def _hand_over(uid: int | None, pipes: list[int]) -> None:
    """The action's ends of its pipes owned by its uid, as a program's pipes are its own outside:
    ``open('/dev/stdin')`` or ``echo x > /dev/stderr`` reopens one through ``/proc/self/fd``, which
    the pipe's owner alone may (mode 0600); owned by the agent, that failed with EACCES. (Never
    /dev/null, which stands for an input not given and is not in ``pipes``.) Not a reason to fail
    the action: it then runs as before."""
    if uid is not None:
        for fd in pipes:
            with suppress(OSError):
                os.fchown(fd, uid, uid)


def _output_pipes() -> tuple[int, int, int, int]:
    """stdout and stderr pipes: our read ends non-blocking, the action's write ends blocking (a
    non-blocking stdout makes a program that writes fast lose output or fail with EAGAIN)."""
    r_out, w_out = os.pipe2(os.O_CLOEXEC)
    try:
        r_err, w_err = os.pipe2(os.O_CLOEXEC)
    except OSError:
        os.close(r_out)
        os.close(w_out)
        raise
    os.set_blocking(r_out, False)
    os.set_blocking(r_err, False)
    return r_out, w_out, r_err, w_err


def main(argv: list[str]) -> int:
    """Entry point: ``python -m arl_tangram.sandbox.forkserver FD CONFIG`` (marshal, hex)."""
    config = marshal.loads(bytes.fromhex(argv[1]))
    server = ForkServer(int(argv[0]), config)
    try:
        server.prepare()
    except Exception as exc:
        # Tell the agent why, in a line a person can act on, rather than just ending.
        server.outq.clear()
        server.send({"op": "hello", "error": f"{exc.__class__.__name__}: {exc}"})
        with suppress(OSError):
            server.flush()
        return 1
    server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
