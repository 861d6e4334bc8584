"""The warm fork server: two single-threaded processes that start one child per action.

The agent starts it with ``python -m arl_tangram.sandbox.forkserver FD CONFIG`` where FD is one
end of a socketpair. It enters its own network and mount namespaces and then splits in two:

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
zygote's fork of the next. Nothing here imports aiohttp or the agent: the zygote must stay small,
because every action pays for copying its page tables.
"""

from __future__ import annotations

# Lean imports on purpose: every megabyte this process holds is copied (page tables) by each fork and
# torn down by each child's exit. No typing, dataclasses, json, selectors, contextlib or traceback;
# socket only where a session interpreter needs descriptor passing.
import atexit
import builtins  # imported here, not in each child (an import statement there costs page faults)
import gc
import heapq
import marshal
import os
import resource
import select
import signal
import socket
import struct
import sys
import time
import types
from collections import deque

from arl_tangram.sandbox import isolation, wire
from arl_tangram.sandbox.cores import CorePool

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

SETUP_FAILED = 249  # exit status of a child whose sandbox could not be set up (reported as an error)
READ_CHUNK = 65536
EOF_GRACE_S = 0.5  # after the action's process is gone, how long to wait for its pipes to close
# Output is read when the action has ended, or from this long after its start on. Reading as it
# comes woke this process for every write and close of a short action, each wake-up placing it on
# the action's core behind the action (the kernel puts a woken reader beside its writer), while the
# other core sat idle: 14% of the machine, measured. A pipe holds 64 KiB, so a short action that
# writes more waits at most this long for its first read.
PIPE_WATCH_DELAY_S = 0.005
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_CTRL_FD = 3  # the persistent interpreter's control socket, after the child's fd clean-up
# The file a Python action's code runs from, in its workdir (the next names if the request brought
# a file of that name); removed with the workdir.
MAIN_FILES = ("main.py", "main_.py", "main__.py")
_MAX_FD = 1 << 30  # closerange's upper bound: everything


class _suppress:  # contextlib.suppress without importing contextlib
    __slots__ = ("kinds",)

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, value: object, tb: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)


class _Poller:
    """The part of ``selectors`` we need, on ``epoll`` directly."""

    __slots__ = ("data", "epoll")

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.data: dict[int, tuple[str, Any]] = {}

    def register(self, fd: int, data: tuple[str, Any]) -> None:
        self.epoll.register(fd, select.EPOLLIN)
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
        "exit_code",
        "exited",
        "id",
        "interp",
        "interp_restarted",
        "interp_stopped",
        "max_rss_kb",
        "memory_limited",
        "netns",
        "open_pipes",
        "out",
        "out_truncated",
        "pgid_fallback",
        "pid",
        "pidfd",
        "pipes",
        "pipes_at_start",
        "remove_workdir",
        "signal",
        "started",
        "timed_out",
        "uid",
        "watching",
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
    ) -> None:
        self.id = id
        self.pid = pid
        self.pidfd = pidfd
        self.cap = cap
        self.deadline = deadline
        self.started = started
        self.pgid_fallback = pgid_fallback
        self.memory_limited = memory_limited
        self.interp = interp
        self.interp_restarted = interp_restarted
        self.interp_stopped = False
        self.out = bytearray()
        self.err = bytearray()
        self.out_truncated = False
        self.err_truncated = False
        self.open_pipes = 2
        self.pipes: list[int] = []
        self.pipes_at_start: tuple[int, int] = (-1, -1)  # (stdout, stderr) read ends
        self.exited = False
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.timed_out = False
        self.cancelled = False  # killed by the agent's cancel frame
        self.netns = -1  # the network namespace it runs in, from the pool (-1: the fork server's)
        self.cpu_s: float | None = None
        self.max_rss_kb: int | None = None
        self.ended_at: float | None = None
        self.done = False
        self.remove_workdir: str | None = None
        self.cores: list[int] = []
        self.uid: int | None = None
        self.watching = False  # its pipes are in the poller (see PIPE_WATCH_DELAY_S)

    def stream_of(self, fd: int) -> str:
        """``"out"`` or ``"err"``: which of the action's streams the read end ``fd`` is."""
        return "out" if fd == self.pipes_at_start[0] else "err"


