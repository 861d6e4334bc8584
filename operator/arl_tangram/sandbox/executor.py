"""Runs actions: validates the core request, picks a uid and a workdir, hands the action to the fork
server (which queues it until its cores are free), and shapes the result.

This is the agent's engine, shared by the native API and ``/run_code``. It owns the fork server (and
restarts it if it dies), the pool of per-action uids, the sessions and a single janitor thread that
deletes what actions left in their workdirs, off the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import queue
import re
import resource
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from arl_tangram.api.actionpool import MAX_SESSION_TTL_S, WORKDIR_BYTES_PER_FILE
from arl_tangram.errors import CapacityExceeded, InvalidSpec, NotReady
from arl_tangram.sandbox import gopackages, isolation, nodepackages, reaping, workfiles
from arl_tangram.sandbox.actions import ActionControl
from arl_tangram.sandbox.builds import Builder, CompileStep, Dispatch, decode_output
from arl_tangram.sandbox.config import AgentConfig, cpu_limit, infra_cores
from arl_tangram.sandbox.cores import CorePool
from arl_tangram.sandbox.forkclient import ForkServerClient, next_id
from arl_tangram.sandbox.jupyter_driver import RUNTIME_PREFIX
from arl_tangram.sandbox.languages import Detection, action_path, detect
from arl_tangram.sandbox.models import JUPYTER_MARGIN_S, JUPYTER_START_S, JUPYTER_STOP_S, Notebook
from arl_tangram.sandbox.preload import zygote_modules
from arl_tangram.sandbox.wire import UNREAPED_GRACE_S

log = logging.getLogger(__name__)

# A pytest action's code, run as ``pytest test_solution.py`` (SandboxFusion: ``pytest <a temporary
# file>.py``, a name no request file has); where a request file has that name, the next free of
# ``test_solution_.py``, ``test_solution__.py``... (``code_file``), as a python action's main file.
PYTEST_FILE = "test_solution.py"
# The most an action's stack limit may be: the agent's own hard limit, which no child may raise.
_STACK_HARD = resource.getrlimit(resource.RLIMIT_STACK)[1]
STACK_HARD_LIMIT = 1 << 62 if _STACK_HARD == resource.RLIM_INFINITY else _STACK_HARD
# Runtimes whose memory limit is an address-space limit (Python's own, and the tests it runs).
PYTHON_RUNTIMES = ("python", "pytest")
# A bash action's code, run from this file as ``bash .tangram-main.sh`` (SandboxFusion runs ``bash
# <a temporary file>.sh``): from a file, ``$0`` and ``BASH_SOURCE`` name it, errors say
# ``.tangram-main.sh: line N``, a script is as long as the request allows, and the last command is
# bash's child, not exec'd in its place (``bash -c`` execs it, so a last command killed by a signal
# ended the run by that signal instead of 128+n). The name is one no program or request uses for
# its own files: as ``main.sh`` it replaced a request's ``main.sh`` (``bash main.sh`` then ran
# itself until the process limit), a session's ``main.sh`` from an earlier action, and a script
# that wrote ``main.sh`` to run it next rewrote itself while bash read it, and stopped there.
BASH_FILE = ".tangram-main.sh"
# A jupyter action's code: its notebook as JSON (cells and timeouts), read and removed by its driver.
JUPYTER_FILE = ".tangram-notebook.json"
# The runtimes run from a file in the workdir, and that file (the compiled languages' are in
# languages.py, written by ``Builder.admit``).
CODE_FILES = {"pytest": PYTEST_FILE, "bash": BASH_FILE, "jupyter": JUPYTER_FILE}
# A jupyter action's program: it runs the cells in a kernel of its own (jupyter_driver.py says how).
JUPYTER_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jupyter_driver.py")


@dataclass
class ActionSpec:
    """One action as the agent understands it, whichever API it came through."""

    runtime: str
    code: str
    stdin: str | None = None
    timeout_s: float | None = None
    memory_mb: int | None = None
    cores: list[int] | None = None
    ncores: int = 1
    session_id: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    compile_timeout_s: float | None = None  # compiled languages (builds.py)
    # The main thread's stack may grow to ``memory_mb``, as SandboxFusion sets RLIMIT_STACK to a
    # positive memory_limit_MB (``_limits``); otherwise it is the 8 MB a process has outside.
    grow_stack: bool = False
    # The file a runtime of ``CODE_FILES`` runs the code from (``code_file``), set by ``run``.
    code_file: str = ""


@functools.cache
def _fresh_python_vm_kb() -> int:
    """The address space of a fresh ``python main.py`` as its code starts, in kB (0: unknown)."""
    probe = "print(open('/proc/self/status').read())"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    found = re.search(r"^VmSize:\s+(\d+) kB", done.stdout, re.MULTILINE)
    return int(found.group(1)) if found else 0


def code_file(runtime: str, files: Mapping[str, bytes], workdir: str | None = None) -> str:
    """Where ``runtime``'s code is written: its ``CODE_FILES`` name, or where a request file has
    that name (a helper the tests import, say), or a session's ``workdir`` holds one, the name with
    underscores added until it is free."""
    stem, dot, ext = CODE_FILES[runtime].rpartition(".")
    name = CODE_FILES[runtime]
    taken = {os.path.normpath(path) for path in files}  # ``./test_solution.py`` names it too
    while name in taken or (workdir is not None and os.path.lexists(os.path.join(workdir, name))):
        stem += "_"
        name = f"{stem}{dot}{ext}"
    return name


@dataclass
class ActionResult:
    """What happened; ``outcome`` is one of ``OUTCOMES``."""

    outcome: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None
    max_rss_kb: int | None
    cores: list[int]
    files: dict[str, bytes | None] = field(default_factory=dict)
    session_id: str | None = None
    interpreter_restarted: bool = False
    message: str = ""
    notes: list[str] = field(default_factory=list)  # about the result's parts (fetched files left out)
    compile: CompileStep | None = None  # a compiled language's build (builds.py)
    # Why stdout / stderr are not UTF-8 (``builds.decode_output``; empty when they are): the
    # native API returns them with U+FFFD, ``/run_code`` as SandboxFusion does.
    stdout_undecodable: str = ""
    stderr_undecodable: str = ""


# "cancelled": ended by ``DELETE /v1/actions/{key}`` (see actions.py).
OUTCOMES = ("ok", "failed", "timeout", "memory_limit_exceeded", "sandbox_error", "cancelled")


@dataclass
class Session:
    """One trajectory's state on this host."""

    id: str
    uid: int | None
    workdir: str
    persistent: bool
    ttl_s: float
    memory_mb: int
    # The fork server its persistent interpreter lives in, once it has one: when that fork server
    # is lost and replaced, so are the interpreter and its variables.
    interp_server: ForkServerClient | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    actions: int = 0
    interpreter_rss_kb: int | None = None
    peak_rss_kb: int = 0
    closed: bool = False
    # The handles of its calls, waiting or running: closing the session cancels them (a close
    # waited for the running call to end, up to its timeout, while it went on in the workdir).
    controls: set[ActionControl] = field(default_factory=set)

    def describe(self) -> dict[str, Any]:
        """JSON view (memory accounted per session: interpreter RSS and the peak of any action)."""
        return {
            "session_id": self.id,
            "persistent": self.persistent,
            "ttl_s": self.ttl_s,
            "memory_mb": self.memory_mb,
            "actions": self.actions,
            "created": self.created,
            "idle_s": round(time.monotonic() - self.last_used, 3),
            "memory": {
                "interpreter_rss_kb": self.interpreter_rss_kb,
                "peak_rss_kb": self.peak_rss_kb,
                "workdir_bytes": workfiles.tree_size(self.workdir),
            },
        }


