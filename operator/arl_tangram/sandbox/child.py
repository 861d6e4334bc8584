"""An action's process, from its fork to its end: the sandbox set-up the Python loop does (the C loop
does it in C), the namespace's init, and running the action (Python code in-process, an
executable, or a session's persistent interpreter).

Runs in the zygote's children: imports only what the zygote holds already. ``isolation`` (and with
it ctypes) only where the Python loop's children need it: the zygote of the C loop never holds it.
"""

from __future__ import annotations

import _signal
import atexit
import builtins  # imported here, not in each child (an import statement there costs page faults)
import errno
import gc
import marshal
import os
import resource
import signal
import sys
import types

from arl_tangram.sandbox import wire
from arl_tangram.sandbox.lean import suppress
from arl_tangram.sandbox.zygote_wire import SOFT_ONLY, WRITTEN, status_record

# The builtins this module's functions see (a function takes them when it is defined): a copy made
# at import, before any action's code runs. The action's code shares the builtins module with the
# end of its run, and reassigning ``builtins.SystemExit`` or ``builtins.isinstance`` there must not
# change how its status is read (Python reads it in C).
globals()["__builtins__"] = dict(builtins.__dict__)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

SETUP_FAILED = 249  # exit status of a child whose sandbox could not be set up (reported as an error)
CANNOT_EXECUTE = 126  # a shell's status for a file it found but could not run
_NOT_RUNNABLE = (errno.EACCES, errno.ENOEXEC)
_CTRL_FD = 3  # the persistent interpreter's control socket, after the child's fd clean-up
# The file a Python action's code runs from, in its workdir (the next names if the request brought
# a file of that name); removed with the workdir.
MAIN_FILES = ("main.py", "main_.py", "main__.py")
_MAX_FD = 1 << 30  # closerange's upper bound: everything
# Taken when the zygote imports this module, before any action's code runs. The end of a run must
# not go through names the action's code can reassign, as the interpreter's own end does not (it
# calls C): with ``os._exit = lambda c: real(0)`` a failing program exited 0, and with
# ``atexit._run_exitfuncs`` replaced its exit functions never ran. (Where the C module is built a
# run ends in C, which the program cannot reach at all: these serve a session's calls, and the
# end where it is not built.)
_EXIT = os._exit
_RUN_EXITFUNCS = atexit._run_exitfuncs
_COLLECT = gc.collect
_KILL = os.kill
_GETPID = os.getpid
_SIGNAL = _signal.signal  # signal.signal is Python code that reads names of the signal module
_SIGINT = int(signal.SIGINT)
_SIG_DFL = int(signal.SIG_DFL)
_INT_VALUE = int.__int__  # an int subclass's own value, whatever it overrides
# An exception's own traceback slot and setter, whatever its class overrides.
_TRACEBACK_OF = BaseException.__dict__["__traceback__"].__get__
_WITH_TRACEBACK = BaseException.with_traceback
_EXCEPTHOOK = sys.__excepthook__  # the interpreter's own printer
_MISSING = object()
# The status that stands for "ends by SIGINT": an uncaught KeyboardInterrupt, as Python ends then.
_BY_SIGINT = -_SIGINT
# What ``_clear_main`` releases first: not these (a finaliser calls them through the globals).
_CODE_LIKE = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)


def _unraisable_args_type() -> Any:
    """``sys.UnraisableHookArgs``, which ``sys`` does not name: the type of what the interpreter
    hands ``sys.unraisablehook`` (taken from one error it reports), for a failed flush at the end."""
    seen: list[Any] = []
    hook = sys.unraisablehook
    sys.unraisablehook = seen.append

    class _Raises:
        def __del__(self) -> None:
            raise RuntimeError

    try:
        _Raises()
    finally:
        sys.unraisablehook = hook
    return type(seen[0])


_UNRAISABLE_ARGS = _unraisable_args_type()


def _init_forward(sig: int, frame: object) -> None:
    with suppress(OSError):
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


def split_off_init(sockfd: int, rid: int) -> None:
    """In a fresh PID namespace's first process: fork the action (returns in it) and be the
    namespace's init (never returns there). The Python loop's twin of _zygote.c's split_off_init
    (whose comment says why)."""
    action = os.fork()
    if action == 0:
        return
    from arl_tangram.sandbox import isolation  # the Python loop's zygote holds it already

    try:
        _INIT_ACTION[0] = action
        os.closerange(0, sockfd)
        os.closerange(sockfd + 1, _MAX_FD)
        _die_with_parent()
        with suppress(OSError):
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
        os.write(sockfd, status_record(rid, status))
        if status is not None and os.WIFEXITED(status):
            os._exit(os.WEXITSTATUS(status))
        os._exit(128 + os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else 1)
    finally:
        os._exit(1)


