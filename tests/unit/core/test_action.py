"""Actions and duration models: the numbers the scheduler plans with, and clear errors on bad input."""

from __future__ import annotations

import pytest

from arl_tangram.core.action import Action, Amdahl, EfficiencyCurve, Fixed, feasible_range
from arl_tangram.core.resources import ResourceVector
from arl_tangram.errors import InvalidSpec


def test_amdahl_speeds_up_with_diminishing_returns() -> None:
    m = Amdahl(10.0, 0.9)
    assert m.duration(1) == pytest.approx(10.0)
    assert m.duration(10) == pytest.approx(10.0 * (0.1 + 0.09))
    assert m.elastic and m.convex


def test_efficiency_curve_is_the_papers_form() -> None:
    m = EfficiencyCurve(1.5, ((1, 1.0), (2, 0.9), (4, 0.8), (8, 0.7)))
    assert m.duration(4) == pytest.approx(1.5 / (0.8 * 4))
    assert m.elastic and m.convex


def test_fixed_duration_is_not_elastic() -> None:
    assert not Fixed(0.6).elastic
    assert Fixed(0.6).duration(32) == 0.6


def test_action_sorts_its_feasible_set_and_knows_its_minimum() -> None:
    a = Action("a", "t", "gpu", (8, 2, 4, 2), Amdahl(1.0, 0.5))
    assert a.feasible == (2, 4, 8)
    assert a.min_units == 2 and a.elastic


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Action("x", "t", "cpu", (), Fixed(1.0)), "action[x].feasible"),
        (lambda: Action("x", "t", "cpu", (0, 1), Fixed(1.0)), "action[x].feasible"),
        (lambda: Action("x", "t", "cpu", (1,), Fixed(1.0), priority=-1), "action[x].priority"),
        (lambda: Amdahl(0.0, 0.5), "duration.t1"),
        (lambda: Amdahl(1.0, 1.5), "duration.p"),
        (lambda: EfficiencyCurve(1.0, ((2, 1.5),)), "duration.efficiency"),
        (lambda: feasible_range(4, 2), "feasible"),
        (lambda: ResourceVector({"memory": -1.0}), "resources.memory"),
    ],
)
def test_bad_input_names_the_field(build: object, field: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        build()  # type: ignore[operator]
    assert err.value.field == field


def test_resource_vectors_add_subtract_and_refuse_to_go_negative() -> None:
    a = ResourceVector({"cpu": 4, "memory": 8})
    b = ResourceVector({"cpu": 1})
    assert (a - b)["cpu"] == 3 and (a + b)["memory"] == 8
    assert b.fits_in(a) and not a.fits_in(b)
    with pytest.raises(ValueError, match="negative"):
        b - a