class Janitor:
    """One long-lived thread deleting finished workdirs, so that no request waits on ``rmtree``
    (nor on an unmount: ``mounted``, each workdir is a tmpfs of its own)."""

    def __init__(self, mounted: bool = False) -> None:
        self.mounted = mounted
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tangram-janitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            if path is None:
                return
            workfiles.remove_tree(path, self.mounted)

    def remove(self, path: str) -> None:
        """Queue ``path`` for deletion."""
        self._queue.put(path)

    def stop(self) -> None:
        """Finish what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=30)


class Executor:
    """The engine behind every API of the agent."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._closed = False  # ``close`` has begun
        # Validation and reporting only: the fork server owns the pool (see cores.py).
        self.cores = CorePool(config.cores)
        self.cores_busy = 0
        self.server: ForkServerClient | None = None
        self.sessions: dict[str, Session] = {}
        self.isolation: dict[str, Any] = {}
        # What a Python action's address space starts with beyond a fresh interpreter's (``_limits``).
        self.python_headroom_kb = 0
        self.root = config.workdir_root
        # Each workdir's size limit, its own tmpfs (0: none), once ``start`` knows it can mount them.
        self.workdir_mb = 0
        # Languages beyond Python: their toolchains are found in ``start``.
        self.builder = Builder(
            Detection({}, {}), config.limits.max_timeout_s, compile_memory_mb=config.limits.memory_mb
        )
        self._uids: deque[int] = deque()
        self._session_uids: deque[int] = deque()
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._waiting = 0  # requests queued for a slot (bounded by config.max_waiting)
        self._janitor: Janitor | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._seq = 0
        self._restart_lock = asyncio.Lock()
        self._old_server: ForkServerClient | None = None  # one being closed after it was lost
        self._on_sigchld = False  # orphans are reaped on SIGCHLD
        self._orphans_possible = False  # a fork server was lost: some may still run
        # A uid per action and per session, when this process may switch uids.
        self.run_as_root = isolation.can_switch_uid()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    # ---- life cycle -------------------------------------------------------------------------------
    async def start(self) -> list[str]:
        """Create the workdir root, start the fork server; returns the isolation warnings."""
        self.root = _prepare_root(self.root)
        if isolation.shared_root(self.root):  # the command made it so (cli: own_mount_namespace)
            self.workdir_mb = self.config.limits.workdir_mb
        self.builder.detection = await asyncio.to_thread(detect)
        # Node looks for node_modules, and Go for go.mod, up from each program's workdir, the
        # root's children.
        nodepackages.link_at(self.root, self.builder.detection.node_modules())
        gopackages.place_at(self.root, self.builder.detection.go_modcache())
        if self.run_as_root:
            base = self.config.uid_base
            self._uids = deque(range(base, base + self.config.max_concurrent))
            start = base + self.config.max_concurrent
            self._session_uids = deque(range(start, start + self.config.max_sessions))
            # Read by each action's mount namespace (isolation.bind_identity).
            await asyncio.to_thread(
                isolation.write_identity, self.root, range(base, start + self.config.max_sessions)
            )
        fs_config = {
            "network_allowed": self.config.network_allowed,
            "no_pid_namespace": self.config.no_pid_namespace,
            "private_tmp": self.config.private_tmp,
            "seccomp": self.config.seccomp,
            "memory_reserve_mb": self.config.memory_reserve_mb,
            # Each action's private /tmp and /dev/shm hold at most the pool's default memory each
            # (an action's own memory limit where the tmpfs is made for it), and files by the
            # workdirs' rule (child.tmp_options).
            "tmp_bytes": self.config.limits.memory_mb << 20,
            "tmp_bytes_per_file": WORKDIR_BYTES_PER_FILE,
            "tmp_min_files": workfiles.WORKDIR_MIN_FILES,
            "preload": zygote_modules(self.config.preload),
            "zygote": self.config.fork_loop,
            "infra_cores": self._place_infra(),
            # The zygote's own environment: an action's differs from it in a few variables.
            "base_env": self._env(self.root, 1),
            "writable": [self.root],
            "workdir_mounts": bool(self.workdir_mb),
            "cores": self.config.cores,
            "readable": [*_runtime_paths(), *self.builder.detection.readable()],
            # Shared files that readers lock: each mount namespace binds copies of its own over them
            # (child.set_private_copies says why).
            "private_copies": gopackages.locked_files(self.root, self.builder.detection.found.values()),
        }
        # One fork server owns all the cores, so that it alone decides when an action may start.
        # It forks about a thousand actions a second here; a host with many more cores than that
        # keeps busy would split its cores among several (not needed on the pools we run).
        self.server = ForkServerClient(fs_config)
        try:
            hello = await self.server.start()
        except BaseException:
            # Nothing was served: leave nothing behind (the workdir root is ours alone).
            await self.server.close()
            self._remove_root()
            raise
        self.isolation = {**hello["isolation"], "workdir_mb": self.workdir_mb}
        fresh = await asyncio.to_thread(_fresh_python_vm_kb)
        self.python_headroom_kb = max(0, int(hello.get("zygote_vm_kb") or 0) - fresh) if fresh else 0
        self._janitor = Janitor(mounted=bool(self.workdir_mb))
        self._reaper = asyncio.create_task(self._expire_sessions())
        self._adopt_orphans()
        return _isolation_warnings(self.isolation)

    def _adopt_orphans(self) -> None:
        """Become the subreaper of what a lost fork server leaves (see reaping.py) and reap it as it
        comes (on SIGCHLD, and once a second for orphans still running when adopted)."""
        if not reaping.become_subreaper():
            log.warning("cannot become child subreaper: a lost fork server's children go to init")
            return
        with contextlib.suppress(RuntimeError, ValueError):  # not the main thread: the timer only
            asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self._reap_orphans)
            self._on_sigchld = True

    def _reap_orphans(self) -> None:
        keep = {s.proc.pid for s in (self.server, self._old_server) if s is not None and s.proc is not None}
        if reaping.reap_orphans(keep):
            log.info("killed and reaped processes a lost fork server left")
        else:
            self._orphans_possible = False

    async def close(self) -> None:
        """Close every session, stop the fork server (its actions die with it), clean up. Once: the
        agent calls it as it starts to stop (``server.build_app``) and again at its cleanup."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        if self._on_sigchld:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
            self._on_sigchld = False
        for sid in list(self.sessions):
            with contextlib.suppress(Exception):
                await self.close_session(sid)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.close()
        if self._janitor is not None:
            self._janitor.stop()
        self._remove_root()

    def _remove_root(self) -> None:
        if isolation.shared_root(self.root):
            # Its own mount (isolation.own_mount_namespace), with every workdir under it: a bind of
            # the directory, whose filesystem is left as it is.
            with contextlib.suppress(OSError):
                isolation.umount2(self.root, isolation.MNT_DETACH)
        workfiles.remove_tree(self.root)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot now."""
        return self._waiting

    @property
    def healthy(self) -> bool:
        """The fork server is running."""
        return self.server is not None and self.server.alive

    def _place_infra(self) -> list[int]:
        """Keep this process (the HTTP loop) to its half of the cores and return the fork server's
        half, where it keeps itself (actions run on their grants): see ``infra_cores``."""
        split = infra_cores(self.config.cores) if self.config.infra_affinity else None
        if split is None:
            return []
        os.sched_setaffinity(0, split[1])
        return split[0]

    def _live_server(self) -> ForkServerClient:
        if self.server is None or not self.server.alive:
            raise NotReady("the fork server is not running; restarting it", delay=1.0)
        return self.server

    async def _replace_dead_server(self) -> None:
        """Start a new fork server if the last one died (the agent keeps serving)."""
        old = self.server
        if old is None or old.alive:
            return
        log.warning("the fork server exited; starting a new one")
        self.server = ForkServerClient(old.config)
        self._old_server = old  # reaped by its own Popen, not as an orphan
        self._orphans_possible = True
        await old.close()
        self._old_server = None
        await self.server.start()

    # ---- actions ----------------------------------------------------------------------------------
    def _check_runtime(self, runtime: str) -> None:
        if runtime not in self.config.runtimes and not self.builder.offers(runtime):
            raise InvalidSpec(
                "runtime", f"unknown runtime {runtime!r}; this pool offers {', '.join(self.config.runtimes)}"
            )

    def _notebook(self, spec: ActionSpec) -> str:
        """A jupyter action's code made whole: the notebook as given (``models.Notebook``), checked,
        with what its driver takes from this agent (how much output it may answer with, how long
        its kernel may take to start and an interrupted cell to stop)."""
        try:
            notebook = Notebook.model_validate_json(spec.code)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'the code'}: {e['msg']}"
                for e in exc.errors(include_url=False, include_input=False)
            )
            raise InvalidSpec("code", f"a jupyter action's code is its notebook as JSON: {problems}") from exc
        timeout = self.config.limits.timeout_s if spec.timeout_s is None else spec.timeout_s
        # The action's timeout bounds the whole run: the cells get it less the kernel's start and
        # stop (half of it, where it is shorter than twice those), or what they ask within that.
        most = timeout - JUPYTER_MARGIN_S if timeout > 2 * JUPYTER_MARGIN_S else timeout / 2
        total = notebook.total_timeout or most
        if total > most:
            raise InvalidSpec(
                "code",
                f"the notebook's total_timeout {total:g} s leaves its kernel's start and stop no room "
                f"in the action's timeout {timeout:g} s: at most {most:g} s",
            )
        return json.dumps(
            {
                "cells": notebook.cells,
                "cell_timeout": notebook.cell_timeout,
                "total_timeout": total,
                "start_timeout": JUPYTER_START_S,
                "stop_timeout": JUPYTER_STOP_S,
                "output_bytes": self.config.limits.output_bytes,
            }
        )

    def _limits(self, spec: ActionSpec, memory_mb: int | None) -> tuple[float, dict[str, int]]:
        """The action's timeout and limits (its CPU time's: ``config.cpu_limit``, a backstop)."""
        lim = self.config.limits
        timeout = lim.timeout_s if spec.timeout_s is None else spec.timeout_s
        # A notebook's cells may have the ceiling, its kernel's start and stop the margin beyond it.
        most = lim.max_timeout_s + (JUPYTER_MARGIN_S if spec.runtime == "jupyter" else 0.0)
        if not 0 < timeout <= most:
            raise InvalidSpec("timeout", f"{timeout} s is outside (0, {most:g}] s")
        memory = memory_mb if memory_mb is not None else lim.memory_mb
        if not 16 <= memory <= lim.max_memory_mb:
            raise InvalidSpec("memory_mb", f"{memory} MB is outside [16, {lim.max_memory_mb}] MB")
        limits = {
            "cpu": cpu_limit(timeout),
            "as": memory << 20,
            "nproc": lim.nproc,
            "nofile": lim.nofile,
            "fsize": lim.fsize_mb << 20,
        }
        if spec.runtime == "python":
            # Forked from the zygote, the program starts with its address space (the agent's
            # modules, the C loop), larger than a fresh ``python main.py``'s: the difference is
            # added, so that what it may allocate is what it may outside (a 50 MB bytearray under
            # 64 MB failed here, 7 MB short, and passes there).
            limits["as"] += self.python_headroom_kb << 10
            limits["written"] = memory << 20  # its /tmp, /dev/shm and IPC memory stay the limit's
        if spec.runtime not in PYTHON_RUNTIMES:
            # An exec'd program's memory is what it writes (RLIMIT_DATA), not the address space it
            # reserves: a Go binary reserves about 1.2 GB and uses 40 MB, Node about 0.7 GB, each
            # WebAssembly memory about 10 GB, and under an address-space limit of 512 MB both
            # failed before their first line where outside they run. Their address space is held
            # to what any request may ask for (``max_memory_mb``), which bounds what RLIMIT_DATA
            # does not count (shared mappings).
            limits["data"] = memory << 20
            limits["as"] = lim.max_memory_mb << 20
        if spec.grow_stack and (spec.runtime == "python" or self.builder.main_stack(spec.runtime)):
            # /run_code with a memory limit: the main thread's stack may grow to it, as SandboxFusion
            # sets it (a memoised recursion 200,000 deep, a depth-first search over a million
            # nodes: a pass there, a segmentation fault in 8 MB). Threads keep their 8 MB: a Python
            # action's are sized by the zygote's start, a C or C++ program's by thread_stack.c.
            # What a Python action executes inherits the limit, and its threads are sized by it (as
            # every thread is under SandboxFusion). The hard limit stays the agent's (the child).
            limits["stack"] = min(memory << 20, STACK_HARD_LIMIT)
        return timeout, limits

    def _argv(self, spec: ActionSpec, dop: int) -> list[str] | None:
        if spec.runtime == "python":
            return None
        if spec.runtime == "bash":
            return ["/bin/bash", spec.code_file]
        if spec.runtime == "jupyter":
            # -P: the driver's directory (the agent's modules) is not put on the driver's path.
            return [sys.executable, "-P", JUPYTER_DRIVER, spec.code_file]
        # Test files run in parallel on more than one core, each file's tests in one worker, in
        # the file's order (``--dist loadfile``): a file's tests may share module state (one fills
        # a list, the next reads it), and dealt out one by one to the workers they failed where
        # plain pytest passes them. The request's own file alone (no ``args`` naming others) has
        # nothing to run in parallel: no workers are started for it, and its tests may use the
        # cores themselves (``TANGRAM_DOP``).
        # Otherwise plain ``pytest FILE`` as SandboxFusion runs it: its options (``-q``, ``-p
        # no:cacheprovider``, ``-n 0``) were the program's to see, and changed verdicts: the
        # ``cache`` fixture was missing, a pytest.ini's ``addopts = --lf`` or ``-p no:xdist`` made
        # the command line wrong (exit 4), ``getoption('verbose')`` was -1.
        # -P: nothing before the standard library and site-packages on the path as pytest starts,
        # as under its console script. ``python -m`` puts the working directory first, so a
        # request's helper named as a module pytest imports at start (``code.py``, ``signal.py``)
        # was imported in its place (a pass where ``pytest`` fails to collect, or pytest broke),
        # and helpers imported under ``--import-mode=importlib`` were found where they are not.
        parallel = dop > 1 and bool(spec.args)
        xdist = ["-n", str(dop), "--dist", "loadfile"] if parallel else []
        return [sys.executable, "-P", "-m", "pytest", *xdist, spec.code_file, *spec.args]

    def _own_tmp(self, spec: ActionSpec, uid: int | None) -> bool:
        """Whether the action's /tmp is its own and gone with it (the fork server's private_tmp: a
        uid of its own and a mount namespace), outside a session (whose calls each get a fresh one,
        where its temporary files kept in the workdir last from call to call)."""
        own = self.config.private_tmp and bool(self.isolation.get("private_tmp"))
        return own and uid is not None and spec.session_id is None

    def _env(self, workdir: str, dop: int, own_tmp: bool = False) -> dict[str, str]:
        """An action's environment. ``TMPDIR`` is the workdir unless its /tmp is its own
        (``_own_tmp``): then unset, as outside, so temporary files go to /tmp (in the workdir they
        were in the program's listing of its directory, a ``glob('*.txt')``, pytest's ``tmp_path``)."""
        tmp = {} if own_tmp else {"TMPDIR": workdir}
        return {
            "PATH": action_path(),
            "HOME": workdir,
            **tmp,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "MPLBACKEND": "Agg",
            "TANGRAM_DOP": str(dop),
            "TANGRAM_CORES": "",  # filled in by the fork server, which picks the cores
            "OMP_NUM_THREADS": str(dop),
        }

    async def run(self, spec: ActionSpec, control: ActionControl | None = None) -> ActionResult:
        """Run one action to completion (or timeout) and describe what happened; ``control``, when
        given, can cancel it at any stage (the result's outcome is then ``cancelled``)."""
        self._check_runtime(spec.runtime)
        if not self.healthy:
            async with self._restart_lock:
                await self._replace_dead_server()
        if spec.runtime == "jupyter":
            spec.code = self._notebook(spec)
        session = None
        if spec.session_id is not None:
            session = self.sessions.get(spec.session_id)
            if session is None or session.closed:
                raise _no_session(spec.session_id)
        if spec.runtime in CODE_FILES:
            # (In a session, picked again under its lock, beside the files its workdir holds then:
            # ``_run_in_session``.)
            spec.code_file = code_file(spec.runtime, spec.files)
            spec.files = {**spec.files, spec.code_file: spec.code.encode()}
        spec.files = self.builder.admit(spec.runtime, spec.code, spec.files, spec.compile_timeout_s)
        want: int | frozenset[int] = frozenset(spec.cores) if spec.cores else spec.ncores
        if (
            session is not None
            and session.persistent
            and spec.runtime == "python"
            and spec.memory_mb not in (None, session.memory_mb)
        ):
            # The interpreter is limited once, when it starts; a call cannot change that.
            raise InvalidSpec(
                "memory_mb",
                f"a persistent session's interpreter has the session's memory limit "
                f"({session.memory_mb} MB); set memory_mb when creating the session",
            )
        memory_mb = spec.memory_mb if spec.memory_mb is not None else (session.memory_mb if session else None)
        timeout, limits = self._limits(spec, memory_mb)
        # Validate the grant before queueing for it.
        self.cores.check(want)
        if self._slots.locked() and self._waiting >= self.config.max_waiting:
            # Back-pressure: each waiting request holds its body; past this, say when to come back.
            raise NotReady(
                f"{self._waiting} actions already wait for one of {self.config.max_concurrent} slots; "
                "retry shortly or spread the load over more hosts",
                delay=1.0,
            )
        if session is None:
            result = await self._run_held(spec, None, want, timeout, limits, control)
        else:
            control = control if control is not None else ActionControl()
            session.controls.add(control)
            try:
                result = await self._run_held(spec, session, want, timeout, limits, control)
            finally:
                session.controls.discard(control)
        return self._notebook_verdict(result) if spec.runtime == "jupyter" else result

    def _notebook_verdict(self, result: ActionResult) -> ActionResult:
        """A notebook's status is the notebook's, not only its driver's exit: the driver answers
        (and exits 0) when ``total_timeout`` ran out or the kernel died too, and the native
        status was ``ok`` then, its verdict only inside the JSON, so a caller reading the status
        (an ActionBatch's counts, a trainer's check) took a notebook that never ended for one
        that ran. Now ``timeout`` and ``failed``, with the driver's message; the stdout is still
        its answer, with the cells that ran. A cell that raised is the notebook's data, as on
        ``/run_jupyter`` (``Success``): still ``ok``."""
        if result.outcome != "ok" or result.stdout_truncated:
            return result
        try:
            answer = json.loads(result.stdout)
            status, message = answer["status"], answer["message"]
        except (ValueError, KeyError, TypeError):
            return result
        outcome = {"TimeLimitExceeded": "timeout", "Error": "failed"}.get(status)
        if outcome is None:
            return result
        self.counts["ok"] -= 1
        self.counts[outcome] += 1
        result.outcome = outcome
        result.message = result.message or str(message)
        return result

    async def _run_held(
        self,
        spec: ActionSpec,
        session: Session | None,
        want: int | frozenset[int],
        timeout_s: float,
        limits: dict[str, int],
        control: ActionControl | None,
    ) -> ActionResult:
        """``run`` once admitted: wait for the session, then for a slot."""
        # A session's calls run one at a time: each waits for its session before it takes a slot,
        # so that calls queued on one session hold no slot another action could run in (three
        # queued calls held both slots of an agent of two, and an unrelated action waited).
        lock = session.lock if session is not None else None
        held = False
        self._waiting += 1
        try:
            if lock is not None:
                held = await _acquire(lock, control)
                if held and session is not None and session.closed:  # closed while this call waited
                    raise _no_session(spec.session_id)
            got_slot = (lock is None or held) and await _acquire(self._slots, control)
        except BaseException:
            if held and lock is not None:
                lock.release()
            raise
        finally:
            self._waiting -= 1
        if not got_slot:
            if held and lock is not None:
                lock.release()
            return self._cancelled(spec)
        try:
            if session is not None:
                if session.closed:  # closed while this call waited for a slot
                    raise _no_session(spec.session_id)
                return await self._run_in_session(spec, session, want, timeout_s, limits, control)
            return await self._run_fresh(spec, want, timeout_s, limits, control)
        finally:
            self._slots.release()
            if lock is not None:
                lock.release()

    def _cancelled(self, spec: ActionSpec) -> ActionResult:
        """The result of an action cancelled before it started."""
        self.counts["cancelled"] += 1
        return ActionResult(
            outcome="cancelled",
            exit_code=None,
            signal=None,
            stdout="",
            stderr="",
            stdout_truncated=False,
            stderr_truncated=False,
            wall_s=0.0,
            cpu_s=None,
            max_rss_kb=None,
            cores=[],
            session_id=spec.session_id,
            message="cancelled before it started",
        )

    async def _run_fresh(
        self,
        spec: ActionSpec,
        want: int | frozenset[int],
        timeout_s: float,
        limits: dict[str, int],
        control: ActionControl | None = None,
    ) -> ActionResult:
        uid = self._uids.popleft() if self.run_as_root else None
        reply: dict[str, Any] | None = None
        self._seq += 1
        workdir = os.path.join(self.root, f"a{self._seq}")
        try:
            # A tmpfs of its own is made here, files or not; a plain directory only for files (the
            # fork server makes an empty one, and removes it when the action left it empty).
            if spec.files or self.workdir_mb:
                workfiles.make_workdir(workdir, uid, self.workdir_mb)
                for path, data in spec.files.items():
                    workfiles.write_file(workdir, f"files[{path!r}]", path, data, uid)

            msg = self._message(spec, uid, workdir, want, timeout_s, limits)
            msg["remove_workdir"] = not spec.fetch_files and not self.workdir_mb
            msg["workdir_tmpfs"] = bool(self.workdir_mb)  # the memory guard counts it (forkserver._held)
            if self.workdir_mb and not spec.files:
                msg["workdir_made"] = True
            build = await self.builder.prepare(
                spec.runtime,
                spec.files,
                msg,
                self._dispatcher(control),
                spec.compile_timeout_s,
                cacheable=True,
            )
            if build.stop is not None:  # the compile failed: the action ends there
                cores, reply = build.stop
                files, notes = self._fetch(workdir, spec.fetch_files)
                return build.attach(self._result(reply, cores, files, None, timeout_s, notes))
            cores, reply = await self._dispatch(self._live_server(), msg, control)
            files, notes = self._fetch(workdir, spec.fetch_files)
        finally:
            if not (reply or {}).get("workdir_removed"):
                self._discard_workdir(workdir, uid)
            if uid is not None:
                self._uids.append(uid)
        return build.attach(self._result(reply, cores, files, None, timeout_s, notes))

    async def _run_in_session(
        self,
        spec: ActionSpec,
        session: Session,
        want: int | frozenset[int],
        timeout_s: float,
        limits: dict[str, int],
        control: ActionControl | None = None,
    ) -> ActionResult:
        if spec.code_file:
            # A file of its name made since it was picked (by the call before, or an upload),
            # while this call waited for the session, is the session's: never overwritten (nor
            # removed after).
            code = spec.files.pop(spec.code_file)
            spec.code_file = code_file(spec.runtime, spec.files, session.workdir)
            spec.files[spec.code_file] = code
        for path, data in spec.files.items():
            workfiles.write_file(session.workdir, f"files[{path!r}]", path, data, session.uid)
        interp = session.persistent and spec.runtime == "python"

        msg = self._message(spec, session.uid, session.workdir, want, timeout_s, limits)
        msg["in_session"] = True  # its main file goes at the call's end (forkserver)
        if interp:
            msg["op"] = "interp_run"
            msg["sid"] = session.id
            # A long-lived interpreter must not die of accumulated CPU seconds.
            msg["limits"] = {k: v for k, v in limits.items() if k != "cpu"}
        build = await self.builder.prepare(
            spec.runtime, spec.files, msg, self._dispatcher(control), spec.compile_timeout_s, cacheable=False
        )
        if build.stop is not None:  # the compile failed: the action ends there
            cores, reply = build.stop
            session.last_used = time.monotonic()
            files, notes = self._fetch(session.workdir, spec.fetch_files)
            return build.attach(self._result(reply, cores, files, session.id, timeout_s, notes))
        server = self._live_server()
        # None: not a notebook, whose driver makes no such entries.
        before = (
            await asyncio.to_thread(_runtime_entries, session.workdir) if spec.runtime == "jupyter" else None
        )
        cores, reply = await self._dispatch(server, msg, control)
        # What the call asked back is read before its code file goes (a fetch of it found none).
        files, notes = self._fetch(session.workdir, spec.fetch_files)
        if spec.code_file:
            # The file the code ran from is the call's (as a Python call's main file is): left,
            # each call of the session took the next free name, and ``ls`` showed them all. A
            # driver killed (by its timeout, or by a cell) leaves its kernel's runtime directory
            # (connection key, sockets, history) too: those made during this call, not the
            # session's own files of such a name. In a thread: a cell may have left a million
            # files there, and the loop serves the host.
            await asyncio.to_thread(
                workfiles.remove_entries,
                session.workdir,
                lambda name: (
                    name == spec.code_file
                    or (before is not None and name.startswith(RUNTIME_PREFIX) and name not in before)
                ),
            )
        if interp:
            if session.interp_server not in (None, server):
                # Its interpreter died with the fork server it lived in: this call ran in a new one.
                reply["interp_restarted"] = True
            session.interp_server = server
        session.actions += 1
        session.last_used = time.monotonic()
        rss = reply.get("max_rss_kb") or 0
        session.peak_rss_kb = max(session.peak_rss_kb, rss)
        if interp:
            session.interpreter_rss_kb = reply.get("max_rss_kb")
        return build.attach(self._result(reply, cores, files, session.id, timeout_s, notes))

    async def _dispatch(
        self, server: ForkServerClient, msg: dict[str, Any], control: ActionControl | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """Send the action and wait for its answer; returns (the cores it ran on, the reply).

        The fork server queues the action until its cores are free and frees them when the action's
        last process is gone: no round trip to the agent between two actions on a core. Cancelling
        ``control`` from now on asks the fork server to kill the action's whole process tree (or to
        drop it from its queue).
        """
        reply_to = server.send_call(msg)  # queued now: a cancel frame can only follow it
        if control is not None:
            target = msg["id"]
            control.attach(
                lambda: server.submit({"op": "cancel", "id": next_id(), "target": target}, _ignore_answer)
            )
        reply = await reply_to
        if "busy_cores" in reply:
            self.cores_busy = int(reply["busy_cores"])
        return list(reply.get("cores") or []), reply

    def _dispatcher(self, control: ActionControl | None) -> Dispatch:
        """``_dispatch`` to the running fork server, cancelled with ``control`` (a compile step)."""
        return lambda msg: self._dispatch(self._live_server(), msg, control)

    def _message(
        self,
        spec: ActionSpec,
        uid: int | None,
        workdir: str,
        want: int | frozenset[int],
        timeout_s: float,
        limits: dict[str, int],
    ) -> dict[str, Any]:
        dop = want if isinstance(want, int) else len(want)
        return {
            "op": "run",
            "id": next_id(),
            "code": spec.code,
            "argv": self._argv(spec, dop),
            "stdin": spec.stdin.encode() if spec.stdin else None,
            "uid": uid,
            "workdir": workdir,
            "want": want if isinstance(want, int) else sorted(want),
            "env": self._env(workdir, dop, own_tmp=self._own_tmp(spec, uid)),
            "timeout": timeout_s,
            "limits": limits,
            # The action's memory limit, whichever limit carries it for its runtime (``_limits``):
            # the memory guard spares sessions' idle interpreters an action over it.
            "memory": limits.get("written", limits.get("data", limits["as"])),
            "cap": self.config.limits.output_bytes,
        }

    def _fetch(self, workdir: str, paths: list[str]) -> tuple[dict[str, bytes | None], list[str]]:
        """The files the request asked back, and why any of them is ``None`` beyond being absent;
        and a note when the workdir is full (a write in it may have failed for want of room).

        The action has run by now: a file over the per-file limit, or over what one response
        carries in all, comes back as ``None`` with a note, never as an error that loses the result.
        """
        files: dict[str, bytes | None] = {}
        notes: list[str] = []
        if self.workdir_mb and workfiles.full(workdir):
            mb = self.workdir_mb
            notes.append(
                f"the workdir is full (its limit: {mb} MB and {workfiles.workdir_files(mb)} files and "
                "directories): a write past it fails with ENOSPC, 'No space left on device'"
            )
        budget = self.config.max_fetch_bytes
        for path in paths:
            field = f"fetch_files[{path!r}]"
            try:
                data = workfiles.read_file(workdir, field, path, self.config.max_file_bytes)
            except InvalidSpec as exc:  # over the per-file limit
                files[path], data = None, None
                notes.append(str(exc))
                continue
            if data is not None and len(data) > budget:
                files[path] = None
                notes.append(
                    f"{field}: {path!r} ({len(data)} bytes) does not fit the {budget} bytes left of "
                    f"the {self.config.max_fetch_bytes} one response carries"
                )
                continue
            files[path] = data
            budget -= len(data or b"")
        return files, notes

    def _result(
        self,
        reply: dict[str, Any],
        cores: list[int],
        files: dict[str, bytes | None],
        session_id: str | None,
        timeout_s: float,
        notes: list[str] | None = None,
    ) -> ActionResult:
        message = ""
        if reply.get("cancelled"):
            outcome = "cancelled"
            message = "cancelled: its processes were killed"
        elif "sandbox_error" in reply:
            outcome = "sandbox_error"
            message = reply["sandbox_error"]
            reply = {}
        elif reply.get("setup_error"):
            outcome = "sandbox_error"
            message = reply.get("stderr", b"").decode("utf-8", "replace").strip()
        elif reply.get("timed_out"):
            outcome = "timeout"
            message = f"killed after the {timeout_s:g} s wall-clock limit"
            if reply.get("unreaped"):
                message += (
                    f"; its end was not seen {UNREAPED_GRACE_S:g} s after the kill (it left a process "
                    "only the sandbox could reap, or one stuck in the kernel): answered without it"
                )
        elif reply.get("memory_evicted_mb") is not None:
            outcome = "memory_limit_exceeded"
            held = f"{reply['memory_evicted_mb']} MB in its processes and files"
            if reply.get("memory_evicted_over_limit"):
                message = (
                    "killed: the host's memory was nearly exhausted and this action held more than "
                    f"its own memory limit ({held}; the limit bounds each process, not their sum)"
                )
            else:
                message = (
                    "killed: the host's memory was nearly exhausted and this action held the most of "
                    f"it ({held}; its memory limit bounds each process, not their sum)"
                )
        elif reply.get("memory_error"):
            outcome = "memory_limit_exceeded"
            message = "the program ran out of its memory limit"
        elif reply.get("exit_code") == 0 and not reply.get("interp_ended"):
            outcome = "ok"
        else:
            outcome = "failed"
        if reply.get("interp_ended") and not message:
            message = (
                f"the session's interpreter ended during the call (exit status {reply.get('exit_code')}) "
                "without answering it (its variables are gone; the next call starts a fresh one)"
            )
        if reply.get("interp_ran_frozen") and not message:
            message = (
                "the session's interpreter, or a process it started, ran between calls (where all "
                "of it is stopped), so it was stopped for good: its variables are gone; this call "
                "ran in a fresh one"
            )
        if reply.get("interp_evicted") and not message:
            message = (
                "the session's interpreter was stopped while idle: the host's memory ran short (its "
                "variables are gone; this call ran in a fresh one)"
            )
        if reply.get("interp_unreaped") and not message:
            message = (
                "the session's interpreter held more exited processes than a session keeps (orphans "
                "of what it started, which it adopts as its PID namespace's first process, and "
                "children it did not wait for), so it was stopped (its variables are gone; the next "
                "call starts a fresh one)"
            )
        if reply.get("interp_stopped") and not message:
            message = (
                "the call left processes running, so the session's interpreter was stopped (its "
                "variables are gone; the next call starts a fresh one)"
            )
        self.counts[outcome] += 1
        stdout, stdout_undecodable = decode_output(reply.get("stdout", b""))
        stderr, stderr_undecodable = decode_output(reply.get("stderr", b""))
        return ActionResult(
            outcome=outcome,
            exit_code=reply.get("exit_code"),
            signal=reply.get("signal"),
            stdout=stdout,
            stderr=stderr,
            stdout_undecodable=stdout_undecodable,
            stderr_undecodable=stderr_undecodable,
            stdout_truncated=bool(reply.get("stdout_truncated")),
            stderr_truncated=bool(reply.get("stderr_truncated")),
            wall_s=float(reply.get("wall_s", 0.0)),
            cpu_s=reply.get("cpu_s"),
            max_rss_kb=reply.get("max_rss_kb"),
            cores=cores,
            files=files,
            session_id=session_id,
            interpreter_restarted=bool(reply.get("interp_restarted")),
            message=message,
            notes=list(notes or []),
        )

    def _discard_workdir(self, workdir: str, uid: int | None) -> None:
        """Hand a workdir to the janitor, first out of reach of ``uid``, which goes back to the pool
        now: whoever gets it next must not walk into what the last holder left (workdir names are
        guessable, and a tree of many files may keep the janitor busy for seconds).

        A workdir of its own tmpfs is detached here instead, at once and from every namespace, its
        files with it (an unmount costs no walk, however many files): nobody can walk into it.
        """
        if self.workdir_mb and workfiles.detach(workdir):
            return
        if uid is not None:
            try:
                workfiles.seal(workdir)
            except OSError as exc:  # never lose the uid over it: the janitor still removes the tree
                log.warning("could not seal workdir %s from uid %d: %s", workdir, uid, exc)
        if self._janitor is not None:
            self._janitor.remove(workdir)
        else:
            workfiles.remove_tree(workdir, mounted=bool(self.workdir_mb))

    # ---- sessions ---------------------------------------------------------------------------------
    async def create_session(
        self, persistent: bool = False, ttl_s: float | None = None, memory_mb: int | None = None
    ) -> Session:
        """A new session with its own private workdir (and uid, when running as root)."""
        if len(self.sessions) >= self.config.max_sessions:
            raise NotReady(f"this host already holds {len(self.sessions)} sessions", delay=5.0)
        ttl = self.config.session_ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= MAX_SESSION_TTL_S:
            raise InvalidSpec("ttl_s", f"{ttl} s is outside (0, {MAX_SESSION_TTL_S}] s")
        memory = self.config.limits.memory_mb if memory_mb is None else memory_mb
        if not 16 <= memory <= self.config.limits.max_memory_mb:
            raise InvalidSpec(
                "memory_mb", f"{memory} MB is outside [16, {self.config.limits.max_memory_mb}] MB"
            )
        if self.run_as_root and not self._session_uids:
            raise CapacityExceeded("no session uid left")
        uid = self._session_uids.popleft() if self.run_as_root else None
        sid = secrets.token_hex(8)
        # Not named by its id, which is all it takes to use the session: every action's mount
        # table lists the workdirs that are mounts.
        self._seq += 1
        workdir = os.path.join(self.root, f"s{self._seq}")
        try:
            workfiles.make_workdir(workdir, uid, self.workdir_mb)
        except BaseException:
            if uid is not None:
                self._session_uids.append(uid)
            raise
        session = Session(
            id=sid,
            uid=uid,
            workdir=workdir,
            persistent=persistent,
            ttl_s=ttl,
            memory_mb=memory,
        )
        self.sessions[sid] = session
        return session

    def get_session(self, sid: str) -> Session:
        """The open session ``sid`` or ``InvalidSpec``."""
        session = self.sessions.get(sid)
        if session is None:
            raise _no_session(sid)
        return session

    async def close_session(self, sid: str) -> None:
        """Stop its interpreter, delete its workdir, recycle its uid."""
        session = self.sessions.pop(sid, None)
        if session is None:
            raise _no_session(sid)
        session.closed = True
        for control in list(session.controls):
            control.cancel()  # its processes killed (or its wait ended): the lock comes free at once
        try:
            async with session.lock:
                server = session.interp_server
                if server is not None and server.alive:
                    await server.call({"op": "interp_stop", "id": next_id(), "sid": sid})
        finally:
            # Also when the fork server was lost meanwhile (its interpreter with it): the session
            # is gone either way, and nothing would come back for its workdir and uid.
            self._discard_workdir(session.workdir, session.uid)
            if session.uid is not None:
                self._session_uids.append(session.uid)

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self._orphans_possible:  # a /proc scan: only after a fork server was lost
                self._reap_orphans()
            now = time.monotonic()
            for sid, session in list(self.sessions.items()):
                if not session.lock.locked() and now - session.last_used > session.ttl_s:
                    log.info("session %s expired after %.0f s idle", sid, session.ttl_s)
                    with contextlib.suppress(Exception):
                        await self.close_session(sid)


def _ignore_answer(reply: dict[str, Any] | BaseException) -> None:
    """For frames whose answer nobody waits for (a cancel: the action's own reply tells the end)."""


def _runtime_entries(workdir: str) -> frozenset[str]:
    """The names in ``workdir`` of the kind a notebook's driver makes (``RUNTIME_PREFIX``)."""
    try:
        with os.scandir(workdir) as entries:
            return frozenset(e.name for e in entries if e.name.startswith(RUNTIME_PREFIX))
    except OSError:
        return frozenset()


def _no_session(sid: str | None) -> InvalidSpec:
    """The refusal of a call to a session this host does not hold open (never was, or closed)."""
    return InvalidSpec("session_id", f"no open session {sid!r} on this host")


async def _acquire(lock: asyncio.Semaphore | asyncio.Lock, control: ActionControl | None) -> bool:
    """Acquire ``lock``; ``False`` (and not held) when ``control`` cancelled the action meanwhile."""
    if control is None:
        await lock.acquire()
        return True
    if control.requested:
        return False
    task = asyncio.current_task()
    control.wait_with(task)
    try:
        await lock.acquire()
    except asyncio.CancelledError:
        if not control.requested or task is None:
            raise
        task.uncancel()  # the cancel was ours, aimed at this wait only
        return False
    finally:
        control.wait_with(None)
    return True


def _prepare_root(root: str) -> str:
    os.makedirs(root, mode=0o711, exist_ok=True)
    # Others may traverse (to reach their own 0700 workdir) but not list the root.
    os.chmod(root, 0o711)
    return os.path.realpath(root)


def _runtime_paths() -> list[str]:
    """Where the Python that actions run lives: the installation, the venv, this package."""
    import site

    import arl_tangram

    paths = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(site.getsitepackages())
    paths.add(os.path.dirname(os.path.dirname(os.path.abspath(arl_tangram.__file__))))
    return sorted(paths)


def _isolation_warnings(iso: dict[str, Any]) -> list[str]:
    from arl_tangram.sandbox.isolation import Isolation

    known = {k: v for k, v in iso.items() if k != "notes"}
    return Isolation(**known, notes=tuple(iso.get("notes", []))).warnings()
