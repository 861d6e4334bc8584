"""In-place pod resize (the pod `resize` subresource), as a v1.36 kubelet reports it, and its one
actuation here: the CPU affinity of the container's processes.

A kubelet keeps three views of a container's resources: desired (spec), allocated (accepted for the
node: status.containerStatuses[].allocatedResources) and actual (enacted on the running container:
status.containerStatuses[].resources). A resize that fits the node is allocated at once and then
actuated (PodResizeInProgress while it is); one that does not fit now but would on an emptier node is
PodResizePending/Deferred and retried; one that cannot fit this node at all is PodResizePending/
Infeasible (in v1.36 the API server's PodResize admission plugin refuses those first, with 403).
The pure parts (the core map, the fit check, the conditions) are here; the worker applies them. There
are no cgroups here (v1, shared): the CPU limit becomes a set of cores (see `cores_for`); memory is
accepted and reported but not enforced.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .api import Json, now_rfc3339
from .podspec import quantity

PENDING = "PodResizePending"
IN_PROGRESS = "PodResizeInProgress"
DEFERRED = "Deferred"
INFEASIBLE = "Infeasible"
ERROR = "Error"
# What the fit check counts, as the kubelet's admission does for a resize.
CHECKED_RESOURCES = ("cpu", "memory")


def cores_for(resources: Json, available: int) -> int:
    """How many of the runner's cores a container gets: its CPU limit rounded up (500m gets 1, 2 gets
    2), at most all of them; all of them without a CPU limit (no limit, no restriction)."""
    limit = (resources.get("limits") or {}).get("cpu")
    if limit is None:
        return available
    return max(1, min(available, math.ceil(quantity(limit) - 1e-9)))


class CoreMap:
    """Which of the runner's cores each container may run on. The simulated nodes advertise more CPUs
    than the host has, so cores are shared between containers (as all of them were before): a
    container that needs N cores gets the N least used ones (by how many containers hold each), and
    keeps the cores it has when its count does not change, so a resize of one pod moves no other."""

    def __init__(self, cores: Iterable[int]) -> None:
        self.cores = sorted(set(cores))
        if not self.cores:
            raise ValueError("the node runner has no CPU to give its pods (empty affinity)")
        self._held: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def assign(self, key: str, count: int) -> tuple[int, ...]:
        """The cores of container `key` (any stable string) once it needs `count` of them."""
        if count < 1:
            raise ValueError(f"a container needs at least one core, not {count}")
        count = min(count, len(self.cores))
        with self._lock:
            old = self._held.pop(key, ())
            if len(old) == count:
                self._held[key] = old
                return old
            load = Counter(c for held in self._held.values() for c in held)
            # Its own cores first (a shrink keeps some of them, a growth adds to them), then the least
            # used, then the lowest numbered: deterministic for the same state.
            ranked = sorted(self.cores, key=lambda c: (c not in old, load[c], c))
            chosen = tuple(sorted(ranked[:count]))
            self._held[key] = chosen
            return chosen

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def held(self) -> dict[str, tuple[int, ...]]:
        with self._lock:
            return dict(self._held)


def requests_of(resources: Json) -> dict[str, float]:
    return {k: quantity(v) for k, v in (resources.get("requests") or {}).items() if k in CHECKED_RESOURCES}


def pod_requests(containers: list[Json], init_containers: Iterable[Json] = ()) -> dict[str, float]:
    """A pod's effective requests from its containers' resources, as the kubelet sums them: the sum of
    the containers, or the largest init container where that is larger."""
    total: dict[str, float] = {}
    for res in containers:
        for k, v in requests_of(res).items():
            total[k] = total.get(k, 0.0) + v
    for res in init_containers:
        for k, v in requests_of(res).items():
            total[k] = max(total.get(k, 0.0), v)
    return total


def _amount(resource: str, value: float) -> int:
    # The kubelet's messages give CPU in millicores and memory in bytes.
    return round(value * 1000) if resource == "cpu" else round(value)


def fit(
    wanted: dict[str, float], used_by_others: dict[str, float], allocatable: dict[str, str]
) -> tuple[str, str] | None:
    """None when a pod's resized requests fit the node; else (Infeasible, message) when they exceed
    what the node has at all, or (Deferred, message) when they only exceed what the other pods leave."""
    for res in CHECKED_RESOURCES:
        if res not in wanted or res not in allocatable:
            continue
        capacity = quantity(allocatable[res])
        if wanted[res] > capacity:
            return INFEASIBLE, (
                f"Node didn't have enough capacity: {res}, requested: {_amount(res, wanted[res])}, "
                f"capacity: {_amount(res, capacity)}"
            )
    for res in CHECKED_RESOURCES:
        if res not in wanted or res not in allocatable:
            continue
        capacity, used = quantity(allocatable[res]), used_by_others.get(res, 0.0)
        if wanted[res] + used > capacity:
            return DEFERRED, (
                f"Node didn't have enough resource: {res}, requested: {_amount(res, wanted[res])}, "
                f"used: {_amount(res, used)}, capacity: {_amount(res, capacity)}"
            )
    return None


def resize_condition(kind: str, old: Json | None, reason: str, message: str, generation: int | None) -> Json:
    """A PodResizePending or PodResizeInProgress condition as the kubelet writes it: status True, the
    pod generation it is about, lastTransitionTime kept while the reason stays the same."""
    now = now_rfc3339()
    cond: Json = {
        "type": kind,
        "status": "True",
        "lastProbeTime": now,
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("reason", "") == reason else now,
        "observedGeneration": generation,
    }
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


class ResizeConditions:
    """The pod's two resize conditions, changed only when the kubelet would change them (a new reason
    or generation), so that a deferred resize retried every tick patches the status once."""

    def __init__(self) -> None:
        self.pending: Json | None = None
        self.in_progress: Json | None = None

    def set_pending(self, reason: str, message: str, generation: int | None) -> bool:
        old = self.pending
        if old and old.get("reason") == reason and old.get("observedGeneration") == generation:
            return False
        self.pending = resize_condition(PENDING, old, reason, message, generation)
        return True

    def clear_pending(self) -> None:
        self.pending = None

    def start(self, generation: int | None) -> None:
        """A resize was allocated: in progress for this generation (any earlier error is cleared)."""
        self.in_progress = resize_condition(IN_PROGRESS, None, "", "", generation)

    def failed(self, message: str) -> None:
        """Actuation failed: in progress with reason Error, for the generation being actuated."""
        generation = self.in_progress.get("observedGeneration") if self.in_progress else None
        if self.in_progress and self.in_progress.get("message") == message:
            return
        self.in_progress = resize_condition(IN_PROGRESS, self.in_progress, ERROR, message, generation)

    def done(self) -> None:
        self.in_progress = None

    def list(self) -> list[Json]:
        return [c for c in (self.pending, self.in_progress) if c is not None]


# ---- actuation: the CPU affinity of a process tree ---------------------------------------------------


def _children_map(proc: Path = Path("/proc")) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name (field 2) may hold spaces and parentheses; the fields after its last
            # closing parenthesis are fixed: state, then the parent's PID.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # it exited while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (PIDs as this runner sees them)."""
    children = _children_map()
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def set_tree_affinity(root: int, cores: Iterable[int], max_passes: int = 20) -> int:
    """Pins every thread of `root` and of all its descendants to `cores`; returns how many threads it
    changed. A process that forks while the tree is walked may hand its child the old mask, so the walk
    repeats until a pass changes nothing (new children inherit the mask once their parent has it)."""
    target = set(cores)
    changed_total = 0
    for _ in range(max_passes):
        changed = 0
        for pid in process_tree(root):
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                try:
                    if os.sched_getaffinity(tid) != target:
                        os.sched_setaffinity(tid, target)
                        changed += 1
                except (ProcessLookupError, FileNotFoundError):
                    continue  # the thread ended
        changed_total += changed
        if changed == 0:
            return changed_total
    raise OSError(f"the processes of pid {root} kept forking with the old CPU affinity ({max_passes} passes)")
