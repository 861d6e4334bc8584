"""Scheduler policies on real managers: invariants under a fixed sweep of random event sequences, and
the behaviours users notice (elastic DoP, fair share, priorities, GPU residency)."""

from __future__ import annotations

import functools
import math
import random

import pytest

from arl_tangram.core.action import Action, Amdahl, EfficiencyCurve, Fixed, feasible_range
from arl_tangram.core.policies.paper import FcfsMinPolicy, PaperPolicy
from arl_tangram.core.policies.registry import POLICIES
from arl_tangram.core.policies.tangram import TangramPolicy
from arl_tangram.core.pool import Grant
from arl_tangram.core.scheduler import Scheduler
from arl_tangram.errors import CapacityExceeded, InvalidSpec
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.managers.gpu import GpuManager, GpuNode

POOLED = ["fcfs-min", "paper", "tangram"]


def cpu_pool(hosts: int = 2, cores: int = 8, memory: float = 64.0) -> CpuManager:
    numa = 2 if cores % 2 == 0 else 1
    return CpuManager([SandboxHost.uniform(f"h{i}", cores, numa, memory) for i in range(hosts)])


def make(policy: str, mgr: CpuManager) -> Scheduler:
    return POLICIES[policy]({"cpu": mgr})


# Sessions of 2 GiB. On hosts of 10 GiB (odd seeds) ten of the twelve trajectories fit, so new
# sessions wait for memory while pinned ones go on; on 64 GiB (even seeds) only cores bind. One
# size: which waiting session closes hosts to the others does not change which hosts close
# (sessions of mixed sizes are in test_no_deadlock.py).
SESSION_GIB = 2.0
HOST_GIB = (64.0, 10.0)


def random_action(rng: random.Random, i: int, tenants: int, classes: int) -> Action:
    n = rng.randrange(12)
    if rng.random() < 0.4:
        lo = rng.randint(1, 3)
        feas = feasible_range(lo, lo + rng.randint(0, 8))
        model: Amdahl | Fixed = Amdahl(rng.uniform(0.5, 10.0), rng.uniform(0.5, 0.99))
    else:
        feas, model = (rng.randint(1, 2),), Fixed(rng.uniform(0.1, 2.0))
    return Action(
        f"a{i}",
        f"t{n}",
        "cpu",
        feas,
        model,
        memory_gib=SESSION_GIB,
        tenant=f"n{rng.randrange(tenants)}",
        priority=rng.randrange(classes),
    )


def check_invariants(
    sched: Scheduler,
    mgr: CpuManager,
    admitted: list[Grant],
    lane_fifo: bool,
    before: tuple[dict[str, str], dict[str, float]] | None = None,
    now: float = 0.0,
) -> None:
    """No core granted twice or leaked, memory within each host, and FCFS. Without ``before``,
    FCFS is global (``fcfs-min``, ``paper``). With ``before`` (pins and free session memory per
    host as the decision began), it is exactly ``tangram``'s promise, per lane: a waiting action
    whose session is on a host (pinned before, or by an action admitted in this decision) holds
    back every later action on that host except one that backfills (expected to end before the
    units a deferred action there waits for return); one without a session holds back every later
    new session and every later action on a host that had memory for its session. Short first:
    a short action (``is_short``) may pass a longer one that has waited less than ``aging_s`` (the
    queues here stay within ``short_lookahead``)."""
    seen: dict[str, set[int]] = {}
    for g in sched.running.values():
        assert g.units in g.action.feasible
        assert len(g.unit_ids) == g.units
        cores = seen.setdefault(g.host, set())
        assert not cores & set(g.unit_ids), "a core granted twice"
        cores |= set(g.unit_ids)
        assert mgr.pins[g.action.trajectory] == g.host, "an action ran off its trajectory's host"
    for name, host in mgr.hosts.items():
        assert host.free_cores + len(seen.get(name, set())) == host.cores, "cores leaked or over-allocated"
        assert sum(host.pinned.values()) <= host.memory_gib + 1e-9
        assert host.memory_free == pytest.approx(host.memory_gib - sum(host.pinned.values()))
    waiting = list(sched.queue.fcfs("cpu"))
    for g in admitted:
        a = g.action
        for w in waiting:
            same = (w.priority, w.tenant) == (a.priority, a.tenant) if lane_fifo else True
            if same and isinstance(sched, TangramPolicy):
                same = not (sched.is_short(a) and not sched.is_short(w) and now - w.arrival < sched.aging_s)
            if same and before is not None:
                pins, mem = before
                host = mgr.pins.get(w.trajectory)
                if host is not None:
                    # Pinned elsewhere, it never competes for g's cores; on g's host, g may only
                    # backfill: end before the units a deferred action there waits for return.
                    until = getattr(sched, "backfill_until", {}).get(host)
                    same = host == g.host and not (until is not None and g.est_end <= until + 1e-9)
                else:
                    new_session = a.trajectory not in pins
                    same = new_session or mem[g.host] >= w.memory_gib - 1e-9
            assert not (same and w.seq < a.seq), f"FCFS violated: {a.id} admitted before earlier {w.id}"


def run_random_events(policy: str, seed: int) -> None:
    """Sixty random arrivals and completions on two 8-core hosts, invariants checked after every
    decision."""
    rng = random.Random(seed)
    mgr = cpu_pool(memory=HOST_GIB[seed % 2])
    sched = make(policy, mgr)
    tangram = policy == "tangram"
    now, i = 0.0, 0
    for _ in range(60):
        now += rng.uniform(0.0, 0.5)
        if sched.running and rng.random() < 0.45:
            sched.complete(rng.choice(list(sched.running.values())), now)
        else:
            a = random_action(rng, i, tenants=3 if tangram else 1, classes=2 if tangram else 1)
            i += 1
            sched.submit(a, now)
        before = (dict(mgr.pins), {h.name: h.memory_free for h in mgr.hosts.values()})
        admitted = sched.schedule(now)
        check_invariants(sched, mgr, admitted, lane_fifo=tangram, before=before if tangram else None, now=now)