class Interp:
    """A session's persistent interpreter."""

    __slots__ = ("alive", "call", "ctrl", "frozen", "pid", "pidfd", "rbuf", "sid", "uid")

    def __init__(self, sid: str, pid: int, pidfd: int, ctrl: socket.socket, uid: int | None) -> None:
        self.sid = sid
        self.uid = uid
        self.pid = pid
        self.pidfd = pidfd
        self.ctrl = ctrl
        self.rbuf = bytearray()
        self.call: Call | None = None
        self.alive = True
        self.frozen = False  # stopped (SIGSTOP) between calls: it keeps threads of its own


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
        self.queue: deque[dict[str, Any]] = deque()
        self.private_tmp = False  # per action (see _zygote.c's private_tmp), set in ``prepare``
        self.netns_free: list[int] = []  # network namespaces ready for actions (_fill_netns_pool)
        self.netns_home = -1  # the fork server's own network namespace, while there is a pool
        # Made in ``prepare``, after the zygote is forked: it must inherit none of them.
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
            with _suppress(OSError):
                os.sched_setaffinity(0, self.config["infra_cores"])
        self.iso = isolation.enter_private_namespaces(
            bool(self.config.get("network_allowed")),
            list(self.config.get("writable", [])),
            list(self.config.get("readable", [])),
            pid_namespace=not self.config.get("no_pid_namespace"),
        )
        try:
            # Once here instead of in every child: it is inherited by every fork and exec and can
            # never be unset, so no action (nor anything it executes) can gain privileges through a
            # set-uid program. The fork server itself never executes anything.
            isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
        except OSError as exc:
            self.iso.notes = (*self.iso.notes, f"no_new_privs failed ({exc.strerror})")
        if not self.iso.pid_namespace:
            # Without namespaces, orphaned action processes come to us (not to the host's init, which
            # may reap late), so that a clean-up can wait until they are really gone. (Not
            # inherited by the zygote: the orphans of its children come here.)
            with _suppress(OSError):
                isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)
        self.private_tmp = bool(self.config.get("private_tmp")) and self.iso.private_tmp
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
        self.send({"op": "hello", "pid": os.getpid(), "isolation": self.iso.as_dict()})
        self.flush()

    def _fill_netns_pool(self) -> None:
        """Network namespaces for actions, made now so that an action pays nothing for its own.

        Each action enters one (loopback up, nothing else): ports, abstract unix sockets and
        loopback traffic are its own. One goes back to the pool when its action's exit record
        comes, that is when every process of the action is gone (its PID namespace is empty), so
        nothing of the last holder is in it. As many as there are cores, plus a few: an action
        holds at least one core, so the pool never runs dry (if it does, one is made on the spot).
        Where actions have no PID namespace (nothing proves a namespace empty) or may use the
        network, they share the fork server's namespace, as before.
        """
        if not (self.iso.network_namespace and self.iso.pid_namespace):
            return
        try:
            self.netns_home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            for _ in range(len(self.pool.cores) + 4):
                self.netns_free.append(isolation.loopback_netns(self.netns_home))
        except OSError as exc:
            for fd in self.netns_free:
                os.close(fd)
            self.netns_free = []
            self.netns_home = -1
            self.iso.notes = (*self.iso.notes, f"no network namespace per action ({exc.strerror})")
            return
        self.iso.netns_per_action = True

    def _take_netns(self) -> int:
        if self.netns_home < 0:
            return -1
        if self.netns_free:
            return self.netns_free.pop()
        return isolation.loopback_netns(self.netns_home)

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
                else:
                    self._on_pipe(fd, kind, owner)
            self._process_exits()
            self._fire_timers()
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
        with _suppress(BlockingIOError):
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
        """
        while self.queue:
            msg = self.queue[0]
            cores = self.pool.take(msg["want"])
            if cores is None:
                return
            self.queue.popleft()
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
    def _stdin_fd(self, data: bytes | None) -> int:
        if not data:
            return self.devnull
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _make_workdir(self, msg: dict[str, Any]) -> None:
        # Here rather than in the child: a few system calls in this process, instead of the child's
        # copy-on-write faults on every Python object the same work touches there.
        uid = msg.get("uid")
        try:
            os.mkdir(msg["workdir"], 0o700)
            if uid is not None:
                os.chown(msg["workdir"], uid, uid)
        except FileExistsError:
            pass

    def _start_run(self, msg: dict[str, Any]) -> None:
        self._make_workdir(msg)
        opened: list[int] = []
        try:
            stdin_fd = self._stdin_fd(msg.get("stdin"))
            if stdin_fd != self.devnull:
                opened.append(stdin_fd)
            r_out, w_out, r_err, w_err = _output_pipes()
            opened += [r_out, w_out, r_err, w_err]
            fds = [w_out, w_err] if stdin_fd == self.devnull else [w_out, w_err, stdin_fd]
            # A private /tmp and /dev/shm needs what the fork server's own mount namespace needed
            # (and root, which an action of its own uid implies).
            msg["private_tmp"] = self.private_tmp and msg.get("uid") is not None
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
        call.netns = netns
        if msg.get("remove_workdir"):
            call.remove_workdir = msg["workdir"]
        call.uid = msg.get("uid")
        self.zy.owners[pid] = call
        self._track(call, r_out, r_err, watch=False)
        heapq.heappush(self.timers, (started + PIPE_WATCH_DELAY_S, call.id))

    def _track(self, call: Call, r_out: int, r_err: int, watch: bool = True) -> None:
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

    def _start_interp_run(self, msg: dict[str, Any]) -> None:
        sid = msg["sid"]
        interp = self.interps.get(sid)
        restarted = False
        if interp is None or not interp.alive:
            restarted = interp is not None
            interp = self._spawn_interp(msg)
        elif interp.frozen:
            self._thaw(interp, msg["cores"])
        stdin_fd = self._stdin_fd(msg.get("stdin"))
        r_out, w_out, r_err, w_err = _output_pipes()
        # The interpreter was forked for an earlier call: it takes this call's cores and environment
        # (TANGRAM_CORES, TANGRAM_DOP...) itself before running the code.
        payload = marshal.dumps({"code": msg["code"], "cores": msg["cores"], "env": msg["env"]})
        started = time.monotonic()
        try:
            # Bounded: an interpreter whose code stopped reading its control socket must not be able
            # to stall this loop (the call then runs into its timeout, which kills the interpreter).
            interp.ctrl.settimeout(2.0)
            socket.send_fds(interp.ctrl, [struct.pack("<I", len(payload))], [stdin_fd, w_out, w_err])
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
        )
        call.cores = msg["cores"]
        interp.call = call
        self._track(call, r_out, r_err)

    def _spawn_interp(self, msg: dict[str, Any]) -> Interp:
        self._make_workdir(msg)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid, pidfd = self.zy.spawn(msg, [child.fileno()], interp=True)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        parent.setblocking(False)
        interp = Interp(sid=msg["sid"], pid=pid, pidfd=pidfd, ctrl=parent, uid=msg.get("uid"))
        self.interps[interp.sid] = interp
        self.zy.owners[pid] = interp
        self.sel.register(parent.fileno(), ("ctrl", interp))
        return interp

    def _stop_interp(self, sid: str) -> None:
        interp = self.interps.pop(sid, None)
        if interp is not None:
            self._kill_interp(interp)

    def _kill_interp(self, interp: Interp) -> None:
        """Kill the interpreter and all it started, and reap it now: a closed session leaves no
        process behind, and a stopped interpreter is known dead before the session's next call."""
        if interp.alive:
            with _suppress(OSError):
                signal.pidfd_send_signal(interp.pidfd, signal.SIGKILL)
            status = None
            with _suppress(EOFError):  # a lost zygote: this process ends soon after
                status = self.zy.wait_exit(interp)[1]
            self._interp_gone(interp, status)
        if not self.iso.pid_namespace and interp.uid is not None:
            # What the interpreter started, now that no namespace takes it down.
            _kill_uid(interp.uid, self._tracked_pids())

    def _freeze(self, interp: Interp) -> str | None:
        """SIGSTOP the interpreter and wait until every thread has stopped (a thread may have
        forked meanwhile: its company is looked at once more). ``"processes"`` when it must go."""
        with _suppress(OSError):
            signal.pidfd_send_signal(interp.pidfd, signal.SIGSTOP)
        deadline = time.monotonic() + 0.05
        while not _all_stopped(interp.pid):
            if time.monotonic() >= deadline:
                return "processes"
            time.sleep(0.0002)
        interp.frozen = True
        return _company(interp.pid)

    def _thaw(self, interp: Interp, cores: list[int]) -> None:
        """Move every thread of a frozen interpreter to the call's cores, then let it run."""
        with _suppress(OSError):
            for tid in os.listdir(f"/proc/{interp.pid}/task"):
                with _suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)
        with _suppress(OSError):
            signal.pidfd_send_signal(interp.pidfd, signal.SIGCONT)
        interp.frozen = False

    def _tracked_pids(self) -> set[int]:
        tracked = {c.pid for c in self.calls.values()} | {i.pid for i in self.interps.values() if i.alive}
        tracked.add(self.zy.pid)
        return tracked

    # ---- events -----------------------------------------------------------------------------------
    def _on_pipe(self, fd: int, kind: str, call: Call) -> bool:
        """Read once from an output pipe; whether there may be more to read right away."""
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._close_pipe(fd, call)
            return False
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
        return True

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
        self, owner: Call | Interp, status: int | None, cpu_s: float | None, max_rss_kb: int | None
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
            # Its PID namespace is empty now, so is its network namespace: ready for the next.
            self.netns_free.append(call.netns)
            call.netns = -1
        # The action's own status, as its init reported it (when it ran under one and got that far).
        true_status = self.zy.statuses.pop(call.id, None)
        self._set_status(call, status if true_status is None else true_status)
        call.cpu_s = cpu_s
        call.max_rss_kb = max_rss_kb
        if call.pgid_fallback:
            _sweep_without_pidns(call.pid, call.id, call.uid, self._tracked_pids())
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
        os.close(interp.pidfd)
        interp.ctrl.close()
        call = interp.call
        if call is not None and not call.exited:
            call.exited = True
            call.ended_at = time.monotonic()
            self._set_status(call, status)
            if call.open_pipes:
                heapq.heappush(self.timers, (call.ended_at + EOF_GRACE_S, call.id))
            self._maybe_finish(call)

    def _on_ctrl(self, interp: Interp) -> None:
        try:
            chunk = interp.ctrl.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            return  # the pidfd reports the death
        interp.rbuf += chunk
        try:
            replies = wire.decode_frames(interp.rbuf)
        except Exception:
            replies = [{"exit_code": 1, "corrupt": True}]
        for reply in replies:
            call = interp.call
            if call is None or call.exited:
                continue
            if reply.get("corrupt"):
                self._kill(call)
                continue
            call.exited = True
            call.ended_at = time.monotonic()
            call.exit_code = int(reply.get("exit_code", 1))
            call.max_rss_kb = _rss_kb(interp.pid)
            # What the call left running in the interpreter would run on after its answer, past
            # its timeout and without a CPU limit, on cores handed to the next actions.
            company = _company(interp.pid)
            if company == "threads":
                # Threads (a BLAS pool, an executor) are part of the session's state: the whole
                # interpreter is stopped until its next call, which moves them to its own cores.
                company = self._freeze(interp)
            if company == "processes":
                # A process may have left its session: stop the interpreter (its PID namespace
                # takes the rest down); the next call gets a fresh one.
                call.interp_stopped = True
                self._kill_interp(interp)
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
                if now >= call.deadline:
                    call.timed_out = True
                    self._kill(call)
            elif call.ended_at is not None and now >= call.ended_at + EOF_GRACE_S:
                # Something outside the action's namespace still holds its pipes: stop waiting.
                self._finish(call)

    def _kill(self, call: Call) -> None:
        with _suppress(OSError):
            signal.pidfd_send_signal(call.pidfd, signal.SIGKILL)
        if call.pgid_fallback:
            with _suppress(OSError):
                os.killpg(call.pid, signal.SIGKILL)

    def _maybe_finish(self, call: Call) -> None:
        if call.exited and call.open_pipes == 0 and not call.done:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        call.done = True
        self.pool.release(call.cores)
        for fd in call.pipes:
            self.sel.unregister(fd)
            os.close(fd)
        call.pipes = []
        self.calls.pop(call.id, None)
        if call.interp is not None and call.interp.call is call:
            call.interp.call = None
        tail = bytes(call.err[-4096:])
        memory_error = call.memory_limited and call.exit_code not in (0, None) and not call.timed_out
        memory_error = memory_error and any(m in tail for m in _MEMORY_MARKERS)
        end = call.ended_at if call.ended_at is not None else time.monotonic()
        reply = {
            "id": call.id,
            "exit_code": call.exit_code,
            "signal": call.signal,
            "timed_out": call.timed_out,
            "cancelled": call.cancelled,
            "stdout": bytes(call.out),
            "stderr": bytes(call.err),
            "stdout_truncated": call.out_truncated,
            "stderr_truncated": call.err_truncated,
            "wall_s": end - call.started,
            "cpu_s": call.cpu_s,
            "max_rss_kb": call.max_rss_kb,
            "memory_error": memory_error,
            "setup_error": call.exit_code == SETUP_FAILED and call.interp is None,
            "interp_restarted": call.interp_restarted,
            "interp_stopped": call.interp_stopped,
            "workdir_removed": False,
            "cores": call.cores,
            "busy_cores": self.pool.busy,
        }
        if call.remove_workdir is not None:
            # The common case (nothing left behind) costs one rmdir here; anything else goes to the
            # agent's janitor thread so that this loop never walks a tree an action filled.
            with _suppress(OSError):
                os.unlink(call.remove_workdir + "/" + MAIN_FILES[0])  # the usual content, if any
            try:
                os.rmdir(call.remove_workdir)
                reply["workdir_removed"] = True
            except FileNotFoundError:
                reply["workdir_removed"] = True
            except OSError:
                pass
        self.send(reply)


