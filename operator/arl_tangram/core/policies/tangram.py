"""``tangram``: our scheduler. Same objective as the paper's, a fraction of its cost, plus priority
classes and weighted fair share between tenants.

What differs from ``paper`` and why it is no worse:
- Allocation: where a partition's state is a plain count (CPU cores on a host, API slots) and every
  duration is convex and non-increasing over a contiguous feasible range, marginal-gain greedy is
  exactly DPArrange's optimum at O(free log n). Non-elastic candidates simply take their minimum.
- GPU pools are planned with residency in view (``_decide_residency``): each action takes the TP
  size and block with the earliest expected completion, counting restores, the eviction of hot
  services and the backlog behind it, or waits for a busy block that holds its service.
- Eviction: evicting frees units that are only worth something if some admitted elastic action is
  short of its maximum; when none is, no eviction can lower the objective and the search is
  skipped (exact). Otherwise t goes up to ``max_evict`` and the waiting actions are estimated on a
  bounded window (``wait_window``) instead of the whole queue.
- Candidates: at most ``window`` per decision (the rest wait for the next event). In the estimate
  the first waiting action tries a ladder of allocations (minimum, powers of two, maximum).
- Sessions: a new session is pinned on arrival to the host with the fewest live sessions per
  core (``_pin_session``), not where cores happen to be free at its first start.
- FCFS per sandbox host. The promise, per lane: an action that waits holds back exactly the later
  actions that would compete for what it waits for. One whose session is on a host (pinned before
  this decision, or by an earlier action admitted in it) waits for that host's cores: no later
  action starts on that host. New sessions start in order: the first one that waits holds back
  every later new session, and no later action starts on a host that would have taken its session
  when the decision began (memory, session cap, cores, not draining). Later new sessions close no
  hosts of their own (the sessions there must go on to free memory for the first). Actions pinned
  elsewhere go on.
- Order: FCFS within each (priority class, tenant) lane; lanes are merged by effective class (an
  action waiting longer than ``aging_s`` counts as class 0, so no class starves) and then by the
  tenant's virtual time (weighted fair share: a tenant's virtual time grows by units/weight on
  each admission, and a tenant that comes back from idle starts at the backlogged minimum, or with
  none backlogged at the furthest any tenant reached). On a
  sandbox pool, short actions go first (``_order``): a tool call is not kept waiting behind a test
  that arrived before it, until that test has waited ``aging_s``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from arl_tangram.core.action import Action
from arl_tangram.core.dparrange import dp_arrange, greedy_arrange, is_contiguous
from arl_tangram.core.estimate import UnitHeap, list_schedule
from arl_tangram.core.pool import (
    Grant,
    Partition,
    Pinning,
    PlacementOption,
    PoolManager,
    ResidencyPlanner,
    Scratch,
)
from arl_tangram.core.queue import Lane
from arl_tangram.core.scheduler import Scheduler

# One partition's arrangement (``TangramPolicy._arrange_part``): the durations it sums, in order,
# the units of its actions, and whether an elastic one below its maximum is so for want of units.
_Part = tuple[list[float], list[int], bool]


@dataclass
class _Arranged:
    """An arrangement of candidates (``TangramPolicy._arrange``): summed durations, units per
    candidate, the scratch holding their minimums, whether capacity binds, and each partition
    with its arrangement (for the eviction search's shorter prefixes)."""

    total: float
    units: list[int]
    scratch: Scratch
    binding: bool
    parts: list[tuple[Partition, _Part]]


class TangramPolicy(Scheduler):
    """Our policy (see the module docstring)."""

    name = "tangram"

    def __init__(
        self,
        pools: Mapping[str, PoolManager],
        *,
        window: int = 256,
        wait_window: int = 8,
        backfill_window: int = 32,
        max_evict: int = 2,
        depth: int = 2,
        aging_s: float = 60.0,
        short_s: float = 5.0,
        short_lookahead: int = 256,
        tenant_weights: Mapping[str, float] | None = None,
        restore_aware: bool = True,
        first_gap_s: float = 10.0,
    ) -> None:
        super().__init__(pools)
        self.window = window
        self.wait_window = wait_window
        self.backfill_window = backfill_window
        # Each eviction step trades a start now for the estimate's promise on a window of waiting
        # actions that knows nothing of the arrivals to come; two steps kept the mean gains and
        # lost the rest's errors (docs/scheduler.md: 4 steps met the targets on 53 / 59 of two
        # sets of 68 swept variants, 2 steps on 54 / 59 with lower means and the same p99 misses).
        self.max_evict = max_evict
        self.depth = depth
        self.aging_s = aging_s
        # Short first (``_order``, ``is_short``); ``short_s`` 0 keeps plain FCFS.
        self.short_s = short_s
        self.short_lookahead = short_lookahead
        self.weights = dict(tenant_weights or {})
        # False: GPU pools take the DP over buddy chunks, blind to where services are resident.
        self.restore_aware = restore_aware
        self.first_gap_s = first_gap_s
        self.vtime: dict[str, dict[str, float]] = {}
        self._running_by_pool: dict[str, dict[int, tuple[float, int]]] = {}
        self._running_by_host: dict[tuple[str, str], dict[int, tuple[float, int]]] = {}
        # Actions that chose to wait in the last decision (for more units soon, see ``_defers``):
        # they hold back nobody. ``_releases`` caches a host's running grants by expected end.
        self.deferred: set[int] = set()
        # Hosts held for a deferred action in the last decision, and until when a later action
        # may use them (it must be expected to end by then: backfilling).
        self.backfill_until: dict[str, float] = {}
        self._releases: dict[str, list[tuple[float, int]]] = {}
        self._resident: dict[str, bool] = {}
        self._pins: dict[str, bool] = {}
        # Per (pool, lane): actions that arrived while their session could not be pinned, oldest
        # first (``_pin_session``); the front is always checked before it is trusted.
        self._unpinned: dict[tuple[str, Lane], deque[Action]] = {}
        # This decision's hosts closed to new sessions, each with the number of candidates taken
        # before it closed: the arrangement replays them in that order, so that every candidate
        # lands on the host the scan saw it take (a later hold must not move an earlier session).
        self._holds: list[tuple[int, str]] = []
        # Per service: (last arrival, smoothed gap between arrivals): how hot its cached copies are.
        self._svc_arrivals: dict[str, tuple[float, float]] = {}
        self._svc_waiting: dict[str, int] = {}  # waiting actions per service
        # Per pool: its waiting actions whose new session waits for memory (``_memory_waiting``).
        self._mem_waiting: dict[str, dict[int, Action]] = {}
        # Per service: the seconds its actions waited for a busy copy since it was last restored
        # (the rent, ``_pay_rent``), and until when no other copy could be had (``_no_copy``).
        self._svc_rent: dict[str, tuple[float, float]] = {}
        # This decision's price of holding a unit-second, for the arrangement (``greedy_arrange``).
        self._hold_cost = 0.0
        self._defer_hold = 0.0
        # This decision's running grants of the pool by expected end: the ones put in order so
        # far, their units, and the rest as a heap (``_running_heap``).
        self._by_end: tuple[list[tuple[float, int]], int, list[tuple[float, int]]] | None = None

    # ---- bookkeeping ------------------------------------------------------------------------
    def submit(self, action: Action, now: float, *, growing: bool = False) -> None:
        pool_vt = self.vtime.setdefault(action.pool, {})
        lanes = self.queue.lanes(action.pool)
        backlogged = {t for (_, t) in lanes}
        if action.tenant not in backlogged:
            # Coming back from idle: no credit for the time away (else it would starve the others).
            # With nothing waiting, the pool's virtual time is the furthest any tenant got (start-time
            # fair queueing's end of a busy period): a floor of its own kept a tenant served least
            # long ago ahead of everyone arriving just after it until it caught up with them (one
            # never served took 40 admissions in a row from one that had run 40 before the pool
            # went idle).
            if backlogged:
                floor = min(pool_vt.get(t, 0.0) for t in backlogged)
            else:
                floor = max(pool_vt.values(), default=0.0)
            pool_vt[action.tenant] = max(pool_vt.get(action.tenant, 0.0), floor)
        super().submit(action, now, growing=growing)
        mgr = self.pools[action.pool]
        pinning = self._pinning(mgr)
        if pinning is not None and pinning.pinned_host(action) is None:
            self._pin_session(pinning, action)
        if action.service is not None:
            self._svc_waiting[action.service] = self._svc_waiting.get(action.service, 0) + 1
            seen = self._svc_arrivals.get(action.service)
            if seen is None:
                self._svc_arrivals[action.service] = (now, self.first_gap_s)
            else:
                last, gap = seen
                self._svc_arrivals[action.service] = (now, 0.8 * gap + 0.2 * (now - last))

    def _pin_session(self, pinning: Pinning, action: Action) -> None:
        """Pin a new session on arrival (``Pinning.pin_session``: the host with the fewest live
        sessions per core, where its memory fits), even if that host has no free core now: its
        actions then wait in that host's queue. Saturated ``swe`` variants showed why: pinned
        where cores happened to be free at its first start, a burst of sessions went to the one
        host with a few idle cores (80 and 71 sessions on two hosts, 16 and 25 on the others,
        utilisation 55%). New sessions start in order: while an earlier session of the lane still
        waits unpinned (no memory for it at its arrival), this one stays unpinned too. Those are
        kept per lane in arrival order, the ones no longer waiting or pinned since dropped from
        the front, so the check costs O(1) amortised (a scan of the lane made each arrival of a
        10,000-action batch O(n))."""
        key = (action.pool, (action.priority, action.tenant))
        earlier = self._unpinned.get(key)
        while earlier and not (self.queue.is_waiting(earlier[0]) and pinning.pinned_host(earlier[0]) is None):
            earlier.popleft()
        if not earlier and pinning.pin_session(action) is not None:
            if earlier is not None:
                del self._unpinned[key]
            return
        self._unpinned.setdefault(key, deque()).append(action)
        self._mem_waiting.setdefault(action.pool, {})[id(action)] = action

    def _memory_waiting(self, pool: str) -> int:
        """Waiting actions of ``pool`` whose new session no host had memory for at their arrival
        (or that wait behind such an earlier one, new sessions starting in order), kept as they
        arrive and dropped as they start or are withdrawn: O(1). (The lanes' ``_unpinned`` queues
        are checked at their fronts only: a short new session started ahead of a longer earlier
        one, and a withdrawn one, stayed in them.)"""
        return len(self._mem_waiting.get(pool, ()))

    def _on_withdraw(self, action: Action) -> None:
        self._left_waiting(action)

    def _left_waiting(self, action: Action) -> None:
        """``action`` no longer waits (started or withdrawn): out of the counts of what waits (every
        waiting action came through ``submit``, even one no host could hold yet: ``growing``)."""
        self._mem_waiting.get(action.pool, {}).pop(id(action), None)
        if action.service is not None:
            self._svc_waiting[action.service] -= 1

    @staticmethod
    def _wants_units(pinning: Pinning | None, action: Action) -> bool:
        """Whether units could start ``action``: not a new session that no host has memory for."""
        return (
            pinning is None or pinning.pinned_host(action) is not None or bool(pinning.session_hosts(action))
        )

    def _on_adopt(self, grant: Grant) -> None:
        self._track(grant)

    def _track(self, grant: Grant) -> None:
        entry = (grant.est_end, grant.units)
        self._running_by_pool.setdefault(grant.action.pool, {})[id(grant)] = entry
        self._running_by_host.setdefault((grant.action.pool, grant.host), {})[id(grant)] = entry

    def _on_release(self, grant: Grant) -> None:
        self._running_by_pool.get(grant.action.pool, {}).pop(id(grant), None)
        self._running_by_host.get((grant.action.pool, grant.host), {}).pop(id(grant), None)

    def _weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    # ---- order -----------------------------------------------------------------------------------
    def is_short(self, action: Action) -> bool:
        """Whether ``action`` goes ahead of longer ones on a sandbox pool (``_order``)."""
        return not action.elastic and action.model.duration(action.min_units) <= self.short_s

    def _order(self, pool: str, now: float) -> Iterator[Action]:
        """Waiting actions in admission order: lanes merged by class (with aging) and fair share,
        and on a sandbox pool short actions first (``is_short``): among the first
        ``short_lookahead``, a longer action that has waited less than ``aging_s`` goes behind the
        short ones. Why: with exclusive cores, a tool call of half a second waited in FCFS order
        for the cores a test of a minute was given, where ``static``'s shared cores serve it at
        once; on saturated pools that wait was most of the mean. Measured on two sets of 68 swept
        variants (docs/scheduler.md): targets met 54 / 59 -> 57 / 59, p99 misses 2 / 1 -> 0 / 0.
        A longer action is passed by short ones for at most ``aging_s``, then keeps its place."""
        base = self._lane_order(pool, now)
        if self.short_s <= 0 or self._pinning(self.pools[pool]) is None:
            yield from base
            return
        behind: list[Action] = []
        for n, action in enumerate(base):
            if n >= self.short_lookahead:
                yield from behind
                yield action
                yield from base
                return
            if self.is_short(action) or now - action.arrival >= self.aging_s:
                yield action
            else:
                behind.append(action)
        yield from behind

    def _lane_order(self, pool: str, now: float) -> Iterator[Action]:
        """Waiting actions in lane order: lanes merged by class (with aging) and fair share."""
        lanes = self.queue.lanes(pool)
        if len(lanes) == 1:
            yield from next(iter(lanes.values()))
            return
        vt = dict(self.vtime.get(pool, {}))
        iters: dict[Lane, Iterator[Action]] = {key: iter(lane) for key, lane in lanes.items()}
        heads: dict[Lane, Action] = {key: lane[0] for key, lane in lanes.items()}
        for key in heads:
            next(iters[key])
        while heads:
            key = min(heads, key=lambda k: self._rank(heads[k], vt, now))
            action = heads[key]
            yield action
            vt[action.tenant] = vt.get(action.tenant, 0.0) + action.min_units / self._weight(action.tenant)
            nxt = next(iters[key], None)
            if nxt is None:
                del heads[key]
            else:
                heads[key] = nxt

    def _rank(self, action: Action, vt: dict[str, float], now: float) -> tuple[int, float, int]:
        cls = 0 if now - action.arrival >= self.aging_s else action.priority
        return cls, vt.get(action.tenant, 0.0), action.seq

    # ---- decision --------------------------------------------------------------------------------
    def _pinning(self, mgr: PoolManager) -> Pinning | None:
        known = self._pins.get(mgr.pool)
        if known is None:
            known = self._pins[mgr.pool] = isinstance(mgr, Pinning)
        return cast(Pinning, mgr) if known else None

    def _arrange(
        self, mgr: PoolManager, admitted: Sequence[Action], longer: _Arranged | None = None
    ) -> _Arranged | None:
        """Units per admitted action, summed duration, the scratch, and whether any elastic action
        was left short of its maximum (capacity binding).

        ``longer``: the arrangement of candidates of which ``admitted`` is a prefix (the eviction
        search). On a pinning pool its scratch serves the prefix as it is (every candidate of the
        prefix took the same host there, the holds before it being the same; placing reads only
        that), and a host whose candidates are all kept is not arranged again. Each trial made a
        new scratch and arranged every host: at 1,280 cores, 30 candidates and 4 trials, a third
        of a decision. Same result: a host's partition holds the units free before any candidate
        took some, whichever of them are kept."""
        pinning = self._pinning(mgr)
        if longer is not None and pinning is not None:
            scratch = longer.scratch
            keep = {id(a) for a in admitted}
            parts: list[tuple[Partition, _Part | None]] = []
            for part, arranged in longer.parts:
                acts = [a for a in part.actions if id(a) in keep]
                if len(acts) == len(part.actions):
                    parts.append((part, arranged))
                elif acts:
                    parts.append((Partition(part.operator, acts, part.free_units, part.countable), None))
        else:
            scratch = mgr.scratch()
            holds = iter(self._holds)
            hold = next(holds, None)
            for i, a in enumerate(admitted):
                while pinning is not None and hold is not None and hold[0] <= i:
                    pinning.hold(scratch, hold[1])
                    hold = next(holds, None)
                if not scratch.try_take(a, a.min_units):
                    return None
            parts = [(part, None) for part in scratch.partitions(admitted)]
        units_of: dict[int, int] = {}
        total = 0.0
        binding = False
        out: list[tuple[Partition, _Part]] = []
        for part, kept in parts:
            done = kept if kept is not None else self._arrange_part(part)
            if done is None:
                return None
            terms, units, short = done
            for t in terms:  # added one by one, as the trial's own arrangement adds them
                total += t
            for a, k in zip(part.actions, units, strict=True):
                units_of[id(a)] = k
                if a.elastic and k < a.feasible[-1] and short:
                    binding = True
            out.append((part, done))
        return _Arranged(total, [units_of[id(a)] for a in admitted], scratch, binding, out)

    def _arrange_part(self, part: Partition) -> _Part | None:
        """One partition's arrangement: the durations it sums, in the order it sums them, the
        units of its actions, and whether an elastic one below its maximum is so for want of
        units (not stopped by its price)."""
        elastic = [a for a in part.actions if a.elastic]
        if part.countable and all(is_contiguous(a.feasible) and a.model.convex for a in elastic):
            fixed = [a for a in part.actions if not a.elastic]
            terms = [a.model.duration(a.min_units) for a in fixed]
            free = part.free_units - sum(a.min_units for a in fixed)
            res = greedy_arrange(elastic, free, self._hold_cost) if elastic else (0.0, [])
            if res is None:
                return None
            of = {id(a): k for a, k in zip(elastic, res[1], strict=True)}
            units = [of[id(a)] if a.elastic else a.min_units for a in part.actions]
            # Units left over: an action below its maximum stopped by its price, not for want.
            return [*terms, res[0]], units, sum(res[1]) >= free
        dp = dp_arrange(part.actions, part.operator)
        if dp is None:
            return None
        return [dp[0]], dp[1], True

    def _running_heap(self, mgr: PoolManager, need: int, now: float) -> UnitHeap:
        """The earliest-freeing running grants holding at least ``need`` units (a bounded view).
        The grants are put in order once per decision (``_by_end``) and only as far as the
        largest ``need`` asked for: the eviction search asks up to ``max_evict + 1`` times, and
        heapifying every running grant of a 1,280-core pool each time was a tenth of a decision."""
        if self._by_end is None:
            entries = list(self._running_by_pool.get(mgr.pool, {}).values())
            heapq.heapify(entries)
            self._by_end = ([], 0, entries)
        ordered, got, entries = self._by_end
        while entries and got < need:
            t, u = heapq.heappop(entries)
            ordered.append((t, u))
            got += u
        self._by_end = (ordered, got, entries)
        out: UnitHeap = []
        got = 0
        for t, u in ordered:
            if got >= need:
                break
            out.append((max(t, now), u))
            got += u
        return out

    def _decide(self, now: float) -> list[Grant]:
        grants: list[Grant] = []
        for pool in self.queue.pools():
            grants += self._decide_pool(self.pools[pool], pool, now)
        for g in grants:
            self._left_waiting(g.action)
            svc = g.action.service
            if svc is not None:
                self._pay_rent(svc, g, now)
            self._track(g)
            vt = self.vtime.setdefault(g.action.pool, {})
            vt[g.action.tenant] = vt.get(g.action.tenant, 0.0) + g.units / self._weight(g.action.tenant)
        return grants

    def _defers(self, action: Action, pool: str, host: str, free: int, now: float) -> float | None:
        """When waiting for units its host releases soon costs less than starting now on the
        ``free`` units there, the time ``action`` waits for (else None): an elastic test given
        the one core left would hold it for minutes, where the cores of a run ending in seconds
        finish it in seconds. The cost is its own completion plus the queue's: each unit-second
        held (the wider grant's, and the free units left idle while it waits, as a backfill may
        not use them) delays the waiting actions, at the arrangement's price (``_defer_hold``).
        Counting only its own completion, a test on a saturated host waited for wide grants
        while the cores it held idle were what the queue behind it lacked: tangram's mean lost
        to static's on 3-5 of 12 small saturated swe variants per seed (now 1-4). The host is then
        held for it (its free units and those released), and it never waits in all longer than
        starting now would take (ski rental: at most twice the better choice). A grant running
        past its estimate is not counted on."""
        top = action.feasible[-1]
        if free < action.min_units or free >= top:
            return None
        now_s = action.model.duration(free)
        if now - action.arrival >= now_s:
            return None
        releases = self._releases.get(host)
        if releases is None:
            entries = self._running_by_host.get((pool, host), {}).values()
            releases = self._releases[host] = sorted(entries)
        h = self._defer_hold
        now_cost = now_s + h * free * now_s
        got = free
        for end, units in releases:
            if end < now:
                continue  # running past its estimate: when it ends is not known
            wait = end - now
            if wait >= now_s:
                break
            got += units
            k = min(top, got)
            d = action.model.duration(k)
            if wait + d + h * (k * d + free * wait) < now_cost:
                self.deferred.add(id(action))
                return now + wait
            if got >= top:
                break
        return None

    def _close(
        self,
        pinning: Pinning,
        prefix: Scratch,
        full: set[str],
        held: set[str],
        hosts: Iterable[str],
        taken: int,
    ) -> None:
        """Hosts an earlier action waits on: later actions pinned there wait too (``full``), and no
        new session is pinned there (held in ``prefix`` and, after ``taken`` candidates, in the
        arrangement that replays this scan)."""
        full.update(hosts)
        for h in full - held:
            pinning.hold(prefix, h)
            self._holds.append((taken, h))
        held |= full

    def _lookahead(
        self, pinning: Pinning, full: set[str], no_backfill: set[str], unpinned_waits: bool, rest: int
    ) -> int:
        """After a host closed: -1 while some host can still start a later action, else how many
        more actions the scan looks at. With every host closed only a backfill can start (on a
        host held for a deferred action, by an action that ends before the units it waits for
        come back): with none of those, nothing (0, exact); with one, at most ``backfill_window``
        more (bounded, as candidates are). Every action pinned on arrival (``_pin_session``), a scan
        that went on to the end made a decision O(queue): 13 ms p99 at 10,000 queued."""
        if rest < 0:
            every_host = len(full) >= pinning.hosts_total()
            if not (every_host or (unpinned_waits and len(full) >= pinning.hosts_open())):
                return -1
            rest = self.backfill_window
        return rest if any(h not in no_backfill for h in self.backfill_until) else 0

    def _decide_pool(self, mgr: PoolManager, pool: str, now: float) -> list[Grant]:
        resident = self._resident.get(pool)
        if resident is None:
            resident = self._resident[pool] = self.restore_aware and isinstance(mgr, ResidencyPlanner)
        if resident:
            return self._decide_residency(mgr, pool, now)
        order = self._order(pool, now)
        # The price of a unit-second held, as the arrangement prices it (``_hold_cost``): every
        # waiting action starts later by the unit-seconds placed ahead of it over the pool's units.
        # Only actions that wait for units price them: a new session waiting for memory
        # (``_memory_waiting``) gains from its host's sessions ending sooner, not from idle cores.
        want_units = max(0, self.queue.waiting(pool) - self._memory_waiting(pool))
        self._defer_hold = want_units / max(1, mgr.total_units())
        self.deferred = set()
        self.backfill_until = {}
        self._releases = {}
        self._by_end = None
        self._holds = []
        held: set[str] = set()
        prefix = mgr.scratch()
        cands: list[Action] = []
        blocked: list[Action] = []
        pinning = self._pinning(mgr)
        full: set[str] = set()  # hosts whose FCFS head cannot start: their later actions wait too
        unpinned_waits = False  # an unpinned action cannot start: later unpinned ones wait too
        no_backfill: set[str] = set()  # hosts an unpinned action waits on as well
        # Once every host is closed, nothing later can start but a backfill; -1 until then, else
        # how many more actions the scan looks at (``_lookahead``).
        rest = -1
        for action in order:
            if len(cands) >= self.window or rest == 0:
                blocked.append(action)
                break
            rest -= rest > 0
            # The session's host as this decision stands: one started by an earlier candidate
            # counts, or a later action of that session could take the cores an earlier one awaits.
            host = None if pinning is None else pinning.pinned_host(action, prefix)
            if host is not None and host in full:
                # Backfill: on a host held for a deferred action, a later one may start if it is
                # expected to end before the units the deferred one waits for come back.
                until = None if host in no_backfill else self.backfill_until.get(host)
                fits_before = until is not None and now + action.model.duration(action.min_units) <= until
                if fits_before and prefix.try_take(action, action.min_units):
                    cands.append(action)
                continue
            if host is not None and action.elastic and pinning is not None:
                until = self._defers(action, pool, host, pinning.host_free(prefix, host), now)
                if until is not None:
                    # It waits for its host's cores now and those released soon: later actions
                    # there wait too (or backfill), as behind any head that waits.
                    self.backfill_until[host] = until
                    self._close(pinning, prefix, full, held, [host], len(cands))
                    rest = self._lookahead(pinning, full, no_backfill, unpinned_waits, rest)
                    continue
            if host is None and unpinned_waits:
                # New sessions start in order. This one waits behind the earlier one and closes
                # no host of its own: those hosts' sessions must go on to free the memory the
                # earlier one waits for (closing them deadlocks the pool).
                continue
            if prefix.try_take(action, action.min_units):
                cands.append(action)
                continue
            if not blocked:
                blocked.append(action)
            if pinning is None:
                break
            # A pinned action waits for cores of its own host only, and an unpinned one for cores
            # of a host with memory for its session: actions pinned elsewhere do not compete with
            # it, so FCFS holds per host and the scan goes on.
            if host is None:
                unpinned_waits = True
                hosts = pinning.session_hosts(action)
                no_backfill.update(hosts)  # it waits for those cores too: no later backfill there
                self._close(pinning, prefix, full, held, hosts, len(cands))
            else:
                self._close(pinning, prefix, full, held, [host], len(cands))
            rest = self._lookahead(pinning, full, no_backfill, unpinned_waits, rest)
            if rest == 0:
                break
        if not cands:
            return []
        if not any(a.elastic for a in cands):
            return self._commit(mgr, [(a, a.min_units) for a in cands], now, prefix)
        # Widening an action delays the queue behind it: each action waiting beyond the
        # candidates starts later by the unit-seconds placed ahead of it over the pool's units
        # (list scheduling), which prices a unit-second of holding. (Pricing the arrivals while it
        # runs as well made ai-coding's p99 8.2 s against 6.8 s, swe's 87 s against 77 s.)
        # (Memory waiters are left out as above; a candidate that was one is counted in neither.)
        memory_waiters = self._mem_waiting.get(pool, {})
        fresh = sum(id(a) in memory_waiters for a in cands)
        self._hold_cost = max(0, want_units - (len(cands) - fresh)) / max(1, mgr.total_units())
        arranged = self._arrange(mgr, cands)
        if arranged is None:
            return self._commit(mgr, [(a, a.min_units) for a in cands], now, prefix)
        total, units, scratch, binding = arranged.total, arranged.units, arranged.scratch, arranged.binding
        keep = len(cands)
        if binding and self.max_evict > 0:
            # The bounded waiting window, without the new sessions that wait for memory: the
            # estimate would start them on the units an eviction frees, which they cannot use
            # (a test was kept from starting at all behind thirty of them).
            blocked = [a for a in blocked if self._wants_units(pinning, a)]
            for n, action in enumerate(order):  # the rest of the window, looked at boundedly
                if len(blocked) >= self.wait_window or n >= 4 * self.wait_window:
                    break
                if self._wants_units(pinning, action):
                    blocked.append(action)
            best = total + self._waiting_cost(mgr, cands, units, blocked, now)
            # Admitting nothing is an option only while something runs in the pool: with the pool
            # idle no completion would come to wake the decision again (the estimate's optimism,
            # e.g. a test sized for more cores than its host has, must not stall the pool).
            most = len(cands) if self._running_by_pool.get(pool) else len(cands) - 1
            for t in range(1, min(self.max_evict, most) + 1):
                trial = self._arrange(mgr, cands[:-t], arranged)
                if trial is None:
                    break
                waiting = cands[-t:] + blocked
                obj = trial.total + self._waiting_cost(mgr, cands[:-t], trial.units, waiting, now)
                if obj >= best:
                    break
                best, units, scratch, keep = obj, trial.units, trial.scratch, len(cands) - t
        return self._commit(mgr, list(zip(cands[:keep], units, strict=True)), now, scratch)

    def _pay_rent(self, svc: str, grant: Grant, now: float) -> None:
        """Count what ``grant``'s action paid for want of another copy of ``svc``: its wait, less
        the part of it before no other copy could be had (``_no_copy``): before the service's
        last restore ended (a second restore started then would not have been ready sooner: the
        requests that arrive while a cold service loads wait for it whatever the policy), or
        while no block was free for one. A restore starts the count again."""
        if grant.restore_s > 0:
            self._svc_rent[svc] = (0.0, now + grant.restore_s)
            return
        rent, since = self._svc_rent.get(svc, (0.0, 0.0))
        self._svc_rent[svc] = (rent + max(0.0, now - max(grant.action.arrival, since)), since)

    def _no_copy(self, svc: str, now: float) -> None:
        """No new copy of ``svc`` could be had at ``now``: waits until now buy none."""
        rent, since = self._svc_rent.get(svc, (0.0, 0.0))
        self._svc_rent[svc] = (rent, max(since, now))

    def heat(self, pool: str, now: float) -> dict[str, float]:
        """Expected demand of each service, 0..1: 1 while it runs or waits, else decaying with the
        time since its last arrival over three smoothed gaps between its arrivals (a service whose
        requests stopped cools within seconds; one arriving steadily stays near 1)."""
        out = {
            svc: math.exp(-(now - last) / max(3.0 * gap, 1e-6))
            for svc, (last, gap) in self._svc_arrivals.items()
        }
        for g in self.running.values():
            if g.action.pool == pool and g.action.service is not None:
                out[g.action.service] = 1.0
        return out

    def _decide_residency(self, mgr: PoolManager, pool: str, now: float) -> list[Grant]:
        """GPU pools: each action in admission order takes the option (TP size and block) with the
        earliest expected completion, counting the restore of a cold service and the restores its
        evictions will cost the evicted services' next requests. An action whose best option is a
        busy block that already holds its service waits for it (booking it, so that the next
        action of that service sees it later), but never longer in all than running now would
        take (ski rental: at most twice the better choice); and not once the service's requests
        have waited for busy copies as long, in all, as a new copy costs (``_pay_rent``), nor when
        the new copy would evict no other service's (only this request pays for a copy the later
        ones use; one at a time per service, not while another of its copies restores). An
        action with no option at all (too few free GPUs, its service nowhere resident) ends the
        admitted prefix, so a big action is not starved by small ones behind it."""
        busy_until: dict[tuple[str, int], float] = {}
        for g in self.running.values():
            if g.action.pool == pool:
                for u in g.unit_ids:
                    busy_until[(g.host, u)] = g.est_end
        # A service's waiting requests raise what evicting its copy costs (and put it last among
        # the victims): they lose that copy, not only its next request. Priced by heat alone,
        # five services always busy on five nodes evicted each other's copies about 2,000 times
        # in 4,400 requests (mean 288 s, static's dedicated replicas 6.2 s); now 4.2 s.
        heat = self.heat(pool, now)
        for name, waiting in self._svc_waiting.items():
            if waiting > 0:
                heat[name] = heat.get(name, 1.0) * (1 + waiting)
        plan = cast(ResidencyPlanner, mgr).residency_plan(now, heat, busy_until)
        chosen: list[tuple[Action, int]] = []
        restored: set[str] = set()  # services a copy is restored for in this decision

        waiting = self.queue.waiting(pool)
        units = max(1, mgr.total_units())
        per_unit = 1.0 / units
        same = dict(self._svc_waiting)
        queued = 0
        same_behind = 0
        gap = math.inf  # the service's smoothed gap between arrivals

        def cost(action: Action, o: PlacementOption) -> float:
            # Own completion, plus what the choice costs the actions waiting behind it: in list
            # scheduling each starts later by the unit-seconds placed ahead of it over the pool's
            # units (the paper's objective counts them the same way). A restore's unit-seconds
            # are shared by the backlog of its service, which the restored copy will serve.
            d = action.model.duration(o.units)
            own = max(0.0, o.ready_at - now) + o.restore_s + d + o.penalty_s
            work = o.units * (d + o.restore_s / (1 + same_behind))
            # A copy's TP size is sticky: the service's backlog will be served by the copies this
            # choice makes or keeps (another size costs a restore). While its arrivals bring more
            # GPU-seconds per second at this size than the pool has, that backlog only grows, and
            # a wide copy's lost efficiency is paid again by each of its actions. Counted on this
            # action alone, a TP-4 copy made while deepsearch's judge pool was idle was kept
            # through a growing backlog (58 actions at TP-4, fcfs-min's mean lower). A backlog
            # that drains is better served by the fast copy than by restoring narrow ones.
            waste = 0.0
            if o.units * d >= units * gap:
                k0 = action.min_units
                waste = max(0.0, o.units * d - k0 * action.model.duration(k0))
            # Only a backlog beyond what the pool runs at once competes for these units.
            behind = max(0, queued - units)
            return own + behind * (work + same_behind * waste) * per_unit

        for n, action in enumerate(self._order(pool, now)):
            if n >= self.window:
                break
            if not plan.has_free():
                for name, count in self._svc_waiting.items():
                    if count > 0:
                        self._no_copy(name, now)  # every GPU busy: no copy could be had now
                break
            queued = max(0, waiting - n - 1)
            if action.service is not None:
                same[action.service] -= 1
                same_behind = same[action.service]
                gap = self._svc_arrivals[action.service][1]
            else:
                same_behind = 0
                gap = math.inf
            opts = plan.options(action)
            if not opts:
                break
            best = min(opts, key=lambda o: cost(action, o))
            ready = [o for o in opts if o.ready_at <= now]
            best_now = min(ready, key=lambda o: cost(action, o)) if ready else None
            # Ski rental across requests as well as within one. Waiting for a busy copy is cheaper
            # than a restore for each request alone, so a busy service kept one copy and queued
            # behind it while GPUs sat free (swept reward-gpu variants: mean 1.27 s against
            # paper's 1.03 s; 0.74 s against 0.54 s). Once the waits its requests paid since its
            # last restore (the rent, ``_pay_rent``) add up to what a new copy costs this request
            # more than waiting, the copy is made, and the count starts again.
            # The rent buys one copy: a restore earlier in this decision has spent it (three
            # requests waiting together each restored a copy of a 70B service at once).
            # A copy that evicts no other service's copy displaces no one: its only price is this
            # request's extra wait, and it stays to serve the service's later requests. The rent
            # is for copies that cost others; this one is bought at the first wait, as ``paper``
            # does. Once GPU memory is pre-warmed, ``paper`` led tangram by up to 15% on swept
            # variants with one or two bursty services on roomy pools (the copy came only after
            # about a restore's worth of waits); now they tie or tangram leads. Not while a copy
            # of the service is still being restored: requests arriving 50 ms apart each restored
            # one (five 7 s copies on 20 GPUs, a review found), where the warm copy was free in
            # 0.6 s.
            svc = action.service
            fresh = svc is not None and svc not in restored
            rent, since = self._svc_rent.get(svc, (0.0, 0.0)) if svc is not None and fresh else (0.0, now)
            buy = (
                best_now is not None
                and best_now.restore_s > 0
                and (
                    rent >= cost(action, best_now) - cost(action, best)
                    or (fresh and not best_now.displaces and since <= now)
                )
            )
            if best_now is None and svc is not None:
                self._no_copy(svc, now)
            if (
                best.ready_at > now
                and not buy
                and (best_now is None or now - action.arrival < cost(action, best_now))
            ):
                plan.take(action, best, best.ready_at + action.model.duration(best.units))
                continue
            assert best_now is not None
            plan.take(action, best_now, now + best_now.restore_s + action.model.duration(best_now.units))
            if best_now.restore_s > 0 and svc is not None:
                restored.add(svc)
            chosen.append((action, best_now.units))
        return self._commit(mgr, chosen, now, plan)

    def _waiting_cost(
        self,
        mgr: PoolManager,
        admitted: Sequence[Action],
        units: Sequence[int],
        waiting: Sequence[Action],
        now: float,
    ) -> float:
        need = sum(a.min_units for a in waiting) + max((a.feasible[-1] for a in waiting), default=0)
        heap = self._running_heap(mgr, need, now)
        used = 0
        for a, k in zip(admitted, units, strict=True):
            heap.append((now + a.model.duration(k), k))
            used += k
        left = mgr.free_units() - used
        if left > 0:
            heap.append((now, left))
        # The heap is the pool's: a pinned action cannot gather more units than one host has.
        host_cap = getattr(mgr, "max_host_cores", None)
        top = host_cap() if callable(host_cap) else mgr.total_units()
        cost = list_schedule(
            heap, waiting, now, self.depth, total_units=mgr.total_units(), branch=lambda a: _ladder(a, top)
        )
        return cost if math.isfinite(cost) else 1e18


def _ladder(action: Action, top: int) -> list[int]:
    """The allocations the first waiting action tries in the estimate: its minimum, powers of two
    and its largest that one host can give (a handful instead of every count; durations are smooth
    in m)."""
    feas = [k for k in action.feasible if k <= top] or [action.feasible[0]]
    out = [k for k in feas if k == feas[0] or k == feas[-1] or k & (k - 1) == 0]
    return out
