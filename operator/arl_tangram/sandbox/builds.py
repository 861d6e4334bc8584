"""The compile step of an action in a language of ``languages.py``, before its run.

The compile is an action of its own, sent to the same fork server as the run: it runs in the
action's workdir, as the action's uid, on the action's cores, under the action's process limits and
its memory limit or the pool's default, whichever is more (the request's limit is its program's),
in the same namespaces, with ``compile_timeout`` as its wall-clock limit. Only when it
succeeds is the run sent (SandboxFusion's semantics: a failed or timed-out compile ends the action,
``compile_result`` says why and there is no ``run_result``). Both steps of a fresh action go
through the compile cache (``compilecache.py``); a hit sends no compile at all.

The executor calls ``Builder.admit`` when an action arrives (the source becomes a workdir file;
the compile timeout is checked) and ``Builder.prepare`` once its workdir holds the files: that
fills in the run's argv and environment and returns, when the action must end at its compile, the
reply it ends with.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from arl_tangram.errors import InvalidSpec
from arl_tangram.sandbox import gopackages, workfiles
from arl_tangram.sandbox.compilecache import CompileCache, CompiledBuild, build_key
from arl_tangram.sandbox.config import cpu_limit
from arl_tangram.sandbox.forkclient import next_id
from arl_tangram.sandbox.languages import (
    ENTRY_NOT_FOUND,
    JAVA_FILES,
    Detection,
    Language,
    Toolchain,
    artifact_names,
)

# SandboxFusion's default compile timeout (its request model's), used when a request gives none.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# The largest artifact kept (a Rust or Go binary is a few MB; anything larger is rebuilt).
MAX_ARTIFACT_BYTES = 64 << 20

Dispatch = Callable[[dict[str, Any]], Awaitable[tuple[list[int], dict[str, Any]]]]

# What a failed compile says when it failed for the moment, not for its source (kept, that
# failure was every later identical request's verdict, a compile error):
# - a process it started died of a signal, which its driver outlives and turns into a failure of
#   its own (the OOM killer kills the largest process: ``cc1plus``, not ``g++``): gcc's "Killed
#   signal terminated program cc1plus" and collect2's "ld terminated with signal 9", Go's
#   "compile: signal: killed", rustc's "linking with `cc` failed: signal: 9 (SIGKILL)", ldmd2's
#   "Error executing /usr/bin/ldc2: Killed" (strsignal's word); a shell script's compiler (scalac)
#   and iverilog's driver exit 128 + the signal instead (``SHELL_SIGNAL_BASE``);
# - a process or thread it needed was refused (EAGAIN: the host's or the pod's processes, which
#   every action shares, were full): gcc's "vfork: Resource temporarily unavailable", Go's
#   "failed to create new OS thread", the JVM's "unable to create native thread".
# A source's own words that match (a string in a line an error echoes) only cost a rebuild.
_FAILED_FOR_THE_MOMENT = re.compile(
    rb"signal terminated program|terminated with signal|\bsignal: (?:\d+|killed)\b|: Killed$"
    rb"|[Rr]esource temporarily unavailable|failed to create new OS thread|unable to create native thread",
    re.MULTILINE,
)
# A shell reports a child killed by signal n as the exit status 128 + n.
SHELL_SIGNAL_BASE = 128


class HasCompile(Protocol):
    """What ``Build.attach`` sets on an action's result (executor.ActionResult)."""

    compile: CompileStep | None
    message: str


R = TypeVar("R", bound=HasCompile)


def decode_output(data: bytes) -> tuple[str, str]:
    """A program's output as text (bytes that are not UTF-8 replaced by U+FFFD), and why it is
    not UTF-8 (the ``UnicodeDecodeError``'s message; empty when it is)."""
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as err:
        return data.decode("utf-8", "replace"), str(err)


def sandboxfusion_text(text: str, undecodable: str) -> str:
    """An output as SandboxFusion's ``try_decode`` reports it: output that is not UTF-8 is not
    returned at all, but ``[DecodeError]`` and the error's message in its place, so a client's
    verdict (an expected output compared) is the one SandboxFusion gives: the replaced text could
    match an expected output that holds U+FFFD."""
    return f"[DecodeError] {undecodable}" if undecodable else text


