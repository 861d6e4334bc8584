"""Weighted fair share under ``tangram`` when every tenant has been away: the one that comes back a
moment before the others must not be paid for the time it was away (docs/scheduler.md, Lanes)."""

from __future__ import annotations

from arl_tangram.core.action import Action, Fixed
from arl_tangram.core.policies.tangram import TangramPolicy
from arl_tangram.managers.cpu import CpuManager, SandboxHost


def _run(sched: TangramPolicy, now: float, admissions: int) -> tuple[list[str], float]:
    """Admit ``admissions`` actions one completion at a time; their tenants in order, and the time."""
    order = [g.action.tenant for g in sched.schedule(now)]
    while len(order) < admissions:
        now += 1.0
        sched.complete(next(iter(sched.running.values())), now)
        order += [g.action.tenant for g in sched.schedule(now)]
    return order, now


def _drain(sched: TangramPolicy, now: float) -> float:
    while sched.running:
        now += 1.0
        sched.complete(next(iter(sched.running.values())), now)
        sched.schedule(now)
    return now


def test_a_tenant_back_first_after_everyone_was_idle_gets_no_credit_over_the_others() -> None:
    """``busy`` runs 40 actions alone; the pool goes idle. Then ``away`` (never served) arrives a
    moment before ``busy`` comes back: both are back from idle, so they alternate. The backlogged
    minimum was empty when ``away`` came, so it kept its virtual time of 0 and took 40 admissions
    in a row while ``busy`` waited."""
    sched = TangramPolicy({"cpu": CpuManager([SandboxHost.uniform("h0", 1, 1, 64.0)])})
    for i in range(40):
        sched.submit(Action(f"b{i}", f"b{i}", "cpu", (1,), Fixed(1.0), tenant="busy"), 0.0)
    _, now = _run(sched, 0.0, 40)
    now = _drain(sched, now) + 100.0
    for i in range(40):
        sched.submit(Action(f"w{i}", f"w{i}", "cpu", (1,), Fixed(1.0), tenant="away"), now)
    for i in range(40):
        sched.submit(Action(f"c{i}", f"c{i}", "cpu", (1,), Fixed(1.0), tenant="busy"), now + 0.001)
    order, _ = _run(sched, now + 0.001, 20)
    assert abs(order[:20].count("away") - 10) <= 1, order


def test_weights_still_hold_after_the_pool_was_idle() -> None:
    """Weights 3:1 between two tenants that both come back after an idle pool."""
    sched = TangramPolicy(
        {"cpu": CpuManager([SandboxHost.uniform("h0", 1, 1, 64.0)])}, tenant_weights={"A": 3.0, "B": 1.0}
    )
    for i in range(30):
        sched.submit(Action(f"a{i}", f"a{i}", "cpu", (1,), Fixed(1.0), tenant="A"), 0.0)
    _, now = _run(sched, 0.0, 30)
    now = _drain(sched, now) + 100.0
    for i in range(60):
        sched.submit(Action(f"B{i}", f"B{i}", "cpu", (1,), Fixed(1.0), tenant="B"), now)
        sched.submit(Action(f"A{i}", f"A{i}", "cpu", (1,), Fixed(1.0), tenant="A"), now)
    order, _ = _run(sched, now, 40)
    assert abs(order[:40].count("A") - 30) <= 2, order
