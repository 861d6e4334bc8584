"""``tangram bench gpu``: its event loop serves every request, and its comparisons move the right way."""

from __future__ import annotations

from arl_tangram.gpu.bench import Service, _arrivals, _whole, bench_latency, bench_nvlink, simulate


def test_every_request_is_served_once() -> None:
    services = [Service("a", 2.0, 5.0, 0.05), Service("b", 10.0, 2.0, 0.1)]
    arrivals = _arrivals(services, 60.0, seed=3)
    r = simulate(_whole(2), arrivals)
    assert r.actions == len(arrivals) > 100
    assert r.act_p99_s >= r.act_mean_s > 0


def test_chunks_across_pcie_cost_only_when_pcie_is_slower() -> None:
    same = bench_nvlink(120.0, seed=2, penalty=1.0)
    assert same["aware"] == same["naive"]  # the same pairs' work, only other GPUs
    slower = bench_nvlink(120.0, seed=2, penalty=2.0)
    assert slower["naive"]["act_mean_s"] > slower["aware"]["act_mean_s"]
    assert slower["aware"] == same["aware"]  # aware chunks never cross PCIe


def test_latency_is_measured_on_both_boards() -> None:
    lat = bench_latency(200)
    assert lat["place_us_pcie-pairs"]["median"] > 0 and lat["place_us_mig-h100"]["median"] > 0
    assert lat["mig_plan_gpus"] >= 1