@dataclass(frozen=True)
class CompileStep:
    """What the compile did, as SandboxFusion's ``compile_result`` reports it."""

    status: str  # Finished | TimeLimitExceeded | Error
    execution_time: float
    return_code: int | None
    stdout: str
    stderr: str
    cached: bool = False  # served from the compile cache (no compile ran)
    # Why stdout / stderr are not UTF-8 (``decode_output``; empty when they are).
    stdout_undecodable: str = ""
    stderr_undecodable: str = ""

    @property
    def ok(self) -> bool:
        """Whether the run may follow."""
        return self.status == "Finished" and self.return_code == 0

    def as_dict(self, sandboxfusion: bool = False) -> dict[str, Any]:
        """SandboxFusion's CommandRunResult, plus ``cached``; with ``sandboxfusion``, output that is
        not UTF-8 as SandboxFusion reports it (``sandboxfusion_text``)."""
        out, err = self.stdout, self.stderr
        if sandboxfusion:
            out = sandboxfusion_text(out, self.stdout_undecodable)
            err = sandboxfusion_text(err, self.stderr_undecodable)
        return {
            "status": self.status,
            "execution_time": round(self.execution_time, 6),
            "return_code": self.return_code,
            "stdout": out,
            "stderr": err,
            "cached": self.cached,
        }


@dataclass
class Build:
    """The outcome of ``Builder.prepare``."""

    step: CompileStep | None = None  # the compile to report (None: no compile, or not reported)
    # Set when the action ends at its compile: the (cores, reply) it ends with, as from a run.
    stop: tuple[list[int], dict[str, Any]] | None = None
    compile_timeout_s: float = 0.0

    def attach(self, result: R) -> R:
        """Put the compile step on the action's result; returns the result."""
        result.compile = self.step
        if self.step is not None and self.step.status == "TimeLimitExceeded":
            result.message = f"the compile was killed after the {self.compile_timeout_s:g} s compile_timeout"
        return result


NO_BUILD = Build()


def _step_of(reply: Mapping[str, Any], wall_s: float) -> CompileStep:
    if "sandbox_error" in reply or reply.get("setup_error") or reply.get("cancelled"):
        status, code = "Error", None
    elif reply.get("timed_out"):
        status, code = "TimeLimitExceeded", None
    else:
        status, code = "Finished", reply.get("exit_code")
    stderr = reply.get("stderr", b"")
    if "sandbox_error" in reply:
        stderr = str(reply["sandbox_error"]).encode()
    out, out_undecodable = decode_output(reply.get("stdout", b""))
    err, err_undecodable = decode_output(stderr)
    return CompileStep(
        status=status,
        execution_time=float(reply.get("wall_s", wall_s)),
        return_code=code,
        stdout=out,
        stderr=err,
        stdout_undecodable=out_undecodable,
        stderr_undecodable=err_undecodable,
    )


def _failed_for_the_moment(reply: Mapping[str, Any]) -> bool:
    """Whether a failed compile says it failed for the moment (``_FAILED_FOR_THE_MOMENT``)."""
    code = reply.get("exit_code")
    if isinstance(code, int) and code > SHELL_SIGNAL_BASE:
        return True
    stderr = reply.get("stderr", b"")
    return isinstance(stderr, bytes) and _FAILED_FOR_THE_MOMENT.search(stderr) is not None


def _no_entry(language: Language) -> Build:
    """The build of a program that names nothing to run (a Scala program without an object): it
    fails before any compile, as SandboxFusion's does (its message, return code 1). SandboxFusion
    reports this compile as ``Error``, so the request as ``SandboxError``, which a client retries
    and a pool would count against its host; it is the program's doing, so here it is a failed
    compile (``Failed``), what a client scores the same."""
    failed = CompiledBuild(artifacts={}, return_code=1, stdout="", stderr=ENTRY_NOT_FOUND, compile_s=0.0)
    step = CompileStep(
        status="Finished", execution_time=0.0, return_code=1, stdout="", stderr=ENTRY_NOT_FOUND
    )
    return Build(step=step if language.reports_compile else None, stop=([], _reply_of(failed, 0.0)))


def _reply_of(entry: CompiledBuild, wall_s: float) -> dict[str, Any]:
    """A fork-server-like reply for a kept failed build (what the executor shapes results from)."""
    return {
        "exit_code": entry.return_code,
        "signal": None,
        "stdout": entry.stdout.encode(),
        "stderr": entry.stderr.encode(),
        "wall_s": wall_s,
        "cores": [],
    }