def child_main(
    req: dict[str, Any],
    stdin_fd: int,
    out_fd: int,
    err_fd: int,
    ctrl_fd: int | None,
    under_init: bool = False,
) -> NoReturn:
    """Set up the sandbox in the freshly forked child, then run the action (``req`` as
    ``decode_request`` gives it). Never returns. (The C loop does this set-up in C.)"""
    from arl_tangram.sandbox import isolation  # the Python loop's zygote holds it already

    try:
        if under_init:  # a process group of its own, in the fork server's session (_zygote.c says why)
            os.setpgid(0, 0)
        else:
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
        limits = dict(req.get("limits", ()))
        # What the program may write: its data limit beyond Python, its address space in it (which
        # beyond Python is --max-memory-mb, the most any request may ask for).
        written = limits.get(WRITTEN) or limits.get(resource.RLIMIT_DATA) or limits.get(resource.RLIMIT_AS, 0)
        if req.get("private_tmp"):
            private_tmp(workdir, written)
        if req.get("own_proc"):
            isolation.own_proc()
        if req.get("own_ipc"):
            isolation.unshare(isolation.CLONE_NEWIPC)
            bound_ipc(written)
        os.chdir(workdir)  # created by the fork server before the fork
        os.umask(0o022)
        oom_first()
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if ctrl_fd is None:  # dumpable again, as after an execve: _zygote.c's child_setup says why
                isolation.prctl(isolation.PR_SET_DUMPABLE, 1)
        # The PID namespace's init must not outlive the fork server (say, if the agent is killed -9).
        # Set after the uid change, which would clear it. (Should the fork server die in the few
        # microseconds before, the action still ends at its CPU-time limit.)
        with suppress(OSError):
            _die_with_parent()
        # No new privileges: inherited from the fork server, which set it once at start-up (it is
        # inherited by every fork and can never be unset; one ctypes call less in each child).
        for res, value in req.get("limits", ()):
            if res == WRITTEN:  # no rlimit: the size of what it may write, above
                continue
            if res in SOFT_ONLY:  # the hard limit stays the agent's (zygote_wire.SOFT_ONLY says why)
                hard = resource.getrlimit(res)[1]
                resource.setrlimit(res, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))
                continue
            # CPU time: SIGXCPU at the limit, SIGKILL a second later.
            resource.setrlimit(res, (value, value + 1 if res == resource.RLIMIT_CPU else value))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if req.get("landlock"):  # after the mounts, which it would refuse
            isolation.restrict_writes(workdir)
        # Last, once nothing of the set-up needs a call it refuses (mounts above all).
        if _INSTALL_SECCOMP is not None:
            _INSTALL_SECCOMP()
        # The environment was made the action's in the zygote, just before the fork; the
        # request's files were written by the agent before the action was sent.
    except BaseException as exc:
        with suppress(Exception):
            os.write(2, f"tangram: sandbox set-up failed: {exc.__class__.__name__}: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    _run_action(req, ctrl_fd)


# How many files and directories a private /tmp or /dev/shm of a given size may hold: one per
# this many bytes of it, and at least the second (the rule of workfiles.workdir_files, sent in the
# fork server's config; see tmp_options).
_tmp_files = (0, 0)


def set_tmp_files(bytes_per_file: int, min_files: int) -> None:
    """The file bound of each private /tmp and /dev/shm (``tmp_options``), from the config."""
    global _tmp_files
    _tmp_files = (bytes_per_file, min_files)


# Files every action may read that a reader also locks: Go takes a shared flock on the go.mod and
# go.sum at the workdir root, its build cache's trim.txt and the module cache's ziphash files in
# each build. flock needs no write access, so an action holding an exclusive lock on one of them
# held every other action's Go build until its compile timeout. Each mount namespace made ahead
# (PrivateTmp.make: the pool's, a session interpreter's) binds copies of its own over them
# (``private_tmp``): a lock taken there is its holder's alone. From the fork server's config
# (``set_private_copies``).
_private_copies: tuple[str, ...] = ()


def set_private_copies(paths: list[str] | tuple[str, ...]) -> None:
    """The shared files each mount namespace gets copies of its own of (``_private_copies``)."""
    global _private_copies
    _private_copies = tuple(paths)


def tmp_options(size: int) -> str:
    """The mount options of a private /tmp or /dev/shm of ``size`` bytes (0: no bound). tmpfs
    counts bytes, not files: without ``nr_inodes`` (the kernel's default is one per two pages of
    the machine's memory) an action's empty files, each about a kilobyte of the kernel's memory
    and none of the size, could take gigabytes of the host's memory. _zygote.c's is its twin."""
    if size <= 0:
        return "mode=1777"
    per, least = _tmp_files
    files = f",nr_inodes={max(least, size // per, 1)}" if per > 0 else ""  # 0 would be no bound
    return f"size={size}{files},mode=1777"


# What the kernel spends, at most, per System V message queue (msgmnb's default 16 KiB, each byte of
# it a message of its own of about 72 bytes of the kernel's memory when they are empty) and per
# semaphore, rounded up: the bounds below keep either class within half the action's limit.
IPC_QUEUE_BYTES = 2 << 20
IPC_SEM_BYTES = 128
# The kernel's defaults of an IPC namespace: the most semaphores in a set, operations in one
# semop, and sets (kernel.sem's first, third and fourth fields); the fewest queues left to a program.
SEM_DEFAULTS = (32000, 500, 32000)
MIN_QUEUES = 16


def ipc_bounds(size: int) -> tuple[int, int, int]:
    """(System V shared memory in pages, message queues, semaphores) that an action with a memory
    limit of ``size`` bytes may hold in its own IPC namespace (_zygote.c's ipc_bounds is its twin).
    Shared memory is counted by the page; queues and semaphores are kernel memory that no count
    of the guard's sees, so their number is what bounds them."""
    queues = min(max(size // IPC_QUEUE_BYTES, MIN_QUEUES), 32000)
    sems = min(max(size // IPC_SEM_BYTES, SEM_DEFAULTS[0]), 1024000000)
    return size // os.sysconf("SC_PAGESIZE"), queues, sems


def oom_first() -> None:
    """Make this process (and what it starts) the first the kernel's OOM killer takes, before the
    agent or the fork server: the memory guard's last resort, where memory it cannot place on an
    action runs out (_zygote.c's twin). Raising it needs no privilege. Best effort: only where
    the agent has CAP_SYS_RESOURCE does the kernel keep it as the program's floor; without (most
    pods, and here) a program that execs may write it back down."""
    from arl_tangram.sandbox import isolation  # the Python loop's zygote holds it already

    with suppress(OSError):
        isolation.write_proc("/proc/self/oom_score_adj", OOM_FIRST)


OOM_FIRST = b"1000"


def bound_ipc(size: int) -> None:
    """Bound the System V memory of the action's own IPC namespace by its memory limit: a segment
    it writes and detaches is in no process's address space, so RLIMIT_AS does not hold it, and a
    namespace's defaults let it hold all the host's memory (32,000 queues of 16,384 empty messages,
    a gigabyte of the kernel's memory per thousand; a billion semaphores of 64 bytes). Best effort:
    where /proc/sys cannot be written, the kernel's defaults stay."""
    from arl_tangram.sandbox import isolation  # the Python loop's zygote holds it already

    if size <= 0:
        return
    shm_pages, queues, sems = ipc_bounds(size)
    semmsl, semopm, semmni = SEM_DEFAULTS
    for name, value in (
        ("shmall", str(shm_pages)),
        ("msgmni", str(queues)),
        ("sem", f"{semmsl} {sems} {semopm} {semmni}"),
    ):
        with suppress(OSError):
            isolation.write_proc(f"/proc/sys/kernel/{name}", value.encode())


def private_tmp(workdir: str, size: int) -> None:
    """The Python loop's twin of _zygote.c's private_tmp (whose comment says what and why)."""
    from arl_tangram.sandbox import isolation

    root = os.path.dirname(workdir)
    isolation.unshare(isolation.CLONE_NEWNS)
    rootfd = os.open(root, os.O_PATH | os.O_CLOEXEC)  # in the new namespace: a bind source must be
    copies = _make_private_copies()
    opts = tmp_options(size)
    for point in isolation.PRIVATE_TMP_POINTS:
        isolation.mount("tangram", point, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, opts)
        if root.startswith(point + "/"):
            os.makedirs(root, mode=0o711, exist_ok=True)
            isolation.mount(f"/proc/self/fd/{rootfd}", root, None, isolation.MS_BIND | isolation.MS_REC)
    os.close(rootfd)
    isolation.bind_identity(root)
    for target, fd in copies:
        with suppress(OSError):  # the shared file stays (a lock is not worth failing an action for)
            isolation.mount(f"/proc/self/fd/{fd}", target, None, isolation.MS_BIND)
            # Read-only as the shared file is to actions (its owner is root's, its mode 0444).
            flags = isolation.MS_REMOUNT | isolation.MS_BIND | isolation.MS_RDONLY
            isolation.mount("none", target, None, flags | isolation.MS_NOSUID | isolation.MS_NODEV)
        os.close(fd)


def _make_private_copies() -> list[tuple[str, int]]:
    """In a fresh mount namespace, before its /tmp and /dev/shm are covered: a copy of each of
    ``_private_copies`` on a small tmpfs of its own, mounted on the one of the two under which none
    of them lies (the private tmpfs mounted there next hides it; no path reaches it), as
    (target, O_PATH descriptor) pairs for ``private_tmp`` to bind over the shared files."""
    from arl_tangram.sandbox import isolation

    found = [path for path in _private_copies if os.path.isfile(path)]
    point = next(
        (p for p in isolation.PRIVATE_TMP_POINTS if not any(f.startswith(p + "/") for f in found)), None
    )
    if not found or point is None:
        return []
    contents = []
    for path in found:
        with suppress(OSError), open(path, "rb") as fh:
            contents.append((path, fh.read()))
    room = sum(len(data) + 4096 for _, data in contents) + 4096
    isolation.mount(
        "tangram", point, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, f"size={room},mode=0700"
    )
    copies = []
    for n, (path, data) in enumerate(contents):
        copy = f"{point}/{n}"
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        copies.append((path, os.open(copy, os.O_PATH | os.O_CLOEXEC)))
    return copies


def child_after_c_setup(
    kind: str,
    code: str | None,
    argv: tuple[str, ...] | None,
    env_delta: tuple[tuple[str, str | None], ...],
    ctrl_fd: int,
    main_file: str | None,
    compiled: memoryview | None,
) -> NoReturn:
    """A child of the C loop, its sandbox set up there (the main file written, when it could be):
    adopt the environment, run the action."""
    try:
        _adopt_environment(env_delta)
    except BaseException as exc:
        with suppress(Exception):
            os.write(2, f"tangram: sandbox set-up failed: {exc.__class__.__name__}: {exc}\n".encode())
        os._exit(SETUP_FAILED)
    req = {"code": code, "argv": argv, "main_file": main_file, "compiled": compiled, "main_written": True}
    _run_action(req, ctrl_fd if kind == "interp" else None)


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


# The Python loop's set-up flag (``mmap``; _zygote.c's ``setup_flag`` says what and why): this
# child's page while its set-up runs, given by its zygote (``adopt_setup_flag``).
_SETUP_FLAG: Any = None


def adopt_setup_flag(page: Any) -> None:
    """In a child of the Python loop, just forked: its set-up flag (holding 1)."""
    global _SETUP_FLAG
    _SETUP_FLAG = page


def mark_setup(running: bool, unmap: bool) -> None:
    """This child's set-up is over (``running`` False: the program starts) or, after an execve of
    the sandbox's own that failed, failed after all (True); ``unmap``: the program runs in this
    process, so the flag's page goes first, out of its reach. The C loop's children hold the C
    module's flag (``mark_setup`` there), the Python loop's this module's."""
    global _SETUP_FLAG
    if _SETUP_FLAG is not None:
        _SETUP_FLAG[0] = 1 if running else 0
        if unmap:
            _SETUP_FLAG.close()
            _SETUP_FLAG = None
    elif _C_MARK_SETUP is not None:
        _C_MARK_SETUP(running, unmap)


def _run_action(req: dict[str, Any], ctrl_fd: int | None) -> NoReturn:
    """Run the action in this set-up child: a session's interpreter, an executable, or Python code."""
    try:
        if ctrl_fd is not None:
            mark_setup(False, True)
            _interpreter_loop()
        argv = req.get("argv")
        if argv:
            try:
                for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                mark_setup(False, False)  # the page goes with the exec
                # A bare name (a toolchain's, ``languages.command_words``) is found on the
                # action's PATH, as a shell finds it: the program's argv[0] is that name.
                if "/" in argv[0]:
                    os.execve(argv[0], argv, os.environ)
                os.execvpe(argv[0], argv, os.environ)
            except BaseException as exc:
                with suppress(Exception):
                    os.write(2, f"tangram: cannot execute {argv[0]}: {exc}\n".encode())
                # The program's own build that is no executable (a Go package not main, a Rust
                # library: "./out" in its workdir) fails as a shell running it does, 126: the
                # program's fault, not the sandbox's. A toolchain that cannot run is the sandbox's.
                own = argv[0].startswith("./") and getattr(exc, "errno", None) in _NOT_RUNNABLE
                if own:
                    with suppress(OSError):  # a workdir on a noexec mount: the host's fault
                        own = not os.statvfs(".").f_flag & os.ST_NOEXEC
                if not own:
                    mark_setup(True, False)
                os._exit(CANNOT_EXECUTE if own else SETUP_FAILED)
        mark_setup(False, True)
        _run_python_and_exit(req)
    finally:
        # Whatever happens (say, user code closed the interpreter's control socket and the reply
        # raised), the child must never return into the fork server's loop below its caller.
        _EXIT(1)


# Modules the zygote holds that ``python main.py`` would not have imported when the program starts
# (preloads, what the zygote needs): a file of the program's named as one of them shadows it there.
_SHADOWABLE: frozenset[str] = frozenset()


def note_shadowable(startup: list[str]) -> list[str]:
    """In the zygote, once its imports are done: which of its modules a program's own file may
    shadow (not those a fresh interpreter has at start, nor built-in ones, nor ours, which the
    child itself uses); returns them for the manager (``ForkServer._shadows``)."""
    global _SHADOWABLE
    tops = {name.partition(".")[0] for name in sys.modules}
    keep = set(startup) | set(sys.builtin_module_names) | {"__main__", "arl_tangram"}
    _SHADOWABLE = frozenset(name for name in tops if name not in keep)
    return sorted(_SHADOWABLE)


def unshadow() -> None:
    """Forget the zygote's modules that a module of the program's, in its directory, names: its
    ``import json`` then finds the program's ``json.py`` first, as under ``python main.py``, where
    the script's directory leads ``sys.path``. A stat or two per module the zygote holds (never a
    walk of the directory, which the program may have filled); a module already loaded from the
    directory (a session's earlier call imported it) stays. On the child's own compile path, which
    the manager takes when it sees such a file (``ForkServer._shadows``), and before each call of a
    session's interpreter."""
    if not _SHADOWABLE:
        return
    try:
        here = os.getcwd() + "/"
    except OSError:  # a session's earlier call left it in a directory since removed
        return
    for stem in _SHADOWABLE:
        module = sys.modules.get(stem)
        if module is None or (getattr(module, "__file__", None) or "").startswith(here):
            continue
        if holds_module(".", stem):
            for key in [k for k in sys.modules if k == stem or k.startswith(stem + ".")]:
                del sys.modules[key]


def holds_module(directory: str, name: str) -> bool:
    """Whether ``directory`` (first on ``sys.path``) gives ``import name`` a module of its own:
    ``name.py`` or a package ``name/`` (a directory without ``__init__.py`` is a namespace portion,
    which a module later on the path still beats)."""
    return os.path.lexists(f"{directory}/{name}.py") or os.path.exists(f"{directory}/{name}/__init__.py")


def prepare_child_world() -> None:
    """Set up once, in the zygote, the Python world every child starts from: a fresh ``__main__``,
    ``python -c``'s argv and path, the standard streams' names. The zygote runs none of its own
    code in it, and each child gets a copy of its own: building these in every child cost about 35
    of its copy-on-write faults."""
    global _CHILD_MAIN
    _CHILD_MAIN = _fresh_main_module()
    _fresh_std_streams()


_CHILD_MAIN: dict[str, Any] | None = None
# The C module's parts, where it was built: the reset of the recursion budget (``_run_code``: the
# code starts with the zygote's frames below it, which would count against the program's recursion
# limit), C stdio's flush, a run's whole end (``_run_python_and_exit``) and a session's loop.
try:
    _C_MODULE: Any = __import__("arl_tangram.sandbox._zygote", fromlist=["fresh_recursion"])
    _FRESH_RECURSION: Callable[[], None] | None = _C_MODULE.fresh_recursion
    _C_FLUSH: Callable[[], None] | None = _C_MODULE.flush_stdio
    _C_RUN_TO_END: Callable[[types.CodeType, dict[str, Any], bool], NoReturn] | None = _C_MODULE.run_to_end
    _C_END_WITH: Callable[[BaseException, dict[str, Any], bool], NoReturn] | None = _C_MODULE.end_with
    _C_SERVE_SESSION: Callable[[int, dict[str, Any], Callable[[dict[str, Any]], None]], NoReturn] | None = (
        _C_MODULE.serve_session
    )
    _C_MARK_SETUP: Callable[[bool, bool], None] | None = _C_MODULE.mark_setup
except ImportError:  # no C compiler at install
    _C_MARK_SETUP = None
    _FRESH_RECURSION = None
    _C_FLUSH = None
    _C_RUN_TO_END = None
    _C_END_WITH = None
    _C_SERVE_SESSION = None


def _flush_c_stdio() -> None:
    """Write out what the program's C code left in stdio's buffers (``printf`` through ctypes or an
    extension), as ``exit(3)`` does after Python's own streams: a child ends with ``os._exit``,
    which does not, and that output was lost. Without the C module, through ctypes where the
    program loaded it (the usual way Python code reaches C's stdio)."""
    with suppress(BaseException):
        if _C_FLUSH is not None:
            _C_FLUSH()
        elif "ctypes" in sys.modules:
            sys.modules["ctypes"].CDLL(None).fflush(None)


# Made ready in the Python loop's zygote by prepare_python_children: installs the actions' seccomp
# filter (isolation.prepared_seccomp); sets the parent-death signal (isolation.prepared_prctl).
_INSTALL_SECCOMP: Callable[[], None] | None = None
_SET_PDEATHSIG_KILL: Callable[[], None] | None = None


def prepare_python_children(program: bytes | None) -> None:
    """In the zygote of the Python loop, before any fork: what its children's set-up calls through
    ctypes, with the arguments built now (see ``isolation.prepared_prctl``), and the libc functions
    looked up (the first use of one through ctypes looks it up and caches a function object, about
    0.1 ms in each child). The filter is the one each child installs last (the C loop installs the
    same program itself: _zygote.c's child_setup)."""
    from arl_tangram.sandbox import isolation

    global _INSTALL_SECCOMP, _SET_PDEATHSIG_KILL
    _INSTALL_SECCOMP = isolation.prepared_seccomp(program) if program else None
    _SET_PDEATHSIG_KILL = isolation.prepared_prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL)
    isolation.resolve_libc()


def _die_with_parent() -> None:
    if _SET_PDEATHSIG_KILL is None:
        raise RuntimeError("prepare_python_children was not called in the zygote")
    _SET_PDEATHSIG_KILL()


def straight_path() -> tuple[Any, ...]:
    """What the C loop's straight path for compiled Python code needs (_zygote.c's run_straight):
    the prepared ``__main__`` namespace and the mapping behind ``os.environ``."""
    environ: Any = os.environ
    return (_CHILD_MAIN, environ._data)


def warm_child_path() -> None:
    """Do once here what every child would otherwise do first, each in its own copy of the heap.

    The first ``compile`` of source text in a process sets up the compiler's state (about 1.2 ms
    and 185 copy-on-write page faults in each child, measured here). Done in the zygote before
    ``gc.freeze``, children inherit it ready-made.
    """
    compile("pass", "<string>", "exec")


def _fresh_main_module() -> dict[str, Any]:
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    # As ``python main.py`` has them: a module-level annotation goes into ``__annotations__``, which
    # a program may read before it makes any; ``__cached__`` is None for a script.
    main.__dict__["__cached__"] = None
    # ``python -c``'s loader; a run from its main file gets that file's (``_main_loader``).
    main.__dict__["__loader__"] = sys.modules["_frozen_importlib"].BuiltinImporter
    if sys.version_info < (3, 14):  # 3.14 makes module annotations on demand (PEP 649)
        main.__dict__.update(__annotations__={})
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    if sys.path:
        sys.path[0] = ""
    return main.__dict__


def _main_loader(filename: str) -> Any:
    """``__loader__`` as ``python main.py`` has it: a SourceFileLoader of the file (the C loop's
    straight path makes the same in run_straight)."""
    return sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", filename)


def _fresh_std_streams() -> None:
    """The standard streams every child starts with, built once here: in each child they sit on
    descriptors 0, 1 and 2 (the action's), with empty buffers. Built in each child they cost a
    quarter of a millisecond.

    They are built while those descriptors are a pipe, as an action's are (its output is a pipe, and
    a pipe is what a program reads its input from outside a sandbox): a stream caches whether it
    can seek the first time it is asked, and the zygote's own, made on /dev/null or a log file,
    said it could. Then ``sys.stdout.reconfigure(encoding=...)`` and
    ``io.TextIOWrapper(sys.stdout.buffer, ...)``, which programs use to set their output's
    encoding, asked the pipe for its position and failed (ESPIPE), where outside they work."""
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    r, w = os.pipe()
    try:
        for fd, end in ((0, r), (1, w), (2, w)):
            os.dup2(end, fd)
        fresh = [
            _std_stream(0, sys.__stdin__),
            _std_stream(1, sys.__stdout__),
            _std_stream(2, sys.__stderr__),
        ]
        # Python's own originals (typeshed calls them final; the interpreter lets them be set).
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = fresh  # type: ignore[misc]
    finally:
        for fd, keep in zip((0, 1, 2), saved, strict=True):
            os.dup2(keep, fd)
            os.close(keep)
        os.close(r)
        os.close(w)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__


def _std_stream(fd: int, old: Any) -> Any:
    """A standard stream on ``fd`` as ``python`` builds it (``create_stdio``): buffered, the raw
    stream named ``<stdin>``..., ``newline="\\n"``, and the encoding, error handler and buffering
    of ``old``, the one it replaces (PYTHONIOENCODING's)."""
    import io

    mode = "r" if fd == 0 else "w"
    buffer: Any = open(fd, mode + "b", closefd=False)  # noqa: SIM115 - lives as the stream
    buffer.raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    stream = io.TextIOWrapper(
        buffer,
        encoding=old.encoding if old is not None else "utf-8",
        errors=old.errors if old is not None else ("backslashreplace" if fd == 2 else "surrogateescape"),
        newline="\n",
        line_buffering=old.line_buffering if old is not None else fd == 2,
        write_through=old.write_through if old is not None else False,
    )
    stream.mode = mode  # type: ignore[misc]  # as create_stdio sets it
    return stream


def _fresh_stdin() -> None:
    """A session's call reads its own input only: a new stream on descriptor 0 (its pipe), since
    the last call's may hold input it read ahead and never used (8 KiB of the previous input came
    first). Where the program had rebound ``sys.stdin``, that stays; ``sys.__stdin__`` is new."""
    old = sys.__stdin__
    stream = _std_stream(0, old)
    if sys.stdin is old:
        sys.stdin = stream
    sys.__stdin__ = stream  # type: ignore[misc]  # typeshed says final; the interpreter lets it be set


def _exit_code_of(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` ends ``python`` with (``_Py_HandleSystemExit``): None
    0; an int as C's ``(int)PyLong_AsLong`` gives it, so one beyond a C long is -1 (status 255,
    where a mask gave ``sys.exit(2**64)`` 0) and the rest keeps its low 8 bits; anything else is
    printed to stderr, status 1."""
    try:
        code: Any = exc.code
    except BaseException:
        code = exc  # a ``code`` that raises: the exception itself is printed, status 1, as Python does
    if code is None:
        return 0
    if issubclass(type(code), int):  # PyLong_Check: the real type, not ``__class__``
        value: int = _INT_VALUE(code)  # the value, not what a subclass's ``__and__`` says
        return value & 0xFF if -(1 << 63) <= value < (1 << 63) else 255
    with suppress(Exception):
        _write_stderr(f"{code}\n")
    return 1


def _write_stderr(text: str) -> None:
    """As ``PySys_WriteStderr``: to ``sys.stderr``, or to descriptor 2 where it is missing, None
    or its write fails (a program's ``sys.stderr = None``: ``print(file=None)`` wrote to stdout)."""
    err = sys.__dict__.get("stderr")
    if err is not None:
        with suppress(BaseException):  # a failed write: C's stderr, as Python then uses
            err.write(text)
            return
    os.write(2, text.encode("utf-8", "backslashreplace"))


def _run_code(
    source: str | None, namespace: dict[str, Any], filename: str = "<string>", compiled: Any = None
) -> int:
    """Run ``source`` like ``python -c`` (or ``python FILENAME``) would, in ``namespace``; returns
    the exit status. ``compiled``: its code object (marshalled), compiled already by the manager."""
    failure: BaseException | None = None
    try:
        if _FRESH_RECURSION is not None:
            _FRESH_RECURSION()  # as deep as under ``python main.py`` (_zygote.c's run_straight)
        code = _code_of(source, filename, compiled)
    except BaseException as exc:
        # Raised before the program's first line (a SyntaxError): no frame of the program's.
        failure = _WITH_TRACEBACK(exc, None)
    else:
        try:
            exec(code, namespace)
        except BaseException as exc:
            # Skip our own frame, as the interpreter's own traceback would. Through BaseException's
            # own method and slot: a class of the program's may override ``with_traceback`` (one
            # returning ``SystemExit(0)`` turned a failure into a success) or ``__traceback__``.
            tb = _TRACEBACK_OF(exc)
            _WITH_TRACEBACK(exc, tb.tb_next if tb is not None else None)
            failure = exc
    _flush_io()
    # Reported outside the ``except``, as Python reports it from C: an exception the program's
    # ``sys.excepthook`` raises has no context, and ``sys.exc_info()`` there is empty.
    return 0 if failure is None else _status_of(failure)


def _code_of(source: str | None, filename: str, compiled: Any) -> types.CodeType:
    """The action's code object: ``compiled`` (marshalled by the manager), else ``source`` compiled
    under ``filename``. Raises what compiling raises (a SyntaxError), as ``python main.py`` would."""
    if compiled is not None:
        code: types.CodeType = marshal.loads(compiled)
        return code
    # dont_inherit: not this module's ``from __future__ import annotations``, which ``python
    # file.py`` does not have either (annotations would come back as strings).
    text = source or ""
    # Run from a file, the file's bytes (``python main.py``); else the text (``python -c``).
    source_code = text if filename == "<string>" else source_of(text)
    return compile(source_code, filename, "exec", dont_inherit=True)


def _status_of(exc: BaseException) -> int:
    """The status of a program ended by ``exc``, said as Python says it: a SystemExit's code
    (``_exit_code_of``); otherwise the exception reported (``_report``), then the end by SIGINT
    after a KeyboardInterrupt of exactly that class (``run_eval_code_obj`` compares the class
    itself, so a subclass ends with 1), else 1."""
    # The real class, as Python's PyExceptionInstance_Class reads it: ``isinstance`` believes a
    # ``__class__`` property, and an AssertionError claiming to be SystemExit(0) passed.
    if issubclass(type(exc), SystemExit):
        return _exit_code_of(exc)  # type: ignore[arg-type]  # its real class is SystemExit's
    hooked = _report(exc)
    if hooked is not None:
        return hooked
    return _BY_SIGINT if type(exc) is KeyboardInterrupt else 1


def _report(exc: BaseException) -> int | None:
    """As ``PyErr_Print`` after a program's uncaught exception: ``sys.last_*`` set (the exit
    functions may read them), then ``sys.excepthook``, the interpreter's own C printer unless the
    program set another (no traceback module to import in the child). A hook that raises
    SystemExit ends the program with its status (returned here, else None); one that raises
    anything else is reported with the original exception, as Python does."""
    tb = _TRACEBACK_OF(exc)
    with suppress(BaseException):
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        hook = sys.__dict__.get("excepthook", _MISSING)
        if hook is _MISSING:
            _write_stderr("sys.excepthook is missing\n")
            _EXCEPTHOOK(type(exc), exc, tb)
        else:
            hook(type(exc), exc, tb)
    except SystemExit as hook_exit:  # ``except`` matches the real class
        with suppress(BaseException):
            return _exit_code_of(hook_exit)
        return 1
    except BaseException as failed:
        with suppress(BaseException):
            _write_stderr("Error in sys.excepthook:\n")
            # From the hook's own frame on, as Python's (which calls it from C): no frame of ours.
            # On the exception itself: the printer shows the traceback an exception holds.
            failed_tb = _TRACEBACK_OF(failed)
            _WITH_TRACEBACK(failed, failed_tb.tb_next if failed_tb is not None else None)
            _EXCEPTHOOK(type(failed), failed, _TRACEBACK_OF(failed))
            _write_stderr("\nOriginal exception was:\n")
            _EXCEPTHOOK(type(exc), exc, tb)
    return None


def _flush_io() -> None:
    """As Python's ``flush_io`` once the main module has run (or raised, before the error is
    printed): stderr, then stdout, errors ignored. What the program printed comes before what
    its threads, exit functions and subprocesses write at its end."""
    for name in ("stderr", "stdout"):
        with suppress(BaseException):
            stream = sys.__dict__.get(name)
            if stream is not None:
                stream.flush()


def _flush_std_streams(say: bool = True) -> bool:
    """Flush sys.stdout and sys.stderr as Python's ``flush_std_files`` does at its end; False when
    one that is not closed failed (Python then exits 120, having said so for stdout once: a
    program whose last output could not be written has not succeeded). ``say``: report a failed
    stdout (the second flush, after ``__main__`` is cleared, does not say it again)."""
    ok = True
    out = sys.stdout
    if out is not None and not _is_closed(out):
        try:
            out.flush()
        except BaseException as exc:
            ok = False
            if say:
                # As Python says it: "Exception ignored in: <stdout's repr>", then the error with
                # its traceback from the stream's own flush (none from a C one).
                tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
                with suppress(BaseException):
                    sys.unraisablehook(_UNRAISABLE_ARGS((type(exc), exc, tb, None, out)))
    err = sys.stderr
    if err is not None and not _is_closed(err):
        try:
            err.flush()
        except BaseException:
            ok = False
    return ok


def _flush_first_streams() -> None:
    """The streams the program started with, where it rebound sys.stdout or sys.stderr: Python's
    shutdown destroys them at its very end, which flushes what was printed to them before. Each on
    its own (a detached one raises), and never a reason to fail."""
    names = sys.__dict__  # a stream the program deleted is None here, not an error for both
    for name in ("stdout", "stderr"):
        first, now = names.get(f"__{name}__"), names.get(name)
        with suppress(BaseException):
            if first is not None and first is not now and not _is_closed(first):
                first.flush()


def _is_closed(stream: Any) -> bool:
    """Python's ``file_is_closed``: a ``closed`` that cannot be read or tested counts as open."""
    try:
        return bool(stream.closed)
    except BaseException:
        return False


def _clear_main(namespace: dict[str, Any]) -> None:
    """Release what ``__main__`` holds, as Python's shutdown does. There the module's dict dies as
    a cycle, and every finaliser runs with the globals in place (PEP 442); here the dict was made
    in the zygote and is frozen (``gc.freeze``), so it is never garbage. Its objects are released
    first, the newest first (an object's finaliser may use an older one), keeping its functions,
    classes and modules, which a finaliser calls through the globals. Then its names are cleared
    as ``_PyModule_ClearDict`` clears a module still alive: a single leading underscore first,
    every other but ``__builtins__`` next. Finalisers run, and files left open are flushed and
    closed: a file written and never closed kept nothing, and a finaliser's output was lost."""
    for key in reversed(list(namespace)):
        if isinstance(key, str) and not key.startswith("__"):
            with suppress(BaseException):
                if not isinstance(namespace[key], _CODE_LIKE):
                    namespace[key] = None
    for single in (True, False):
        for key in list(namespace):
            if key == "__builtins__" or not isinstance(key, str):
                continue
            if single == (key[:1] == "_" and key[1:2] != "_"):
                with suppress(BaseException):
                    namespace[key] = None


def _forget_last_exception() -> None:
    """As ``finalize_modules_delete_special``: ``sys.last_*`` deleted before the collection, and
    the tracebacks of that exception (and of its cause and context) cut, as the C loop's caller
    still holds the exception: its frames, and what they hold, can then be released."""
    value = sys.__dict__.get("last_value")
    for name in ("last_type", "last_value", "last_traceback"):
        sys.__dict__.pop(name, None)
    pending = [value]
    seen: set[int] = set()
    while pending:
        exc = pending.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        with suppress(BaseException):
            exc.__traceback__ = None
        pending += [exc.__cause__, exc.__context__]


def source_of(code: str) -> bytes:
    """The bytes of the main file holding ``code`` (``_write_main`` writes them), for ``compile``:
    compiled from those, a coding declaration decodes them as ``python main.py`` does
    (``# coding: latin-1`` makes the file's UTF-8 "é" two characters; an unknown codec is a
    SyntaxError) and a leading BOM is allowed. Compiled from the text, the declaration was ignored
    and a BOM was a SyntaxError."""
    return code.encode("utf-8", "surrogatepass")


def _write_main(path: str, source: str) -> bool:
    """Write the action's code to its main file (the Python loop's twin of _zygote.c's
    write_main): run from there, it looks as under ``python main.py`` (``__file__``, ``sys.argv``,
    tracebacks with their source lines, ``inspect.getsource``). ``False`` when it could not be."""
    data = source_of(source)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with suppress(OSError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def _run_python_and_exit(req: dict[str, Any]) -> NoReturn:
    namespace = _CHILD_MAIN
    if namespace is None:
        namespace = _fresh_main_module()
        _fresh_std_streams()
    # The main file the manager named (``main.py``, or another name where the request brought a
    # file of that name); none, or one that could not be written (a full disk, a file limit): run
    # as ``python -c`` would.
    filename = req.get("main_file") or "<string>"
    compiled = req.get("compiled")
    if compiled is None:
        unshadow()
    written = req.get("main_written") or filename == "<string>" or _write_main(filename, req["code"])
    if not written:
        filename = "<string>"
    if filename == "<string>":
        compiled = None  # compiled under the file's name: compile again, as `python -c` would
    else:
        namespace["__file__"] = filename
        namespace["__loader__"] = _main_loader(filename)
        sys.argv = [filename]
        if sys.path:
            sys.path[0] = filename.rpartition("/")[0]
    if "numpy" in sys.modules:
        # numpy's global generator is not reseeded at fork, unlike the random module's.
        with suppress(Exception):
            sys.modules["numpy"].random.seed()
    if _C_RUN_TO_END is None or _C_END_WITH is None:
        _finish_and_exit(_run_code(req["code"], namespace, filename, compiled), namespace)
    # The code runs, and the run ends, in C (_zygote.c's run_to_end): no frame of this module runs
    # again once the program has started. The program can reach this module (``sys.modules``) and
    # replace any of its functions or the names they call; with the end here, one that made every
    # function outside the standard library exit 0 failed outside and passed in the sandbox.
    script = filename != "<string>"
    failed: BaseException | None = None
    try:
        # As deep as under ``python main.py``: the compiler's own limit depends on the depth.
        if _FRESH_RECURSION is not None:
            _FRESH_RECURSION()
        code = _code_of(req["code"], filename, compiled)
    except BaseException as exc:
        # Raised before the program's first line (a SyntaxError): no frame of the program's.
        failed = _WITH_TRACEBACK(exc, None)
    if failed is not None:  # ended outside the ``except``: no exception is being handled there
        _C_END_WITH(failed, namespace, script)
    _C_RUN_TO_END(code, namespace, script)


def _finish_and_exit(code: int, namespace: dict[str, Any] | None = None) -> NoReturn:
    """What Python does after a program's main module (``Py_FinalizeEx``): its threads, its exit
    functions, its streams, a collection and ``__main__`` cleared (finalisers run, open files are
    flushed), its streams again; then the exit: 120 when a stream could not be flushed, and by
    SIGINT after a KeyboardInterrupt. Every name it calls was taken before the action's code ran.

    Only where the C module is not built: this is Python code, which the program can reach and
    replace (see ``_run_python_and_exit``); _zygote.c's end_run is its twin, in C."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:  # only code that imported it can have started threads
            with suppress(BaseException):
                threading._shutdown()  # wait for non-daemon threads (Python looks it up too)
        with suppress(BaseException):
            _RUN_EXITFUNCS()
        flushed = _flush_std_streams()
        with suppress(BaseException):
            _forget_last_exception()
            # Not while daemon threads run: Python's shutdown stops them first (they never take the
            # interpreter again), and one that went on would find its globals gone.
            if threading is None or threading.active_count() <= 1:
                _COLLECT()
                _clear_main(namespace if namespace is not None else _CHILD_MAIN or {})
                _COLLECT()
        flushed = _flush_std_streams(say=flushed) and flushed
        _flush_first_streams()
        _flush_c_stdio()
        if code == _BY_SIGINT:
            with suppress(BaseException):
                _SIGNAL(_SIGINT, _SIG_DFL)
                _KILL(_GETPID(), _SIGINT)
            code = 130
        elif not flushed:
            code = 120
    finally:
        _EXIT(code if 0 <= code <= 255 else 1)


def _prepare_call(request: dict[str, Any]) -> None:
    """Before a session's call runs: a fresh stdin, the call's cores and environment (TANGRAM_CORES,
    TANGRAM_DOP...), and the program's own modules ahead of the agent's."""
    _fresh_stdin()
    if request.get("cores"):
        os.sched_setaffinity(0, request["cores"])
    os.environ.update(request.get("env") or {})
    unshadow()


def _interpreter_loop() -> NoReturn:
    """A session's persistent interpreter: run each call's code in the same globals. In C where the
    C module is built (_zygote.c's serve_session, which says why); this loop otherwise."""
    if _CHILD_MAIN is None:
        _fresh_main_module()
        _fresh_std_streams()
    # The globals of the module that is ``__main__`` here (the C loop's zygote makes its own from
    # the prepared names): ``import __main__``, pickle and multiprocessing find the session's names.
    namespace: dict[str, Any] = sys.modules["__main__"].__dict__
    if _C_SERVE_SESSION is not None:
        _C_SERVE_SESSION(_CTRL_FD, namespace, _prepare_call)
    import socket

    ctrl = socket.socket(fileno=_CTRL_FD)
    devnull = os.open(os.devnull, os.O_RDWR)
    # The interpreter's key, sent before any call (wire.SESSION_KEY_SIZE). Here, in Python, a call's
    # code can find it; the C loop holds it where it cannot.
    key = b""
    while len(key) < wire.SESSION_KEY_SIZE:
        chunk = ctrl.recv(wire.SESSION_KEY_SIZE - len(key))
        if not chunk:
            _EXIT(0)
        key += chunk
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(ctrl, wire.SESSION_CALL.size, 3)
        except OSError:
            _EXIT(0)
        if len(header) < wire.SESSION_CALL.size:
            _EXIT(0)
        length, nonce = wire.SESSION_CALL.unpack(header)
        payload = bytearray()
        while len(payload) < length:
            chunk = ctrl.recv(length - len(payload))
            if not chunk:
                _EXIT(0)
            payload += chunk
        request = marshal.loads(bytes(payload))
        for target, fd in zip((0, 1, 2), fds, strict=False):
            os.dup2(fd, target)
            os.close(fd)
        _prepare_call(request)
        code = _run_code(request["code"], namespace)
        if code == _BY_SIGINT:
            code = 1  # a KeyboardInterrupt ends the call, not the session (as at a Python prompt)
        _flush_std_streams()
        # What this call printed to the streams it started with and then rebound goes with its
        # output, not a later call's.
        _flush_first_streams()
        _flush_c_stdio()
        for target in (0, 1, 2):
            os.dup2(devnull, target)
        ctrl.sendall(wire.SESSION_ANSWER.pack(nonce, code, wire.session_mac(key, nonce, code)))
