"""The agent's settings, loaded once at start-up, and the per-action limits derived from them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from arl_tangram.api.actionpool import DEFAULT_MAX_PROCESSES, WORKDIR_BYTES_PER_FILE
from arl_tangram.errors import InvalidSpec

RUNTIMES = ("python", "bash", "pytest", "jupyter")
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


def cpu_limit(timeout_s: float) -> int:
    """RLIMIT_CPU for a process given ``timeout_s``: a backstop, the timeout's worth on every core of
    the host, one second over, so that the timeout (which the fork server enforces by the wall
    clock) always comes first. CPU time counts every thread's, and not only on the cores granted:
    a program may widen its own affinity (``sched_setaffinity``), as it may outside, and a limit of
    the granted cores' worth killed such a program with SIGXCPU where outside it passed (the limit
    of one core's killed a two-thread program on two granted cores, before that)."""
    return int(timeout_s * _HOST_CPUS) + 1


_HOST_CPUS = max(1, os.cpu_count() or 1)  # read once: glibc reads /sys for it on each call


def host_memory_mb() -> int:
    """This host's physical memory in MB: the default ceiling of one action's memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _absolute(text: str) -> str:
    return os.path.abspath(text)


MB = 1 << 20


def setting(
    default: Any = MISSING,
    *,
    flag: str,
    help: str,
    factory: Callable[[], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    per_mb: bool = False,
    negated: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A setting's one source: its default and the command-line flag that sets it (``cli`` makes
    the argument parser from these). ``per_mb``: a byte count given in (fractional) MB; ``negated``:
    a flag that turns a default-true setting off; ``parse``: text to value (else the default's type)."""
    meta = {
        "flag": flag,
        "help": help,
        "parse": parse,
        "per_mb": per_mb,
        "negated": negated,
        "choices": choices,
    }
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Limits:
    """Per-action limits: the defaults of a pool, and the ceilings a request may not exceed.

    The ceilings let through what SandboxFusion clients send (its own are the host's): a run of up
    to an hour, as much memory as the host has (``memory_limit_MB: -1``, its default, asks for
    that), and output large enough for a correct answer of several megabytes (clients such as verl
    score ``stdout`` and ignore ``stdout_truncated``). A pool sets tighter ones with the flags.
    """

    timeout_s: float = setting(10.0, flag="--timeout", help="default wall-clock limit per action (s)")
    max_timeout_s: float = setting(3600.0, flag="--max-timeout", help="the most a request may ask for (s)")
    memory_mb: int = setting(
        1024,
        flag="--memory-mb",
        help="default memory limit per action (MB): its address space under Python, the data it writes in "
        "the other languages; also the least memory a compile gets",
    )
    max_memory_mb: int = setting(
        flag="--max-memory-mb",
        help="the most a request may ask for (MB; default: the host's memory)",
        factory=host_memory_mb,
    )
    nproc: int = setting(DEFAULT_MAX_PROCESSES, flag="--nproc", help="processes (and threads) per action")
    # A shell's usual soft limit: at 256 a program holding 300 files open failed (EMFILE) where it
    # runs under a login shell. Descriptors cost the host little. (Soft and hard are both set to
    # it: a program that raises its soft limit to the hard one, as Go's runtime does, stays here.)
    nofile: int = setting(1024, flag="--nofile", help="open files per process")
    fsize_mb: int = setting(64, flag="--fsize-mb", help="largest file an action may write (MB)")
    # Its own tmpfs per workdir (workfiles.make_workdir): the agent's workdirs are memory, and a
    # pod's memory is its limit's. Beyond it a write fails as on a full disk; 0 leaves it unbounded.
    workdir_mb: int = setting(
        1024,
        flag="--workdir-mb",
        help="most an action's (and a session's) workdir may hold (MB; its files are bounded too, one per "
        f"{WORKDIR_BYTES_PER_FILE >> 10} KiB of it): a write past it fails with ENOSPC, as on a full disk; "
        "0: no limit",
    )
    output_bytes: int = setting(8 << 20, flag="--output-bytes", help="cap on stdout and on stderr (bytes)")


