"""GPU manager: buddy chunks (no leaks), NVLink-aware chunks, MIG slices, residency and LRU eviction."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.core.action import Action, EfficiencyCurve
from arl_tangram.core.pool import Grant
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.gpu import GpuManager, GpuNode, chunk_counts

CURVE = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7))


def req(i: int, service: str = "rm", gb: float = 10.0, mig: str | None = None) -> Action:
    feas = (1,) if mig else (1, 2, 4, 8)
    return Action(
        f"r{i}",
        f"t{i}",
        "gpu",
        feas,
        EfficiencyCurve(1.0, CURVE),
        service=service,
        service_gb=gb,
        mig_profile=mig,
    )


def resident_on_a_free_chunk(mgr: GpuManager, service: str, k: int = 1) -> bool:
    """Whether the service's next action could start on a free chunk of size k with no restore."""
    return any(
        node.resident((service, k), sub)
        for node in mgr.nodes
        for start, size in node.free_blocks()
        if size >= k
        for sub in range(start, start + size, k)
    )


def aligned(g: Grant, node: GpuNode) -> bool:
    pos = sorted(node.order.index(x) for x in g.unit_ids)
    return pos[0] % g.units == 0 and pos == list(range(pos[0], pos[0] + g.units))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 100_000))
def test_random_alloc_free_never_overlaps_and_leaks_nothing(seed: int) -> None:
    rng = random.Random(seed)
    mgr = GpuManager([GpuNode("n0", 8), GpuNode("n1", 8)])
    initial = chunk_counts(mgr.nodes, {n.name: n.busy for n in mgr.nodes})
    held: list[Grant] = []
    for i in range(80):
        if held and rng.random() < 0.5:
            g = held.pop(rng.randrange(len(held)))
            mgr.release(g, float(i))
        else:
            k = rng.choice((1, 2, 4, 8))
            g_new = mgr.place(req(i, service=f"s{rng.randrange(4)}"), k, float(i))
            if g_new is not None:
                node = next(n for n in mgr.nodes if n.name == g_new.host)
                assert aligned(g_new, node)
                held.append(g_new)
        busy = [(g.host, x) for g in held for x in g.unit_ids]
        assert len(busy) == len(set(busy)), "a GPU runs two actions"
        assert mgr.free_units() == 16 - len(busy)
    for g in held:
        mgr.release(g, 100.0)
    assert chunk_counts(mgr.nodes, {n.name: n.busy for n in mgr.nodes}) == initial


def test_buddy_takes_the_smallest_free_chunk() -> None:
    mgr = GpuManager([GpuNode("n0", 8)])
    g1 = mgr.place(req(1), 1, 0.0)
    g2 = mgr.place(req(2), 1, 0.0)
    assert g1 is not None and g2 is not None
    assert {g1.unit_ids[0], g2.unit_ids[0]} == {0, 1}  # the split 2-chunk is used up first
    g4 = mgr.place(req(3), 4, 0.0)
    assert g4 is not None and g4.unit_ids == (4, 5, 6, 7)


def test_pcie_pairs_give_only_nvlinked_pairs() -> None:
    # GPUs 0-4, 1-5, 2-6, 3-7 linked in pairs only: chunks of 2 must be those pairs, none of 4.
    nv = [[a % 4 == b % 4 for b in range(8)] for a in range(8)]
    node = GpuNode("n0", 8, nvlink=nv)
    mgr = GpuManager([node])
    g = mgr.place(req(1), 2, 0.0)
    assert g is not None and g.unit_ids[0] % 4 == g.unit_ids[1] % 4
    assert mgr.place(req(2), 4, 0.0) is None
    assert chunk_counts([node], {"n0": node.busy}) == (0, 3, 0, 0)


def test_all_to_all_matrix_is_treated_as_nvswitch() -> None:
    full = [[True] * 8 for _ in range(8)]
    assert GpuNode("n", 8, nvlink=full).nvlink is None