# ---- the zygote ------------------------------------------------------------------------------------
# The request format is shared with the C loop (_zygote.c, whose header comment describes it).
_REQUEST = b"TZR1"
_REQUEST_IN_MEMFD = b"TZRM"
_DATAGRAM_MAX = 60 << 10  # a larger request travels in a memfd (a datagram must fit the buffer)


def _env_block(items: Any) -> bytes:
    block = bytearray()
    for key, value in items:
        if not key or "=" in key or "\0" in key or (value is not None and "\0" in value):
            raise ValueError(f"environment variable {key!r} cannot be set (a NUL byte or '=' in its name)")
        block += (key if value is None else f"{key}={value}").encode("utf-8", "surrogateescape") + b"\0"
    return bytes(block)


def _span(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def encode_request(msg: dict[str, Any], interp: bool, base_env: dict[str, str]) -> bytes:
    """The zygote's request for the action ``msg`` (see _zygote.c for the layout). ``base_env`` is
    the zygote's own environment: the child's ``os.environ`` is brought from it to the action's by
    the difference only (a handful of variables instead of all)."""
    env = dict(msg.get("env") or {})
    env["TANGRAM_ACTION_ID"] = str(msg["id"])
    delta = [(k, v) for k, v in env.items() if base_env.get(k) != v]
    delta += [(k, None) for k in base_env if k not in env]
    cores = list(msg.get("cores") or [])
    limits = [(_RLIMITS[name], int(value)) for name, value in (msg.get("limits") or {}).items() if value]
    code = msg.get("code") or ""
    argv = msg.get("argv") or []
    uid = msg.get("uid")
    flags = (1 if interp else 0) | (2 if msg.get("private_tmp") and not interp else 0)
    flags |= 4 if msg.get("netns") else 0
    return b"".join(
        (
            _REQUEST,
            struct.pack("<qiI", int(msg["id"]), -1 if uid is None else int(uid), flags),
            struct.pack(f"<I{len(cores)}i", len(cores), *cores),
            struct.pack("<I", len(limits)),
            b"".join(struct.pack("<iq", res, value) for res, value in limits),
            _span(msg["workdir"].encode() + b"\0"),
            _span(_env_block(env.items())),
            _span(_env_block(delta)),
            _span(code.encode("utf-8", "surrogatepass")),
            _span(b"".join(os.fsencode(a) + b"\0" for a in argv)),
        )
    )


def decode_request(data: bytes) -> dict[str, Any]:
    """The inverse of ``encode_request`` (for the Python loop; the C loop reads it in C)."""
    if data[:4] != _REQUEST:
        raise ValueError("malformed request")
    rid, uid, flags, ncores = struct.unpack_from("<qiII", data, 4)
    at = 24
    cores = list(struct.unpack_from(f"<{ncores}i", data, at))
    at += 4 * ncores
    (nlimits,) = struct.unpack_from("<I", data, at)
    at += 4
    limits = [struct.unpack_from("<iq", data, at + 12 * i) for i in range(nlimits)]
    at += 12 * nlimits
    spans = []
    for _ in range(5):
        (size,) = struct.unpack_from("<I", data, at)
        spans.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    workdir, env, _, code, argv = spans
    pairs = [item.decode("utf-8", "surrogateescape").partition("=") for item in env.split(b"\0")[:-1]]
    return {
        "id": rid,
        "uid": None if uid < 0 else uid,
        "interp": bool(flags & 1),
        "private_tmp": bool(flags & 2),
        "netns": bool(flags & 4),
        "cores": cores,
        "limits": limits,
        "workdir": workdir.rstrip(b"\0").decode(),
        "env": {key: value for key, _, value in pairs},
        "code": code.decode("utf-8", "surrogatepass"),
        "argv": [os.fsdecode(a) for a in argv.split(b"\0")[:-1]] or None,
    }


def _parse_record(data: bytes) -> tuple[Any, ...]:
    kind = data[:1]
    if kind == b"S":
        rid, pid = struct.unpack_from("<qi", data, 1)
        return ("s", rid, pid)
    if kind == b"X":
        pid, status, cpu_s, max_rss_kb = struct.unpack_from("<iidq", data, 1)
        return ("x", pid, None if status < 0 else status, cpu_s, max_rss_kb)
    if kind == b"E":
        (rid,) = struct.unpack_from("<q", data, 1)
        return ("e", rid, data[9:].decode("utf-8", "replace"))
    if kind == b"W":
        rid, status = struct.unpack_from("<qi", data, 1)
        return ("w", rid, None if status < 0 else status)
    if kind == b"R":
        notes, loop = marshal.loads(data[1:])
        return ("r", notes, loop)
    raise ValueError(f"unknown record from the zygote: {data[:16]!r}")


def _spawn_record(rid: int, pid: int) -> bytes:
    return b"S" + struct.pack("<qi", rid, pid)


def _error_record(rid: int, message: str) -> bytes:
    return b"E" + struct.pack("<q", rid) + message.encode()


def _status_record(rid: int, status: int | None) -> bytes:
    return b"W" + struct.pack("<qi", rid, -1 if status is None else status)


def _exit_record(pid: int, status: int | None, cpu_s: float, max_rss_kb: int) -> bytes:
    return b"X" + struct.pack("<iidq", pid, -1 if status is None else status, cpu_s, max_rss_kb)


class _ZygoteLink:
    """The manager's end of the zygote: fork requests out, pidfds and exit records back.

    A datagram socket (SOCK_SEQPACKET) keeps each request together with the descriptors it carries.
    Records back (as tuples): ``("s", id, pid)`` with the child's pidfd, ``("e", id, message)`` when
    the fork failed, ``("x", pid, status, cpu_s, max_rss_kb)`` when a child exited (the zygote, its
    parent, reaps it), and ``("w", id, status)`` from a PID namespace's init: the wait status of the
    action under it (the truth; the init's own exit status can only approximate it).

    An exit record is matched to its call (``owners``) the moment it is read, even while waiting
    for a fork: the pid is free again once reaped, and the very fork being waited for may reuse it.
    """

    __slots__ = ("base_env", "loop", "notes", "owners", "pending", "pid", "sock", "statuses")

    def __init__(
        self, sock: socket.socket, pid: int, ready: tuple[Any, ...], base_env: dict[str, str]
    ) -> None:
        self.sock = sock
        self.pid = pid
        self.notes: list[str] = list(ready[1])
        self.loop: str = ready[2]  # "c" or "python"
        self.base_env = base_env  # the zygote's own environment
        self.owners: dict[int, Any] = {}  # pid -> the Call or Interp whose process it is
        self.pending: deque[tuple[Any, ...]] = deque()  # (owner, status, cpu_s, max_rss_kb) to handle
        self.statuses: dict[int, int | None] = {}  # action id -> its true wait status (its init's report)

    @classmethod
    def start(cls, config: dict[str, Any], pid_namespace: bool, agent_fd: int) -> _ZygoteLink:
        """Fork the zygote and wait until it has imported its modules."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            # The agent's socket is the manager's alone: the agent must see it close when the
            # manager is gone, zygote or not.
            os.close(agent_fd)
            ours.close()
            _zygote_main(theirs, config, pid_namespace)
        theirs.close()
        data = ours.recv(1 << 16)
        if not data:
            raise RuntimeError("the zygote exited while starting")
        if data[:1] == b"F":
            raise RuntimeError(data[1:].decode("utf-8", "replace"))
        return cls(ours, pid, _parse_record(data), _base_env(config))

    def spawn(self, msg: dict[str, Any], fds: list[int], interp: bool = False) -> tuple[int, int]:
        """Have the zygote fork the child for ``msg`` with ``fds``; returns (pid, pidfd)."""
        request = encode_request(msg, interp, self.base_env)
        extra: list[int] = []
        if len(request) > _DATAGRAM_MAX:
            memfd = os.memfd_create("request", os.MFD_CLOEXEC)
            extra.append(memfd)
            os.write(memfd, request)
            request = _REQUEST_IN_MEMFD + struct.pack("<qQ", int(msg["id"]), len(request))
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
        (owner, status, cpu_s, max_rss_kb), taken out of ``pending``."""
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
        _, pid, status, cpu_s, max_rss_kb = record
        owner = self.owners.pop(pid, None)
        if owner is not None:
            self.pending.append((owner, status, cpu_s, max_rss_kb))

    def _recv(self, flags: int) -> tuple[tuple[Any, ...], list[int]]:
        data, fds, _ = _recv_with_fds(self.sock, 4096, 1, flags)
        if not data:
            raise EOFError("the zygote exited")
        return _parse_record(data), fds


def _recv_with_fds(sock: socket.socket, size: int, max_fds: int, flags: int) -> tuple[bytes, list[int], int]:
    """One datagram and the descriptors it carries: (data, fds, msg_flags). (``socket.recv_fds``
    of Python 3.11 drops its ``flags`` argument, and imports ``array`` into the zygote.)"""
    data, ancillary, msg_flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(max_fds * 4), flags)
    fds: list[int] = []
    for level, kind, blob in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(blob) // 4}i", blob[: len(blob) - len(blob) % 4])
    return data, fds, msg_flags


