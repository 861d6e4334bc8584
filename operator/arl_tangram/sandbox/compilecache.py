"""A content-addressed cache of builds, so that building the same program again costs little.

RL rollouts send one program many times (once per test case, and again when a policy repeats
itself): each send compiled it anew, a second or more for C++, Java or Rust. The cache keys a
build by everything that decides its output: the language, the toolchain (binaries and version),
the compile command, the source, every other file of the request (headers, jars, ...) by path and
content, and the memory limit the compile ran under. A hit copies the kept artifacts into the
action's fresh workdir; the build's own output (warnings, a compile error) is kept with them and
reported again. Failed builds are kept too: a program that does not compile fails the same way
every time. What depends on the moment (a timeout, a sandbox error) is never kept.

Entries live in the agent's memory (bounded in bytes, least recently used go first), never on a
path an action could reach: a build that one tenant made is served to another only for the very
same inputs, and nobody can read or replace an entry. Concurrent builds of one key are made once:
the first builds, the others wait for its entry (``building``, ``wait_for_build``); when it keeps
none (it timed out), they build side by side rather than one after another.

A build in a session's workdir is never cached: files left there by earlier calls may change it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class CompiledBuild:
    """One kept build: its artifacts and what the compile said."""

    artifacts: Mapping[str, bytes]  # workdir file -> content (all kept artifacts are executable)
    return_code: int
    stdout: str
    stderr: str
    compile_s: float  # how long the original compile took
    # Why stdout / stderr are not UTF-8 (``builds.decode_output``; empty when they are).
    stdout_undecodable: str = ""
    stderr_undecodable: str = ""

    @property
    def ok(self) -> bool:
        """Whether the build succeeded."""
        return self.return_code == 0

    @property
    def size(self) -> int:
        """Bytes it holds (what the cache's bound counts)."""
        return sum(len(v) for v in self.artifacts.values()) + len(self.stdout) + len(self.stderr) + 256


def build_key(
    language: str,
    fingerprint: str,
    command: list[str],
    files: Mapping[str, bytes],
    memory_mb: int,
) -> str:
    """The key of a build: every input that decides its output."""
    parts = [text.encode() for text in (language, fingerprint, str(memory_mb), str(len(command)), *command)]
    parts.append(str(len(files)).encode())
    for path in sorted(files):
        parts += [path.encode(), files[path]]
    return parts_digest(parts)


def parts_digest(parts: Iterable[bytes]) -> str:
    """SHA-256 of ``parts``, each length-prefixed: no two different sequences share an encoding."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


@dataclass
class CacheStats:
    """Counters for ``/v1/health``."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    waits: int = 0  # builds that waited for the same build made by another action


@dataclass
class CompileCache:
    """The cache (see the module docstring). Used from the agent's event loop only."""

    max_bytes: int = DEFAULT_MAX_BYTES
    entries: OrderedDict[str, CompiledBuild] = field(default_factory=OrderedDict)
    bytes: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    _building: dict[str, asyncio.Event] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more, not {self.max_bytes}")

    def get(self, key: str) -> CompiledBuild | None:
        """The entry for ``key`` (now the most recently used), counting a hit or a miss."""
        entry = self.entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self.entries.move_to_end(key)
        self.stats.hits += 1
        return entry

    def put(self, key: str, entry: CompiledBuild) -> bool:
        """Keep ``entry`` (evicting the least recently used as needed); ``False`` when it alone is
        larger than the whole cache."""
        if entry.size > self.max_bytes:
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        while self.entries and self.bytes + entry.size > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.size
            self.stats.evictions += 1
        self.entries[key] = entry
        self.bytes += entry.size
        self.stats.stores += 1
        return True

    @asynccontextmanager
    async def building(self, key: str) -> AsyncIterator[None]:
        """Mark ``key`` as being built for as long as the block runs (``wait_for_build`` waits)."""
        event = asyncio.Event()
        self._building[key] = event
        try:
            yield
        finally:
            if self._building.get(key) is event:
                del self._building[key]
            event.set()

    async def wait_for_build(self, key: str) -> bool:
        """Wait until the build of ``key`` under way ends; ``False`` when none was under way."""
        event = self._building.get(key)
        if event is None:
            return False
        self.stats.waits += 1
        await event.wait()
        return True

    def describe(self) -> dict[str, object]:
        """JSON view for ``/v1/health``."""
        return {
            "entries": len(self.entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.stats.hits,
            "misses": self.stats.misses,
            "stores": self.stats.stores,
            "evictions": self.stats.evictions,
            "waits": self.stats.waits,
        }