def test_mig_slices_are_sub_gpu_units_with_profiles() -> None:
    node = GpuNode("n0", 8, mig={7: ["3g.40gb", "3g.40gb", "1g.10gb"]})
    mgr = GpuManager([node])
    a = mgr.place(req(1, mig="3g.40gb"), 1, 0.0)
    b = mgr.place(req(2, mig="3g.40gb"), 1, 0.0)
    assert a is not None and b is not None and a.extra["mig"] != b.extra["mig"]
    assert mgr.place(req(3, mig="3g.40gb"), 1, 0.0) is None
    assert mgr.place(req(4), 8, 0.0) is None  # GPU 7 is in MIG mode: no whole 8-chunk
    g4 = mgr.place(req(5), 4, 0.0)
    assert g4 is not None and 7 not in g4.unit_ids
    mgr.release(a, 1.0)
    assert mgr.place(req(6, mig="3g.40gb"), 1, 1.0) is not None


def test_resident_chunk_is_preferred_and_lru_evicts_to_fit() -> None:
    mgr = GpuManager([GpuNode("n0", 2, memory_gb=80.0)], memory_headroom=1.0)
    a = mgr.place(req(1, "a", gb=50.0), 1, 0.0)
    assert a is not None and a.restore_s == pytest.approx(50.0 / 20.0)
    mgr.release(a, 1.0)
    b = mgr.place(req(2, "b", gb=50.0), 1, 1.0)
    assert b is not None and b.unit_ids != a.unit_ids  # a's GPU is kept; buddy picks the other
    mgr.release(b, 2.0)
    again = mgr.place(req(3, "a", gb=50.0), 1, 2.0)
    assert again is not None and again.unit_ids == a.unit_ids and again.restore_s == 0.0
    held = mgr.place(req(4, "b", gb=50.0), 1, 2.0)
    assert held is not None and held.restore_s == 0.0
    mgr.release(again, 3.0)
    mgr.release(held, 3.0)
    c = mgr.place(req(5, "c", gb=50.0), 1, 3.0)  # evicts the least recently used of a, b
    assert c is not None and c.restore_s > 0
    node = mgr.nodes[0]
    assert all(sum(cache.values()) <= node.memory_gb for cache in node.cache.values())
    assert resident_on_a_free_chunk(mgr, "b")  # b was used last, still resident
    assert not resident_on_a_free_chunk(mgr, "a")


def test_invalid_nodes_are_rejected() -> None:
    with pytest.raises(InvalidSpec, match="gpus"):
        GpuNode("n", 6)
    with pytest.raises(InvalidSpec, match="nvlink"):
        GpuNode("n", 2, nvlink=[[True]])


def test_reserved_gpus_of_a_partial_node_are_never_handed_out() -> None:
    node = GpuNode("n0", 8, reserved={6, 7})
    mgr = GpuManager([node])
    assert mgr.total_units() == 6 and mgr.free_units() == 6
    assert sorted(s for _, s in node.free_blocks()) == [2, 4]  # a 4-chunk and a 2-chunk
    assert mgr.place(req(1), 8, 0.0) is None
    grants = [mgr.place(req(i), 1, 0.0) for i in range(6)]
    assert all(g is not None for g in grants)
    assert not {u for g in grants if g is not None for u in g.unit_ids} & {6, 7}
    assert mgr.place(req(9), 1, 0.0) is None
    with pytest.raises(InvalidSpec, match="reserved"):
        GpuNode("bad", 4, reserved={4})


def test_plan_offers_the_resident_block_free_and_a_busy_warm_copy_later() -> None:
    mgr = GpuManager([GpuNode("n0", 8)], memory_headroom=1.0)
    warm = mgr.place(req(1, "a", gb=40.0), 4, 0.0)
    assert warm is not None
    busy_until = {("n0", g): 5.0 for g in warm.unit_ids}
    plan = mgr.residency_plan(1.0, {"a": 1.0}, busy_until)
    opts = {(o.units, o.ready_at > 1.0): o for o in plan.options(req(2, "a", gb=40.0))}
    later = opts[(4, True)]  # the warm copy, busy until 5 s, with no restore
    assert later.ready_at == pytest.approx(5.0) and later.restore_s == 0.0
    cold = opts[(4, False)]  # the other 4-chunk, free now, but a restore first
    assert cold.restore_s == pytest.approx(2.0) and cold.ready_at == 1.0
    assert (8, False) not in opts  # no free 8-chunk while half the node is busy
    mgr.release(warm, 5.0)
    plan = mgr.residency_plan(5.0, {"a": 1.0}, {})
    best = min(plan.options(req(3, "a", gb=40.0)), key=lambda o: o.restore_s + o.ready_at)
    assert best.units == 4 and best.restore_s == 0.0


