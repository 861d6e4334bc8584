"""Quota manager: calls never exceed the concurrency cap nor the token bucket's rate."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.core.action import Action, Fixed
from arl_tangram.core.policies.tangram import TangramPolicy
from arl_tangram.core.pool import Grant
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.quota import ApiQuota, QuotaManager


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 100_000), st.integers(1, 8), st.floats(0.5, 20.0), st.integers(1, 10))
def test_never_beyond_cap_or_rate(seed: int, cap: int, rate: float, burst: int) -> None:
    rng = random.Random(seed)
    mgr = QuotaManager(ApiQuota("search", cap, rate, float(burst)))
    sched = TangramPolicy({mgr.pool: mgr})
    now = 0.0
    starts: list[float] = []
    running: list[Grant] = []
    for i in range(120):
        # Mostly a busy stream, now and then a long lull: a bucket must not save tokens beyond burst.
        now += rng.expovariate(10.0) if rng.random() < 0.9 else rng.uniform(5.0, 50.0)
        if running and rng.random() < 0.4:
            sched.complete(running.pop(rng.randrange(len(running))), now)
        else:
            sched.submit(Action(f"c{i}", f"t{i}", mgr.pool, (1,), Fixed(1.0)), now)
        wake = sched.next_wakeup(now)
        assert wake is None or wake > now
        got = sched.schedule(now)
        running += got
        starts += [now] * len(got)
        assert mgr.quota.in_flight == len(running) <= cap
    # Token bucket: in any window of length w at most burst + rate * w calls started.
    for i, t0 in enumerate(starts):
        n = sum(1 for t in starts[i:] if t - t0 <= 1.0)
        assert n <= burst + rate * 1.0 + 1e-6


def test_a_long_lull_saves_no_more_than_burst_tokens() -> None:
    mgr = QuotaManager(ApiQuota("x", 100, 1.0, 3.0))
    sched = TangramPolicy({mgr.pool: mgr})
    for i in range(10):
        sched.submit(Action(f"a{i}", f"t{i}", mgr.pool, (1,), Fixed(1.0)), 0.0)
    assert len(sched.schedule(0.0)) == 3  # the full bucket
    assert sched.schedule(0.5) == []
    # 1000 s later the bucket holds burst (3) tokens, not 1000.
    assert len(sched.schedule(1000.0)) == 3
    assert len(sched.schedule(1001.0)) == 1


def test_next_wakeup_says_when_a_token_comes_back() -> None:
    mgr = QuotaManager(ApiQuota("x", 10, 2.0, 1.0))
    sched = TangramPolicy({mgr.pool: mgr})
    sched.submit(Action("a", "t", mgr.pool, (1,), Fixed(1.0)), 0.0)
    sched.submit(Action("b", "t2", mgr.pool, (1,), Fixed(1.0)), 0.0)
    assert len(sched.schedule(0.0)) == 1
    assert sched.next_wakeup(0.0) == pytest.approx(0.5)
    assert sched.schedule(0.25) == []
    assert len(sched.schedule(0.5)) == 1


def test_invalid_quota() -> None:
    with pytest.raises(InvalidSpec, match="concurrency"):
        ApiQuota("x", 0, 1.0, 1.0)