def _base_env(config: dict[str, Any]) -> dict[str, str]:
    """The zygote's own environment: a typical action's (the agent sends one), so that a child's
    differs from it in a few variables; the fork server's own when none is given."""
    base = config.get("base_env")
    return dict(os.environ) if base is None else dict(base)


def _zygote_main(sock: socket.socket, config: dict[str, Any], pid_namespace: bool) -> NoReturn:
    """The zygote's whole life: pre-import, warm up, then fork on request. Never returns."""
    try:
        # Should the manager be killed outright, this process goes too (and its children with it:
        # each has the same setting towards us).
        _SET_PDEATHSIG_KILL()
        notes = []
        failed = []
        for name in config.get("preload", []):
            try:
                __import__(name)
            except Exception as exc:  # a missing optional module must not stop the agent
                failed.append(f"{name} ({exc.__class__.__name__}: {exc})")
        if failed:
            notes.append("preload failed: " + ", ".join(failed))
        fast: Any = None
        if config.get("zygote", "auto") != "python":
            try:
                fast = __import__("arl_tangram.sandbox._zygote", fromlist=["serve"])
            except ImportError as exc:
                if config.get("zygote") == "c":
                    sock.send(b"F" + f"--fork-loop c: the C fork loop is not built ({exc})".encode())
                    os._exit(1)
                notes.append(
                    f"the C fork loop is not built ({exc}); the Python one forks instead, at about "
                    "a third of the throughput (install with a C compiler present to build it)"
                )
        # After the preloads, which may change the environment: from here on only the children's
        # environments differ from this one.
        os.environ.clear()
        os.environ.update(_base_env(config))
        zygote = _Zygote(sock, pid_namespace)
        _warm_child_path()
        _prepare_child_world()
        # Keep the children's copy-on-write pages shared: the collector would otherwise touch them all.
        gc.collect()
        gc.freeze()
        isolation.malloc_trim()
        sock.send(b"R" + marshal.dumps((notes, "python" if fast is None else "c")))
        if fast is None:
            zygote.serve()
        else:
            forked = fast.serve(zygote.sockfd, int(pid_namespace), zygote.own_pidns, zygote.devnull)
            if forked is not None:
                # In a child: the C loop has set the sandbox up already.
                _child_after_c_setup(*forked)
    except BaseException:
        pass
    os._exit(0)