def test_plan_evicts_the_coldest_service_where_lru_would_evict_a_hot_one() -> None:
    def loaded() -> GpuManager:
        mgr = GpuManager([GpuNode("n0", 1, memory_gb=80.0)], memory_headroom=1.0)
        for i, svc in enumerate(("hot", "cold")):
            g = mgr.place(req(i, svc, gb=40.0), 1, float(i))
            assert g is not None
            mgr.release(g, float(i) + 0.5)
        return mgr

    # LRU (no plan, as the paper): "hot" was used first, so it goes.
    mgr = loaded()
    g = mgr.place(req(5, "new", gb=40.0), 1, 3.0)
    assert g is not None
    mgr.release(g, 4.0)
    assert not resident_on_a_free_chunk(mgr, "hot")
    # Demand-weighted (tangram's plan): "cold" goes, and the option's penalty says what it costs.
    mgr = loaded()
    plan = mgr.residency_plan(3.0, {"hot": 1.0, "cold": 0.1}, {})
    (opt,) = plan.options(req(5, "new", gb=40.0))
    assert opt.penalty_s == pytest.approx(0.1 * 2.0)
    action = req(5, "new", gb=40.0)
    (opt,) = plan.options(action)
    plan.take(action, opt, 10.0)
    g = mgr.place(action, 1, 3.0, plan)
    assert g is not None
    mgr.release(g, 4.0)
    assert resident_on_a_free_chunk(mgr, "hot")
    assert not resident_on_a_free_chunk(mgr, "cold")


def test_evicting_another_tp_size_of_the_same_service_costs_nothing() -> None:
    mgr = GpuManager([GpuNode("n0", 2, memory_gb=80.0)], memory_headroom=1.0)
    g = mgr.place(req(1, "judge", gb=60.0), 2, 0.0)  # TP-2 copy: 30 GB on each GPU
    assert g is not None
    mgr.release(g, 1.0)
    plan = mgr.residency_plan(1.0, {"judge": 1.0}, {})
    tp1 = [o for o in plan.options(req(2, "judge", gb=60.0)) if o.units == 1]
    # A TP-1 copy (60 GB) evicts the TP-2 copy: the judge stays resident, only its TP changes.
    assert tp1 and tp1[0].restore_s == pytest.approx(3.0) and tp1[0].penalty_s == 0.0
    other = [o for o in plan.options(req(3, "other", gb=60.0)) if o.units == 1]
    assert other and other[0].penalty_s == pytest.approx(3.0)  # another service's copy is hot


# ---- the manager on published inventories (the node agent's fake boards) ---------------------------

from arl_tangram.gpu.fake import fake_inventory  # noqa: E402
from arl_tangram.gpu.inventory import NodeInventory  # noqa: E402


def _inventory_manager(*topologies: str) -> tuple[GpuManager, dict[str, NodeInventory]]:
    invs = {f"{t}-{i}": fake_inventory(t, f"{t}-{i}") for i, t in enumerate(topologies)}
    return GpuManager([GpuNode.from_inventory(inv) for inv in invs.values()]), invs


def test_from_inventory_reads_the_board() -> None:
    node = GpuNode.from_inventory(fake_inventory("mig-h100", "h"))
    assert node.gpus == 8 and node.nvlink is None  # NVSwitch: all-to-all
    assert sorted(node.mig) == [4, 5, 6, 7] and node.pool_gpus == 4
    assert node.memory_gb == pytest.approx(81559 / 1024)
    assert all(s.uuid.startswith("MIG-") for s in node.slices)
    pairs = GpuNode.from_inventory(fake_inventory("pcie-pairs"))
    assert pairs.nvlink is not None and pairs.nvlink[0][2] and not pairs.nvlink[0][1]


