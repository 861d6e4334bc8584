"""The agent's settings, loaded once at start-up, and the per-action limits derived from them."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from arl_tangram.errors import InvalidSpec

RUNTIMES = ("python", "bash", "pytest")
# Modules the fork server imports once so that actions find them loaded. Kept small on purpose: every
# megabyte the fork server holds is paid again by each fork and each child's exit (measured here:
# about 0.1 ms per MB per action). Pools that need numpy or pandas name them with --preload.
DEFAULT_PRELOAD = ("math", "itertools", "functools", "collections", "heapq", "bisect", "string", "json")


def infra_cores(cores: list[int]) -> tuple[list[int], list[int]] | None:
    """Where the agent's own processes run: (the fork server's cores, the HTTP loop's cores), two
    disjoint halves of the pool's cores, or ``None`` with fewer than two.

    Each action is pinned to the cores it is granted; these are only the places the two pipeline
    stages that serve it may run. They hand work to each other with synchronous wake-ups, and on a
    busy host the kernel then stacks both on the waker's core (it stops looking for idle cores as
    load rises) while another core idles: 15% of two cores, measured, against 8% kept apart. The
    fork server takes the first half, where a lone action's grant is too (the lowest free core):
    the forking and the reading of its output then stay beside it.
    """
    ordered = sorted(set(cores))
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def parse_cores(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``; a clear error for anything else."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = part.split("-", 1)
                cores.update(range(int(lo), int(hi) + 1))
            else:
                cores.add(int(part))
    except ValueError as exc:
        raise InvalidSpec("cores", f"{text!r} is not a core list like '0-3,6'") from exc
    if not cores or min(cores) < 0:
        raise InvalidSpec("cores", f"{text!r} names no usable core")
    return sorted(cores)


def default_workdir_root() -> str:
    """A memory-backed directory when there is one: creating a workdir on a journalled disk costs ms."""
    base = (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )
    return os.path.join(base, f"tangram-sandbox-{os.getpid()}")


def host_memory_mb() -> int:
    """This host's physical memory in MB: the default ceiling of one action's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


@dataclass
class Limits:
    """Per-action limits: the defaults of a pool, and the ceilings a request may not exceed.

    The ceilings let through what SandboxFusion clients send (its own are the host's): a run of up
    to an hour, as much memory as the host has (``memory_limit_MB: -1``, its default, asks for
    that), and output large enough for a correct answer of several megabytes (clients such as verl
    score ``stdout`` and ignore ``stdout_truncated``). A pool sets tighter ones with the flags.
    """

    timeout_s: float = 10.0
    max_timeout_s: float = 3600.0
    memory_mb: int = 1024
    max_memory_mb: int = field(default_factory=host_memory_mb)
    nproc: int = 128
    nofile: int = 256
    fsize_mb: int = 64
    output_bytes: int = 8 << 20


@dataclass
class AgentConfig:
    """Everything ``tangram sandbox-agent`` can be told."""

    host: str = "127.0.0.1"
    port: int = 8080
    cores: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))
    workdir_root: str = field(default_factory=default_workdir_root)
    runtimes: tuple[str, ...] = RUNTIMES
    network_allowed: bool = False
    no_pid_namespace: bool = False  # e.g. under gVisor/Kata, or to compare the fallback clean-up
    # A private tmpfs /tmp and /dev/shm per action (a mount namespace each: about 0.1 ms of CPU per
    # action, measured here); off, both stay read-only to actions.
    private_tmp: bool = True
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    # "c": the fork loop in C (fails to start when it is not built), "python", or "auto" (C when built)
    fork_loop: str = "auto"
    infra_affinity: bool = True  # keep the HTTP loop and the fork server on disjoint cores (infra_cores)
    uid_base: int = 40000
    max_concurrent: int = 256
    max_sessions: int = 1024
    session_ttl_s: float = 1800.0
    max_body_bytes: int = 16 << 20
    max_file_bytes: int = 8 << 20
    max_fetch_bytes: int = 32 << 20  # all of one response's fetch_files together
    max_waiting: int = 1024  # requests queued for a slot beyond max_concurrent; more get 503
    token: str | None = None
    # Exactly-once dispatch (actions.py): how long a finished keyed action's response is kept, and
    # how many responses / bytes of them at most (the oldest go first).
    action_key_ttl_s: float = 600.0
    action_keys_max: int = 10000
    action_keys_max_bytes: int = 128 << 20
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> None:
        """Fail fast, naming the option, on settings that cannot work."""
        unknown = set(self.runtimes) - set(RUNTIMES)
        if unknown:
            raise InvalidSpec("runtimes", f"unknown runtime(s) {sorted(unknown)}; known: {list(RUNTIMES)}")
        if self.action_key_ttl_s < 0:
            raise InvalidSpec("action-key-ttl", "must be 0 or more seconds")
        if self.action_keys_max < 0 or self.action_keys_max_bytes < 0:
            raise InvalidSpec("action-keys-max", "must be 0 or more")
        if self.max_waiting < 0:
            raise InvalidSpec("max-waiting", "must be 0 or more")
        if self.fork_loop not in ("auto", "c", "python"):
            raise InvalidSpec("fork-loop", f"unknown fork loop {self.fork_loop!r}; known: auto, c, python")
        online = os.sched_getaffinity(0)
        missing = set(self.cores) - online
        if missing:
            raise InvalidSpec("cores", f"cores {sorted(missing)} are not available to this process")
        if not 1 <= self.port <= 65535 and self.port != 0:
            raise InvalidSpec("listen", f"port {self.port} out of range")
        if self.limits.timeout_s <= 0 or self.limits.timeout_s > self.limits.max_timeout_s:
            raise InvalidSpec("timeout", "the default timeout must be positive and at most the maximum")
        if self.limits.memory_mb > self.limits.max_memory_mb:
            raise InvalidSpec("memory-mb", "the default memory limit exceeds the maximum")
