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


def test_a_cut_of_mixed_text_keeps_the_longest_start_that_fits() -> None:
    """Cheap characters, then dear ones: a guess shrunk by the share it overshot stopped at 28
    characters where 58 fit."""
    text = "a" * 50 + "\x00" * 100
    part, cut = _Budget(100).text(text)
    assert cut and len(json.dumps(part)) <= 100 < len(json.dumps(text[: len(part) + 1]))
    assert len(part) == 58


def test_a_lists_items_pay_for_their_separators() -> None:
    budget = _Budget(100)
    item = {"text/plain": "1"}
    taken = 0
    while budget.take(item, item=True):
        taken += 1
    assert len(json.dumps([item] * taken)) <= 100