def test_a_node_with_six_gpus_is_padded_with_gpus_it_never_hands_out() -> None:
    inv = fake_inventory("nvswitch-h100", "six")
    six = NodeInventory(inv.node, inv.gpus[:6], tuple(r[:6] for r in inv.nvlink[:6]), inv.driver, inv.source)
    mgr = GpuManager([GpuNode.from_inventory(six)])
    assert mgr.total_units() == 6
    got = [mgr.place(req(i, service=f"s{i}"), 1, 0.0) for i in range(7)]
    assert all(g is not None for g in got[:6]) and got[6] is None
    assert {x for g in got[:6] if g is not None for x in g.unit_ids} == set(range(6))


def test_grants_carry_the_device_uuids() -> None:
    mgr, invs = _inventory_manager("pcie-pairs", "mig-a100")
    g = mgr.place(req(1), 2, 0.0)
    assert g is not None
    inv = invs[g.host]
    assert g.extra["uuids"].split(",") == [inv.gpus[x].uuid for x in g.unit_ids]
    m = mgr.place(req(2, mig="3g.40gb"), 1, 0.0)
    assert m is not None and m.extra["uuids"].startswith("MIG-")
    gpu_info = invs[m.host].gpus[m.unit_ids[0]]
    assert m.extra["uuids"] in {x.uuid for x in gpu_info.mig_instances if x.profile == "3g.40gb"}


def test_pcie_pairs_chunks_follow_the_bridges_not_the_indices() -> None:
    mgr, invs = _inventory_manager("pcie-pairs")
    inv = next(iter(invs.values()))
    grants = [mgr.place(req(i, service=f"s{i}"), 2, 0.0) for i in range(5)]
    assert all(g is not None for g in grants[:4]) and grants[4] is None
    for g in grants[:4]:
        assert g is not None and inv.is_clique(g.unit_ids)
    assert mgr.place(req(9), 4, 0.0) is None  # no four GPUs share NVLink on this board


def test_ring_has_pairs_but_no_four_gpu_clique() -> None:
    mgr, invs = _inventory_manager("ring4")
    inv = next(iter(invs.values()))
    g = mgr.place(req(1), 2, 0.0)
    assert g is not None and inv.is_clique(g.unit_ids)
    assert not mgr.can_ever_fit(Action("x", "t", "gpu", (4,), EfficiencyCurve(1.0, CURVE), service="rm"))


