"""The device cache of the reward runtime: LRU victims, services kept resident, never over the device."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.rewards.cache import DeviceCache, DoesNotFit, pick_next


def _cache(capacity: int = 10, **sizes: int) -> DeviceCache:
    c = DeviceCache(capacity)
    for name, size in sizes.items():
        c.add(name, size)
    return c


def test_victims_are_least_recently_used_first() -> None:
    c = _cache(10, a=4, b=4, c=4)
    c.mark_resident("a")
    c.mark_resident("b")
    assert c.plan("c") == ["a"]
    c.touch("a")  # a ran: b is now the least recently used
    assert c.plan("c") == ["b"]
    assert c.plan("a") == []


def test_kept_and_busy_services_are_never_victims() -> None:
    c = DeviceCache(10)
    c.add("keep", 4, keep=True)
    c.add("b", 4)
    c.add("c", 6)
    c.mark_resident("keep")
    c.mark_resident("b")
    assert c.plan("c") == ["b"]
    with pytest.raises(DoesNotFit):
        c.plan("c", busy=["b"])


def test_a_service_bigger_than_the_device_is_refused_when_declared() -> None:
    c = DeviceCache(2**30)
    with pytest.raises(DoesNotFit, match="more than the device"):
        c.add("huge", 2**31)


def test_restoring_over_the_device_is_refused() -> None:
    c = _cache(10, a=6, b=6)
    c.mark_resident("a")
    with pytest.raises(DoesNotFit):
        c.mark_resident("b")


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=6),
    st.lists(st.integers(0, 5), min_size=1, max_size=60),
)
def test_serving_any_sequence_never_exceeds_the_device(sizes: list[int], requests: list[int]) -> None:
    c = DeviceCache(10)
    for i, s in enumerate(sizes):
        c.add(f"s{i}", s)
    for r in requests:
        name = f"s{r % len(sizes)}"
        victims = c.plan(name)
        before = set(c.resident)
        assert set(victims) <= before
        for v in victims:
            c.mark_evicted(v)
        c.mark_resident(name)
        c.touch(name)
        assert c.used <= c.capacity
        assert c.resident[-1] == name
        # Only as many evictions as needed: without the last victim it would not have fit.
        if victims:
            assert sum(c.sizes[s] for s in before - set(victims[:-1])) + c.sizes[name] > c.capacity


def test_resident_preference_within_the_grace() -> None:
    c = _cache(10, a=5, b=5)
    c.mark_resident("b")
    waiting = {"a": 1.0, "b": 1.02}  # a is older but evicted; b is resident
    assert pick_next(waiting, c, now=1.03, grace_s=0.05) == "b"
    assert pick_next(waiting, c, now=1.2, grace_s=0.05) == "a"  # a waited past the grace: no starving
    assert pick_next({"a": 1.0}, c, now=1.0, grace_s=0.05) == "a"
    assert pick_next({}, c, now=1.0, grace_s=0.05) is None
