"""The zygote: the process that pre-imports the configured modules once and then only forks, one
child per action, each into its sandbox (see forkserver's docstring for the two processes).

``zygote_main`` is its whole life; the fork loop is C (_zygote.c) where built, else ``Zygote``.
"""

from __future__ import annotations

import atexit
import gc
import marshal
import os
import signal
import struct

from arl_tangram.sandbox.child import (
    SETUP_FAILED,
    adopt_setup_flag,
    child_after_c_setup,
    child_main,
    note_shadowable,
    prepare_child_world,
    prepare_python_children,
    set_tmp_files,
    split_off_init,
    straight_path,
    warm_child_path,
)
from arl_tangram.sandbox.zygote_wire import (
    IDENTITY_FILES,
    REQUEST_IN_MEMFD,
    REQUEST_MAX_FDS,
    decode_request,
    error_record,
    exit_record,
    recv_with_fds,
    spawn_record,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def base_env(config: dict[str, Any]) -> dict[str, str]:
    """The zygote's own environment: a typical action's (the agent sends one), so that a child's
    differs from it in a few variables; the fork server's own when none is given."""
    base = config.get("base_env")
    return dict(os.environ) if base is None else dict(base)


def zygote_main(sock: int, config: dict[str, Any], pid_namespace: bool, startup: list[str]) -> NoReturn:
    """The zygote's whole life: pre-import, warm up, then fork on request. Never returns."""
    try:
        notes = []
        fast: Any = None
        if config.get("zygote", "auto") != "python":
            try:
                fast = __import__("arl_tangram.sandbox._zygote", fromlist=["serve"])
            except ImportError as exc:
                if config.get("zygote") == "c":
                    os.write(sock, b"F" + f"--fork-loop c: the C fork loop is not built ({exc})".encode())
                    os._exit(1)
                notes.append(
                    f"the C fork loop is not built ({exc}); the Python one forks instead, at about "
                    "a third of the throughput (install with a C compiler present to build it)"
                )
        # Should the manager be killed outright, this process goes too (and its children with it:
        # each has the same setting towards us). The C loop's zygote calls libc through the C
        # module, the Python loop's through ctypes (isolation): with the C loop neither ctypes nor
        # isolation is imported, 0.5 MiB and 9 mappings that every fork would copy and every
        # action's exit tear down (measured with the default preloads).
        # The file bound of each action's private /tmp and /dev/shm (child.tmp_options), where the
        # action's child makes them (a cold pool's, or each action's without namespaces made ahead).
        tmp_files = (int(config.get("tmp_bytes_per_file") or 0), int(config.get("tmp_min_files") or 0))
        set_tmp_files(*tmp_files)
        if fast is not None:
            fast.die_with_parent()
            fast.default_reserved_signals()
            # Before the preloads, whose threads (a BLAS pool) would make arenas every child keeps.
            fast.few_malloc_arenas()
            fast.set_identity(IDENTITY_FILES)
            fast.set_tmp_files(*tmp_files)
        else:
            from arl_tangram.sandbox import isolation

            isolation.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
            isolation.default_reserved_signals()
            # Its children's set-up flags (_new_setup_flag): imported now, among the modules the
            # zygote holds at start (child.note_shadowable), and by the Python loop alone: in the C
            # loop's zygote a module more is mappings every fork copies and every exit tears down.
            import mmap  # noqa: F401

            isolation.few_malloc_arenas()
        # The exit functions of the zygote's own modules go, once here rather than in every child:
        # the zygote never runs them (it ends with os._exit), and an action's program must not run
        # ours. The preloads' stay: a program importing ``logging`` outside gets its
        # ``logging.shutdown`` at exit (a MemoryHandler's records are flushed then), and here its
        # import finds the module loaded, registering nothing.
        atexit._clear()
        failed = []
        for name in config.get("preload", []):
            try:
                __import__(name)
            except Exception as exc:  # a missing optional module must not stop the agent
                failed.append(f"{name} ({exc.__class__.__name__}: {exc})")
        if failed:
            notes.append("preload failed: " + ", ".join(failed))
        # After the preloads, which may change the environment: from here on only the children's
        # environments differ from this one.
        os.environ.clear()
        os.environ.update(base_env(config))
        zygote = Zygote(sock, pid_namespace)
        warm_child_path()
        prepare_child_world()
        # The actions' seccomp filter (the fork server probed it: forkserver._prepare_seccomp).
        program = config.get("seccomp_program")
        if fast is None:
            prepare_python_children(program)
        # Keep the children's copy-on-write pages shared: the collector would otherwise touch them all.
        gc.collect()
        gc.freeze()
        if fast is not None:
            fast.malloc_trim()
        else:
            isolation.malloc_trim()
        if fast is None:
            # What the Python loop imports as it serves, among the modules held before programs run.
            import select  # noqa: F401
            import socket  # noqa: F401
        shadow = note_shadowable(startup)
        os.write(sock, b"R" + marshal.dumps((notes, "python" if fast is None else "c", shadow)))
        if fast is None:
            zygote.serve()
        else:
            forked = fast.serve(
                zygote.sockfd,
                int(pid_namespace),
                zygote.own_pidns,
                zygote.devnull,
                *straight_path(),
                program,
            )
            if forked is not None:
                # In a child: the C loop has set the sandbox up already.
                child_after_c_setup(*forked)
    except BaseException:
        pass
    os._exit(0)


def _new_setup_flag() -> Any:
    """A child's set-up flag (_zygote.c's ``setup_flag``): a page of its own, shared with this
    process, holding 1 until the child's program starts."""
    import mmap  # the Python loop's alone (imported at its start: zygote_main)

    page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    page[0] = 1
    return page


class Zygote:
    """The forking process's loop in Python (the C loop in _zygote.c does the same, faster)."""

    __slots__ = ("applied_env", "devnull", "ep", "kids", "own_pidns", "pid_namespace", "sock", "sockfd")

    def __init__(self, sock: int, pid_namespace: bool) -> None:
        self.sockfd = sock
        self.sock: Any = None  # a socket object on sockfd, made by ``serve`` (this loop's only)
        self.pid_namespace = pid_namespace
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC) if pid_namespace else -1
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.ep: Any = None
        self.kids: dict[int, tuple[int, Any]] = {}  # pidfd -> (pid, its set-up flag)
        self.applied_env: dict[str, str] = dict(os.environ)  # what os.environ holds (see _apply_env)

    def serve(self) -> None:
        """Fork and reap until the manager closes its end."""
        # Imported here, by this loop only: with the C loop the zygote holds neither module (see
        # zygote_main on what every module the zygote holds costs each action).
        import select
        import socket

        self.sock = socket.socket(fileno=self.sockfd)
        self.ep = ep = select.epoll()
        ep.register(self.sockfd, select.EPOLLIN)
        while True:
            for fd, _ in ep.poll():
                if fd == self.sockfd:
                    if not self._on_request():
                        return
                else:
                    self._on_exit(fd)

    def _on_request(self) -> bool:
        import select
        import socket

        from arl_tangram.sandbox import isolation

        data, fds, flags = recv_with_fds(self.sock, 1 << 16, REQUEST_MAX_FDS, 0)
        if not data:
            return False
        rid = struct.unpack_from("<q", data, 4)[0] if len(data) >= 12 else -1
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise OSError("the request was cut short")
            if data[:4] == REQUEST_IN_MEMFD:
                memfd = fds.pop()
                data = os.pread(memfd, struct.unpack_from("<Q", data, 12)[0], 0)
                os.close(memfd)
            req = decode_request(data)
            extra = (1 if req["netns"] else 0) + (1 if req["mntns"] else 0)
            if len(fds) < (1 if req["interp"] else 2) + extra:
                raise ValueError("malformed request")
            # The namespaces to enter come last: the network's, and before it the mount one's.
            netns_fd = fds.pop() if req["netns"] else -1
            mntns_fd = fds.pop() if req["mntns"] else -1
            namespaces = [fd for fd in (netns_fd, mntns_fd) if fd >= 0]
            fds += namespaces  # closed with the rest below, in both processes
            self._apply_env(req["env"])
            flag = _new_setup_flag()
            try:
                pid = self._fork_isolated()
            except BaseException:
                flag.close()
                raise
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            self.sock.send(error_record(rid, f"{exc.__class__.__name__}: {exc}"))
            return True
        if pid:
            import mmap  # held since the Python loop's start (zygote_main)

            flag.madvise(mmap.MADV_DONTFORK)  # this child's alone (_zygote.c's setup_flag says why)
        if pid == 0:
            adopt_setup_flag(flag)
            try:
                if netns_fd >= 0:
                    isolation.setns(netns_fd, isolation.CLONE_NEWNET)
                if mntns_fd >= 0:
                    isolation.setns(mntns_fd, isolation.CLONE_NEWNS)
            except BaseException:
                os._exit(SETUP_FAILED)
            for fd in namespaces:
                os.close(fd)
                fds.remove(fd)
            if req["interp"]:
                child_main(req, self.devnull, self.devnull, self.devnull, fds[0])
            if self.pid_namespace:
                split_off_init(self.sockfd, req["id"])
            stdin_fd = fds[2] if len(fds) > 2 else self.devnull
            child_main(req, stdin_fd, fds[0], fds[1], None, under_init=self.pid_namespace)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # out of descriptors: the child must not run untracked
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            flag.close()
            self.sock.send(error_record(rid, f"{exc.__class__.__name__}: {exc}"))
            return True
        self.kids[pidfd] = (pid, flag)
        self.ep.register(pidfd, select.EPOLLIN)
        socket.send_fds(self.sock, [spawn_record(rid, pid)], [pidfd])
        return True

    def _on_exit(self, pidfd: int) -> None:
        pid, flag = self.kids[pidfd]
        try:
            got, status, rusage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            got, status, rusage = pid, None, None
        if got == 0:
            return  # not yet reapable (should not happen: the pidfd said it exited)
        del self.kids[pidfd]
        self.ep.unregister(pidfd)
        os.close(pidfd)
        # Final: its processes are gone (see _zygote.c's setup_flag); killed during it, it was killed.
        exited = status is not None and os.WIFEXITED(status)
        setup_failed = flag[0] != 0 and exited and os.WEXITSTATUS(status or 0) == SETUP_FAILED
        flag.close()
        cpu_s = 0.0 if rusage is None else rusage.ru_utime + rusage.ru_stime
        max_rss = 0 if rusage is None else rusage.ru_maxrss
        self.sock.send(exit_record(pid, status, cpu_s, max_rss, setup_failed))

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
        from arl_tangram.sandbox import isolation

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


def main(argv: list[str], startup: list[str] | None = None) -> NoReturn:
    """Entry point, with ``argv`` FD CONFIG PIDNS (CONFIG marshal, hex; PIDNS 1 or 0): see
    forkserver._spawn_zygote, which starts it. ``startup``: the modules the interpreter had before
    it imported any of ours (``python main.py`` has the same)."""
    zygote_main(int(argv[0]), marshal.loads(bytes.fromhex(argv[1])), argv[2] == "1", startup or [])