MIXED = ("nvswitch-h100", "pcie-pairs", "ring4", "mig-a100", "mig-h100")
PROFILES = sorted({m.profile for t in MIXED for g in fake_inventory(t).gpus for m in g.mig_instances})


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from((1, 2, 4, 8)), st.integers(0, 5), st.integers(0, 99)),
        min_size=1,
        max_size=120,
    ),
    st.sampled_from([MIXED, ("pcie-pairs", "ring4"), ("mig-a100",), ("mig-h100", "nvswitch-h200")]),
)
def test_inventory_chunks_and_slices_never_overlap_leak_or_cross_pcie(
    ops: list[tuple[int, int, int, int]], topologies: tuple[str, ...]
) -> None:
    mgr, invs = _inventory_manager(*topologies)
    nodes = {n.name: n for n in mgr.nodes}
    total = mgr.total_units()
    held: list[Grant] = []
    for i, (kind, k, svc, pick) in enumerate(ops):
        if kind == 0 and held:
            mgr.release(held.pop(pick % len(held)), float(i))
        elif kind == 1:
            g = mgr.place(req(i, service=f"s{svc}", gb=10.0 * (1 + svc)), k, float(i))
            if g is not None:
                node, inv = nodes[g.host], invs[g.host]
                assert aligned(g, node)
                assert inv.is_clique(g.unit_ids), "a chunk crosses PCIe"
                assert all(not inv.gpus[x].mig_enabled for x in g.unit_ids)
                assert g.extra["uuids"].split(",") == [inv.gpus[x].uuid for x in g.unit_ids]
                held.append(g)
        else:
            g = mgr.place(req(i, mig=PROFILES[pick % len(PROFILES)]), 1, float(i))
            if g is not None:
                assert invs[g.host].gpus[g.unit_ids[0]].mig_enabled
                held.append(g)
        whole = [(g.host, x) for g in held if "mig" not in g.extra for x in g.unit_ids]
        slices = [(g.host, g.extra["mig"]) for g in held if "mig" in g.extra]
        assert len(whole) == len(set(whole)), "a GPU runs two actions"
        assert len(slices) == len(set(slices)), "a MIG slice runs two actions"
        assert {(n.name, x) for n in mgr.nodes for x in n.busy} == set(whole)
        assert {(n.name, f"{s.gpu}:{s.index}") for n in mgr.nodes for s in n.slices if s.busy} == set(slices)
        assert mgr.free_units() == total - len(whole) - len(slices)
        for n in mgr.nodes:  # the service cache never holds more than a GPU's memory
            for g_idx, cache in n.cache.items():
                assert sum(cache.values()) <= n.memory_gb + 1e-6, (n.name, g_idx)
    for g in held:
        mgr.release(g, 1e6)
    assert mgr.free_units() == total
    assert all(not n.busy and not any(s.busy for s in n.slices) for n in mgr.nodes)


def test_resident_chunk_is_preferred_and_lru_is_evicted_on_an_inventory_node() -> None:
    mgr, _ = _inventory_manager("pcie-pairs")
    node = mgr.nodes[0]
    big = node.memory_gb / 1.2 * 0.6  # two such services do not fit on one GPU at TP 1
    first = mgr.place(req(1, "a", big), 1, 0.0)
    assert first is not None and first.restore_s > 0
    mgr.release(first, 1.0)
    again = mgr.place(req(2, "a", big), 1, 2.0)
    assert again is not None and again.restore_s == 0 and again.unit_ids == first.unit_ids
    mgr.release(again, 3.0)
    # Fill every GPU with a service of its own, then one more: the least recently used goes.
    held = [mgr.place(req(10 + i, f"b{i}", big), 1, 4.0 + i) for i in range(8)]
    assert all(h is not None for h in held)
    for h in held:
        assert h is not None
        mgr.release(h, 20.0)
    assert ("a", 1, node.name, node.order.index(first.unit_ids[0])) not in node.cache[first.unit_ids[0]]


def test_across_pcie_only_when_asked_and_only_when_no_clique_is_free() -> None:
    mgr, invs = _inventory_manager("pcie-pairs")
    inv = next(iter(invs.values()))
    assert mgr.place(req(1), 4, 0.0) is None
    g = mgr.place(req(1), 4, 0.0, across_pcie=True)
    assert g is not None and not inv.is_clique(g.unit_ids)
    # Its members are two bridged pairs (the most linked four), and the next TP-2 is still a pair.
    assert sum(inv.linked(a, b) for a in g.unit_ids for b in g.unit_ids if a < b) == 2
    pair = mgr.place(req(2), 2, 0.0, across_pcie=True)
    assert pair is not None and inv.is_clique(pair.unit_ids)


def test_prewarm_fills_free_memory_largest_first_at_the_widest_size_and_never_evicts() -> None:
    mgr = GpuManager([GpuNode("n0", 4, 80.0)], restore_gbps=20.0, memory_headroom=1.2)
    # 70B and 63B in bf16 fit side by side at TP 4 (42 + 37.8 GB per GPU); 7B fits nowhere after.
    made = mgr.prewarm({"rm-7b": (14.0, (1, 2, 4)), "rm-70b": (140.0, (2, 4)), "rm-63b": (126.0, (2, 4))})
    assert made == [("rm-70b", 4, "n0", 0), ("rm-63b", 4, "n0", 0)]
    node = mgr.nodes[0]
    assert all(sum(node.cache[g].values()) <= node.memory_gb for g in range(4))
    # The first request of a pre-warmed service restores nothing; the cold one pays its load.
    warm = mgr.place(req(0, "rm-70b", 140.0), 4, 0.0)
    assert warm is not None and warm.restore_s == 0.0
    mgr.release(warm, 1.0)
    cold = mgr.place(req(1, "rm-7b", 14.0), 1, 1.0)
    assert cold is not None and cold.restore_s == pytest.approx(14.0 / 20.0)


