"""Workload files: the cluster, the baseline's provisioning and the sources of actions, in YAML.

Every parameter a simulation uses is in the file (docs/workloads.md documents each). ``load`` reads
and validates one; ``builtin`` loads one shipped with the package; ``generate`` turns a workload into
the same trajectories for every policy (seeded, deterministic).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from arl_tangram.core.action import Amdahl, DurationModel, EfficiencyCurve, Fixed, feasible_range
from arl_tangram.errors import InvalidSpec

BUILTIN = ("ai-coding", "reward-gpu", "deepsearch", "mixed", "memory-tight", "swe")


# ---- reading helpers: each names the field it complains about ---------------------------------------
def _get(d: dict[str, Any], key: str, where: str, kind: type | tuple[type, ...] = (int, float)) -> Any:
    if key not in d:
        raise InvalidSpec(f"{where}.{key}", "is required")
    value = d[key]
    if kind in ((int, float), float) and isinstance(value, bool):
        raise InvalidSpec(f"{where}.{key}", f"must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise InvalidSpec(f"{where}.{key}", f"has the wrong type: {value!r}")
    return value


def _num(d: dict[str, Any], key: str, where: str, lo: float = 0.0, default: float | None = None) -> float:
    if key not in d and default is not None:
        return default
    value = float(_get(d, key, where))
    if value < lo or math.isnan(value):
        raise InvalidSpec(f"{where}.{key}", f"must be >= {lo}, got {value}")
    return value


def _int(d: dict[str, Any], key: str, where: str, lo: int = 0, default: int | None = None) -> int:
    if key not in d and default is not None:
        return default
    value = _get(d, key, where, int)
    if value < lo:
        raise InvalidSpec(f"{where}.{key}", f"must be >= {lo}, got {value}")
    return int(value)


def _dict(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, dict):
        raise InvalidSpec(f"{where}.{key}", "must be a mapping")
    return value


@dataclass(frozen=True)
class LogNormal:
    """A lognormal given by its median and sigma (of the underlying normal)."""

    median: float
    sigma: float

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def sample(self, rng: random.Random) -> float:
        return self.median * math.exp(rng.gauss(0.0, self.sigma)) if self.sigma > 0 else self.median

    @classmethod
    def parse(cls, d: dict[str, Any], where: str) -> LogNormal:
        return cls(_num(d, "median_s", where, 1e-9), _num(d, "sigma", where, 0.0))


# ---- the cluster -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ApiSpec:
    name: str
    concurrency: int
    rate: float
    burst: float


@dataclass(frozen=True)
class ClusterSpec:
    cpu_hosts: int
    cores_per_host: int
    numa_per_host: int
    memory_gib_per_host: float
    gpu_nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    nvlink: str
    mig: dict[int, list[str]]
    restore_gbps: float
    memory_headroom: float
    apis: tuple[ApiSpec, ...]
    dispatch_overhead_s: float
    last_node_gpus: int = 0  # GPUs of the last node in the pool (0: all); the rest serve others

    @property
    def total_gpus(self) -> int:
        if self.gpu_nodes and self.last_node_gpus:
            return (self.gpu_nodes - 1) * self.gpus_per_node + self.last_node_gpus
        return self.gpu_nodes * self.gpus_per_node


@dataclass(frozen=True)
class StaticSpec:
    dop: int
    pod_request_cores: float
    pod_limit_cores: float
    pod_admission_per_s: float
    pod_start: LogNormal
    gpus_per_replica: int
    api_fail_s: float
    api_backoff_s: float
    max_failures: int


# ---- the sources of actions --------------------------------------------------------------------------
@dataclass(frozen=True)
class CodingSource:
    trajectories: int
    release_at_s: float
    actions_min: int
    actions_max: int
    think: LogNormal
    tool_cores: int
    tool: LogNormal
    test_every: int
    test_last: bool
    test_cores_min: int
    test_cores_max: int
    test_p_min: float
    test_p_max: float
    test_t1: LogNormal
    memory_gib: float
    tenant: str
    priority: int


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    params_b: float


@dataclass(frozen=True)
class RewardSource:
    services: tuple[ServiceSpec, ...]
    bytes_per_param: float
    efficiency: dict[int, float]
    t1: LogNormal
    period_s: float
    on_fraction: float
    on_utilization: float
    horizon_s: float
    tenant: str
    priority: int


@dataclass(frozen=True)
class SearchSource:
    trajectories: int
    calls_min: int
    calls_max: int
    apis: tuple[str, ...]
    call: LogNormal
    think: LogNormal
    judge: ServiceSpec
    bytes_per_param: float
    efficiency: dict[int, float]
    judge_t1: LogNormal
    tenant: str
    priority: int


Source = CodingSource | RewardSource | SearchSource


@dataclass(frozen=True)
class PlannerSpec:
    """How the capacity planner scales the pools when a run uses it (``bench sim --planner``)."""

    period_s: float
    host_cores: int
    host_cold_start_s: float
    gpu_cold_start_s: float
    min_hosts: int
    warm_hosts: int
    min_gpu_nodes: int
    warm_gpu_nodes: int
    max_starting: int
    idle_timeout_s: float
    time_limit_s: float
    solver: str
    target_utilisation: float = 0.8
    target_efficiency: float = 0.5
    sessions_per_core: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    cluster: ClusterSpec
    static: StaticSpec
    sources: tuple[Source, ...]
    description: str = ""
    planner: PlannerSpec | None = None

    @property
    def has_gpu(self) -> bool:
        return any(isinstance(s, RewardSource | SearchSource) for s in self.sources)


def _cluster(d: dict[str, Any]) -> ClusterSpec:
    w = "cluster"
    cpu = _dict(d, "cpu_hosts", w)
    gpu = _dict(d, "gpu_nodes", w)
    apis = []
    for i, a in enumerate(d.get("apis", []) or []):
        where = f"cluster.apis[{i}]"
        if not isinstance(a, dict):
            raise InvalidSpec(where, "must be a mapping")
        apis.append(
            ApiSpec(
                str(_get(a, "name", where, str)),
                _int(a, "concurrency", where, 1),
                _num(a, "rate_per_s", where, 1e-9),
                _num(a, "burst", where, 1.0),
            )
        )
    nvlink = str(gpu.get("nvlink", "all"))
    if nvlink not in ("all", "pairs"):
        raise InvalidSpec("cluster.gpu_nodes.nvlink", f"must be 'all' or 'pairs', got {nvlink!r}")
    mig_raw = gpu.get("mig", {}) or {}
    if not isinstance(mig_raw, dict):
        raise InvalidSpec("cluster.gpu_nodes.mig", "must map a GPU index to a list of MIG profiles")
    mig = {int(k): [str(p) for p in v] for k, v in mig_raw.items()}
    per = _int(gpu, "gpus", f"{w}.gpu_nodes", 1, 8)
    last = _int(gpu, "last_node_gpus", f"{w}.gpu_nodes", 0, 0)
    if last > per:
        raise InvalidSpec(f"{w}.gpu_nodes.last_node_gpus", f"must be at most gpus ({per}), got {last}")
    return ClusterSpec(
        cpu_hosts=_int(cpu, "count", f"{w}.cpu_hosts", 0, 0),
        cores_per_host=_int(cpu, "cores", f"{w}.cpu_hosts", 1, 1),
        numa_per_host=_int(cpu, "numa_nodes", f"{w}.cpu_hosts", 1, 1),
        memory_gib_per_host=_num(cpu, "memory_gib", f"{w}.cpu_hosts", 0.0, 0.0),
        gpu_nodes=_int(gpu, "count", f"{w}.gpu_nodes", 0, 0),
        gpus_per_node=_int(gpu, "gpus", f"{w}.gpu_nodes", 1, 8),
        gpu_memory_gb=_num(gpu, "memory_gb", f"{w}.gpu_nodes", 1.0, 80.0),
        nvlink=nvlink,
        mig=mig,
        restore_gbps=_num(gpu, "restore_gbps", f"{w}.gpu_nodes", 1e-9, 20.0),
        memory_headroom=_num(gpu, "memory_headroom", f"{w}.gpu_nodes", 1.0, 1.2),
        apis=tuple(apis),
        dispatch_overhead_s=_num(d, "dispatch_overhead_s", w, 0.0, 0.0),
        last_node_gpus=0 if last == per else last,
    )


def _static(d: dict[str, Any]) -> StaticSpec:
    w = "static"
    return StaticSpec(
        dop=_int(d, "dop", w, 1, 4),
        pod_request_cores=_num(d, "pod_request_cores", w, 0.0, 0.5),
        pod_limit_cores=_num(d, "pod_limit_cores", w, 1e-9, 4.0),
        pod_admission_per_s=_num(d, "pod_admission_per_s", w, 1e-9, 20.0),
        pod_start=LogNormal.parse(_dict(d, "pod_start", w), f"{w}.pod_start")
        if "pod_start" in d
        else LogNormal(5.0, 0.0),
        gpus_per_replica=_int(d, "gpus_per_replica", w, 1, 4),
        api_fail_s=_num(d, "api_fail_s", w, 0.0, 0.05),
        api_backoff_s=_num(d, "api_backoff_s", w, 0.0, 1.0),
        max_failures=_int(d, "max_failures", w, 1, 3),
    )


def _efficiency(d: dict[str, Any], where: str) -> dict[int, float]:
    raw = _dict(d, "efficiency", where)
    if not raw:
        raise InvalidSpec(f"{where}.efficiency", "must give E(m) for each feasible GPU count")
    out = {int(k): float(v) for k, v in raw.items()}
    for k, e in out.items():
        if k not in (1, 2, 4, 8) or not 0 < e <= 1:
            raise InvalidSpec(f"{where}.efficiency", f"need m in 1,2,4,8 and 0 < E <= 1, got E({k})={e}")
    return out


def _services(d: dict[str, Any], where: str) -> tuple[ServiceSpec, ...]:
    raw = d.get("services")
    if not isinstance(raw, list) or not raw:
        raise InvalidSpec(f"{where}.services", "must be a non-empty list of {name, params_b}")
    out = []
    for i, s in enumerate(raw):
        sw = f"{where}.services[{i}]"
        if not isinstance(s, dict):
            raise InvalidSpec(sw, "must be a mapping")
        out.append(ServiceSpec(str(_get(s, "name", sw, str)), _num(s, "params_b", sw, 1e-9)))
    return tuple(out)


def _source(d: dict[str, Any], i: int) -> Source:
    w = f"sources[{i}]"
    kind = d.get("kind")
    tenant = str(d.get("tenant", "default"))
    priority = _int(d, "priority", w, 0, 0)
    if kind == "coding":
        tool = _dict(d, "tool", w)
        test = _dict(d, "test", w)
        acts = _dict(d, "actions", w)
        src = CodingSource(
            trajectories=_int(d, "trajectories", w, 1),
            release_at_s=_num(d, "release_at_s", w, 0.0, 0.0),
            actions_min=_int(acts, "min", f"{w}.actions", 1),
            actions_max=_int(acts, "max", f"{w}.actions", 1),
            think=LogNormal.parse(_dict(d, "think", w), f"{w}.think"),
            tool_cores=_int(tool, "cores", f"{w}.tool", 1),
            tool=LogNormal.parse(tool, f"{w}.tool"),
            test_every=_int(test, "every", f"{w}.test", 1),
            test_last=bool(test.get("last", True)),
            test_cores_min=_int(test, "cores_min", f"{w}.test", 1),
            test_cores_max=_int(test, "cores_max", f"{w}.test", 1),
            test_p_min=_num(test, "p_min", f"{w}.test"),
            test_p_max=_num(test, "p_max", f"{w}.test"),
            test_t1=LogNormal(
                _num(test, "t1_median_s", f"{w}.test", 1e-9), _num(test, "t1_sigma", f"{w}.test")
            ),
            memory_gib=_num(d, "memory_gib", w, 0.0, 0.0),
            tenant=tenant,
            priority=priority,
        )
        if src.actions_max < src.actions_min:
            raise InvalidSpec(f"{w}.actions", "max must be >= min")
        if src.test_cores_max < src.test_cores_min:
            raise InvalidSpec(f"{w}.test.cores_max", "must be >= cores_min")
        if not 0 <= src.test_p_min <= src.test_p_max <= 1:
            raise InvalidSpec(f"{w}.test.p_min", "need 0 <= p_min <= p_max <= 1")
        return src
    if kind == "reward":
        src_r = RewardSource(
            services=_services(d, w),
            bytes_per_param=_num(d, "bytes_per_param", w, 1e-9, 2.0),
            efficiency=_efficiency(d, w),
            t1=LogNormal.parse(_dict(d, "t1", w), f"{w}.t1"),
            period_s=_num(d, "period_s", w, 1e-9),
            on_fraction=_num(d, "on_fraction", w, 1e-9),
            on_utilization=_num(d, "on_utilization", w, 1e-9),
            horizon_s=_num(d, "horizon_s", w, 1e-9),
            tenant=tenant,
            priority=priority,
        )
        if src_r.on_fraction > 1:
            raise InvalidSpec(f"{w}.on_fraction", "must be <= 1")
        return src_r
    if kind == "search":
        calls = _dict(d, "calls", w)
        judge = _dict(d, "judge", w)
        apis = d.get("apis")
        if not isinstance(apis, list) or not apis:
            raise InvalidSpec(f"{w}.apis", "must list the API names calls go to")
        return SearchSource(
            trajectories=_int(d, "trajectories", w, 1),
            calls_min=_int(calls, "min", f"{w}.calls", 1),
            calls_max=_int(calls, "max", f"{w}.calls", 1),
            apis=tuple(str(a) for a in apis),
            call=LogNormal.parse(_dict(d, "call", w), f"{w}.call"),
            think=LogNormal.parse(_dict(d, "think", w), f"{w}.think"),
            judge=ServiceSpec(
                str(_get(judge, "name", f"{w}.judge", str)), _num(judge, "params_b", f"{w}.judge", 1e-9)
            ),
            bytes_per_param=_num(judge, "bytes_per_param", f"{w}.judge", 1e-9, 2.0),
            efficiency=_efficiency(judge, f"{w}.judge"),
            judge_t1=LogNormal.parse(_dict(judge, "t1", f"{w}.judge"), f"{w}.judge.t1"),
            tenant=tenant,
            priority=priority,
        )
    raise InvalidSpec(f"{w}.kind", f"must be coding, reward or search, got {kind!r}")


def _planner(d: dict[str, Any]) -> PlannerSpec:
    w = "planner"
    spec = PlannerSpec(
        period_s=_num(d, "period_s", w, 1e-3, 10.0),
        host_cores=_int(d, "host_cores", w, 1, 64),
        host_cold_start_s=_num(d, "host_cold_start_s", w, 0.0, 10.0),
        gpu_cold_start_s=_num(d, "gpu_cold_start_s", w, 0.0, 60.0),
        min_hosts=_int(d, "min_hosts", w, 1, 1),
        warm_hosts=_int(d, "warm_hosts", w, 0, 1),
        min_gpu_nodes=_int(d, "min_gpu_nodes", w, 1, 1),
        warm_gpu_nodes=_int(d, "warm_gpu_nodes", w, 0, 0),
        max_starting=_int(d, "max_starting", w, 1, 4),
        idle_timeout_s=_num(d, "idle_timeout_s", w, 0.0, 60.0),
        time_limit_s=_num(d, "time_limit_s", w, 0.0, 1.0),
        solver=str(d.get("solver", "greedy")),
        target_utilisation=_num(d, "target_utilisation", w, 1e-3, 0.8),
        target_efficiency=_num(d, "target_efficiency", w, 1e-3, 0.5),
        sessions_per_core=_num(d, "sessions_per_core", w, 0.0, 0.0),
    )
    for name in ("target_utilisation", "target_efficiency"):
        if getattr(spec, name) > 1.0:
            raise InvalidSpec(f"planner.{name}", f"must be in (0, 1], got {getattr(spec, name)}")
    if spec.solver not in ("auto", "highs", "cbc", "greedy"):
        raise InvalidSpec("planner.solver", f"must be auto, highs, cbc or greedy, got {spec.solver!r}")
    return spec


def parse(doc: Any, origin: str = "<workload>") -> Workload:
    """Validate a parsed YAML document into a Workload."""
    if not isinstance(doc, dict):
        raise InvalidSpec("workload", f"{origin}: the top level must be a mapping")
    sources = doc.get("sources")
    if not isinstance(sources, list) or not sources:
        raise InvalidSpec("sources", f"{origin}: must be a non-empty list")
    wl = Workload(
        name=str(doc.get("name", origin)),
        seed=_int(doc, "seed", "workload", 0, 0),
        cluster=_cluster(_dict(doc, "cluster", "workload")),
        static=_static(_dict(doc, "static", "workload")),
        sources=tuple(_source(s if isinstance(s, dict) else {}, i) for i, s in enumerate(sources)),
        description=str(doc.get("description", "")),
        planner=_planner(_dict(doc, "planner", "workload")),
    )
    api_names = {a.name for a in wl.cluster.apis}
    for i, s in enumerate(wl.sources):
        if isinstance(s, SearchSource):
            missing = set(s.apis) - api_names
            if missing:
                raise InvalidSpec(f"sources[{i}].apis", f"not declared under cluster.apis: {sorted(missing)}")
        if isinstance(s, CodingSource) and wl.cluster.cpu_hosts == 0:
            raise InvalidSpec("cluster.cpu_hosts.count", "a coding source needs sandbox hosts")
        if isinstance(s, RewardSource | SearchSource) and wl.cluster.gpu_nodes == 0:
            raise InvalidSpec("cluster.gpu_nodes.count", "reward and judge actions need GPU nodes")
    return wl


def load(path: str | Path) -> Workload:
    """Read and validate a workload file."""
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise InvalidSpec("--workload-file", f"cannot read {p}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise InvalidSpec("--workload-file", f"{p} is not valid YAML: {exc}") from exc
    return parse(doc, str(p))


def builtin(name: str) -> Workload:
    """One of the workloads shipped with the package."""
    if name not in BUILTIN:
        raise InvalidSpec("--workload", f"unknown workload {name!r}; built-in: {', '.join(BUILTIN)}")
    text = resources.files("arl_tangram.sim").joinpath("workloads", f"{name}.yaml").read_text()
    return parse(yaml.safe_load(text), f"{name}.yaml")


# ---- generation --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One action of a trajectory, preceded by ``think_s`` of LLM generation."""

    think_s: float
    kind: str
    pool: str
    feasible: tuple[int, ...]
    estimate: DurationModel
    true: DurationModel
    service: str | None = None
    service_gb: float = 0.0