# A fixed sweep, not sampled examples: the same seeds on every run (CI cannot go red by chance),
# and enough of them that a bug showing in 1 seed of 250 shows here about 8 times (the per-host
# FCFS bug this sweep was sized on failed 1 seed in 250).
SEEDS = range(2000)


@pytest.mark.parametrize("policy", POOLED)
def test_random_events_never_overallocate_and_keep_fcfs(policy: str) -> None:
    failed: list[tuple[int, str]] = []
    for seed in SEEDS:
        try:
            run_random_events(policy, seed)
        except AssertionError as e:
            failed.append((seed, str(e).splitlines()[0]))
    assert not failed, f"{len(failed)} of {len(SEEDS)} seeds fail, first ones: {failed[:5]}"


def test_fcfs_min_gives_minimum_and_paper_gives_elastic_units() -> None:
    test = Action("t", "tr", "cpu", feasible_range(1, 8), Amdahl(10.0, 0.95))
    for cls, expected in ((FcfsMinPolicy, 1), (PaperPolicy, 8)):
        sched = cls({"cpu": cpu_pool(1, 8)})
        sched.submit(Action("t", "tr", "cpu", test.feasible, test.model), 0.0)
        (g,) = sched.schedule(0.0)
        assert g.units == expected


def test_tangram_matches_paper_allocation_on_a_contended_host() -> None:
    mk = lambda i, p: Action(f"a{i}", f"tr{i}", "cpu", feasible_range(1, 16), Amdahl(5.0 + i, p))  # noqa: E731
    results = []
    for cls in (PaperPolicy, TangramPolicy):
        sched = cls({"cpu": cpu_pool(1, 16)})
        for i, p in enumerate((0.99, 0.9, 0.6)):
            sched.submit(mk(i, p), 0.0)
        results.append(sorted((g.action.id, g.units) for g in sched.schedule(0.0)))
    assert results[0] == results[1]
    assert sum(u for _, u in results[1]) == 16


def test_trajectory_is_pinned_where_its_memory_fits_and_load_is_lowest() -> None:
    mgr = CpuManager([SandboxHost.uniform("small", 8, 1, 1.0), SandboxHost.uniform("big", 4, 1, 64.0)])
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("a", "tr", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 0.0)
    (g,) = sched.schedule(0.0)
    assert g.host == "big"  # "small" has more free cores but not the trajectory's memory
    sched.complete(g, 1.0)
    sched.submit(Action("b", "tr", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)
    (g2,) = sched.schedule(1.0)
    assert g2.host == "big"


def test_tenant_flood_does_not_starve_another_tenant() -> None:
    mgr = cpu_pool(1, 4)
    sched = TangramPolicy({"cpu": mgr})
    for i in range(200):
        sched.submit(Action(f"A{i}", f"A{i % 7}", "cpu", (1,), Fixed(1.0), tenant="A"), 0.0)
    for i in range(5):
        sched.submit(Action(f"B{i}", f"B{i}", "cpu", (1,), Fixed(1.0), tenant="B"), 0.001)
    order: list[str] = []
    now = 0.0
    order += [g.action.tenant for g in sched.schedule(now)]
    while sched.queue.waiting("cpu") > 180:
        now += 1.0
        g = next(iter(sched.running.values()))
        sched.complete(g, now)
        order += [x.action.tenant for x in sched.schedule(now)]
    # Equal weights: B's five actions all start within the first dozen admissions, not after 200 A's.
    assert order[:12].count("B") == 5


def test_weights_share_the_pool_in_proportion() -> None:
    mgr = cpu_pool(1, 2)
    sched = TangramPolicy({"cpu": mgr}, tenant_weights={"A": 3.0, "B": 1.0})
    for i in range(100):
        sched.submit(Action(f"A{i}", "ta", "cpu", (1,), Fixed(1.0), tenant="A"), 0.0)
        sched.submit(Action(f"B{i}", "tb", "cpu", (1,), Fixed(1.0), tenant="B"), 0.0)
    order = [g.action.tenant for g in sched.schedule(0.0)]
    now = 0.0
    while len(order) < 80:
        now += 1.0
        sched.complete(next(iter(sched.running.values())), now)
        order += [g.action.tenant for g in sched.schedule(now)]
    assert 50 <= order[:80].count("A") <= 70


def test_priority_class_first_and_aging_prevents_starvation() -> None:
    mgr = cpu_pool(1, 1)
    sched = TangramPolicy({"cpu": mgr}, aging_s=10.0)
    sched.submit(Action("low", "tl", "cpu", (1,), Fixed(1.0), priority=1), 0.0)
    sched.submit(Action("hi0", "th", "cpu", (1,), Fixed(1.0), priority=0), 0.0)
    (g,) = sched.schedule(0.0)
    assert g.action.id == "hi0"
    now, started = 0.0, ""
    i = 1
    while not started:
        now += 1.0
        sched.submit(Action(f"hi{i}", "th", "cpu", (1,), Fixed(1.0), priority=0), now)
        i += 1
        sched.complete(next(iter(sched.running.values())), now)
        started = ",".join(x.action.id for x in sched.schedule(now) if x.action.id == "low")
    assert 10.0 <= now <= 12.0  # admitted once it had waited aging_s, despite the flood of class 0


def test_gpu_tangram_prefers_the_resident_tp_size() -> None:
    gpu = GpuManager([GpuNode("n0", 8)])
    curve = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7))
    sched = TangramPolicy({"gpu": gpu})
    first = Action("r0", "x", "gpu", (1, 2, 4, 8), EfficiencyCurve(1.0, curve), service="rm", service_gb=60.0)
    sched.submit(first, 0.0)
    (g,) = sched.schedule(0.0)
    assert g.restore_s > 0
    sched.complete(g, 5.0)
    sched.submit(
        Action("r1", "y", "gpu", (1, 2, 4, 8), EfficiencyCurve(1.0, curve), service="rm", service_gb=60.0),
        5.0,
    )
    (g2,) = sched.schedule(5.0)
    assert g2.units == g.units and g2.restore_s == 0.0


