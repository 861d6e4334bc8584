"""The warm fork server: a single-threaded process that forks one child per action.

The agent starts it with ``python -m arl_tangram.sandbox.forkserver FD CONFIG_JSON`` where FD is one
end of a socketpair. It pre-imports the configured modules once (so an action pays for ``fork``, not
for interpreter start-up and imports), enters its own network and mount namespaces, and then serves
frames (see ``wire``) from the agent:

- ``run``: fork a child into a fresh PID namespace; the child sets up its cores, uid, workdir, rlimits
  and environment and then either runs Python code in-process or ``execve``s a command (bash,
  pytest). Output is read from pipes by this process, capped, and returned with the exit status.
- ``interp_run`` / ``interp_stop``: a session's persistent interpreter (a forked child that keeps its
  globals between calls, like a notebook kernel); each call gets fresh pipes passed over a socket.
- ``kill``: end a running action now.

Nothing here imports aiohttp or the agent: the fork server must stay small, because every action
pays for copying its page tables.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import heapq
import importlib
import json
import marshal
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, NoReturn

from arl_tangram.sandbox import isolation, wire

SETUP_FAILED = 249  # exit status of a child whose sandbox could not be set up (reported as an error)
READ_CHUNK = 65536
EOF_GRACE_S = 0.5  # after the action's process is gone, how long to wait for its pipes to close
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_CTRL_FD = 3  # the persistent interpreter's control socket, after the child's fd clean-up


@dataclass
class Call:
    """One action in flight: its process (or the session interpreter serving it) and its output."""

    id: int
    pid: int
    pidfd: int
    cap: int
    deadline: float
    started: float
    pgid_fallback: bool
    memory_limited: bool
    interp: Interp | None = None
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    out_truncated: bool = False
    err_truncated: bool = False
    open_pipes: int = 2
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    cpu_s: float | None = None
    max_rss_kb: int | None = None
    ended_at: float | None = None
    done: bool = False
    interp_restarted: bool = False
    pipes: list[int] = field(default_factory=list)


@dataclass
class Interp:
    """A session's persistent interpreter."""

    sid: str
    pid: int
    pidfd: int
    ctrl: socket.socket
    rbuf: bytearray = field(default_factory=bytearray)
    call: Call | None = None
    alive: bool = True


