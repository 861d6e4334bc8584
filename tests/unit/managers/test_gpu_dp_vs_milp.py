"""The GPU DP on partially occupied pools equals a MILP that packs the actions into the free chunks.

The buddy DP (``BuddyOperator`` driving ``dp_arrange``) sees only how many free aligned chunks of 1,
2, 4 and 8 GPUs there are. The oracle here sees the chunks themselves: it puts each action's GPUs
into one free maximal block (a power-of-two count fits a power-of-two block, aligned, whenever the
block's GPUs suffice), so it knows nothing of the DP's splitting rule. The pools are occupied the
way the scheduler occupies them: grants placed and released by the real ``GpuManager``, on nodes
with reserved GPUs and PCIe-paired boards.
"""

from __future__ import annotations

import pulp
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from arl_tangram.core.action import Action, EfficiencyCurve
from arl_tangram.core.dparrange import dp_arrange
from arl_tangram.managers.gpu import BuddyOperator, GpuManager, GpuNode

# pulp 3.x warns about its 4.0 API on every variable; the model built here is the same in both.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CURVE = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7))
PCIE_PAIRS = [[a != b and a // 2 == b // 2 for b in range(8)] for a in range(8)]


def milp_optimum(actions: list[Action], blocks: list[int]) -> float | None:
    """Least summed duration with each action on one free block of ``blocks`` (their sizes), at one
    of its feasible counts, no block holding more GPUs than it has; None when nothing fits."""
    prob = pulp.LpProblem("chunks", pulp.LpMinimize)
    x = {
        (i, k, b): pulp.LpVariable(f"x_{i}_{k}_{b}", cat="Binary")
        for i, a in enumerate(actions)
        for k in a.feasible
        for b, size in enumerate(blocks)
        if k <= size
    }
    prob += pulp.lpSum(actions[i].model.duration(k) * v for (i, k, _), v in x.items())
    for i in range(len(actions)):
        mine = [v for (j, _, _), v in x.items() if j == i]
        if not mine:
            return None
        prob += pulp.lpSum(mine) == 1
    for b, size in enumerate(blocks):
        prob += pulp.lpSum(k * v for (_, k, c), v in x.items() if c == b) <= size
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=20))
    if prob.sol_status == pulp.LpSolutionInfeasible:
        return None
    assert prob.sol_status == pulp.LpSolutionOptimal, pulp.LpSolution[prob.sol_status]
    return float(pulp.value(prob.objective))


def action(i: int, t1: float, lowest: int) -> Action:
    feasible = tuple(k for k in (1, 2, 4, 8) if k >= lowest)
    return Action(f"g{i}", f"t{i}", "gpu", feasible, EfficiencyCurve(t1, CURVE), service="rm", service_gb=4.0)


@st.composite
def occupied_pools(draw: st.DrawFn) -> GpuManager:
    """One to three nodes, some with reserved GPUs or PCIe pairs, after grants placed and released."""
    nodes = []
    for j in range(draw(st.integers(1, 3))):
        gpus = draw(st.sampled_from([2, 4, 8, 8]))
        reserved = draw(st.sets(st.integers(0, gpus - 1), max_size=2)) if gpus > 2 else set()
        paired = gpus == 8 and draw(st.booleans())
        nodes.append(GpuNode(f"n{j}", gpus, reserved=reserved, nvlink=PCIE_PAIRS if paired else None))
    mgr = GpuManager(nodes)
    # The first grant (one GPU, which always fits) is kept: no pool here is empty (test_dparrange
    # compares the DP with a plain capacity MILP on an empty node).
    grants = [
        (1, True),
        *draw(st.lists(st.tuples(st.sampled_from([1, 1, 2, 4]), st.booleans()), max_size=12)),
    ]
    held = []
    for i, (k, keep) in enumerate(grants):
        grant = mgr.place(action(i, 1.0, 1), k, float(i))
        if grant is not None:
            held.append((grant, keep))
    for grant, keep in held:
        if not keep:
            mgr.release(grant, 100.0)
    assert mgr.free_units() < mgr.total_units()
    return mgr


waiting_actions = st.lists(
    st.tuples(st.floats(0.1, 5.0), st.sampled_from([1, 1, 2, 4])), min_size=1, max_size=4
).map(lambda drawn: [action(100 + i, t1, lowest) for i, (t1, lowest) in enumerate(drawn)])


@settings(max_examples=100, deadline=None)
@given(mgr=occupied_pools(), actions=waiting_actions)
def test_gpu_dparrange_on_occupied_pools_equals_the_chunk_milp(
    mgr: GpuManager, actions: list[Action]
) -> None:
    scratch = mgr.scratch()
    blocks = [size for node in mgr.nodes for _, size in node.free_blocks()]
    (part,) = scratch.partitions(actions)
    assert isinstance(part.operator, BuddyOperator)
    event(f"{len(blocks)} free blocks" if len(blocks) < 4 else "4+ free blocks")
    res = dp_arrange(actions, part.operator)
    opt = milp_optimum(actions, blocks)
    event("nothing fits" if opt is None else "an optimum")
    if opt is None:
        assert res is None, (blocks, res)
        return
    assert res is not None, blocks
    assert res[0] == pytest.approx(opt, rel=1e-6, abs=1e-6), (blocks, res[1])
    # The DP's answer is one the allocator can grant: largest first, every take succeeds.
    for a, k in sorted(zip(actions, res[1], strict=True), key=lambda pair: -pair[1]):
        assert scratch.try_take(a, k), (blocks, res[1])


def test_a_fragmented_pool_is_not_one_of_its_size() -> None:
    """Six free GPUs in chunks of 2 and 4 cannot run two 4-GPU actions: the DP knows it, as the MILP."""
    mgr = GpuManager([GpuNode("n0", 8)])
    two = mgr.place(action(0, 1.0, 1), 2, 0.0)
    assert two is not None
    blocks = [size for _, size in mgr.nodes[0].free_blocks()]
    assert sorted(blocks) == [2, 4]
    actions = [action(1, 2.0, 4), action(2, 2.0, 4)]
    (part,) = mgr.scratch().partitions(actions)
    assert dp_arrange(actions, part.operator) is None
    assert milp_optimum(actions, blocks) is None
    one = [action(1, 2.0, 2), action(2, 2.0, 1)]
    res = dp_arrange(one, part.operator)
    assert res is not None and sorted(res[1]) == [2, 4]
    assert res[0] == pytest.approx(milp_optimum(one, blocks))