def test_submit_rejects_unknown_pools_and_impossible_actions() -> None:
    sched = TangramPolicy({"cpu": cpu_pool(1, 4)})
    with pytest.raises(InvalidSpec, match="no pool named 'gpu'"):
        sched.submit(Action("a", "t", "gpu", (1,), Fixed(1.0)), 0.0)
    with pytest.raises(CapacityExceeded):
        sched.submit(Action("b", "t", "cpu", (8,), Fixed(1.0)), 0.0)


@pytest.mark.parametrize("policy", POOLED)
def test_a_growing_pool_queues_what_no_host_holds_yet_and_grants_it_once_one_does(policy: str) -> None:
    """The operator's pools grow (its planner adds hosts for what waits, from none): an action no
    host can hold yet is refused only where the pool cannot grow; where it can, it waits in the
    policy's own queue through ``submit`` (counted like any other) and starts on the first host."""
    mgr = CpuManager([])
    sched = make(policy, mgr)
    first = Action("a0", "t", "cpu", (1, 2), Amdahl(4.0, 0.9), tenant="x")
    with pytest.raises(CapacityExceeded):
        sched.submit(first, 0.0)
    sched.submit(first, 0.0, growing=True)
    later = Action("a1", "u", "cpu", (1,), Fixed(1.0), tenant="y")
    sched.submit(later, 0.5, growing=True)
    assert sched.queued() == 2 and sched.schedule(1.0) == []
    mgr.add_host(SandboxHost.uniform("h0", 4, 2, 64.0))
    grants = sched.schedule(2.0)
    assert {g.action.id for g in grants} == {"a0", "a1"} and sched.queued() == 0
    assert all(g.host == "h0" and g.start == 2.0 for g in grants)
    for g in grants:
        sched.complete(g, 3.0)
    assert mgr.free_units() == 4


def _big(i: int, at: float = 0.0) -> Action:
    """A request of a 140 GB service on four GPUs (two chunks of a node of eight): 0.625 s warm,
    7 s to restore."""
    return Action(
        f"r{i}", f"t{i}", "gpu", (4,), EfficiencyCurve(2.0, ((4, 0.8),)), service="big", service_gb=140.0
    )


def _other_copy(gpu: GpuManager, beside: Grant) -> None:
    """Put a cold copy of another 140 GB service on the chunk ``beside``'s copy does not hold, so
    that a second copy of ``beside``'s service would evict it (and the rent decides)."""
    (ck,) = gpu.prewarm({"other": (140.0, (4,))})
    node = gpu.nodes[0]
    assert not set(node.members(ck[3], 4)) & set(beside.unit_ids)


def test_gpu_tangram_waits_for_a_warm_chunk_rather_than_evicting_for_a_big_model() -> None:
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    (first,) = sched.schedule(0.0)
    assert first.restore_s == pytest.approx(7.0)
    _other_copy(gpu, first)
    sched.complete(first, 7.7)  # now resident on its chunk
    sched.submit(_big(1), 8.0)
    (warm,) = sched.schedule(8.0)
    assert warm.restore_s == 0.0
    sched.submit(_big(2), 8.1)
    assert sched.schedule(8.1) == []  # the other chunk holds another service: 7 s vs 0.6 s of wait
    sched.complete(warm, 8.6)
    (again,) = sched.schedule(8.6)
    assert again.restore_s == 0.0 and again.unit_ids == warm.unit_ids


def test_gpu_tangram_makes_a_copy_that_displaces_no_one_at_the_first_wait() -> None:
    """A copy on GPUs that hold no other service costs only the restoring request's extra wait,
    and then serves the service's later requests: it is made at the first wait, as ``paper``
    does. Before, it came only once about a restore's worth of waits had been paid (pre-warmed
    swept variants with one bursty service on a roomy pool: mean 1.117 s against paper's 0.973 s)."""
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    (first,) = sched.schedule(0.0)
    sched.complete(first, 7.7)
    sched.submit(_big(1), 8.0)
    (warm,) = sched.schedule(8.0)
    sched.submit(_big(2), 8.1)
    (copy,) = sched.schedule(8.1)  # the other chunk is empty
    assert copy.restore_s == pytest.approx(7.0) and not set(copy.unit_ids) & set(warm.unit_ids)
    sched.complete(warm, 8.7)
    sched.complete(copy, copy.est_end)
    sched.submit(_big(3), 20.0)
    sched.submit(_big(4), 20.0)
    both = sched.schedule(20.0)
    assert len(both) == 2 and all(g.restore_s == 0.0 for g in both)


