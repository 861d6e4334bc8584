"""The node runner's pure parts: kubelet's $(VAR) expansion, quantities, pod IP allocation."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from testbed import REPO


def _load() -> ModuleType:
    path = REPO / "hack" / "testbed" / "node_runner.py"
    spec = importlib.util.spec_from_file_location("testbed_node_runner", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


runner = _load()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x-$(A)-$(B)", "x-1-two"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # undefined names stay as written
        ("$(A", "$(A"),  # unterminated
        ("$A", "$A"),  # only $(...) is a reference
        ("cost: $$5", "cost: $5"),
        ("$", "$"),
        ("", ""),
    ],
)
def test_expand_follows_kubelet(text: str, expected: str) -> None:
    assert runner.expand(text, {"A": "1", "B": "two"}) == expected


@pytest.mark.parametrize(("text", "value"), [("500m", 0.5), ("2", 2.0), ("1Gi", 2.0**30), ("1k", 1000.0)])
def test_quantity(text: str, value: float) -> None:
    assert runner.quantity(text) == pytest.approx(value)


def test_quantity_names_bad_input() -> None:
    with pytest.raises(ValueError, match="12parsecs"):
        runner.quantity("12parsecs")


def test_ip_pool_gives_distinct_addresses_and_reuses_released_ones_last() -> None:
    pool = runner.IpPool("127.9.9.0/30")  # two usable addresses
    a = pool.allocate("pod-a")
    b = pool.allocate("pod-b")
    assert {a, b} == {"127.9.9.1", "127.9.9.2"}
    assert pool.allocate("pod-a") == a  # idempotent per pod
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate("pod-c")
    pool.release("pod-a")
    assert pool.allocate("pod-c") == a
    pool.release("pod-b")
    assert pool.allocate("pod-b-again", wanted=b) == b  # a restarted runner keeps a pod's address
