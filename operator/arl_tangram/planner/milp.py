"""The placement MILP, solved with pulp under a time limit (HiGHS via highspy, or the bundled CBC).

pulp reports ``prob.status == "Optimal"`` for a CBC run stopped by its time limit; only
``prob.sol_status`` tells a proven optimum (``LpSolutionOptimal``) from an incumbent
(``LpSolutionIntegerFeasible``) or nothing at all. :func:`solve_placement` reads ``sol_status``,
rounds and re-checks any solution it returns, and never raises for a solver failure: it reports it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Literal

import pulp

from arl_tangram.errors import InvalidSpec
from arl_tangram.planner.placement import (
    Placement,
    PlacementKey,
    PlacementProblem,
    check_placement,
)
from arl_tangram.planner.plan import SolStatus

SolverName = Literal["auto", "highs", "cbc"]

_SOL_STATUS: dict[int, SolStatus] = {
    pulp.LpSolutionOptimal: "optimal",
    pulp.LpSolutionIntegerFeasible: "feasible",
    pulp.LpSolutionNoSolutionFound: "no-solution",
    pulp.LpSolutionInfeasible: "infeasible",
    pulp.LpSolutionUnbounded: "unbounded",
}

_banner_lock = threading.Lock()
_banner_done = False


def _silence_highs_banner() -> None:
    """HiGHS prints a banner on stdout the first time a solver object is built in a process, whatever
    its options; stdout may be a benchmark's JSON, so build that first object with stdout muted."""
    global _banner_done
    with _banner_lock:
        if _banner_done:
            return
        import highspy

        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 1)
                highspy.Highs()  # type: ignore[no-untyped-call]
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _banner_done = True