def test_gpu_tangram_makes_one_free_copy_at_a_time_for_requests_arriving_apart() -> None:
    """Requests 50 ms apart while the warm copy is busy: the first that waits restores a copy on
    the empty GPUs, and the ones after it wait for the warm copy (free in 0.6 s) rather than each
    restoring another 7 s copy while the first one loads."""
    gpu = GpuManager([GpuNode(f"n{i}", 8) for i in range(3)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    (first,) = sched.schedule(0.0)
    sched.complete(first, first.est_end)
    now = first.est_end + 1.0
    sched.submit(_big(1), now)
    (warm,) = sched.schedule(now)
    assert warm.restore_s == 0.0
    restores = []
    for i in range(2, 8):
        now += 0.05
        sched.submit(_big(i), now)
        restores += [g for g in sched.schedule(now) if g.restore_s > 0]
    assert len(restores) == 1, restores


def test_gpu_tangram_makes_a_second_copy_once_the_waits_for_the_busy_one_add_up() -> None:
    """Each request alone is better off waiting for the busy warm copy (well under a second) than
    restoring one (7 s), so a service kept busy used to queue behind its one copy for good while
    the other chunk sat free. Once the waits its requests paid add up to what a second copy costs
    more than waiting, the copy is made."""
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    (running,) = sched.schedule(0.0)
    _other_copy(gpu, running)  # a second copy evicts it: the rent decides
    warm_ids = running.unit_ids
    now, waited, i = running.est_end - 0.5, 0.0, 1
    copies: set[tuple[int, ...]] = {warm_ids}
    while len(copies) < 2 and i < 60:
        sched.submit(_big(i), now)  # arrives while the warm copy is busy
        got = sched.schedule(now)
        if got:
            copies |= {g.unit_ids for g in got}
            assert all(g.restore_s > 0 for g in got)
            break
        end = running.est_end
        sched.complete(running, end)
        (running,) = sched.schedule(end)
        assert running.unit_ids == warm_ids and running.restore_s == 0.0
        waited += end - now
        now, i = running.est_end - 0.5, i + 1
    assert len(copies) == 2, "the service never got a second copy"
    assert i > 2  # the first requests waited, as each alone should
    assert waited >= 6.0  # and the copy came once their waits added up to about its cost


def test_gpu_tangram_buys_one_copy_when_requests_waiting_together_cross_the_rent() -> None:
    """Requests come in threes every 2.5 s (a load one warm copy serves, with waits); four free
    chunks could take a copy each. The rent pays for one copy: requests waiting together in the
    decision that crosses it each restored one (three 7 s restores where one was wanted)."""
    gpu = GpuManager([GpuNode("n0", 8), GpuNode("n1", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    running = sched.schedule(0.0)
    i, arrive, restores = 1, running[0].est_end, [0]
    while sum(restores) < 2 and arrive < 120.0:
        end = min((g.est_end for g in running), default=math.inf)
        if arrive <= end:
            now = arrive
            for _ in range(3):
                sched.submit(_big(i), now)
                i += 1
            arrive += 2.5
        else:
            now = end
            done = next(g for g in running if g.est_end == end)
            running.remove(done)
            sched.complete(done, now)
        got = sched.schedule(now)
        running += got
        restores.append(sum(g.restore_s > 0 for g in got))
    assert sum(restores) >= 2, "the rent never bought a second copy"
    assert max(restores) == 1


def test_gpu_tangram_does_not_count_a_cold_load_as_want_of_a_second_copy() -> None:
    """Requests arriving while a cold service loads wait for that load whatever the policy: a
    second restore started then would not be ready sooner. Counted as waits for a busy copy, the
    7 s one such request waited made the next request restore a copy it was better off without."""
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    (cold,) = sched.schedule(0.0)
    assert cold.restore_s == pytest.approx(7.0)
    _other_copy(gpu, cold)  # a second copy evicts it: the rent decides
    sched.submit(_big(1), 1.0)
    assert sched.schedule(1.0) == []  # waits for the load under way (a second one ends later)
    sched.complete(cold, cold.est_end)
    (second,) = sched.schedule(cold.est_end)
    assert second.restore_s == 0.0 and second.unit_ids == cold.unit_ids
    # It waited 6.6 s, 0.6 s of them after the load ended; the next one is 0.8 s from the warm
    # copy, and a new copy would cost it 6.2 s more: the 6.6 s would buy one, the 0.6 s do not.
    sched.submit(_big(2), second.est_end - 0.8)
    assert sched.schedule(second.est_end - 0.8) == []


def test_gpu_tangram_counts_no_rent_while_no_copy_could_be_had() -> None:
    """Another service holds the other half of the node while a burst of ten is served one by
    one by the warm copy: no second copy was possible, so those waits buy none. Counted, they
    made a lone request long after restore a copy (7 s) half a second from the warm one,
    evicting the other service."""
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(_big(0), 0.0)
    sched.submit(Action("x", "tx", "gpu", (4,), Fixed(100.0), service="x", service_gb=140.0), 0.0)
    running = sched.schedule(0.0)
    assert len(running) == 2
    for i in range(1, 11):
        sched.submit(_big(i), 8.0)
    now = 0.0
    while sched.queue.waiting("gpu"):
        g = min((g for g in running if g.action.service == "big"), key=lambda g: g.est_end)
        running.remove(g)
        now = g.est_end
        sched.complete(g, now)
        got = sched.schedule(now)
        assert all(x.restore_s == 0.0 for x in got)
        running += got
    for g in running:
        sched.complete(g, 200.0)
    sched.submit(_big(90), 300.0)
    assert len(sched.schedule(300.0)) == 1  # takes the warm copy
    sched.submit(_big(91), 300.1)
    assert sched.schedule(300.1) == []  # waits half a second for the warm copy


def test_tangram_withdrawn_actions_leave_what_it_counts() -> None:
    """A cancelled request leaves the counts the policy prices with: its service's waiting
    requests (which raise what evicting the service costs) and the sessions waiting for memory."""
    gpu = GpuManager([GpuNode("n0", 8)])
    sched = TangramPolicy({"gpu": gpu})
    reqs = [_big(i) for i in range(5)]
    for a in reqs:
        sched.submit(a, 0.0)
    for a in reqs:
        sched.withdraw(a)
    assert sched.queue.waiting("gpu") == 0 and sched.heat("gpu", 0.0)["big"] <= 1.0
    assert sched._svc_waiting["big"] == 0
    mgr = cpu_pool(1, 8, memory=4.0)
    cpu = TangramPolicy({"cpu": mgr})
    cpu.submit(Action("a", "s0", "cpu", (1,), Fixed(9.0), memory_gib=4.0), 0.0)
    assert len(cpu.schedule(0.0)) == 1
    later = [Action(f"n{i}", f"n{i}", "cpu", (1,), Fixed(1.0), memory_gib=4.0) for i in range(3)]
    for a in later:
        cpu.submit(a, 1.0)
    assert cpu._memory_waiting("cpu") == 3
    cpu.withdraw(later[1])
    assert cpu._memory_waiting("cpu") == 2


def test_tangram_counts_sessions_waiting_for_memory_as_they_start_out_of_order() -> None:
    """Short new sessions start ahead of a longer earlier one (short first): each one that starts
    leaves the count of sessions waiting for memory, though the longer one still waits ahead of
    it in its lane (counted from the lane's front, the count stayed at 7 while 2 waited, and the
    price of a core-second went negative)."""
    mgr = cpu_pool(1, 8, memory=8.0)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("a0", "s0", "cpu", (1,), Fixed(1.0), memory_gib=4.0), 0.0)
    sched.submit(Action("b0", "s1", "cpu", (1,), Fixed(100.0), memory_gib=4.0), 0.0)
    running = {g.action.id: g for g in sched.schedule(0.0)}
    sched.submit(Action("A", "A", "cpu", (1,), Fixed(30.0), memory_gib=4.0), 0.5)
    for i in range(6):
        sched.submit(Action(f"B{i}", f"B{i}", "cpu", (1,), Fixed(1.0), memory_gib=4.0), 0.6)
    sched.complete(running["a0"], 1.0)
    mgr.end_trajectory("s0")
    now, started = 1.0, []
    for _ in range(5):
        got = sched.schedule(now)
        started += [g.action.id for g in got]
        assert sched._memory_waiting("cpu") == sched.queue.waiting("cpu")  # all of them wait for memory
        for g in got:
            now += 1.0
            sched.complete(g, now)
            mgr.end_trajectory(g.action.trajectory)
    assert started[:2] == ["B0", "B1"]  # the short ones went first


def test_gpu_tangram_evicts_the_copy_fewer_requests_wait_for() -> None:
    """Two nodes of four GPUs hold a copy each of A and C (160 GB: two never share a GPU). B
    arrives, then ten requests of A, then one of C; both copies come free at once. B takes C's
    node, not A's: evicting A costs its ten waiting requests their copy. Weighed by heat alone
    (A's last arrival a moment older than C's) B evicted A, and A's next request evicted C: busy
    services evicting each other was most of a swept variant's 288 s mean (static 6.2 s)."""
    gpu = GpuManager([GpuNode("n0", 4), GpuNode("n1", 4)])
    sched = TangramPolicy({"gpu": gpu})

    def req(svc: str, i: int) -> Action:
        return Action(
            f"{svc}{i}",
            f"t{svc}{i}",
            "gpu",
            (4,),
            EfficiencyCurve(2.0, ((4, 0.8),)),
            service=svc,
            service_gb=160.0,
        )

    sched.submit(req("A", 0), 0.0)
    sched.submit(req("C", 0), 0.0)
    cold = {g.action.service: g for g in sched.schedule(0.0)}
    assert {g.host for g in cold.values()} == {"n0", "n1"}
    for g in cold.values():
        sched.complete(g, 9.0)
    sched.submit(req("A", 1), 20.0)
    sched.submit(req("C", 1), 20.0)
    warm = sched.schedule(20.0)
    assert len(warm) == 2 and all(g.restore_s == 0.0 for g in warm)
    sched.submit(req("B", 0), 20.1)
    for i in range(2, 12):
        sched.submit(req("A", i), 20.2)
    sched.submit(req("C", 2), 20.5)
    assert sched.schedule(20.5) == []
    for g in warm:
        sched.complete(g, 21.0)
    got = {g.action.id: g for g in sched.schedule(21.0)}
    assert got["B0"].host == cold["C"].host and got["B0"].restore_s > 0
    assert got["A2"].host == cold["A"].host and got["A2"].restore_s == 0.0


def _judge(i: int, service_gb: float) -> Action:
    """A judge request elastic to 1, 2 or 4 GPUs (E(2) = 0.9, E(4) = 0.8), 2 s on one GPU."""
    curve = ((1, 1.0), (2, 0.9), (4, 0.8))
    return Action(
        f"j{i}",
        f"t{i}",
        "gpu",
        (1, 2, 4),
        EfficiencyCurve(2.0, curve),
        service="judge",
        service_gb=service_gb,
    )


def test_gpu_tangram_with_a_backlog_trades_a_fast_copy_for_throughput() -> None:
    gpu = GpuManager([GpuNode("n0", 4)])
    judge = functools.partial(_judge, service_gb=20.0)
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(judge(0), 0.0)
    (alone,) = sched.schedule(0.0)
    assert alone.units == 4  # nobody waits: the fastest copy, all four GPUs
    for i in range(1, 60):
        sched.submit(judge(i), 0.1)
    sched.complete(alone, 2.0)
    admitted = sched.schedule(2.0)
    # Sixty waiting: one GPU each serves them 1.6x faster in all (E(4) = 0.8) than the warm TP-4
    # copy would, which is worth its restores.
    assert [g.units for g in admitted] == [1, 1, 1, 1]


def test_gpu_tangram_splits_a_wide_copy_once_its_service_arrives_faster_than_it_serves() -> None:
    """A TP-4 copy made while the pool was idle, then 16 requests at once: at TP-4 they bring more
    GPU-seconds per second than the pool has, so every one of them would pay the copy's lost
    efficiency. Priced on the first action alone the warm copy won (kept through a backlog of 30)."""
    gpu = GpuManager([GpuNode("n0", 4)])
    judge = functools.partial(_judge, service_gb=64.0)
    sched = TangramPolicy({"gpu": gpu})
    sched.submit(judge(0), 0.0)
    (alone,) = sched.schedule(0.0)
    assert alone.units == 4
    for i in range(1, 17):
        sched.submit(judge(i), 0.1)
    sched.complete(alone, alone.est_end)
    assert [g.units for g in sched.schedule(alone.est_end)] == [1, 1, 1, 1]


def test_tangram_fcfs_is_per_pinned_host() -> None:
    mgr = cpu_pool(2, 4)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("a0", "ta", "cpu", (3,), Fixed(5.0), memory_gib=2.0), 0.0)
    sched.submit(Action("b0", "tb", "cpu", (3,), Fixed(5.0), memory_gib=2.0), 0.0)
    first = sched.schedule(0.0)
    assert {g.action.id: g.host for g in first} == {"a0": "h0", "b0": "h1"}
    sched.submit(Action("a1", "ta", "cpu", (4,), Fixed(1.0), memory_gib=2.0), 1.0)  # h0: 1 free
    sched.submit(Action("b1", "tb", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)
    sched.submit(Action("c0", "tc", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)  # a new session
    started = {g.action.id: g.host for g in sched.schedule(1.0)}
    # a1 waits for its own host; b1, pinned to h1, does not wait behind it; the new session does
    # not take h0's free core ahead of a1 (and h1 is full now), so it waits too.
    assert started == {"b1": "h1"}
    assert [a.id for a in sched.queue.fcfs("cpu")] == ["a1", "c0"]


def test_gpu_tangram_without_residency_arranges_chunks_by_the_dp() -> None:
    gpu = GpuManager([GpuNode("n0", 8)])
    curve = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.5))
    sched = TangramPolicy({"gpu": gpu}, restore_aware=False)
    for i in range(2):
        sched.submit(
            Action(f"r{i}", f"t{i}", "gpu", (1, 2, 4, 8), EfficiencyCurve(1.0, curve), service=f"s{i}"), 0.0
        )
    grants = sched.schedule(0.0)
    # Blind to residency, the DP gives each a 4-chunk: 1/3.2 s each, 0.625 s in all, against
    # 1/4 s + 2/4 s = 0.75 s for one after the other on all 8 GPUs.
    assert sorted(g.units for g in grants) == [4, 4]
    assert not set(grants[0].unit_ids) & set(grants[1].unit_ids)


def _two_busy_hosts() -> tuple[CpuManager, TangramPolicy]:
    """Two 8-core hosts with 4 and 3 cores free, held by sessions "f0" (on h0) and "f1" (on h1)."""
    mgr = cpu_pool(2, 8)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("fill0", "f0", "cpu", (4,), Fixed(100.0), memory_gib=2.0), 0.0)
    sched.submit(Action("fill1", "f1", "cpu", (5,), Fixed(100.0), memory_gib=2.0), 0.0)
    assert {g.action.id: g.host for g in sched.schedule(0.0)} == {"fill0": "h0", "fill1": "h1"}
    return mgr, sched


def test_tangram_a_session_started_in_this_decision_waits_behind_its_hosts_queue() -> None:
    mgr, sched = _two_busy_hosts()
    sched.submit(Action("x", "T", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)  # new: to h0
    sched.submit(Action("y", "f0", "cpu", (4,), Fixed(1.0), memory_gib=2.0), 1.0)  # h0 short of 4
    sched.submit(Action("z", "T", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)
    started = {g.action.id: g.host for g in sched.schedule(1.0)}
    # x's session is on h0 from this decision on: z, behind y in h0's queue, must not take h0's
    # cores ahead of y (it did when the host was read from the committed pins only).
    assert started == {"x": "h0"}
    assert [a.id for a in sched.queue.fcfs("cpu")] == ["y", "z"]
    assert mgr.hosts["h0"].free_cores == 3


def test_tangram_places_each_session_where_the_scan_saw_it() -> None:
    mgr, sched = _two_busy_hosts()
    sched.submit(Action("x", "T", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)  # new: to h0
    sched.submit(Action("y", "f0", "cpu", (4,), Fixed(1.0), memory_gib=2.0), 1.0)  # closes h0
    sched.submit(Action("w", "T", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 1.0)  # waits on h0
    sched.submit(Action("e", "f1", "cpu", feasible_range(1, 2), Amdahl(4.0, 0.9), memory_gib=2.0), 1.0)
    started = {g.action.id: g.host for g in sched.schedule(1.0)}
    # h0 closed to new sessions only after x took it: the elastic arrangement must not move x to
    # h1 (where e, behind w, would then run on the host w's session waits for).
    assert started == {"x": "h0", "e": "h1"}
    assert mgr.pins["T"] == "h0"


def test_tangram_waits_for_cores_released_soon_rather_than_starting_on_one_and_backfills() -> None:
    mgr = cpu_pool(1, 16)
    sched = TangramPolicy({"cpu": mgr}, short_s=0.0)  # in arrival order: the backfill alone decides
    sched.submit(Action("big", "tb", "cpu", (15,), Fixed(2.0), memory_gib=2.0), 0.0)
    sched.submit(Action("t0", "tt", "cpu", (1,), Fixed(0.1), memory_gib=2.0), 0.0)  # pins tt
    (big, first) = sched.schedule(0.0)
    sched.complete(first, 0.1)
    assert sched.schedule(0.1) == []
    test = Action("test", "tt", "cpu", feasible_range(1, 16), Amdahl(100.0, 0.99), memory_gib=2.0)
    sched.submit(test, 0.2)
    sched.submit(Action("quick", "tb", "cpu", (1,), Fixed(0.5), memory_gib=2.0), 0.2)
    sched.submit(Action("slow", "tb", "cpu", (1,), Fixed(5.0), memory_gib=2.0), 0.2)
    started = [g.action.id for g in sched.schedule(0.2)]
    # One core now: 100 s. The 15 cores back at 2 s: 1.8 s + 7.2 s on 16. The test waits, and of
    # the two behind it only the one expected to end by then takes the free core.
    assert started == ["quick"]
    assert sched.backfill_until == {"h0": pytest.approx(2.0)}
    sched.complete(big, 2.0)
    (g,) = [g for g in sched.schedule(2.0) if g.action.id == "test"]
    assert g.units >= 15


def test_tangram_starts_a_short_action_before_an_earlier_longer_one_until_that_one_has_aged() -> None:
    """Short first: on a full host the core freed goes to the tool call that arrived after a test,
    not to the test (FCFS made tool calls wait for minutes of tests); a test that waited
    ``aging_s`` keeps its place; beyond ``short_lookahead`` waiting actions the order is FCFS."""

    def first_started(aging_s: float = 60.0, lookahead: int = 256) -> list[str]:
        mgr = cpu_pool(1, 2)
        sched = TangramPolicy({"cpu": mgr}, aging_s=aging_s, short_lookahead=lookahead)
        for i in range(2):
            sched.submit(Action(f"r{i}", "tt", "cpu", (1,), Fixed(100.0), memory_gib=2.0), 0.0)
        running = sched.schedule(0.0)
        test = Action("test", "tt", "cpu", feasible_range(1, 2), Amdahl(60.0, 0.9), memory_gib=2.0)
        sched.submit(test, 1.0)
        sched.submit(Action("tool", "tt", "cpu", (1,), Fixed(0.5), memory_gib=2.0), 2.0)
        sched.complete(running[0], 3.0)
        return [g.action.id for g in sched.schedule(3.0)]

    assert first_started() == ["tool"]
    assert first_started(aging_s=1.5) == ["test"]  # the test has waited 2 s: it keeps its place
    assert first_started(lookahead=1) == ["test"]  # the tool call is beyond the lookahead


def test_tangram_never_waits_longer_than_starting_at_once_would_take() -> None:
    mgr = cpu_pool(1, 4)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("big", "tb", "cpu", (3,), Fixed(50.0), memory_gib=2.0), 0.0)
    sched.submit(Action("t0", "tt", "cpu", (1,), Fixed(0.1), memory_gib=2.0), 0.0)
    (first,) = [g for g in sched.schedule(0.0) if g.action.id == "t0"]
    sched.complete(first, 0.1)
    sched.schedule(0.1)
    # 4 cores at 50 s: 6 s + 50 s; one core now: 10.9 s. It starts at once on the one core.
    sched.submit(Action("test", "tt", "cpu", feasible_range(1, 4), Amdahl(12.0, 0.1), memory_gib=2.0), 1.0)
    (g,) = sched.schedule(1.0)
    assert g.action.id == "test" and g.units == 1


def test_tangram_on_an_idle_pool_starts_a_test_sized_for_more_cores_than_its_host_has() -> None:
    """The estimate once let such a test wait for the 48 cores the pool's four hosts hold together
    (its session is pinned to one of 32): it waited with nothing running, so no completion ever
    woke the decision again and the run ended with it queued."""
    mgr = cpu_pool(4, 32)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("t0", "tt", "cpu", (1,), Fixed(0.5), memory_gib=2.0), 0.0)  # pins tt
    (first,) = sched.schedule(0.0)
    sched.complete(first, 0.5)
    test = Action("test", "tt", "cpu", feasible_range(1, 48), Amdahl(83.0, 0.966), memory_gib=2.0)
    sched.submit(test, 1.0)
    (g,) = sched.schedule(1.0)
    assert g.action.id == "test" and g.units == 32 and g.host == first.host


def test_tangram_pins_a_new_session_where_fewest_sessions_live_not_where_cores_are_free_now() -> None:
    """A session stays on its host for its whole life: pinning it where a few cores happened to be
    free put whole bursts of sessions on one host of a saturated pool while the others ran few."""
    mgr = cpu_pool(2, 4)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("a", "ta", "cpu", (4,), Fixed(10.0), memory_gib=2.0), 0.0)
    (a,) = sched.schedule(0.0)
    assert a.host == "h0"
    for t in ("tb", "tc"):
        sched.submit(Action(t, t, "cpu", (1,), Fixed(10.0), memory_gib=2.0), 1.0)
    assert {g.action.id: g.host for g in sched.schedule(1.0)} == {"tb": "h1", "tc": "h1"}
    # h0: one session, no core free; h1: two sessions, two cores free. The new session goes to h0
    # and waits there for its cores.
    sched.submit(Action("td", "td", "cpu", (1,), Fixed(1.0), memory_gib=2.0), 2.0)
    assert mgr.pins["td"] == "h0"
    assert sched.schedule(2.0) == []
    sched.complete(a, 10.0)
    (g,) = sched.schedule(10.0)
    assert g.action.id == "td" and g.host == "h0"


def test_tangram_keeps_new_sessions_in_order_while_an_earlier_one_waits_unpinned() -> None:
    """A session that finds no memory on arrival stays unpinned, and so does every later new
    session of its lane until it starts or leaves: new sessions start in order. Once it has gone,
    the next arrival is pinned on arrival again."""
    mgr = cpu_pool(2, 4, memory=4.0)
    sched = TangramPolicy({"cpu": mgr})
    for t in ("ta", "tb"):
        sched.submit(Action(t, t, "cpu", (4,), Fixed(10.0), memory_gib=4.0), 0.0)
    assert {mgr.pins["ta"], mgr.pins["tb"]} == {"h0", "h1"}
    big = Action("big", "tbig", "cpu", (1,), Fixed(1.0), memory_gib=3.0)
    sched.submit(big, 1.0)  # no host has 3 GiB free
    small = Action("small", "tsmall", "cpu", (1,), Fixed(1.0), memory_gib=0.5)
    sched.submit(small, 1.0)  # would fit nowhere either, but must not jump ahead in any case
    assert "tbig" not in mgr.pins and "tsmall" not in mgr.pins
    sched.queue.remove(big)  # withdrawn, as the dispatcher withdraws an action
    late = Action("late", "tlate", "cpu", (1,), Fixed(1.0), memory_gib=0.0)
    sched.submit(late, 2.0)
    # "small" still waits unpinned ahead of it in the lane: "late" stays unpinned too.
    assert "tlate" not in mgr.pins
    sched.queue.remove(small)
    sched.queue.remove(late)
    again = Action("again", "tagain", "cpu", (1,), Fixed(1.0), memory_gib=0.0)
    sched.submit(again, 3.0)
    assert mgr.pins["tagain"] in {"h0", "h1"}


class _CountingPins(CpuManager):
    """A CPU manager that counts how often a decision asks for an action's host: the number of
    waiting actions the scan looks at (a count of work, not a timing)."""

    looked = 0

    def pinned_host(self, action: Action, scratch: object = None) -> str | None:  # type: ignore[override]
        self.looked += 1
        return super().pinned_host(action, scratch)  # type: ignore[arg-type]


def test_tangram_stops_scanning_once_every_host_is_closed() -> None:
    """With every session pinned on arrival, a scan that went on to the end of the queue made each
    decision O(queue) (13 ms p99 at 10,000 queued). Once every host's head waits nothing later can
    start (no host is held for a deferred action here): the scan stops, whatever the queue."""
    looked: list[int] = []
    for queued in (100, 2000):
        mgr = _CountingPins([SandboxHost.uniform(f"h{i}", 4, 1, 1e6) for i in range(2)])
        sched = TangramPolicy({"cpu": mgr})
        for i in range(2):
            sched.submit(Action(f"run{i}", f"r{i}", "cpu", (3,), Fixed(100.0)), 0.0)
        sched.schedule(0.0)
        for i in range(queued):
            sched.submit(Action(f"q{i}", f"q{i}", "cpu", (2,), Fixed(50.0)), 0.0)
        mgr.looked = 0
        assert sched.schedule(0.1) == []
        looked.append(mgr.looked)
    assert looked[0] == looked[1] <= 2 + 1, looked


def test_tangram_scans_on_for_a_backfill_only_as_far_as_its_window() -> None:
    """Every host closed: with one held for a deferred action a later short action may still
    backfill there, so the scan looks on, but at most ``backfill_window`` actions; with that host
    also awaited by an unpinned session (no backfill there) it stops at once."""
    sched = TangramPolicy({"cpu": cpu_pool(2, 4)}, backfill_window=16)
    pinning = sched._pinning(sched.pools["cpu"])
    assert pinning is not None
    assert sched._lookahead(pinning, {"h0"}, set(), False, -1) == -1  # h1 still open
    assert sched._lookahead(pinning, {"h0", "h1"}, set(), False, -1) == 0
    sched.backfill_until = {"h1": 5.0}
    assert sched._lookahead(pinning, {"h0", "h1"}, set(), False, -1) == 16
    assert sched._lookahead(pinning, {"h0", "h1"}, set(), False, 7) == 7  # counting down
    assert sched._lookahead(pinning, {"h0", "h1"}, {"h1"}, True, 7) == 0


@pytest.mark.parametrize("queued", [0, 30])
def test_tangram_waits_for_a_wide_grant_only_while_the_cores_it_idles_are_not_wanted(queued: int) -> None:
    """A test on a host with 2 of 8 cores free, 6 coming back in 2 s: alone, it waits for them
    (done at 8.8 s against 21 s on 2 cores). With 30 actions waiting behind it, the cores it
    would hold idle and the wider grant's unit-seconds are what that queue lacks: it starts now.
    Counting only its own completion, tangram lost the mean to static on small saturated pools."""
    mgr = cpu_pool(1, 8)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("run", "tr", "cpu", (6,), Fixed(2.0)), 0.0)
    (run,) = sched.schedule(0.0)
    test = Action("test", "tt", "cpu", feasible_range(1, 8), Amdahl(40.0, 0.95))
    sched.submit(test, 0.0)
    for i in range(queued):
        sched.submit(Action(f"q{i}", f"q{i}", "cpu", (1,), Fixed(30.0)), 0.0)
    started = {g.action.id: g.units for g in sched.schedule(0.0)}
    if queued:
        assert started == {"test": 2}
    else:
        assert started == {} and id(test) in sched.deferred
        sched.complete(run, 2.0)
        assert {g.action.id: g.units for g in sched.schedule(2.0)} == {"test": 8}


def test_tangram_new_sessions_waiting_for_memory_do_not_price_cores() -> None:
    """Two sessions of 4 GiB fill a host of 8 GiB; thirty more wait for memory. A test of one of
    the two is admitted with 7 cores free: it takes all of them, as with nobody waiting. Counted
    in the price of a core-second, the sessions waiting for memory made tests run on one or two
    cores, so the running sessions lived longer and memory came back later (a swept memory-tight
    variant, 80 sessions of 4 GiB on 16 GiB: mean 114.8 s against static's 85.2 s; now 82.3 s)."""
    mgr = cpu_pool(1, 8, memory=8.0)
    sched = TangramPolicy({"cpu": mgr})
    sched.submit(Action("a0", "s0", "cpu", (1,), Fixed(1.0), memory_gib=4.0), 0.0)
    sched.submit(Action("b0", "s1", "cpu", (1,), Fixed(100.0), memory_gib=4.0), 0.0)
    first = {g.action.id: g for g in sched.schedule(0.0)}
    assert set(first) == {"a0", "b0"}
    for i in range(30):
        sched.submit(Action(f"n{i}", f"n{i}", "cpu", (1,), Fixed(5.0), memory_gib=4.0), 0.5)
    assert sched.schedule(0.5) == []  # no memory for a third session
    sched.complete(first["a0"], 1.0)
    sched.submit(Action("t", "s0", "cpu", feasible_range(1, 8), Amdahl(40.0, 0.95), memory_gib=4.0), 1.0)
    assert {g.action.id: g.units for g in sched.schedule(1.0)} == {"t": 7}
