"""DPArrange is exact: it equals a MILP optimum (pulp) on small random instances; greedy equals it
where durations are convex."""

from __future__ import annotations

import pulp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.core.action import Action, Amdahl, EfficiencyCurve, feasible_range
from arl_tangram.core.dparrange import dp_arrange, greedy_arrange
from arl_tangram.managers.count_op import CountOperator
from arl_tangram.managers.gpu import BuddyOperator

# pulp 3.x warns about its 4.0 API on every variable; the model built here is the same in both.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CURVE = ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7))


def milp_optimum(actions: list[Action], capacity: int) -> float | None:
    """Least summed duration with each action at one of its feasible counts, total <= capacity."""
    prob = pulp.LpProblem("arrange", pulp.LpMinimize)
    x = {
        (i, k): pulp.LpVariable(f"x_{i}_{k}", cat="Binary") for i, a in enumerate(actions) for k in a.feasible
    }
    prob += pulp.lpSum(actions[i].model.duration(k) * v for (i, k), v in x.items())
    for i, a in enumerate(actions):
        prob += pulp.lpSum(x[i, k] for k in a.feasible) == 1
    prob += pulp.lpSum(k * v for (_, k), v in x.items()) <= capacity
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=20))
    if prob.sol_status != pulp.LpSolutionOptimal:  # a time-limited CBC still says "Optimal"
        return None
    return float(pulp.value(prob.objective))


amdahl_actions = st.lists(
    st.builds(
        lambda t1, p, lo, span: Action("a", "t", "cpu", feasible_range(lo, lo + span), Amdahl(t1, p)),
        st.floats(0.1, 20.0),
        st.floats(0.0, 0.99),
        st.integers(1, 3),
        st.integers(0, 6),
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=25, deadline=None)
@given(amdahl_actions, st.integers(0, 30))
def test_cpu_dparrange_equals_milp(actions: list[Action], capacity: int) -> None:
    res = dp_arrange(actions, CountOperator(capacity))
    opt = milp_optimum(actions, capacity)
    if opt is None:
        assert res is None
        return
    assert res is not None
    assert res[0] == pytest.approx(opt, rel=1e-6, abs=1e-6)
    assert sum(res[1]) <= capacity
    assert all(k in a.feasible for a, k in zip(actions, res[1], strict=True))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.builds(
            lambda t1, lo: Action(
                "g", "t", "gpu", tuple(k for k in (1, 2, 4, 8) if k >= lo), EfficiencyCurve(t1, CURVE)
            ),
            st.floats(0.1, 5.0),
            st.sampled_from([1, 2, 4]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_gpu_dparrange_on_one_free_node_equals_milp(actions: list[Action]) -> None:
    # On one empty 8-GPU node any multiset of powers of two summing to <= 8 packs buddy-style,
    # so the buddy DP must reach the plain capacity MILP's optimum.
    res = dp_arrange(actions, BuddyOperator((0, 0, 0, 1)))
    opt = milp_optimum(actions, 8)
    if opt is None:
        assert res is None
    else:
        assert res is not None and res[0] == pytest.approx(opt, rel=1e-6, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(amdahl_actions, st.integers(0, 40))
def test_greedy_equals_dp_for_convex_durations(actions: list[Action], capacity: int) -> None:
    dp = dp_arrange(actions, CountOperator(capacity))
    greedy = greedy_arrange(actions, capacity)
    assert (dp is None) == (greedy is None)
    if dp is not None and greedy is not None:
        assert greedy[0] == pytest.approx(dp[0], rel=1e-9, abs=1e-9)


def test_buddy_operator_splits_the_smallest_chunk_that_fits() -> None:
    op = BuddyOperator((0, 1, 0, 1))
    assert op.prev(op.start(), 1) == (1, 0, 0, 1)  # the 2-chunk splits, the 8 stays whole
    assert op.prev((0, 0, 0, 1), 2) == (0, 1, 1, 0)
    assert op.prev((1, 0, 0, 0), 2) is None
