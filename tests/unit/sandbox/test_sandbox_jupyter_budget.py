"""The notebook driver's output budget (``jupyter_driver._Budget``): a cut stream keeps the longest
start whose JSON fits, whatever its characters' escapes cost, and nothing is taken after a cut."""

from __future__ import annotations

import json

import pytest

from arl_tangram.sandbox.jupyter_driver import _Budget


@pytest.mark.parametrize("unit", ["x", "\u00e9", "\U0001f600", 'a\n"\\', "\x00"])
@pytest.mark.parametrize("limit", [0, 1, 2, 3, 50, 999])
def test_a_cut_keeps_the_longest_start_that_fits(unit: str, limit: int) -> None:
    text = unit * (limit + 10)
    budget = _Budget(limit)
    part, cut = budget.text(text)
    assert cut and text.startswith(part)
    # (Under 2 bytes not even the quotes fit: nothing is kept, the cell's empty stream stands.)
    assert len(json.dumps(part)) <= max(limit, 2)
    assert len(json.dumps(text[: len(part) + 1])) > limit, "one character more would have fitted"
    assert budget.text("more") == ("", True), "nothing after a cut"


def test_what_fits_is_taken_whole() -> None:
    budget = _Budget(100)
    assert budget.text("hello") == ("hello", False)
    assert budget.left == 100 - len(json.dumps("hello"))
    assert budget.take({"text/plain": "1"}) and not budget.take({"text/plain": "x" * 200})