@dataclass
class AgentConfig:
    """Everything ``tangram sandbox-agent`` can be told (``--listen``, ``--token`` and
    ``--log-level`` are the command's own; every other flag is made from a ``setting`` here)."""

    host: str = "127.0.0.1"
    port: int = 8080
    cores: list[int] = setting(
        flag="--cores",
        help="cores this agent hands out, e.g. 0-7 (default: all it may use)",
        factory=lambda: sorted(os.sched_getaffinity(0)),
        parse=lambda text: parse_cores(text),
    )
    workdir_root: str = setting(
        flag="--workdir-root",
        help="where workdirs live (default: a fresh dir on /dev/shm)",
        factory=default_workdir_root,
        parse=_absolute,
    )
    runtimes: tuple[str, ...] = setting(
        RUNTIMES, flag="--runtimes", help="offered runtimes", parse=_comma_list
    )
    network_allowed: bool = setting(
        False,
        flag="--network-allowed",
        help="let actions use the network (they can then reach the agent too: set a token)",
    )
    # e.g. under gVisor/Kata, or to compare the fallback clean-up
    no_pid_namespace: bool = setting(
        False,
        flag="--no-pid-namespace",
        help="clean up leftover processes by uid/process group instead of a PID namespace per action",
    )
    # A private tmpfs /tmp and /dev/shm per action (mount namespaces made ahead and reused while
    # left empty: see forkserver._take_mntns); off, both stay read-only to actions.
    private_tmp: bool = setting(
        True,
        flag="--no-private-tmp",
        negated=True,
        help="no private writable /tmp and /dev/shm per action (both are then read-only to actions)",
    )
    # The memory guard (memguard.py): an action's memory limit bounds each of its processes, not
    # their sum, so an action of many processes (or of memfds) could take the host's memory and the
    # kernel or the kubelet would kill the host with every action on it.
    memory_reserve_mb: int = setting(
        -1,
        flag="--memory-reserve-mb",
        help="when less than this is left of the container's memory (or the machine's), kill the action "
        "holding the most (MB; -1, the default: a twentieth of it, at least 64; 0: never)",
    )
    # A seccomp filter per action (seccomp.py: kernel modules, keyrings, bpf, mounts, new namespaces,
    # ... answer EPERM); off, actions may make every call their uid and capabilities allow.
    seccomp: bool = setting(
        True,
        flag="--no-seccomp",
        negated=True,
        help="no seccomp filter for actions (by default the calls no program needs are refused)",
    )
    preload: tuple[str, ...] = setting(
        DEFAULT_PRELOAD, flag="--preload", help="modules the fork server pre-imports", parse=_comma_list
    )
    # "c": the fork loop in C (fails to start when it is not built), "python", or "auto" (C when built)
    fork_loop: str = setting(
        "auto",
        flag="--fork-loop",
        choices=("auto", "c", "python"),
        help="the zygote's fork loop: C (built at install when a compiler is present; about three "
        "times the throughput), Python, or auto (C when built)",
    )
    infra_affinity: bool = setting(
        True,
        flag="--no-infra-affinity",
        negated=True,
        help="let the kernel place the HTTP loop and the fork server anywhere (by default they keep to "
        "two disjoint halves of the cores, which on a busy host leaves fewer cores idle)",
    )
    uid_base: int = setting(
        40000,
        flag="--uid-base",
        help="first uid given to actions (as root); agents sharing a host need disjoint ranges "
        "of max-concurrent + max-sessions uids",
    )
    max_concurrent: int = setting(256, flag="--max-concurrent", help="actions running at once (uids kept)")
    max_sessions: int = setting(1024, flag="--max-sessions", help="sessions open at once")
    session_ttl_s: float = setting(1800.0, flag="--session-ttl", help="idle seconds before a session closes")
    max_body_bytes: int = setting(16 * MB, flag="--max-body-mb", per_mb=True, help="largest request body")
    max_file_bytes: int = setting(
        8 * MB, flag="--max-file-mb", per_mb=True, help="largest file uploaded or fetched"
    )
    max_fetch_bytes: int = setting(
        32 * MB,
        flag="--max-fetch-mb",
        per_mb=True,
        help="all of one response's fetch_files together (the rest come back empty, with a note)",
    )
    max_waiting: int = setting(
        1024,
        flag="--max-waiting",
        help="requests queued beyond --max-concurrent; more are answered 503 with Retry-After",
    )
    token: str | None = None
    # Exactly-once dispatch (actions.py): how long a finished keyed action's response is kept, and
    # how many responses / bytes of them at most (the oldest go first).
    action_key_ttl_s: float = setting(
        600.0,
        flag="--action-key-ttl",
        help="seconds a finished action's response is kept for a repeat of its X-Tangram-Action-Key",
    )
    action_keys_max: int = setting(
        10000, flag="--action-keys-max", help="finished keyed responses kept at most"
    )
    action_keys_max_bytes: int = setting(
        128 * MB,
        flag="--action-keys-max-mb",
        per_mb=True,
        help="bytes of finished keyed responses kept at most (the oldest are dropped first)",
    )
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
        if self.limits.workdir_mb < 0:
            raise InvalidSpec("workdir-mb", "must be 0 (no limit) or more MB")
        if self.memory_reserve_mb < -1:
            raise InvalidSpec(
                "memory-reserve-mb", "must be -1 (a twentieth of the memory), 0 (no guard) or more MB"
            )