class _HiGHSWithStart(pulp.HiGHS):  # type: ignore[misc]
    """pulp's in-process HiGHS, handed the variables' initial values (when all are set) as a start;
    pulp's own class ignores them (only its command-line variant takes a start)."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        variables = lp.variables()
        if variables and all(var.varValue is not None for var in variables):
            import highspy

            values = [0.0] * len(variables)
            for var in variables:
                values[var.index] = float(var.varValue)
            solution = highspy.HighsSolution()
            solution.col_value = values
            solution.value_valid = True
            lp.solverModel.setSolution(solution)
        super().callSolver(lp)


def highs_available() -> bool:
    """Whether pulp can reach HiGHS through highspy in this environment."""
    return bool(pulp.HiGHS(msg=False).available())


def make_solver(name: SolverName, time_limit_s: float, cbc_path: str | None = None) -> pulp.LpSolver:
    """A pulp solver with a time limit and a zero optimality gap (the cost is integral, so an absolute
    gap under 1 proves optimality; relative gaps would hide the low-order levels of the cost)."""
    if time_limit_s < 0:
        raise InvalidSpec("time_limit_s", f"must be >= 0, got {time_limit_s}")
    if name == "auto":
        name = "highs" if highs_available() else "cbc"
    if name == "highs":
        _silence_highs_banner()
        return _HiGHSWithStart(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=0.5, threads=1)
    if name == "cbc":
        # PULP_CBC_CMD is the binary bundled with pulp; COIN_CMD runs another one at a given path.
        cbc_class = pulp.COIN_CMD if cbc_path else pulp.PULP_CBC_CMD
        kwargs = {"path": cbc_path} if cbc_path else {}
        with warnings.catch_warnings():
            # pulp 3.3 announces that its bundled CBC goes away in 4.0; it is still the one we ship with.
            warnings.simplefilter("ignore", DeprecationWarning)
            # No `threads` option: CBC 2.10's threaded mode (even `-threads 1`) now and then leaves its
            # worker "waiting to start" for 10 s when the time limit strikes at once, blowing the limit.
            # Left unset, CBC runs serially and keeps to it.
            # No warmStart either: pulp fixes it when the solver is built, and a warm start over
            # variables without initial values made this CBC return all zeros as "Optimal Solution
            # Found". CBC is the fallback solver; only HiGHS gets the greedy start.
            return cbc_class(
                msg=False,
                timeLimit=time_limit_s,
                timeMode="elapsed",
                gapRel=0.0,
                gapAbs=0.5,
                **kwargs,
            )
    raise InvalidSpec("solver", f"unknown solver {name!r}; use auto, highs or cbc")


def solver_label(solver: pulp.LpSolver) -> str:
    """A short, human name for reports."""
    return "HiGHS" if isinstance(solver, pulp.HiGHS) else "CBC"


@dataclass(frozen=True)
class MilpOutcome:
    """What one solver run gave. ``placement`` is set only for a feasible, re-checked solution."""

    solver: str
    status: str
    sol_status: SolStatus
    placement: Placement | None
    seconds: float
    message: str


def _variable(prob: pulp.LpProblem, name: str, low: float, up: float, cat: str) -> pulp.LpVariable:
    # pulp 3.3 deprecates free-standing LpVariable for prob.add_variable; older pulp only has the former.
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@dataclass
class PlacementModel:
    """The pulp model of a placement problem, with handles on its variables."""

    prob: pulp.LpProblem
    x: dict[PlacementKey, pulp.LpVariable]
    opened: dict[str, pulp.LpVariable]
    shortfall: dict[str, pulp.LpVariable]
    overshoot: dict[str, pulp.LpVariable]


def build_model(problem: PlacementProblem) -> PlacementModel:
    """The placement MILP: integer counts per (pool, node, shape), a binary per unopened node.

    minimise  w_short*shortfall + w_over*overshoot + w_open*opened + w_inst*instances
    such that each node's free cpu, memory and GPUs hold what lands on it; each pool gets at most
    ``max_count`` instances and at most ``max_units`` units; placed - wanted = overshoot - shortfall.
    """
    w_short, w_over, w_open, w_instance = problem.weights()
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x: dict[PlacementKey, pulp.LpVariable] = {}
    for idx, (req, node, shape) in enumerate(problem.candidates()):
        bound = req.max_count
        if shape.cpu_millicores:
            bound = min(bound, node.free_cpu_millicores // shape.cpu_millicores)
        if shape.memory_bytes:
            bound = min(bound, node.free_memory_bytes // shape.memory_bytes)
        if shape.gpus:
            bound = min(bound, node.free_gpus // shape.gpus)
        x[(req.pool, node.name, shape.units)] = _variable(prob, f"x{idx}", 0, bound, "Integer")

    opened: dict[str, pulp.LpVariable] = {}
    for j, node in enumerate(problem.nodes):
        on_node = [var for (_, n, _), var in x.items() if n == node.name]
        if not on_node or node.opened:
            continue
        y = _variable(prob, f"y{j}", 0, 1, "Binary")
        opened[node.name] = y
        big = sum(int(var.upBound) for var in on_node)
        prob += pulp.lpSum(on_node) <= big * y, f"open_{j}"

    fixed_short = 0
    shortfalls: dict[str, pulp.LpVariable] = {}
    overshoots: dict[str, pulp.LpVariable] = {}
    for k, req in enumerate(problem.requests):
        mine = {key: var for key, var in x.items() if key[0] == req.pool}
        if not mine:
            fixed_short += req.units if req.max_count else 0
            continue
        shortfall = _variable(prob, f"short{k}", 0, req.units, "Continuous")
        overshoot = _variable(prob, f"over{k}", 0, max(0, req.max_units - req.units), "Continuous")
        placed = pulp.lpSum(units * var for (_, _, units), var in mine.items())
        prob += placed - req.units == overshoot - shortfall, f"balance_{k}"
        prob += pulp.lpSum(mine.values()) <= req.max_count, f"count_{k}"
        prob += placed <= req.max_units, f"units_{k}"
        shortfalls[req.pool] = shortfall
        overshoots[req.pool] = overshoot

    # Capacity rows count in units of the gcd of the shapes' needs: byte-sized coefficients (1.7e10
    # for 16 GiB) made CBC return a worse placement than greedy's as "optimal". Exact, not rounded:
    # what lands on a node is a multiple of the unit, so it fits the free bytes iff it fits their floor.
    every_shape = [shape for req in problem.requests for shape in req.shapes]
    cpu_unit = math.gcd(*(shape.cpu_millicores for shape in every_shape)) or 1
    mem_unit = math.gcd(*(shape.memory_bytes for shape in every_shape)) or 1
    for j, node in enumerate(problem.nodes):
        here = {key: var for key, var in x.items() if key[1] == node.name}
        if not here:
            continue
        shapes = {key: problem.request(key[0]).shape(key[2]) for key in here}
        cpu = pulp.lpSum(shapes[k].cpu_millicores // cpu_unit * v for k, v in here.items())
        mem = pulp.lpSum(shapes[k].memory_bytes // mem_unit * v for k, v in here.items())
        gpus = pulp.lpSum(shapes[k].gpus * v for k, v in here.items())
        prob += cpu <= node.free_cpu_millicores // cpu_unit, f"cpu_{j}"
        prob += mem <= node.free_memory_bytes // mem_unit, f"mem_{j}"
        prob += gpus <= node.free_gpus, f"gpu_{j}"

    prob += (
        w_short * (pulp.lpSum(shortfalls.values()) + fixed_short)
        + w_over * pulp.lpSum(overshoots.values())
        + w_open * pulp.lpSum(opened.values())
        + w_instance * pulp.lpSum(x.values())
    )
    return PlacementModel(prob, x, opened, shortfalls, overshoots)


def set_start(model: PlacementModel, problem: PlacementProblem, start: Placement) -> bool:
    """Give every variable its value in ``start`` (a feasible placement, e.g. the greedy one), so that
    a solver stopped by its time limit holds a solution at least that good. False when the start
    does not fit the model (then nothing is set)."""
    if not check_placement(problem, start).feasible or any(key not in model.x for key, _ in start.items()):
        return False
    for key, var in model.x.items():
        var.setInitialValue(start.counts.get(key, 0))
    used = start.nodes_used()
    for name, y in model.opened.items():
        y.setInitialValue(1 if name in used else 0)
    for req in problem.requests:
        if req.pool in model.shortfall:
            placed = start.units_of(req.pool)
            model.shortfall[req.pool].setInitialValue(max(0, req.units - placed))
            model.overshoot[req.pool].setInitialValue(max(0, placed - req.units))
    return True


def solve_placement(
    problem: PlacementProblem, solver: pulp.LpSolver, start: Placement | None = None
) -> MilpOutcome:
    """Solve the placement MILP once, from ``start`` when given (see :func:`set_start`).
    Solver errors come back as ``sol_status == "error"``."""
    label = solver_label(solver)
    model = build_model(problem)
    prob, x = model.prob, model.x
    if start is not None:
        set_start(model, problem, start)
    started = time.perf_counter()
    try:
        prob.solve(solver)
    except (pulp.PulpSolverError, OSError, RuntimeError) as exc:
        # A missing or crashing solver binary is an infrastructure failure of this round only: the
        # planner falls back to its greedy packer and says so in the plan.
        return MilpOutcome(
            label, "Error", "error", None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
        )
    seconds = time.perf_counter() - started
    status = str(pulp.LpStatus.get(prob.status, prob.status))
    sol_status = _SOL_STATUS.get(int(prob.sol_status), "no-solution")
    if sol_status not in ("optimal", "feasible"):
        return MilpOutcome(
            label, status, sol_status, None, seconds, f"solver found no solution ({sol_status})"
        )
    counts: dict[PlacementKey, int] = {}
    for key, var in x.items():
        value = var.varValue
        if value is None:
            return MilpOutcome(label, status, sol_status, None, seconds, "solver returned no values")
        counts[key] = round(value)
    placement = Placement(counts)
    verdict = check_placement(problem, placement)
    if not verdict.feasible:
        # Rounding or solver tolerance broke a constraint: never hand that to the cluster.
        return MilpOutcome(
            label, status, sol_status, None, seconds, f"solver solution rejected: {verdict.problem}"
        )
    return MilpOutcome(label, status, sol_status, placement, seconds, "")