def test_prewarm_spreads_copies_over_nodes_before_sharing_gpus() -> None:
    mgr = GpuManager([GpuNode("n0", 8, 80.0), GpuNode("n1", 8, 80.0)], memory_headroom=1.0)
    made = mgr.prewarm({"a": (64.0, (1, 2, 4, 8)), "b": (32.0, (1, 2, 4, 8)), "c": (16.0, (1, 2, 4, 8))})
    # a and b take a node each at TP 8; c then shares the node with the most memory left (b's).
    assert made == [("a", 8, "n0", 0), ("b", 8, "n1", 0), ("c", 8, "n1", 0)]


def test_prewarm_never_offers_a_size_the_node_or_the_pool_cannot_hold() -> None:
    """A TP size wider than the node, or one whose share of the weights some node's GPUs cannot
    hold (the scheduler never offers it: ``fits_memory``), is skipped, not half-counted."""
    mgr = GpuManager([GpuNode("n0", 4, 80.0)], memory_headroom=1.0)
    assert mgr.prewarm({"a": (400.0, (8,))}) == []
    assert all(not c for c in mgr.nodes[0].cache.values())
    small = GpuManager([GpuNode("big", 8, 80.0), GpuNode("small", 8, 24.0)], memory_headroom=1.0)
    # 40 GB: 20 per GPU at TP 2 fits the small node too; at TP 1 (40) it would not.
    assert small.prewarm({"a": (40.0, (1, 2))}) == [("a", 2, "big", 0)]


def test_prewarm_only_a_new_node() -> None:
    old, new = GpuNode("old", 8, 80.0), GpuNode("new", 8, 80.0)
    mgr = GpuManager([old])
    mgr.prewarm({"a": (40.0, (8,))})
    mgr.add_node(new)
    assert mgr.prewarm({"a": (40.0, (8,))}, only=new) == [("a", 8, "new", 0)]
    assert len({ck for c in old.cache.values() for ck in c}) == 1  # the old node is left as it was


def test_a_service_only_some_nodes_hold_is_placed_on_those() -> None:
    """60 GB a GPU fits an 80 GB GPU, not a 40 GB one: the manager asked every node, so in a
    cluster of both the service was placed on neither, offered no size and waited for good."""
    mgr = GpuManager([GpuNode("a100", 4, 40.0), GpuNode("h100", 4, 80.0)], memory_headroom=1.0)
    big = req(1, gb=60.0)
    assert mgr.can_ever_fit(big)
    assert [o.units for o in mgr.residency_plan(0.0, {}, {}).options(big)] == [1, 2, 4]
    assert mgr.scratch().try_take(big, 1)
    g = mgr.place(big, 1, 0.0)
    assert g is not None and g.host == "h100"
    # TP 2 (30 GB a GPU) fits both: the A100 node may hold it.
    assert {n.name for n in mgr.holding(big, 2)} == {"a100", "h100"}
    assert mgr.prewarm({"rm-60": (60.0, (1,))}) == [("rm-60", 1, "h100", 1)]


def test_a_tp_size_over_a_nodes_gpus_is_never_granted_its_few() -> None:
    """Across PCIe, a TP-8 replica on 4-GPU nodes was granted the node's four GPUs as if eight."""
    mgr = GpuManager([GpuNode("n0", 4, 80.0)])
    assert mgr.place(req(1), 8, 0.0, across_pcie=True) is None
    g = mgr.place(req(2), 4, 0.0, across_pcie=True)
    assert g is not None and len(g.unit_ids) == 4