class _Zygote:
    """The forking process's loop in Python (the C loop in _zygote.c does the same, faster)."""

    __slots__ = ("applied_env", "devnull", "ep", "kids", "own_pidns", "pid_namespace", "sock", "sockfd")

    def __init__(self, sock: socket.socket, pid_namespace: bool) -> None:
        self.sock = sock
        self.sockfd = sock.fileno()
        self.pid_namespace = pid_namespace
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if pid_namespace else -1
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.ep = select.epoll()
        self.kids: dict[int, int] = {}  # pidfd -> pid
        self.applied_env: dict[str, str] = dict(os.environ)  # what os.environ holds (see _apply_env)

    def serve(self) -> None:
        """Fork and reap until the manager closes its end."""
        ep = self.ep
        ep.register(self.sockfd, select.EPOLLIN)
        while True:
            for fd, _ in ep.poll():
                if fd == self.sockfd:
                    if not self._on_request():
                        return
                else:
                    self._on_exit(fd)

    def _on_request(self) -> bool:
        data, fds, flags = _recv_with_fds(self.sock, 1 << 16, 5, 0)
        if not data:
            return False
        rid = struct.unpack_from("<q", data, 4)[0] if len(data) >= 12 else -1
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise OSError("the request was cut short")
            if data[:4] == _REQUEST_IN_MEMFD:
                memfd = fds.pop()
                data = os.pread(memfd, struct.unpack_from("<Q", data, 12)[0], 0)
                os.close(memfd)
            req = decode_request(data)
            if len(fds) < (1 if req["interp"] else 2) + (1 if req["netns"] else 0):
                raise ValueError("malformed request")
            netns_fd = fds.pop() if req["netns"] else -1
            self._apply_env(req["env"])
            pid = self._fork_isolated()
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            self.sock.send(_error_record(rid, f"{exc.__class__.__name__}: {exc}"))
            return True
        if pid == 0:
            if netns_fd >= 0:
                try:
                    isolation.setns(netns_fd, isolation.CLONE_NEWNET)
                except BaseException:
                    os._exit(SETUP_FAILED)
            if req["interp"]:
                _child_main(req, self.devnull, self.devnull, self.devnull, fds[0])
            if self.pid_namespace:
                _split_off_init(self.sockfd, req["id"])
            stdin_fd = fds[2] if len(fds) > 2 else self.devnull
            _child_main(req, stdin_fd, fds[0], fds[1], None)
        if netns_fd >= 0:
            os.close(netns_fd)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # out of descriptors: the child must not run untracked
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.sock.send(_error_record(rid, f"{exc.__class__.__name__}: {exc}"))
            return True
        self.kids[pidfd] = pid
        self.ep.register(pidfd, select.EPOLLIN)
        socket.send_fds(self.sock, [_spawn_record(rid, pid)], [pidfd])
        return True

    def _on_exit(self, pidfd: int) -> None:
        pid = self.kids[pidfd]
        try:
            got, status, rusage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            got, status, rusage = pid, None, None
        if got == 0:
            return  # not yet reapable (should not happen: the pidfd said it exited)
        del self.kids[pidfd]
        self.ep.unregister(pidfd)
        os.close(pidfd)
        cpu_s = 0.0 if rusage is None else rusage.ru_utime + rusage.ru_stime
        self.sock.send(_exit_record(pid, status, cpu_s, 0 if rusage is None else rusage.ru_maxrss))

    def _apply_env(self, env: dict[str, str]) -> None:
        """Make the zygote's own environment the action's, so the child inherits it as is.

        Actions differ in a handful of variables, so this is a few ``putenv`` calls here instead of
        rebuilding the whole environment in every child (whose every write is a copy-on-write fault).
        Nothing of ours lives in this environment: the fork server started with a minimal one.
        """
        current = os.environ
        applied = self.applied_env
        if len(current) != len(applied):
            # Someone else changed the environment: compare against the real one (slower: reading
            # os.environ decodes every key and value).
            applied.clear()
            applied.update(current)
        # Compared with our own record of what we set, not with os.environ: reading that decodes
        # every key and value, and the pages those fresh objects land on are copy-on-write again
        # after each fork.
        for key in [k for k in applied if k not in env]:
            del current[key]
            del applied[key]
        for key, value in env.items():
            if applied.get(key) != value:
                current[key] = value
                applied[key] = value

    def _fork_isolated(self) -> int:
        """Fork a child that is PID 1 of a new PID namespace (when available)."""
        if not self.pid_namespace:
            return os.fork()
        isolation.unshare(isolation.CLONE_NEWPID)
        try:
            pid = os.fork()
        except BaseException:
            isolation.setns(self.own_pidns, isolation.CLONE_NEWPID)
            raise
        if pid:
            # Back to our own namespace for the next unshare (only one child may be its init).
            isolation.setns(self.own_pidns, isolation.CLONE_NEWPID)
        return pid


