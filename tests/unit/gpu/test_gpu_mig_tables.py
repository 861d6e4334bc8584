"""MIG profile tables: the layouts NVIDIA documents are valid, impossible ones are not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arl_tangram.gpu import mig

A100 = mig.model_of("A100-80GB")


@pytest.mark.parametrize(
    "layout",
    [
        ["7g.80gb"],
        ["4g.40gb", "3g.40gb"],
        ["3g.40gb", "3g.40gb"],
        ["4g.40gb", "2g.20gb", "1g.10gb"],
        ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
        ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"],
        ["1g.10gb"] * 7,
        ["1g.20gb"] * 4,
    ],
)
def test_documented_layouts_are_valid(layout: list[str]) -> None:
    assert mig.valid_layout(A100, layout)


@pytest.mark.parametrize(
    "layout",
    [
        ["7g.80gb", "1g.10gb"],
        ["4g.40gb", "4g.40gb"],
        ["3g.40gb", "3g.40gb", "1g.10gb"],
        ["1g.10gb"] * 8,
        ["2g.20gb"] * 4,
        ["1g.10gb+me", "1g.10gb+me"],
    ],
)
def test_impossible_layouts_are_refused(layout: list[str]) -> None:
    assert not mig.valid_layout(A100, layout)


def test_empty_gpu_capacity_matches_the_profile_table() -> None:
    free = mig.remaining_capacity(A100, [])
    assert free == {
        "1g.10gb": 7,
        "1g.10gb+me": 1,
        "1g.20gb": 4,
        "2g.20gb": 3,
        "3g.40gb": 2,
        "4g.40gb": 1,
        "7g.80gb": 1,
    }


@pytest.mark.parametrize(
    ("name", "mib", "key"),
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA A30", 24576, "A30-24GB"),
        ("NVIDIA L40S", 46068, None),
        ("Tesla V100-SXM2-32GB", 32768, None),
    ],
)
def test_model_keys(name: str, mib: int, key: str | None) -> None:
    assert mig.model_key(name, mib) == key


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(mig.MigError, match=r"3g\.40gb"):
        A100.profile("3g.41gb")


def test_parse_layout_checks_the_whole_gpu() -> None:
    assert sorted(mig.parse_layout(A100, {"3g.40gb": 2})) == ["3g.40gb", "3g.40gb"]
    with pytest.raises(mig.MigError, match="cannot hold"):
        mig.parse_layout(A100, {"4g.40gb": 1, "3g.40gb": 1, "1g.10gb": 1})


PROFILES = [p.name for p in A100.profiles]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(PROFILES), min_size=1, max_size=8))
def test_placements_never_overlap_and_respect_the_table(profiles: list[str]) -> None:
    placed = mig.place(A100, profiles)
    if placed is None:
        return
    assert sorted(p for p, _ in placed) == sorted(profiles)
    used = 0
    for name, start in placed:
        p = A100.profile(name)
        assert start in p.starts
        run = ((1 << p.memory) - 1) << start
        assert not used & run
        used |= run
    assert sum(A100.profile(n).compute for n in profiles) <= A100.compute_slices


def test_every_enumerated_layout_is_valid_and_the_list_is_complete() -> None:
    found = set(mig.layouts("A100-80GB"))
    assert all(mig.valid_layout(A100, lay) for lay in found)
    # Completeness against brute force over every multiset of up to 7 profiles.
    import itertools

    brute = {
        tuple(sorted(c))
        for k in range(1, 8)
        for c in itertools.combinations_with_replacement(PROFILES, k)
        if mig.valid_layout(A100, c)
    }
    assert found == brute
