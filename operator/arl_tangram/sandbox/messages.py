"""The frames between the agent and its fork server's manager (``wire`` encodes them), typed.

Only for the type checker: at run time a frame is a plain dict (``marshal`` carries nothing else,
and the fork server imports no ``typing``; it names these under ``TYPE_CHECKING`` only).

Agent -> manager: ``RunMessage`` (``op`` "run", or "interp_run" for a session's interpreter),
``InterpStop``, ``Cancel``. Manager -> agent: ``Hello`` once, then one ``Reply`` per run frame, a
``Stopped`` per ``InterpStop`` and a ``Cancelled`` per ``Cancel``.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict


class RunMessage(TypedDict):
    """Run one action (queued until the cores it wants are free)."""

    op: Literal["run", "interp_run"]
    id: int
    code: str
    argv: list[str] | None  # None: Python code, run in the child itself
    stdin: bytes | None
    uid: int | None
    workdir: str
    want: int | list[int]  # a number of cores, or exactly these
    env: dict[str, str]
    timeout: float
    limits: dict[str, int]  # "cpu", "as", "data" (exec'd languages), "nproc", "nofile", "fsize"
    memory: int  # bytes, the action's memory limit (the guard's: forkserver._guard_memory)
    cap: int  # bytes kept of stdout and of stderr each
    remove_workdir: NotRequired[bool]
    workdir_made: NotRequired[bool]  # the agent made the workdir, empty (a tmpfs of its own)
    workdir_tmpfs: NotRequired[bool]  # a fresh action's workdir is a tmpfs of its own (the memory guard's)
    sid: NotRequired[str]  # interp_run: the session
    # Filled in by the manager before the zygote forks it:
    cores: NotRequired[list[int]]
    private_tmp: NotRequired[bool]
    netns: NotRequired[bool]
    mntns: NotRequired[bool]
    own_proc: NotRequired[bool]  # a /proc of its own PID namespace (in its own mount namespace)
    own_ipc: NotRequired[bool]  # an IPC namespace of its own (shared memory, semaphores, queues)
    landlock: NotRequired[bool]  # its writes confined (isolation.restrict_writes)
    main_file: NotRequired[str]  # Python code: the file it is written to and run from
    compiled: NotRequired[bytes]  # ... and its code object (marshal), when the manager compiled it


class InterpStop(TypedDict):
    op: Literal["interp_stop"]
    id: int
    sid: str


class Cancel(TypedDict):
    """Kill action ``target`` (or drop it from the queue)."""

    op: Literal["cancel"]
    id: int
    target: int


class Reply(TypedDict, total=False):
    """How a run went (``sandbox_error`` alone when it could not be started)."""

    id: int
    exit_code: int | None
    signal: int | None
    timed_out: bool
    cancelled: bool
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None
    max_rss_kb: int | None
    memory_error: bool
    memory_evicted_mb: int | None  # killed by the memory guard, holding this much (forkserver)
    memory_evicted_over_limit: bool  # ... more than its own memory limit
    setup_error: bool
    interp_restarted: bool
    interp_evicted: bool  # the interpreter before was stopped while idle, for the host's memory
    interp_ran_frozen: bool  # ... for running between calls (``forkserver._check_frozen``)
    interp_stopped: bool
    interp_unreaped: bool  # ... holding too many exited processes that it had not reaped
    interp_ended: bool
    workdir_removed: bool
    cores: list[int]
    busy_cores: int
    sandbox_error: str


class Hello(TypedDict, total=False):
    op: Literal["hello"]
    pid: int
    isolation: dict[str, object]
    error: str  # the fork server could not start


class Stopped(TypedDict):
    id: int
    stopped: bool


class Cancelled(TypedDict):
    id: int
    found: bool