def _init_forward(sig: int, frame: object) -> None:
    with _suppress(OSError):
        os.kill(_INIT_ACTION[0], sig)


_INIT_ACTION = [0]
_INIT_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


def _split_off_init(sockfd: int, rid: int) -> None:
    """In a fresh PID namespace's first process: fork the action (returns in it) and be the
    namespace's init (never returns there). The Python loop's twin of _zygote.c's split_off_init
    (whose comment says why)."""
    action = os.fork()
    if action == 0:
        return
    try:
        _INIT_ACTION[0] = action
        os.closerange(0, sockfd)
        os.closerange(sockfd + 1, _MAX_FD)
        _SET_PDEATHSIG_KILL()
        with _suppress(OSError):
            isolation.prctl(isolation.PR_SET_DUMPABLE, 0)
        for sig in _INIT_FORWARDED:
            signal.signal(sig, _init_forward)
        status = None
        while True:
            try:
                pid, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == action:
                status = st
                break
        os.write(sockfd, _status_record(rid, status))
        if status is not None and os.WIFEXITED(status):
            os._exit(os.WEXITSTATUS(status))
        os._exit(128 + os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else 1)
    finally:
        os._exit(1)


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


def _company(pid: int) -> str | None:
    """What the interpreter ``pid`` runs beside its main thread once a call has answered:
    ``"processes"`` (children that are more than unreaped zombies), ``"threads"``, or ``None``.
    (A thread the call joined may still be leaving the kernel's list: it is frozen with the rest,
    which costs nothing.)"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        children: list[bytes] = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                children += fh.read().split()
    except OSError:
        return None  # it is gone already: its exit is reported through the pidfd
    for child in children:
        if _state(b"/proc/%s/stat" % child) not in (b"Z", b""):
            return "processes"
    return "threads" if len(tasks) > 1 else None


def _state(stat_path: bytes | str) -> bytes:
    """The state letter in a /proc stat file (b"" when it is gone)."""
    try:
        with open(stat_path, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b""


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or already exiting)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(_state(f"/proc/{pid}/task/{tid}/stat") in (b"T", b"t", b"Z", b"X", b"") for tid in tasks)


def _rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _sweep_without_pidns(pgid: int, call_id: int, uid: int | None, keep: set[int]) -> None:
    """Clean-up when there is no PID namespace: the process group, then every process of the action's
    own uid (as root; nothing can leave a uid). Without uids: processes carrying the action's env
    marker (what it exec'd), and our orphans (we are the child subreaper) that carry no marker of
    another action (Python-level forks show the environment block they were started with, ours).
    The last may end another running action's daemon early; a start-up warning names this mode."""
    with _suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    if uid is not None:
        _kill_uid(uid, keep)
        return
    me = os.getpid()
    marker = f"TANGRAM_ACTION_ID={call_id}".encode()
    for _ in range(50):  # orphans of killed orphans come to us in turn
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    env = fh.read().split(b"\0")
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            ours = int(fields[1]) == me and fields[0] != b"Z"
            others = any(e.startswith(b"TANGRAM_ACTION_ID=") and e != marker for e in env)
            if marker in env or (ours and not others):
                with _suppress(OSError):
                    os.kill(int(name), signal.SIGKILL)
                found = True
        _reap_orphans(keep)
        if not found:
            return


def _uid_processes(uid: int, me: int) -> list[int]:
    """PIDs (other than ``me``) whose real uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
        except OSError:
            continue
    return found


def _reap_orphans(keep: set[int]) -> None:
    """Reap the exited children we do not track: orphans of actions, ours as the child subreaper."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[1].decode() == me:
            with _suppress(ChildProcessError):
                os.waitpid(int(name), os.WNOHANG)


def _kill_uid(uid: int, keep: set[int]) -> None:
    """SIGKILL every process of ``uid`` from a helper running as that uid: kill(-1) reaches exactly
    the processes it may signal, which for a non-root uid are that uid's own (never the caller).
    Killed orphans become our children (we are their subreaper): reaping them while the helper
    repeats lets it see the uid empty. ``keep``: tracked children, reaped through their pidfds."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # Repeat until no process of the uid is left: a fork bomb may create children while the
            # kernel walks, and a killed process stays listed until its parent has reaped it.
            # (kill(-1) itself cannot tell: it succeeds whenever any other process exists.)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                os.kill(-1, signal.SIGKILL)
                if not _uid_processes(uid, os.getpid()):
                    break
                time.sleep(0.001)
        except BaseException:
            pass
        os._exit(0)
    keep = {*keep, pid}
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        _reap_orphans(keep)
        time.sleep(0.0005)
    _reap_orphans(keep)


# ---- the child side ---------------------------------------------------------------------------------
def _child_main(
    req: dict[str, Any], stdin_fd: int, out_fd: int, err_fd: int, ctrl_fd: int | None
) -> NoReturn:
    """Set up the sandbox in the freshly forked child, then run the action (``req`` as
    ``decode_request`` gives it). Never returns. (The C loop does this set-up in C.)"""
    try:
        atexit._clear()
        os.setsid()
        # The fork server never changes signal dispositions, so they are the interpreter's own, as
        # `python -c` has them; exec'd runtimes get SIGPIPE/SIGXFSZ/SIGINT back to default below.
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # os.closerange is one close_range(2) here; everything above 2 (3 for an interpreter) goes.
        if ctrl_fd is not None:
            os.dup2(ctrl_fd, _CTRL_FD)
            os.closerange(_CTRL_FD + 1, _MAX_FD)
        else:
            os.closerange(3, _MAX_FD)
        cores = req.get("cores")
        if cores:
            os.sched_setaffinity(0, cores)
        workdir = req["workdir"]
        uid = req.get("uid")
        if req.get("private_tmp"):
            _private_tmp(workdir, dict(req.get("limits", ())).get(resource.RLIMIT_AS, 0))
        os.chdir(workdir)  # created by the fork server before the fork
        os.umask(0o022)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        # The PID namespace's init must not outlive the fork server (say, if the agent is killed -9).
        # Set after the uid change, which would clear it. (Should the fork server die in the few
        # microseconds before, the action still ends at its CPU-time limit.)
        with _suppress(OSError):
            _SET_PDEATHSIG_KILL()
        # No new privileges: inherited from the fork server, which set it once at start-up (it is
        # inherited by every fork and can never be unset; one ctypes call less in each child).
        for res, value in req.get("limits", ()):
            # CPU time: SIGXCPU at the limit, SIGKILL a second later.
            resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # The environment was made the action's in the zygote, just before the fork; the
        # request's files were written by the agent before the action was sent.
    except BaseException as exc:
        with _suppress(Exception):
            os.write(2, f"tangram: sandbox set-up failed: {exc.__class__.__name__}: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    _run_action(req, ctrl_fd)


def _private_tmp(workdir: str, size: int) -> None:
    """The Python loop's twin of _zygote.c's private_tmp (whose comment says what and why)."""
    root = os.path.dirname(workdir)
    isolation.unshare(isolation.CLONE_NEWNS)
    rootfd = os.open(root, os.O_PATH | os.O_CLOEXEC)  # in the new namespace: a bind source must be
    opts = f"size={size},mode=1777" if size > 0 else "mode=1777"
    for point in ("/tmp", "/dev/shm"):
        isolation.mount("tangram", point, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, opts)
        if root.startswith(point + "/"):
            os.makedirs(root, mode=0o711, exist_ok=True)
            isolation.mount(f"/proc/self/fd/{rootfd}", root, None, isolation.MS_BIND | isolation.MS_REC)
    os.close(rootfd)


def _child_after_c_setup(
    kind: str,
    code: str,
    argv: tuple[str, ...] | None,
    env_delta: tuple[tuple[str, str | None], ...],
    ctrl_fd: int,
) -> NoReturn:
    """A child of the C loop, its sandbox set up there: adopt the environment, run the action."""
    try:
        atexit._clear()
        _adopt_environment(env_delta)
    except BaseException as exc:
        with _suppress(Exception):
            os.write(2, f"tangram: sandbox set-up failed: {exc.__class__.__name__}: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    _run_action({"code": code, "argv": argv}, ctrl_fd if kind == "interp" else None)


def _adopt_environment(delta: tuple[tuple[str, str | None], ...]) -> None:
    """Make ``os.environ`` show the action's environment, which the C loop has made the process's
    own already (``environ``): the mapping only (no ``putenv`` again), and only what differs from
    the zygote's."""
    environ: Any = os.environ
    data = environ._data
    for key, value in delta:
        if value is None:
            data.pop(environ.encodekey(key), None)
        else:
            data[environ.encodekey(key)] = environ.encodevalue(value)


def _run_action(req: dict[str, Any], ctrl_fd: int | None) -> NoReturn:
    """Run the action in this set-up child: a session's interpreter, an executable, or Python code."""
    try:
        if ctrl_fd is not None:
            _interpreter_loop()
        argv = req.get("argv")
        if argv:
            try:
                for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.execve(argv[0], argv, os.environ)
            except BaseException as exc:
                with _suppress(Exception):
                    os.write(2, f"tangram: cannot execute {argv[0]}: {exc}\n".encode())
                os._exit(SETUP_FAILED)
        _run_python_and_exit(req["code"])
    finally:
        # Whatever happens (say, user code closed the interpreter's control socket and the reply
        # raised), the child must never return into the fork server's loop below its caller.
        os._exit(1)


def _prepare_child_world() -> None:
    """Set up once, in the zygote, the Python world every child starts from: a fresh ``__main__``,
    ``python -c``'s argv and path, the standard streams' names. The zygote runs none of its own
    code in it, and each child gets a copy of its own: building these in every child cost about 35
    of its copy-on-write faults."""
    global _CHILD_MAIN
    _CHILD_MAIN = _fresh_main_module()
    _fresh_std_streams()


_CHILD_MAIN: dict[str, Any] | None = None


def _warm_child_path() -> None:
    """Do once here what every child would otherwise do first, each in its own copy of the heap.

    The first ``compile`` of source text in a process sets up the compiler's state (about 1.2 ms
    and 185 copy-on-write page faults in each child, measured here), and the first use of a libc
    function through ctypes looks it up and caches a function object (about 0.1 ms more). Done in
    the fork server before ``gc.freeze``, children inherit both ready-made. Nothing here changes
    the fork server's own state beyond those caches (no prctl is called, only looked up).
    """
    compile("pass", "<string>", "exec")
    isolation.resolve_libc()


_SET_PDEATHSIG_KILL = isolation.prepared_prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
}


