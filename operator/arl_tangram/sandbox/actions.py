"""Exactly-once dispatch: actions named by the caller's ``X-Tangram-Action-Key``.

A dispatcher that loses its connection (or restarts) sends the same request again with the same
key. The agent must then not run the action a second time: a repeat of a key still running waits
for that one action and gets its response; a repeat within ``ttl_s`` of its end gets the stored
response at once. Nothing here runs anything: the store only remembers, per key, the control of a
running action and, once it ended, the exact response it got.

The store is bounded by count and by bytes. Running entries are never dropped (their number is
bounded by the agent's slots and its queue); finished ones are dropped oldest first, and a response
larger than the whole byte budget is never stored (its waiters still get it).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arl_tangram.errors import InvalidSpec

ACTION_KEY_HEADER = "X-Tangram-Action-Key"
REPLAYED_HEADER = "X-Tangram-Replayed"
CORES_HEADER = "X-Tangram-Cores"
MAX_KEY_CHARS = 256


def parse_action_key(value: str | None) -> str | None:
    """The header's key, ``None`` when absent; ``InvalidSpec`` naming the header otherwise."""
    if value is None:
        return None
    if not 1 <= len(value) <= MAX_KEY_CHARS:
        raise InvalidSpec(ACTION_KEY_HEADER, f"must be 1 to {MAX_KEY_CHARS} characters, got {len(value)}")
    if not (value.isascii() and value.isprintable()):  # exactly " " to "~"; one C call each
        bad = next(c for c in value if not " " <= c <= "~")
        raise InvalidSpec(ACTION_KEY_HEADER, f"must be printable ASCII; found {bad!r}")
    if value != value.strip(" "):
        # HTTP drops a header value's outer spaces: such a key could not be sent again as itself.
        raise InvalidSpec(ACTION_KEY_HEADER, "must not start or end with a space")
    return value


def parse_cores_header(value: str | None) -> list[int] | None:
    """``X-Tangram-Cores: 3,5`` -> ``[3, 5]`` (``None`` when absent); ``InvalidSpec`` naming the
    header for anything but a comma-separated list of distinct core numbers."""
    if value is None:
        return None
    parts = [p.strip() for p in value.split(",")]
    if not parts or any(not p.isascii() or not p.isdigit() for p in parts):
        raise InvalidSpec(CORES_HEADER, f"{value!r} is not a comma-separated list of core numbers like '3,5'")
    cores = [int(p) for p in parts]
    if len(set(cores)) != len(cores):
        raise InvalidSpec(CORES_HEADER, f"{value!r} names a core more than once")
    return cores


@dataclass(frozen=True)
class StoredResponse:
    """Exactly what the first request with the key was answered."""

    status: int
    body: bytes
    # Its headers but Content-Length (Content-Type with its charset, Retry-After...): a replay
    # answers with them too.
    headers: tuple[tuple[str, str], ...]


class ActionControl:
    """The handle to one running action, through which it can be cancelled at any stage.

    The executor tells it where the action is: waiting for a slot or a session (``waiting``, the
    task to cancel), or handed to a fork server (``attach``: cancelling then asks that fork server
    to kill the action's whole process tree).
    """

    def __init__(self) -> None:
        self.requested = False
        self.task: asyncio.Task[Any] | None = None  # set while the action waits; cancelled to stop it
        self._kill: Callable[[], None] | None = (
            None  # a callable asking the fork server to kill it, once dispatched
        )

    def wait_with(self, task: asyncio.Task[Any] | None) -> None:
        """The action waits in ``task`` (``None``: it no longer waits)."""
        self.task = task

    def attach(self, kill: Callable[[], None]) -> None:
        """The action is with a fork server now; ``kill()`` ends it (at once if already requested)."""
        self.task = None
        self._kill = kill
        if self.requested:
            kill()

    def cancel(self) -> None:
        """Stop the action wherever it is; its request then answers with the outcome ``cancelled``."""
        if self.requested:
            return
        self.requested = True
        if self._kill is not None:
            self._kill()
        elif self.task is not None:
            self.task.cancel()


@dataclass
class ActionEntry:
    """One keyed action: running until ``response`` is set."""

    key: str
    cores: list[int] | None
    session_id: str | None
    digest: int = 0  # what the first request under the key asked for (``server._request_digest``)
    control: ActionControl = field(default_factory=ActionControl)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    finished_mono: float | None = None
    response: StoredResponse | None = None
    repeats: int = 0  # repeats of the key waiting for this run's end (shown while running)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class ActionStore:
    """Keyed actions: the running ones and the responses of those that ended within ``ttl_s``."""

    def __init__(self, ttl_s: float, max_entries: int, max_bytes: int) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.running: dict[str, ActionEntry] = {}
        self.finished: OrderedDict[str, ActionEntry] = OrderedDict()  # oldest end first
        self.bytes = 0

    def lookup(self, key: str) -> ActionEntry | None:
        """The running or still-remembered entry for ``key``."""
        self._expire()
        return self.running.get(key) or self.finished.get(key)

    def begin(
        self, key: str, cores: list[int] | None, session_id: str | None, digest: int = 0
    ) -> ActionEntry:
        """Register a new running action (the caller checked ``lookup`` with no await since)."""
        assert key not in self.running and key not in self.finished
        entry = ActionEntry(key=key, cores=cores, session_id=session_id, digest=digest)
        self.running[key] = entry
        return entry

    def finish(self, entry: ActionEntry, response: StoredResponse, keep: bool = True) -> None:
        """The action ended with ``response``: wake its waiters and remember it (unless ``keep`` is
        false: an answer such as "full, retry later" whose action never ran, so that a retry under
        the same key runs it)."""
        self.running.pop(entry.key, None)
        entry.response = response
        entry.finished_at = time.time()
        entry.finished_mono = time.monotonic()
        entry.done.set()
        size = len(response.body)
        if not keep or size > self.max_bytes or self.max_entries == 0:
            return
        self.finished[entry.key] = entry
        self.bytes += size
        while len(self.finished) > self.max_entries or self.bytes > self.max_bytes:
            self._drop_oldest()

    def forget(self, entry: ActionEntry) -> None:
        """Drop a finished entry (a refusal a corrected request under its key replaces)."""
        if self.finished.pop(entry.key, None) is not None and entry.response is not None:
            self.bytes -= len(entry.response.body)

    def _drop_oldest(self) -> None:
        _, old = self.finished.popitem(last=False)
        assert old.response is not None
        self.bytes -= len(old.response.body)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.finished:
            oldest = next(iter(self.finished.values()))
            assert oldest.finished_mono is not None
            if now - oldest.finished_mono < self.ttl_s:
                return
            self._drop_oldest()

    def describe(self) -> dict[str, list[dict[str, object]]]:
        """``GET /v1/actions``."""
        self._expire()
        return {
            "running": [
                {
                    "key": e.key,
                    "started_at": e.started_at,
                    "cores": e.cores,
                    "session_id": e.session_id,
                    "repeats": e.repeats,
                }
                for e in self.running.values()
            ],
            "finished": [{"key": e.key, "finished_at": e.finished_at} for e in self.finished.values()],
        }