@dataclass
class Builder:
    """Compiles actions' programs (see the module docstring)."""

    detection: Detection
    max_timeout_s: float
    # The least memory a compile gets (the pool's default per action): the request's memory limit
    # is its program's, as a judge's is, not its compiler's (rustc and javac need about 512 MB,
    # ``go build`` about 1 GB, and a task limited to 256 MB failed at its compile).
    compile_memory_mb: int = 0
    cache: CompileCache = field(default_factory=CompileCache)

    def offers(self, runtime: str) -> bool:
        """Whether ``runtime`` is a language of this host's toolchains."""
        return runtime in self.detection.found

    def main_stack(self, runtime: str) -> bool:
        """Whether ``runtime``'s programs may grow their main stack to the memory limit
        (``Language.main_stack``)."""
        toolchain = self.detection.found.get(runtime)
        if toolchain is None or not toolchain.language.main_stack:
            return False
        # A C or C++ program's threads keep 8 MB only through thread_stack.c.
        return not toolchain.language.thread_stack or bool(toolchain.thread_stack)

    def names(self) -> list[str]:
        """Every /run_code name of the languages found (aliases included)."""
        found = [tc.language for tc in self.detection.found.values()]
        return sorted({name for lang in found for name in (lang.name, *lang.aliases)})

    def admit(
        self, runtime: str, code: str, files: dict[str, bytes], compile_timeout_s: float | None
    ) -> dict[str, bytes]:
        """The action's files with its code in the language's source file (the code wins over a
        request file of that name, as in SandboxFusion); ``InvalidSpec`` for a compile timeout out
        of range. Other runtimes' files come back as they are."""
        toolchain = self.detection.found.get(runtime)
        if toolchain is None:
            return files
        if compile_timeout_s is not None and not 0 < compile_timeout_s <= self.max_timeout_s:
            raise InvalidSpec(
                "compile_timeout", f"{compile_timeout_s:g} s is outside (0, {self.max_timeout_s:g}] s"
            )
        language = toolchain.language
        source = language.source_for(code)
        if source is None:
            return files
        files = {**files, source: language.source_bytes(code)}
        if (
            language.go_module
            and toolchain.go_modcache
            and "go.mod" not in files
            and any(p.endswith(".go") and p != source for p in files)
        ):
            # A program with packages of its own imports them by the module's path
            # (``SeedSandbox/utils``): the module's root must be its directory, as SandboxFusion
            # copies go.mod there (the one at the workdir root is the workdirs' parent). A lone
            # source keeps that one, and its compile cache (the workdir holds nothing else).
            files = {**gopackages.module_files(), **files}
        return files

    async def prepare(
        self,
        runtime: str,
        files: Mapping[str, bytes],
        msg: dict[str, Any],
        dispatch: Dispatch,
        compile_timeout_s: float | None,
        cacheable: bool,
    ) -> Build:
        """Make ``msg`` (the run, as the executor built it) run the language's program, compiling
        it first when the language needs it. ``files`` are the workdir's files as the request
        gave them (the source included); ``cacheable``: the workdir holds nothing else."""
        toolchain = self.detection.found.get(runtime)
        if toolchain is None:
            return NO_BUILD
        language = toolchain.language
        limits = msg["limits"]
        # The program's memory limit: what it writes (executor._limits sets it for every runtime
        # a toolchain runs).
        memory_mb = int(limits["data"]) >> 20
        # ``.``, the jars found here (javatuples), the request's own: the key holds the argv, so
        # the class path, and the toolchain's fingerprint the found jars' size and mtime.
        jars = toolchain.jars(sorted(p for p in files if p.endswith(".jar")))
        values = {"heap_mb": str(toolchain.heap_mb(memory_mb)), "jars": jars}
        if language.entry is not None:
            start = language.entry(files[language.source].decode("utf-8", "replace"))
            if start is None:
                return _no_entry(language)
            values["entry"] = start
        msg["env"] = {**msg["env"], **toolchain.env}
        if language.go_module and "go.mod" in files:
            # The request's go.mod makes the workdir its module (as under SandboxFusion), but Go
            # ignores a go.mod at the root of its temporary directory ("ignoring go.mod in system
            # temp root"), and TMPDIR may be the workdir: here it is /tmp (each action's own, empty, as
            # SandboxFusion's programs have theirs), and Go's build files stay in the workdir.
            msg["env"] = {**msg["env"], "GOTMPDIR": msg["workdir"], "TMPDIR": "/tmp"}
        msg["argv"] = toolchain.argv(language.run, values)
        if not language.compiled:
            return NO_BUILD
        timeout = DEFAULT_COMPILE_TIMEOUT_S if compile_timeout_s is None else compile_timeout_s
        compile_mb = max(memory_mb, self.compile_memory_mb)
        # ``javac *.java``'s files: the request's and the code's, top level only, in the shell's order.
        java_files = (
            tuple(sorted(p for p in files if p.endswith(".java") and "/" not in p))
            if JAVA_FILES in language.compile
            else ()
        )
        command = toolchain.argv(
            language.compile, {"heap_mb": str(toolchain.heap_mb(compile_mb)), "jars": jars}, java_files
        )
        # The address space stays the program's cap (``--max-memory-mb``, never below a compile's).
        # A compiler's stack is the one it has outside (the program's may grow: executor._limits).
        compile_limits = {**{k: v for k, v in limits.items() if k != "stack"}, "data": compile_mb << 20}
        if not cacheable:
            return await self._compile(toolchain, command, msg, compile_limits, dispatch, timeout, None)
        # The compile's memory is in its key (javac's heap flag, in the command, follows it).
        key = build_key(language.name, toolchain.fingerprint, command, files, compile_mb)
        entry = self._usable(key, timeout)
        if entry is None and await self.cache.wait_for_build(key):
            # Another action was building the same program: its build is this one's.
            entry = self._usable(key, timeout)
            if entry is None:  # it kept none (a timeout): build here, beside any other waiter
                return await self._compile(toolchain, command, msg, compile_limits, dispatch, timeout, key)
        if entry is not None:
            return self._from_cache(toolchain, entry, msg, timeout)
        async with self.cache.building(key):
            return await self._compile(toolchain, command, msg, compile_limits, dispatch, timeout, key)

    def _usable(self, key: str, timeout_s: float) -> CompiledBuild | None:
        """The kept build of ``key``, unless it took longer than this action's compile may."""
        entry = self.cache.get(key)
        return entry if entry is not None and entry.compile_s <= timeout_s else None

    async def _compile(
        self,
        toolchain: Toolchain,
        command: list[str],
        msg: dict[str, Any],
        compile_limits: dict[str, int],
        dispatch: Dispatch,
        timeout_s: float,
        key: str | None,
    ) -> Build:
        limits = {**compile_limits, "cpu": cpu_limit(timeout_s)}
        step_msg = {
            **msg,
            "id": next_id(),
            "argv": command,
            "stdin": None,
            "timeout": timeout_s,
            "limits": limits,
            "env": dict(msg["env"]),
            "remove_workdir": False,  # the run follows in it
        }
        started = time.monotonic()
        cores, reply = await dispatch(step_msg)
        step = _step_of(reply, time.monotonic() - started)
        reported = step if toolchain.language.reports_compile else None
        # A compiler killed by a signal (the kernel's OOM killer, on a host another action filled)
        # failed for the moment, not for its source: kept, that failure was every later identical
        # request's verdict. So was one whose driver outlived the process killed, or could not start
        # one (``_failed_for_the_moment``).
        moment = (
            reply.get("memory_error")
            or reply.get("signal")
            or (not step.ok and _failed_for_the_moment(reply))
        )
        if key is not None and step.status == "Finished" and not moment:
            self._keep(toolchain, key, msg["workdir"], step)
        if step.ok:
            return Build(step=reported, compile_timeout_s=timeout_s)
        return Build(step=reported, stop=(cores, reply), compile_timeout_s=timeout_s)

    def _keep(self, toolchain: Toolchain, key: str, workdir: str, step: CompileStep) -> None:
        artifacts: dict[str, bytes] = {}
        if step.ok:
            try:
                names = artifact_names(toolchain.language, os.listdir(workdir))
                for name in names:
                    data = workfiles.read_file(workdir, "artifact", name, MAX_ARTIFACT_BYTES)
                    if data is None:  # not a regular file (the build's own business): keep nothing
                        return
                    artifacts[name] = data
            except InvalidSpec:  # over the size kept
                return
            if not artifacts:
                return
        self.cache.put(
            key,
            CompiledBuild(
                artifacts=artifacts,
                return_code=step.return_code if step.return_code is not None else -1,
                stdout=step.stdout,
                stderr=step.stderr,
                compile_s=step.execution_time,
                stdout_undecodable=step.stdout_undecodable,
                stderr_undecodable=step.stderr_undecodable,
            ),
        )

    def _from_cache(
        self, toolchain: Toolchain, entry: CompiledBuild, msg: dict[str, Any], timeout_s: float
    ) -> Build:
        started = time.monotonic()
        workdir, uid = msg["workdir"], msg.get("uid")
        for name, data in entry.artifacts.items():
            workfiles.write_file(workdir, "artifact", name, data, uid)
            # The workdir is the action's fresh one, holding only what the agent wrote: no link.
            _make_executable(workdir, name)
        wall = time.monotonic() - started
        step = CompileStep(
            status="Finished",
            execution_time=wall,
            return_code=entry.return_code,
            stdout=entry.stdout,
            stderr=entry.stderr,
            cached=True,
            stdout_undecodable=entry.stdout_undecodable,
            stderr_undecodable=entry.stderr_undecodable,
        )
        reported = step if toolchain.language.reports_compile else None
        if entry.ok:
            return Build(step=reported, compile_timeout_s=timeout_s)
        return Build(step=reported, stop=([], _reply_of(entry, wall)), compile_timeout_s=timeout_s)

    def describe(self) -> dict[str, Any]:
        """JSON view for ``/v1/health``: languages found and missing, the compile cache."""
        return {
            "found": {name: tc.describe() for name, tc in sorted(self.detection.found.items())},
            "missing": dict(sorted(self.detection.missing.items())),
            "compile_cache": self.cache.describe(),
        }


def _make_executable(workdir: str, name: str) -> None:
    """``chmod 755`` a file just written into ``workdir`` (opened without following links)."""
    dirfd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    finally:
        os.close(dirfd)
    try:
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