@dataclass
class Trajectory:
    id: str
    start: float
    steps: list[Step]
    memory_gib: float = 0.0
    tenant: str = "default"
    priority: int = 0
    needs_pod: bool = False


def min_gpus(params_b: float, bytes_per_param: float, headroom: float, gpu_gb: float) -> int:
    """Fewest GPUs (1, 2, 4, 8) whose memory holds the weights with headroom."""
    need = params_b * bytes_per_param * headroom
    for k in (1, 2, 4, 8):
        if need / k <= gpu_gb:
            return k
    raise InvalidSpec("services.params_b", f"{params_b}B parameters do not fit on 8 GPUs of {gpu_gb} GB")


def _gpu_step(
    kind: str,
    svc: ServiceSpec,
    bpp: float,
    eff: dict[int, float],
    t1_true: float,
    t1_est: float,
    cluster: ClusterSpec,
    think: float,
) -> Step:
    lo = min_gpus(svc.params_b, bpp, cluster.memory_headroom, cluster.gpu_memory_gb)
    feasible = tuple(k for k in sorted(eff) if k >= lo and k <= cluster.gpus_per_node)
    curve = tuple(sorted(eff.items()))
    return Step(
        think,
        kind,
        "gpu",
        feasible,
        EfficiencyCurve(t1_est, curve),
        EfficiencyCurve(t1_true, curve),
        svc.name,
        svc.params_b * bpp,
    )


