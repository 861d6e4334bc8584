"""Workload files: the built-ins load, bad files get errors naming the field, generation is seeded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from arl_tangram.errors import InvalidSpec
from arl_tangram.planner.snapshot import ScalingPolicy
from arl_tangram.sim.calibration import calibration
from arl_tangram.sim.workload import (
    BUILTIN,
    MAX_SECONDS,
    LogNormal,
    Workload,
    builtin,
    generate,
    load,
    parse,
    with_overrides,
)


@pytest.mark.parametrize("name", BUILTIN)
def test_builtins_load(name: str) -> None:
    wl = builtin(name)
    assert wl.name == name and wl.sources


def test_ai_coding_matches_the_issue() -> None:
    wl = builtin("ai-coding")
    src = wl.sources[0]
    assert wl.cluster.cpu_hosts == 5 and wl.cluster.cores_per_host == 256
    trajs = generate(with_overrides(wl, scale=0.05))
    assert len(trajs) == 64
    for t in trajs:
        assert 10 <= len(t.steps) <= 40
        assert t.steps[-1].kind == "test"
        assert all(s.kind == "test" for i, s in enumerate(t.steps) if (i + 1) % 5 == 0)
        assert all(s.feasible == tuple(range(1, 33)) for s in t.steps if s.kind == "test")
    assert src.memory_gib == 2


def test_generation_is_deterministic_and_seeded() -> None:
    wl = with_overrides(builtin("deepsearch"), scale=0.02)
    a, b = generate(wl), generate(wl)
    assert [(t.id, t.start, [s.true.duration(1) for s in t.steps]) for t in a] == [
        (t.id, t.start, [s.true.duration(1) for s in t.steps]) for t in b
    ]
    import dataclasses

    c = generate(dataclasses.replace(wl, seed=wl.seed + 1))
    assert [s.true.duration(1) for s in c[0].steps] != [s.true.duration(1) for s in a[0].steps]


def test_reward_services_get_their_minimum_gpus_by_memory() -> None:
    trajs = generate(with_overrides(builtin("reward-gpu"), scale=0.2))
    by_service = {t.steps[0].service: t.steps[0].feasible for t in trajs}
    assert by_service["rm-7b"] == (1, 2, 4, 8)
    assert by_service["rm-70b"] == (4, 8)  # 140 GB of weights with headroom needs 4 x 80 GB


def test_workload_file_round_trip(tmp_path: Path) -> None:
    text = (Path(__file__).parents[3] / "operator/arl_tangram/sim/workloads/deepsearch.yaml").read_text()
    f = tmp_path / "w.yaml"
    f.write_text(text)
    assert load(f).name == "deepsearch"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("sources"), "sources"),
        (lambda d: d["sources"][0].update(kind="nope"), "sources[0].kind"),
        (lambda d: d["sources"][0].update(trajectories=-1), "sources[0].trajectories"),
        (lambda d: d["sources"][0]["think"].update(median_s="fast"), "sources[0].think.median_s"),
        (lambda d: d["sources"][0].update(apis=["nope"]), "sources[0].apis"),
        (lambda d: d["cluster"]["apis"][0].update(concurrency=0), "cluster.apis[0].concurrency"),
    ],
)
def test_bad_files_name_the_field(mutate: object, field: str) -> None:
    doc = yaml.safe_load(
        (Path(__file__).parents[3] / "operator/arl_tangram/sim/workloads/deepsearch.yaml").read_text()
    )
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(InvalidSpec) as err:
        parse(doc)
    assert err.value.field == field


def test_unreadable_and_unknown_workloads(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="cannot read"):
        load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [")
    with pytest.raises(InvalidSpec, match="not valid YAML"):
        load(tmp_path / "bad.yaml")
    with pytest.raises(InvalidSpec, match="unknown workload"):
        builtin("nope")


def test_gpu_override_takes_any_count_with_a_partial_last_node() -> None:
    wl = builtin("reward-gpu")
    twelve = with_overrides(wl, gpus=12).cluster
    assert (twelve.gpu_nodes, twelve.last_node_gpus, twelve.total_gpus) == (2, 4, 12)
    three = with_overrides(wl, gpus=3).cluster
    assert (three.gpu_nodes, three.last_node_gpus, three.total_gpus) == (1, 3, 3)
    whole = with_overrides(wl, gpus=16).cluster
    assert (whole.gpu_nodes, whole.last_node_gpus, whole.total_gpus) == (2, 0, 16)
    with pytest.raises(InvalidSpec, match="gpus"):
        with_overrides(wl, gpus=0)


def test_planner_targets_are_fractions() -> None:
    doc = yaml.safe_load(
        (Path(__file__).parents[3] / "operator/arl_tangram/sim/workloads/ai-coding.yaml").read_text()
    )
    doc["planner"]["target_efficiency"] = 1.5
    with pytest.raises(InvalidSpec, match=r"planner\.target_efficiency"):
        parse(doc)


def _doc(name: str) -> dict:  # type: ignore[type-arg]
    path = Path(__file__).parents[3] / f"operator/arl_tangram/sim/workloads/{name}.yaml"
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["planner"].update(peroid_s=5), "planner.peroid_s"),
        (lambda d: d["sources"][0]["test"].update(cores_mx=8), "sources[0].test.cores_mx"),
        (lambda d: d["cluster"]["cpu_hosts"].update(cors=8), "cluster.cpu_hosts.cors"),
        (lambda d: d.update(sedd=3), "sedd"),
    ],
)
def test_unknown_fields_are_refused_by_name(mutate: object, field: str) -> None:
    doc = _doc("ai-coding")
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(InvalidSpec) as err:
        parse(doc)
    assert (err.value.field, err.value.message) == (field, "unknown field")


def test_a_bool_is_not_a_number() -> None:
    doc = _doc("ai-coding")
    doc["cluster"]["cpu_hosts"]["count"] = True
    with pytest.raises(InvalidSpec, match="count"):
        parse(doc)


def test_scaling_left_out_takes_the_planners_defaults_and_given_fields_win() -> None:
    doc = _doc("ai-coding")
    for key in ("min_hosts", "warm_hosts", "max_starting", "idle_timeout_s"):
        doc["planner"].pop(key)
    wl = parse(doc)
    assert wl.planner is not None
    default = ScalingPolicy(max_instances=wl.planner.cpu_scaling.max_instances)
    assert wl.planner.cpu_scaling == dataclasses.replace(
        default, cold_start_s=10.0, target_utilisation=default.target_utilisation
    )
    doc["planner"]["min_hosts"] = 2
    assert parse(doc).planner.cpu_scaling.min_instances == 2  # type: ignore[union-attr]
    assert parse(doc).planner.gpu_scaling.min_instances == doc["planner"]["min_gpu_nodes"]  # type: ignore[union-attr]


def test_static_takes_the_measured_calibration_unless_the_file_sets_figures() -> None:
    cal = calibration()
    wl = builtin("ai-coding")
    assert wl.static.pod_start == LogNormal(cal.pod_start.median_s, cal.pod_start.sigma)
    assert (wl.static.pod_admission_per_s, wl.static.exec_s) == (cal.pod_admission_per_s, cal.exec_s)
    doc = _doc("ai-coding")
    doc["static"].update(pod_start={"median_s": 5.0, "sigma": 0.3}, exec_s=0.0)
    own = parse(doc).static
    assert (own.pod_start, own.exec_s) == (LogNormal(5.0, 0.3), 0.0)


def _gpu_nodes(d: dict, **kw: object) -> None:  # type: ignore[type-arg]
    d["cluster"]["gpu_nodes"].update(kw)


@pytest.mark.parametrize(
    ("base", "mutate", "field"),
    [
        # Each field is valid alone; together no host or GPU node can ever hold the work, which a
        # pooled run only found mid-way (naming an action) or never (waiting for ever).
        ("ai-coding", lambda d: d["sources"][0]["tool"].update(cores=512), "sources[0].tool.cores"),
        (
            "ai-coding",
            lambda d: d["sources"][0]["test"].update(cores_min=300, cores_max=400),
            "sources[0].test.cores_min",
        ),
        ("memory-tight", lambda d: d["sources"][0].update(memory_gib=65), "sources[0].memory_gib"),
        # Host memory left out (0) with sessions that hold memory.
        ("memory-tight", lambda d: d["cluster"]["cpu_hosts"].pop("memory_gib"), "sources[0].memory_gib"),
        (
            "memory-tight",
            lambda d: d["cluster"]["cpu_hosts"].update(numa_nodes=3),
            "cluster.cpu_hosts.numa_nodes",
        ),
        ("reward-gpu", lambda d: _gpu_nodes(d, gpus=3), "cluster.gpu_nodes.gpus"),
        ("reward-gpu", lambda d: _gpu_nodes(d, mig={8: ["1g.10gb"]}), "cluster.gpu_nodes.mig"),
        (
            "reward-gpu",
            lambda d: d["sources"][0]["services"].append({"name": "huge", "params_b": 2000}),
            "sources[0].services[10].params_b",
        ),
        ("deepsearch", lambda d: d["sources"][0]["judge"].update(params_b=5000), "sources[0].judge.params_b"),
        # Only TP 8 given, nodes of 4 GPUs: no TP size fits.
        (
            "reward-gpu",
            lambda d: (d["sources"][0].update(efficiency={8: 0.7}), _gpu_nodes(d, gpus=4)),
            "sources[0].efficiency",
        ),
        (
            "reward-gpu",
            lambda d: d["sources"][0]["services"].append({"name": "rm-7b", "params_b": 8}),
            "sources[0].services[10].name",
        ),
        (
            "deepsearch",
            lambda d: d["cluster"]["apis"].append(dict(d["cluster"]["apis"][0])),
            "cluster.apis[3].name",
        ),
        ("reward-gpu", lambda d: d["static"].update(gpus_per_replica=3), "static.gpus_per_replica"),
        # A 1-GPU static replica cannot hold rm-70b's weights.
        ("reward-gpu", lambda d: d["static"].update(gpus_per_replica=1), "static.gpus_per_replica"),
    ],
)
def test_work_no_node_can_ever_hold_is_refused_naming_the_field(
    base: str, mutate: object, field: str
) -> None:
    doc = _doc(base)
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(InvalidSpec) as err:
        parse(doc)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("efficiency", "field", "message"),
    [
        ({3: 0.5}, "sources[0].efficiency", "got E(3)=0.5"),
        ({}, "sources[0].efficiency", "must give E(m)"),
        ({"x": 0.5}, "sources[0].efficiency", "key 'x': "),
        # A key with a dot is one key, not a path: "efficiency.2" and "key '5'" named neither.
        ({2.5: 0.5}, "sources[0].efficiency", "key '2.5': "),
    ],
)
def test_an_efficiency_error_names_the_efficiency_field(efficiency: object, field: str, message: str) -> None:
    doc = _doc("reward-gpu")
    doc["sources"][0]["efficiency"] = efficiency
    with pytest.raises(InvalidSpec) as err:
        parse(doc)
    assert err.value.field == field and message in err.value.message
    assert "Value error" not in err.value.message


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        # A slip of units: 600 s written as 0.0006 would loop over 6e6 on/off cycles per service.
        ({"period_s": 0.0006}, "sources[0].period_s", "on/off cycles"),
        ({"on_utilization": 5_000.0}, "sources[0]", "actions"),
    ],
)
def test_a_reward_source_too_large_to_generate_is_refused_before_any_is(
    change: dict[str, float], field: str, message: str
) -> None:
    """Without the check the generator loops for hours and prints nothing (the planner's own
    ``period_s`` only makes a run longer, with its progress bar, so it is not bounded here)."""
    wl = builtin("reward-gpu")
    wl = dataclasses.replace(wl, sources=(dataclasses.replace(wl.sources[0], **change),))
    with pytest.raises(InvalidSpec, match=message) as err:
        generate(wl)
    assert err.value.field == field
    # --scale takes a fraction of the horizon: what was refused whole then generates.
    assert generate(with_overrides(wl, scale=0.001))


def test_a_coding_source_too_large_to_generate_is_refused_naming_its_fields() -> None:
    wl = builtin("ai-coding")
    huge = dataclasses.replace(wl.sources[0], trajectories=10**6, actions_max=1000)
    with pytest.raises(InvalidSpec, match=r"trajectories x actions\.max") as err:
        generate(dataclasses.replace(wl, sources=(huge,)))
    assert err.value.field == "sources[0]"


def _coding(d: dict) -> dict:  # type: ignore[type-arg]
    return d["sources"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("mutate", "field", "message"),
    [
        # A 1e300 s think time or release left every later action 0 s long (ACT nan or 0).
        (lambda d: _coding(d)["think"].update(median_s=1e300), "sources[0].think.median_s", "limit of"),
        (lambda d: _coding(d).update(release_at_s=1e300), "sources[0].release_at_s", "limit of"),
        (lambda d: _coding(d)["tool"].update(median_s=1e300), "sources[0].tool.median_s", "limit of"),
        (lambda d: d["cluster"].update(dispatch_overhead_s=1e9), "cluster.dispatch_overhead_s", "limit of"),
        (lambda d: d["static"].update(pod_admission_per_s=1e-300), "static.pod_admission_per_s", "one every"),
        # sigma 1000: the generator's estimate (the lognormal's mean) overflowed, a traceback.
        (lambda d: _coding(d)["tool"].update(sigma=1000), "sources[0].tool", "e^(sigma^2/2)"),
        (lambda d: _coding(d)["think"].update(sigma=40), "sources[0].think", "e^(sigma^2/2)"),
        (lambda d: _coding(d)["test"].update(t1_sigma=40), "sources[0].test", "e^(sigma^2/2)"),
        # An uncapped exponential backoff: 30 tries of 1 s took static's clock to 1e14 s.
        (lambda d: d["static"].update(max_failures=30), "static.max_failures", "api_backoff_s * 2^28"),
        # 10^7 hosts did not finish setting up.
        (lambda d: d["cluster"]["cpu_hosts"].update(count=10**7), "cluster.cpu_hosts.count", "100000"),
    ],
)
def test_figures_the_simulator_cannot_run_are_refused_naming_the_field(
    mutate: object, field: str, message: str
) -> None:
    doc = _doc("memory-tight")
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(InvalidSpec) as err:
        generate(parse(doc))
    assert err.value.field == field and message in err.value.message


def test_times_up_to_the_bound_are_taken() -> None:
    doc = _doc("memory-tight")
    _coding(doc).update(release_at_s=MAX_SECONDS)
    _coding(doc)["think"].update(median_s=1.0, sigma=5.0)  # mean e^12.5 s, under the bound
    assert parse(doc).sources[0].release_at_s == MAX_SECONDS  # type: ignore[union-attr]


def _memory_tight_text() -> str:
    return (Path(__file__).parents[3] / "operator/arl_tangram/sim/workloads/memory-tight.yaml").read_text()


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        # The last of two keys silently won.
        (_memory_tight_text() + "seed: 4\n", "seed", "given twice (lines 8 and 27)"),
        (
            _memory_tight_text().replace("{median_s: 2.0, sigma: 0.5}", "{median_s: 2.0, median_s: 9}"),
            "sources[0].think.median_s",
            "given twice",
        ),
        # An alias was taken: a few lines of them are billions of values to validate.
        (
            _memory_tight_text().replace("name: memory-tight", "name: &n memory-tight")
            + "training: {steps: 1, train_s: 1, staleness_s: *n}\n",
            "training.staleness_s",
            "a YAML alias (*n, line 27)",
        ),
        ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n", "b[0]", "alias"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "--workload-file", "nested too deeply"),
        ("", "workload", "the top level must be a mapping"),
        ("- a\n- b\n", "workload", "the top level must be a mapping"),
    ],
)
@pytest.mark.timeout(30)
def test_yaml_a_safe_load_takes_silently_is_refused_naming_where(
    tmp_path: Path, text: str, field: str, message: str
) -> None:
    f = tmp_path / "w.yaml"
    f.write_text(text)
    with pytest.raises(InvalidSpec) as err:
        load(f)
    assert err.value.field == field and message in err.value.message


def test_a_file_that_is_not_utf8_is_refused_not_a_traceback(tmp_path: Path) -> None:
    f = tmp_path / "w.yaml"
    f.write_bytes(_memory_tight_text().encode().replace(b"memory-tight", b"memory-\xff", 1))
    with pytest.raises(InvalidSpec, match="not UTF-8") as err:
        load(f)
    assert err.value.field == "--workload-file"


def test_a_test_dop_past_a_host_stops_at_the_hosts_cores_and_runs_the_same() -> None:
    """``cores_max: 1000000000`` built a billion DoPs per test (it hung); no policy grants a test
    more than a host's cores, so the range stops there and every policy runs exactly as at it."""
    from arl_tangram.sim.engine import Simulation

    def workload(cores_max: int) -> Workload:
        doc = _doc("memory-tight")  # hosts of 64 cores
        _coding(doc)["test"].update(cores_max=cores_max)
        return parse(doc)

    wide = workload(10**9)
    tests = [st for t in generate(wide) for st in t.steps if st.kind == "test"]
    assert tests and {max(st.feasible) for st in tests} == {64}
    for policy in ("static", "fcfs-min", "paper", "tangram"):
        runs = [Simulation(wl, policy).run() for wl in (wide, workload(64))]
        assert [(r.start, r.end) for r in runs[0].records] == [(r.start, r.end) for r in runs[1].records]