def _fresh_main_module() -> dict[str, Any]:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    if sys.path:
        sys.path[0] = ""
    return main.__dict__


def _fresh_std_streams() -> None:
    # The fork server's own streams already sit on descriptors 0, 1 and 2 (now the action's), with
    # empty buffers (it never uses them) and UTF-8 (PYTHONIOENCODING): re-point the names only, as
    # building new text streams costs a quarter of a millisecond.
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with _suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _run_code(source: str, namespace: dict[str, Any], filename: str = "<string>") -> int:
    """Run ``source`` like ``python -c`` (or ``python FILENAME``) would, in ``namespace``; returns
    the exit status."""
    try:
        exec(compile(source, filename, "exec"), namespace)
        return 0
    except SystemExit as exc:
        return _exit_code_of(exc)
    except BaseException as exc:
        # Skip our own frame, as the interpreter's own traceback would.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        # The interpreter's own C traceback printer: no traceback module to import in the child.
        with _suppress(BaseException):
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return 1


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with _suppress(Exception):
            stream.flush()


def _source_file(source: str) -> str:
    """Write the action's code as ``main.py`` in its workdir (another name if the request brought a
    file of that name) and return its path: run from there, it looks as under ``python main.py``
    (``__file__``, ``sys.argv``, tracebacks with their source lines, ``inspect.getsource``)."""
    data = source.encode("utf-8", "surrogatepass")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for name in MAIN_FILES:
        try:
            fd = os.open(name, flags, 0o644)
        except FileExistsError:
            continue
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return os.path.join(os.getcwd(), name)
    return "<string>"  # every name taken by the request's files: run it as ``python -c`` would


