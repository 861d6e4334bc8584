"""The notebook driver's output budget (``jupyter_driver._Budget``): a cut stream keeps the longest
start whose JSON fits, whatever its characters' escapes cost, and nothing is taken after a cut; and
the cells' records (``jupyter_driver._Cells``): the answer never takes more than ``output_bytes``,
and keeps the cells' output while it fits."""

from __future__ import annotations

import json
from typing import Any

import pytest

from arl_tangram.sandbox.jupyter_driver import _Budget, _Cells


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


def _msg(cell: str, kind: str, **content: Any) -> dict[str, Any]:
    return {"parent_header": {"msg_id": cell}, "header": {"msg_type": kind}, "content": content}


def _answer(cells: _Cells) -> str:
    """The driver's stdout for these cells, with the longest status its frame may say."""
    return json.dumps({"status": "TimeLimitExceeded", "message": "", "cells": cells.result()}) + "\n"


def test_many_cells_keep_their_output_while_the_answer_fits() -> None:
    """200 cells printing their number in 64 KiB: each cell's reserve was larger than its record
    (328 bytes, for an error name of 100 that few cells have), the reserves went past the limit, and
    every cell's output was dropped from an answer of 36 KB."""
    cells = _Cells(65536, 200)
    for i in range(200):
        cells.begin(str(i))
        cells.record(_msg(str(i), "stream", name="stdout", text=f"{i}\n"))
    result = cells.result()
    assert [c["stdout"] for c in result] == [f"{i}\n" for i in range(200)]
    assert not any(c["stdout_truncated"] for c in result)
    assert len(_answer(cells)) <= 65536


def test_a_cell_flooding_errors_keeps_one_past_the_budget_and_the_notebook_answers() -> None:
    """A cell can send the kernel's ``error`` message itself, without end: past the budget only the
    first is kept (its name and the start of its value), so the answer still fits."""
    cells = _Cells(65536, 2)
    cells.begin("flood")
    for _ in range(5000):
        cells.record(_msg("flood", "error", ename="E" * 100, evalue="v", traceback=[]))
    cells.begin("after")
    cells.record(_msg("after", "error", ename="KeyError", evalue="k" * 200, traceback=["..."]))
    flood, after = cells.result()
    assert flood["error_truncated"] and 0 < len(flood["error"]) < 5000
    assert all(e["ename"] == "E" * 100 for e in flood["error"])
    # Nothing was left for the next cell's error but its name, which its reserve holds.
    ((error,),) = [after["error"]]
    assert (
        error["ename"] == "KeyError" and after["error_truncated"] and ("k" * 200).startswith(error["evalue"])
    )
    assert len(_answer(cells)) <= 65536


@pytest.mark.parametrize(
    ("limit", "count"), [(4096, 3), (65536, 1), (65536, 200), (65536, 270), (300_000, 1000)]
)
def test_the_answer_never_takes_more_than_output_bytes(limit: int, count: int) -> None:
    """Every cell at its worst (long streams, displays, a flood of errors with long names and
    values, the longest status): the answer still fits, and each error past the budget keeps the
    start of its name."""
    cells = _Cells(limit, count)
    for i in range(count):
        cell = cells.begin(str(i))
        for name in ("stdout", "stderr"):
            cells.record(_msg(str(i), "stream", name=name, text="\x00" * 5000))
        cells.record(_msg(str(i), "display_data", data={"text/plain": "d" * 5000}))
        for _ in range(20):
            cells.record(
                _msg(str(i), "error", ename="\x00" * 300, evalue="\x00" * 5000, traceback=["t"] * 50)
            )
        cell["status"] = "aborted"
    assert len(_answer(cells)) <= limit
    assert all(c["error"] and c["error_truncated"] for c in cells.result())
    if count <= 200:
        assert all(c["error"][-1]["ename"] for c in cells.result()), "a name's start is kept"