class ForkServer:
    """The fork server's state and event loop (see the module docstring)."""

    def __init__(self, sock: socket.socket, config: dict[str, Any]) -> None:
        self.sock = sock
        self.config = config
        self.sel = selectors.DefaultSelector()
        self.rbuf = bytearray()
        self.calls: dict[int, Call] = {}
        self.fd_owner: dict[int, tuple[str, Call]] = {}
        self.timers: list[tuple[float, int]] = []
        self.interps: dict[str, Interp] = {}
        self.iso = isolation.Isolation()
        self.own_pidns = -1
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)

    # ---- start-up ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Enter namespaces and pre-import the configured modules; say hello to the agent."""
        self.iso = isolation.enter_private_namespaces(
            bool(self.config.get("network_allowed")),
            list(self.config.get("writable", [])),
            list(self.config.get("readable", [])),
        )
        if self.iso.pid_namespace:
            self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        failed = []
        for name in self.config.get("preload", []):
            try:
                importlib.import_module(name)
            except Exception as exc:  # a missing optional module must not stop the agent
                failed.append(f"{name} ({exc.__class__.__name__}: {exc})")
        if failed:
            self.iso.notes = (*self.iso.notes, "preload failed: " + ", ".join(failed))
        # Keep the children's copy-on-write pages shared: the collector would otherwise touch them all.
        gc.collect()
        gc.freeze()
        self.send({"op": "hello", "pid": os.getpid(), "isolation": self.iso.as_dict()})

    # ---- the loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the agent closes its end of the socket."""
        self.sock.setblocking(False)
        self.sel.register(self.sock, selectors.EVENT_READ, ("agent", None))
        while True:
            timeout = None
            if self.timers:
                timeout = max(0.0, self.timers[0][0] - time.monotonic())
            for key, _ in self.sel.select(timeout):
                kind, call = key.data
                if kind == "agent":
                    if not self._on_agent():
                        return
                elif kind == "pidfd":
                    self._on_exit(call)
                elif kind == "ctrl":
                    self._on_ctrl(key.data[1])
                else:
                    self._on_pipe(key.fd, kind, call)
            self._fire_timers()

    def send(self, message: dict[str, Any]) -> None:
        """Send one frame to the agent (blocking: the agent always reads)."""
        data = wire.encode(message)
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)

    def _on_agent(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.rbuf += chunk
        for msg in wire.decode_frames(self.rbuf):
            op = msg.get("op")
            try:
                if op == "run":
                    self._start_run(msg)
                elif op == "interp_run":
                    self._start_interp_run(msg)
                elif op == "interp_stop":
                    self._stop_interp(msg["sid"])
                    self.send({"id": msg["id"], "stopped": True})
                elif op == "kill":
                    call = self.calls.get(msg["target"])
                    if call is not None:
                        self._kill(call)
            except Exception as exc:  # report, never die: the agent awaits an answer for this id
                self.send({"id": msg.get("id"), "sandbox_error": f"{exc.__class__.__name__}: {exc}"})
        return True

    # ---- starting actions -------------------------------------------------------------------------
    def _stdin_fd(self, data: bytes | None) -> int:
        if not data:
            return self.devnull
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _fork_isolated(self) -> int:
        """Fork a child that is PID 1 of a new PID namespace (when available)."""
        if not self.iso.pid_namespace:
            return os.fork()
        isolation.unshare(isolation.CLONE_NEWPID)
        try:
            return os.fork()
        finally:
            if os.getpid() != 1:
                # Back to our own namespace for the next unshare (only one child may be its init).
                isolation.setns(self.own_pidns, isolation.CLONE_NEWPID)

    def _start_run(self, msg: dict[str, Any]) -> None:
        stdin_fd = self._stdin_fd(msg.get("stdin"))
        r_out, w_out = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        r_err, w_err = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        started = time.monotonic()
        pid = self._fork_isolated()
        if pid == 0:
            _child_main(msg, stdin_fd, w_out, w_err, None)
        os.close(w_out)
        os.close(w_err)
        if stdin_fd != self.devnull:
            os.close(stdin_fd)
        call = Call(
            id=msg["id"],
            pid=pid,
            pidfd=os.pidfd_open(pid),
            cap=int(msg["cap"]),
            deadline=started + float(msg["timeout"]),
            started=started,
            pgid_fallback=not self.iso.pid_namespace,
            memory_limited=bool(msg.get("limits", {}).get("as")),
        )
        self._track(call, r_out, r_err)

    def _track(self, call: Call, r_out: int, r_err: int, watch_pid: bool = True) -> None:
        self.calls[call.id] = call
        call.pipes = [r_out, r_err]
        self.sel.register(r_out, selectors.EVENT_READ, ("out", call))
        self.sel.register(r_err, selectors.EVENT_READ, ("err", call))
        if watch_pid:
            self.sel.register(call.pidfd, selectors.EVENT_READ, ("pidfd", call))
        heapq.heappush(self.timers, (call.deadline, call.id))

    def _start_interp_run(self, msg: dict[str, Any]) -> None:
        sid = msg["sid"]
        interp = self.interps.get(sid)
        restarted = False
        if interp is None or not interp.alive:
            restarted = interp is not None
            interp = self._spawn_interp(msg)
        stdin_fd = self._stdin_fd(msg.get("stdin"))
        r_out, w_out = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        r_err, w_err = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        payload = marshal.dumps({"code": msg["code"]})
        started = time.monotonic()
        try:
            interp.ctrl.setblocking(True)
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
        interp.call = call
        self._track(call, r_out, r_err, watch_pid=False)

    def _spawn_interp(self, msg: dict[str, Any]) -> Interp:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = self._fork_isolated()
        if pid == 0:
            parent.close()
            _child_main(msg, self.devnull, self.devnull, self.devnull, child.fileno())
        child.close()
        parent.setblocking(False)
        interp = Interp(sid=msg["sid"], pid=pid, pidfd=os.pidfd_open(pid), ctrl=parent)
        self.interps[interp.sid] = interp
        self.sel.register(interp.pidfd, selectors.EVENT_READ, ("pidfd", interp))
        self.sel.register(parent, selectors.EVENT_READ, ("ctrl", interp))
        return interp

    def _stop_interp(self, sid: str) -> None:
        interp = self.interps.get(sid)
        if interp is None:
            return
        if interp.alive:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(interp.pidfd, signal.SIGKILL)
            # Reaping now keeps the promise that a closed session leaves no process behind.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(interp.pid, 0)
            self._interp_gone(interp, None)
        self.interps.pop(sid, None)

    # ---- events -----------------------------------------------------------------------------------
    def _on_pipe(self, fd: int, kind: str, call: Call) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_pipe(fd, call)
            return
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

    def _close_pipe(self, fd: int, call: Call) -> None:
        self.sel.unregister(fd)
        os.close(fd)
        call.pipes.remove(fd)
        call.open_pipes -= 1
        self._maybe_finish(call)

    def _on_exit(self, owner: Call | Interp) -> None:
        if isinstance(owner, Interp):
            status, rusage = self._reap(owner.pid)
            self._interp_gone(owner, status)
            return
        call = owner
        status, rusage = self._reap(call.pid)
        self.sel.unregister(call.pidfd)
        os.close(call.pidfd)
        call.exited = True
        call.ended_at = time.monotonic()
        self._set_status(call, status)
        if rusage is not None:
            call.cpu_s = rusage.ru_utime + rusage.ru_stime
            call.max_rss_kb = rusage.ru_maxrss
        if call.pgid_fallback:
            _sweep_without_pidns(call.pid, call.id)
        if call.open_pipes:
            heapq.heappush(self.timers, (call.ended_at + EOF_GRACE_S, call.id))
        self._maybe_finish(call)

    def _reap(self, pid: int) -> tuple[int | None, Any]:
        try:
            _, status, rusage = os.wait4(pid, 0)
            return status, rusage
        except ChildProcessError:
            return None, None

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
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(interp.pidfd)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(interp.ctrl)
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
                if now >= call.deadline:
                    call.timed_out = True
                    self._kill(call)
            elif call.ended_at is not None and now >= call.ended_at + EOF_GRACE_S:
                # Something outside the action's namespace still holds its pipes: stop waiting.
                self._finish(call)

    def _kill(self, call: Call) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(call.pidfd, signal.SIGKILL)
        if call.pgid_fallback:
            with contextlib.suppress(OSError):
                os.killpg(call.pid, signal.SIGKILL)

    def _maybe_finish(self, call: Call) -> None:
        if call.exited and call.open_pipes == 0 and not call.done:
            self._finish(call)

    def _finish(self, call: Call) -> None:
        call.done = True
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
        }
        self.send(reply)