def generate(wl: Workload) -> list[Trajectory]:
    """Every trajectory of the workload, the same for a given seed whatever the policy."""
    out: list[Trajectory] = []
    for si, src in enumerate(wl.sources):
        rng = random.Random(f"{wl.seed}:{si}")
        if isinstance(src, CodingSource):
            tool_est = Fixed(src.tool.mean)
            for t in range(src.trajectories):
                n = rng.randint(src.actions_min, src.actions_max)
                steps = []
                for i in range(n):
                    think = src.think.sample(rng)
                    is_test = (i + 1) % src.test_every == 0 or (src.test_last and i == n - 1)
                    if is_test:
                        model = Amdahl(src.test_t1.sample(rng), rng.uniform(src.test_p_min, src.test_p_max))
                        feas = feasible_range(src.test_cores_min, src.test_cores_max)
                        steps.append(Step(think, "test", "cpu", feas, model, model))
                    else:
                        steps.append(
                            Step(
                                think, "tool", "cpu", (src.tool_cores,), tool_est, Fixed(src.tool.sample(rng))
                            )
                        )
                out.append(
                    Trajectory(
                        f"s{si}-t{t}", src.release_at_s, steps, src.memory_gib, src.tenant, src.priority, True
                    )
                )
        elif isinstance(src, RewardSource):
            t1_est = src.t1.mean
            # Demand is defined against the baseline: while on, a service keeps its static replica
            # (gpus_per_replica GPUs at that TP) ``on_utilization`` busy.
            tp = wl.static.gpus_per_replica
            static_dur = src.t1.mean / (src.efficiency.get(tp, 1.0) * tp)
            rate_on = src.on_utilization / static_dur
            on_len = src.period_s * src.on_fraction
            for j, svc in enumerate(src.services):
                phase = src.period_s * j / len(src.services)
                cycle_start = phase - src.period_s
                k = 0
                while cycle_start < src.horizon_s:
                    clock = max(0.0, cycle_start)
                    end = min(cycle_start + on_len, src.horizon_s)
                    while True:
                        clock += rng.expovariate(rate_on)
                        if clock >= end:
                            break
                        step = _gpu_step(
                            "reward",
                            svc,
                            src.bytes_per_param,
                            src.efficiency,
                            src.t1.sample(rng),
                            t1_est,
                            wl.cluster,
                            0.0,
                        )
                        out.append(
                            Trajectory(f"s{si}-{svc.name}-r{k}", clock, [step], 0.0, src.tenant, src.priority)
                        )
                        k += 1
                    cycle_start += src.period_s
        else:
            for t in range(src.trajectories):
                n = rng.randint(src.calls_min, src.calls_max)
                steps = []
                for _ in range(n):
                    api = src.apis[rng.randrange(len(src.apis))]
                    steps.append(
                        Step(
                            src.think.sample(rng),
                            "call",
                            f"api:{api}",
                            (1,),
                            Fixed(src.call.mean),
                            Fixed(src.call.sample(rng)),
                        )
                    )
                steps.append(
                    _gpu_step(
                        "judge",
                        src.judge,
                        src.bytes_per_param,
                        src.efficiency,
                        src.judge_t1.sample(rng),
                        src.judge_t1.mean,
                        wl.cluster,
                        src.think.sample(rng),
                    )
                )
                out.append(Trajectory(f"s{si}-t{t}", 0.0, steps, 0.0, src.tenant, src.priority))
    out.sort(key=lambda tr: (tr.start, tr.id))
    return out