def _run_python_and_exit(source: str) -> NoReturn:
    namespace = _CHILD_MAIN
    if namespace is None:
        namespace = _fresh_main_module()
        _fresh_std_streams()
    filename = "<string>"
    with _suppress(OSError):  # a full disk or file limit: run it as ``python -c`` would
        filename = _source_file(source)
    if filename != "<string>":
        namespace["__file__"] = filename
        sys.argv = [filename]
        if sys.path:
            sys.path[0] = os.path.dirname(filename)
    if "numpy" in sys.modules:
        # numpy's global generator is not reseeded at fork, unlike the random module's.
        with _suppress(Exception):
            sys.modules["numpy"].random.seed()
    code = _run_code(source, namespace, filename)
    threading = sys.modules.get("threading")
    if threading is not None:  # only code that imported it can have started threads
        with _suppress(BaseException):
            threading._shutdown()  # wait for non-daemon threads, as python -c does
    with _suppress(BaseException):
        atexit._run_exitfuncs()
    _flush_std_streams()
    os._exit(code)


def _interpreter_loop() -> NoReturn:
    """A session's persistent interpreter: run each call's code in the same globals."""
    namespace = _CHILD_MAIN
    if namespace is None:
        namespace = _fresh_main_module()
        _fresh_std_streams()
    import socket

    ctrl = socket.socket(fileno=_CTRL_FD)
    devnull = os.open(os.devnull, os.O_RDWR)
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(ctrl, 4, 3)
        except OSError:
            os._exit(0)
        if len(header) < 4:
            os._exit(0)
        (length,) = struct.unpack("<I", header)
        payload = bytearray()
        while len(payload) < length:
            chunk = ctrl.recv(length - len(payload))
            if not chunk:
                os._exit(0)
            payload += chunk
        request = marshal.loads(bytes(payload))
        for target, fd in zip((0, 1, 2), fds, strict=False):
            os.dup2(fd, target)
            os.close(fd)
        if request.get("cores"):
            os.sched_setaffinity(0, request["cores"])
        os.environ.update(request.get("env") or {})
        code = _run_code(request["code"], namespace)
        _flush_std_streams()
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        ctrl.sendall(wire.encode({"exit_code": code}))


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
        with _suppress(OSError):
            server.flush()
        return 1
    server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