def _rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _sweep_without_pidns(pgid: int, call_id: int) -> None:
    """Fallback clean-up when PID namespaces are unavailable: the group, then the env marker."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    marker = f"TANGRAM_ACTION_ID={call_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


# ---- the child side ---------------------------------------------------------------------------------
def _child_main(msg: dict[str, Any], stdin_fd: int, out_fd: int, err_fd: int, ctrl_fd: int | None) -> NoReturn:
    """Set up the sandbox in the freshly forked child, then run the action. Never returns."""
    try:
        atexit._clear()
        os.setsid()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        if ctrl_fd is not None:
            os.dup2(ctrl_fd, _CTRL_FD)
            os.closerange(_CTRL_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        else:
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        cores = msg.get("cores")
        if cores:
            os.sched_setaffinity(0, cores)
        # The PID namespace's init must not outlive the fork server (say, if the agent is killed -9).
        with contextlib.suppress(OSError):
            isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        workdir = msg["workdir"]
        uid = msg.get("uid")
        try:
            os.mkdir(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
        except FileExistsError:
            pass
        os.chdir(workdir)
        os.umask(0o022)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # Credentials changed: the death signal was cleared, set it again.
            with contextlib.suppress(OSError):
                isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
        with contextlib.suppress(OSError):
            isolation.prctl(isolation.PR_SET_NO_NEW_PRIVS, 1)
        limits = msg.get("limits", {})
        for name, value in limits.items():
            if value:
                res = _RLIMITS[name]
                resource.setrlimit(res, (value, value if name != "cpu" else value + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        env = dict(msg.get("env", {}))
        env["TANGRAM_ACTION_ID"] = str(msg.get("id"))
        os.environ.clear()
        os.environ.update(env)
        for rel, content in (msg.get("files") or {}).items():
            parent = os.path.dirname(rel)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(rel, "wb") as fh:
                fh.write(content)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            os.write(2, f"tangram: sandbox set-up failed: {exc.__class__.__name__}: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    if ctrl_fd is not None:
        _interpreter_loop()
    argv = msg.get("argv")
    if argv:
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execve(argv[0], argv, os.environ)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                os.write(2, f"tangram: cannot execute {argv[0]}: {exc}\n".encode())
            os._exit(SETUP_FAILED)
    _run_python_and_exit(msg["code"])


_RLIMITS = {
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "nofile": resource.RLIMIT_NOFILE,
}


def _fresh_main_module() -> dict[str, Any]:
    import builtins

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    if sys.path:
        sys.path[0] = ""
    return main.__dict__


def _fresh_std_streams() -> None:
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(  # noqa: SIM115
        2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1
    )


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _run_code(source: str, namespace: dict[str, Any]) -> int:
    """Run ``source`` like ``python -c`` would, in ``namespace``; returns the exit status."""
    try:
        exec(compile(source, "<string>", "exec"), namespace)
        return 0
    except SystemExit as exc:
        return _exit_code_of(exc)
    except BaseException as exc:
        # Skip our own frame, as the interpreter's own traceback would.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        with contextlib.suppress(Exception):
            traceback.print_exception(type(exc), exc, tb)
        return 1


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _run_python_and_exit(source: str) -> NoReturn:
    namespace = _fresh_main_module()
    _fresh_std_streams()
    if "numpy" in sys.modules:
        # numpy's global generator is not reseeded at fork, unlike the random module's.
        with contextlib.suppress(Exception):
            sys.modules["numpy"].random.seed()
    code = _run_code(source, namespace)
    with contextlib.suppress(BaseException):
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as python -c
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    _flush_std_streams()
    os._exit(code)


def _interpreter_loop() -> NoReturn:
    """A session's persistent interpreter: run each call's code in the same globals."""
    namespace = _fresh_main_module()
    _fresh_std_streams()
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
        code = _run_code(request["code"], namespace)
        _flush_std_streams()
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        ctrl.sendall(wire.encode({"exit_code": code}))


def main(argv: list[str]) -> int:
    """Entry point: ``python -m arl_tangram.sandbox.forkserver FD CONFIG_JSON``."""
    sock = socket.socket(fileno=int(argv[0]))
    config = json.loads(argv[1])
    server = ForkServer(sock, config)
    server.prepare()
    server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