def with_overrides(wl: Workload, *, gpus: int | None = None, scale: float | None = None) -> Workload:
    """The same workload with another GPU count (whole nodes, the last one partly in the pool when
    the count is not a multiple of a node) or fewer trajectories."""
    import dataclasses

    cluster = wl.cluster
    if gpus is not None:
        per = cluster.gpus_per_node
        if gpus < 1:
            raise InvalidSpec("gpus", f"must be >= 1, got {gpus}")
        # Whole nodes, the last one partly in the pool when the count is not a multiple.
        nodes = -(-gpus // per)
        last = gpus - (nodes - 1) * per
        cluster = dataclasses.replace(cluster, gpu_nodes=nodes, last_node_gpus=0 if last == per else last)
    sources = wl.sources
    if scale is not None:
        if not 0 < scale <= 1:
            raise InvalidSpec("--scale", f"must be in (0, 1], got {scale}")
        scaled: list[Source] = []
        for s in sources:
            if isinstance(s, CodingSource | SearchSource):
                scaled.append(dataclasses.replace(s, trajectories=max(1, round(s.trajectories * scale))))
            else:
                scaled.append(dataclasses.replace(s, horizon_s=s.horizon_s * scale))
        sources = tuple(scaled)
    return dataclasses.replace(wl, cluster=cluster, sources=sources)
