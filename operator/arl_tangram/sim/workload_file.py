"""The workload file format (docs/workloads.md): pydantic models that refuse unknown fields and
build the simulator's domain specs (``sim.workload``) and the planner's (``ScalingPolicy``).

A wrong field raises :class:`InvalidSpec` naming its path, e.g. ``planner.peroid_s: unknown
field``. Scaling fields left out take the planner's defaults (which read the API models'); the
static baseline's pod start-up and exec figures left out take the measured ``calibration.yaml``.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import StrictInt as _StrictInt

from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.gpu import LEVELS
from arl_tangram.planner.snapshot import ScalingPolicy
from arl_tangram.sim.calibration import calibration
from arl_tangram.sim.workload import (
    MAX_NODES,
    MAX_SECONDS,
    ApiSpec,
    ClusterSpec,
    CodingSource,
    LogNormal,
    PlannerSpec,
    RewardSource,
    SearchSource,
    ServiceSpec,
    Source,
    StaticSpec,
    TrainingSpec,
    Workload,
    field_path,
    min_gpus,
)

# YAML numbers: an int is a fine float, a bool is not a number (pydantic's lax mode would take it).
Num = Annotated[float, Field(strict=False, allow_inf_nan=False)]
Int = _StrictInt


def _seconds(s: float) -> float:
    if s > MAX_SECONDS:
        raise ValueError(f"{s:g} s is over the simulator's limit of {MAX_SECONDS:g} s for a time")
    return s


# A time of the file (a duration, a period, a release time): bounded, see ``MAX_SECONDS``.
Seconds = Annotated[Num, AfterValidator(_seconds)]


def _rate(r: float) -> float:
    if 0 < r < 1 / MAX_SECONDS:
        raise ValueError(
            f"{r:g} per second is one every {1 / r:g} s, over the simulator's limit of "
            f"{MAX_SECONDS:g} s for a time"
        )
    return r


# A rate of the file: its interval is a time, bounded as one.
PerSecond = Annotated[Num, AfterValidator(_rate)]


def _lognormal(median_s: float, sigma: float) -> None:
    """Refuse a lognormal whose mean (median * e^(sigma^2/2)) is past ``MAX_SECONDS``: the
    generator takes the mean as the scheduler's estimate, and it overflowed from sigma 38 on."""
    if math.log(median_s) + sigma**2 / 2 > math.log(MAX_SECONDS):
        raise ValueError(
            f"median {median_s:g} s with sigma {sigma:g}: the mean, median * e^(sigma^2/2), is over "
            f"the simulator's limit of {MAX_SECONDS:g} s for a time"
        )


def _level(gpus: int) -> int:
    """``gpus`` where it is one of the GPU manager's chunk sizes (``LEVELS``)."""
    if gpus not in LEVELS:
        raise ValueError(f"must be one of {', '.join(map(str, LEVELS))}, got {gpus}")
    return gpus


# A count of GPUs that is a chunk of the GPU manager's (a node's, a replica's TP size).
GpuLevel = Annotated[Int, AfterValidator(_level)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bools(cls, data: Any) -> Any:
        # A bool where a number belongs is a mistake (``count: yes``), not 1.
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), bool) and field.annotation not in (bool, "bool"):
                    raise ValueError(f"{name}: must be a number, got {data[name]!r}")
        return data


class LogNormalModel(_Model):
    median_s: Seconds = Field(gt=0)
    sigma: Num = Field(ge=0)

    @model_validator(mode="after")
    def _mean(self) -> LogNormalModel:
        _lognormal(self.median_s, self.sigma)
        return self

    def spec(self) -> LogNormal:
        return LogNormal(self.median_s, self.sigma)


class Range(_Model):
    min: Int = Field(ge=1)
    max: Int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.max < self.min:
            raise ValueError("max must be >= min")
        return self


# ---- cluster -----------------------------------------------------------------------------------------
class CpuHosts(_Model):
    count: Int = Field(0, ge=0, le=MAX_NODES)
    cores: Int = Field(1, ge=1)
    numa_nodes: Int = Field(1, ge=1)
    memory_gib: Num = Field(0.0, ge=0)


class GpuNodes(_Model):
    count: Int = Field(0, ge=0, le=MAX_NODES)
    gpus: GpuLevel = 8  # a node is cut into the GPU manager's chunks
    last_node_gpus: Int = Field(0, ge=0)
    memory_gb: Num = Field(80.0, ge=1)
    nvlink: Literal["all", "pairs"] = "all"
    mig: dict[int, list[str]] = Field(default_factory=dict)
    restore_gbps: Num = Field(20.0, gt=0)
    memory_headroom: Num = Field(1.2, ge=1)

    @model_validator(mode="after")
    def _last(self) -> GpuNodes:
        if self.last_node_gpus > self.gpus:
            raise ValueError(f"last_node_gpus must be at most gpus ({self.gpus}), got {self.last_node_gpus}")
        return self


class Api(_Model):
    name: str
    concurrency: Int = Field(ge=1)
    rate_per_s: PerSecond = Field(gt=0)
    burst: Num = Field(ge=1)


class Cluster(_Model):
    cpu_hosts: CpuHosts = CpuHosts()
    gpu_nodes: GpuNodes = GpuNodes()
    apis: list[Api] = Field(default_factory=list)
    dispatch_overhead_s: Seconds = Field(0.0, ge=0)

    def spec(self) -> ClusterSpec:
        c, g = self.cpu_hosts, self.gpu_nodes
        return ClusterSpec(
            cpu_hosts=c.count,
            cores_per_host=c.cores,
            numa_per_host=c.numa_nodes,
            memory_gib_per_host=c.memory_gib,
            gpu_nodes=g.count,
            gpus_per_node=g.gpus,
            gpu_memory_gb=g.memory_gb,
            nvlink=g.nvlink,
            mig={k: list(v) for k, v in g.mig.items()},
            restore_gbps=g.restore_gbps,
            memory_headroom=g.memory_headroom,
            apis=tuple(ApiSpec(a.name, a.concurrency, a.rate_per_s, a.burst) for a in self.apis),
            dispatch_overhead_s=self.dispatch_overhead_s,
            last_node_gpus=0 if g.last_node_gpus == g.gpus else g.last_node_gpus,
        )


class Static(_Model):
    """The baseline; pod start-up, admission and exec default to the measured calibration."""

    dop: Int = Field(4, ge=1)
    pod_request_cores: Num = Field(0.5, ge=0)
    pod_limit_cores: Num = Field(4.0, gt=0)
    pod_admission_per_s: PerSecond | None = Field(None, gt=0)
    pod_start: LogNormalModel | None = None
    exec_s: Seconds | None = Field(None, ge=0)
    gpus_per_replica: GpuLevel = 4  # the TP size its model runs at
    api_fail_s: Seconds = Field(0.05, ge=0)
    api_backoff_s: Seconds = Field(1.0, ge=0)
    max_failures: Int = Field(3, ge=1)

    @field_validator("max_failures")
    @classmethod
    def _longest_backoff(cls, n: int, info: ValidationInfo) -> int:
        # The wait before the last try is api_backoff_s * 2^(n-2): a time, bounded as one (30
        # tries of 1 s took the run's clock to 1e14 s, where it no longer resolves 0.01 s).
        backoff = info.data.get("api_backoff_s")
        if backoff and n >= 2 and math.log2(backoff) + n - 2 > math.log2(MAX_SECONDS):
            raise ValueError(
                f"the wait before try {n} is api_backoff_s * 2^{n - 2} s, over the simulator's "
                f"limit of {MAX_SECONDS:g} s for a time"
            )
        return n

    def spec(self) -> StaticSpec:
        cal = calibration()
        return StaticSpec(
            dop=self.dop,
            pod_request_cores=self.pod_request_cores,
            pod_limit_cores=self.pod_limit_cores,
            pod_admission_per_s=cal.pod_admission_per_s
            if self.pod_admission_per_s is None
            else self.pod_admission_per_s,
            pod_start=LogNormal(cal.pod_start.median_s, cal.pod_start.sigma)
            if self.pod_start is None
            else self.pod_start.spec(),
            exec_s=cal.exec_s if self.exec_s is None else self.exec_s,
            gpus_per_replica=self.gpus_per_replica,
            api_fail_s=self.api_fail_s,
            api_backoff_s=self.api_backoff_s,
            max_failures=self.max_failures,
        )


# ---- sources -----------------------------------------------------------------------------------------
class _Source(_Model):
    tenant: str = "default"
    priority: Int = Field(0, ge=0)


class Tool(_Model):
    cores: Int = Field(ge=1)
    median_s: Seconds = Field(gt=0)
    sigma: Num = Field(ge=0)

    @model_validator(mode="after")
    def _mean(self) -> Tool:
        _lognormal(self.median_s, self.sigma)
        return self


class Test(_Model):
    every: Int = Field(ge=1)
    last: bool = True
    cores_min: Int = Field(ge=1)
    cores_max: Int = Field(ge=1)
    p_min: Num = Field(ge=0, le=1)
    p_max: Num = Field(ge=0, le=1)
    t1_median_s: Seconds = Field(gt=0)
    t1_sigma: Num = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Test:
        if self.cores_max < self.cores_min:
            raise ValueError("cores_max must be >= cores_min")
        if self.p_max < self.p_min:
            raise ValueError("need p_min <= p_max")
        _lognormal(self.t1_median_s, self.t1_sigma)
        return self


class Coding(_Source):
    kind: Literal["coding"]
    trajectories: Int = Field(ge=1)
    release_at_s: Seconds = Field(0.0, ge=0)
    actions: Range
    think: LogNormalModel
    tool: Tool
    test: Test
    memory_gib: Num = Field(0.0, ge=0)

    def spec(self) -> CodingSource:
        t = self.test
        return CodingSource(
            trajectories=self.trajectories,
            release_at_s=self.release_at_s,
            actions_min=self.actions.min,
            actions_max=self.actions.max,
            think=self.think.spec(),
            tool_cores=self.tool.cores,
            tool=LogNormal(self.tool.median_s, self.tool.sigma),
            test_every=t.every,
            test_last=t.last,
            test_cores_min=t.cores_min,
            test_cores_max=t.cores_max,
            test_p_min=t.p_min,
            test_p_max=t.p_max,
            test_t1=LogNormal(t.t1_median_s, t.t1_sigma),
            memory_gib=self.memory_gib,
            tenant=self.tenant,
            priority=self.priority,
        )


def _efficiency(eff: dict[int, float]) -> dict[int, float]:
    if not eff:
        raise ValueError("must give E(m) for each feasible GPU count")
    for k, e in eff.items():
        if k not in LEVELS or not 0 < e <= 1:
            sizes = ", ".join(map(str, LEVELS))
            raise ValueError(f"need m in {sizes} and 0 < E <= 1, got E({k})={e}")
    return dict(eff)


class Service(_Model):
    name: str
    params_b: Num = Field(gt=0)


class Reward(_Source):
    kind: Literal["reward"]
    services: list[Service] = Field(min_length=1)
    bytes_per_param: Num = Field(2.0, gt=0)
    efficiency: dict[int, Num]
    t1: LogNormalModel
    period_s: Seconds = Field(gt=0)
    on_fraction: Num = Field(gt=0, le=1)
    on_utilization: Num = Field(gt=0)
    horizon_s: Seconds = Field(gt=0)

    # A field validator (not a model one) so that an error's path names ``efficiency``.
    @field_validator("efficiency")
    @classmethod
    def _eff(cls, eff: dict[int, float]) -> dict[int, float]:
        return _efficiency(eff)

    def spec(self) -> RewardSource:
        return RewardSource(
            services=tuple(ServiceSpec(s.name, s.params_b) for s in self.services),
            bytes_per_param=self.bytes_per_param,
            efficiency=dict(self.efficiency),
            t1=self.t1.spec(),
            period_s=self.period_s,
            on_fraction=self.on_fraction,
            on_utilization=self.on_utilization,
            horizon_s=self.horizon_s,
            tenant=self.tenant,
            priority=self.priority,
        )


class Judge(_Model):
    name: str
    params_b: Num = Field(gt=0)
    bytes_per_param: Num = Field(2.0, gt=0)
    efficiency: dict[int, Num]
    t1: LogNormalModel

    @field_validator("efficiency")
    @classmethod
    def _eff(cls, eff: dict[int, float]) -> dict[int, float]:
        return _efficiency(eff)


class Search(_Source):
    kind: Literal["search"]
    trajectories: Int = Field(ge=1)
    calls: Range
    apis: list[str] = Field(min_length=1)
    call: LogNormalModel
    think: LogNormalModel
    judge: Judge

    def spec(self) -> SearchSource:
        j = self.judge
        return SearchSource(
            trajectories=self.trajectories,
            calls_min=self.calls.min,
            calls_max=self.calls.max,
            apis=tuple(self.apis),
            call=self.call.spec(),
            think=self.think.spec(),
            judge=ServiceSpec(j.name, j.params_b),
            bytes_per_param=j.bytes_per_param,
            efficiency=dict(j.efficiency),
            judge_t1=j.t1.spec(),
            tenant=self.tenant,
            priority=self.priority,
        )


SourceModel = Annotated[Coding | Reward | Search, Field(discriminator="kind")]


# ---- planner -----------------------------------------------------------------------------------------
# A planner field of the file and the ScalingPolicy field(s) it sets: which pools, which field.
SCALING_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "min_hosts": (("cpu",), "min_instances"),
    "warm_hosts": (("cpu",), "warm_instances"),
    "host_cold_start_s": (("cpu",), "cold_start_s"),
    "min_gpu_nodes": (("gpu",), "min_instances"),
    "warm_gpu_nodes": (("gpu",), "warm_instances"),
    "gpu_cold_start_s": (("gpu",), "cold_start_s"),
    "max_starting": (("cpu", "gpu"), "max_starting"),
    "idle_timeout_s": (("cpu", "gpu"), "idle_timeout_s"),
    "target_utilisation": (("cpu", "gpu"), "target_utilisation"),
}


def scaling_policy(max_instances: int, settings: dict[str, Any], pool: str) -> ScalingPolicy:
    """The ScalingPolicy of ``pool`` ("cpu" or "gpu") from the file's planner ``settings``: the
    fields given there, ScalingPolicy's own defaults for the rest."""
    kwargs = {
        field: value
        for key, value in settings.items()
        if value is not None
        for pools, field in [SCALING_KEYS[key]]
        if pool in pools
    }
    return ScalingPolicy(max_instances=max(max_instances, kwargs.get("min_instances", 0)), **kwargs)


class Planner(_Model):
    # No floor of its own: what bounds it is the rounds it makes over the run (sim.planning).
    period_s: Seconds = Field(10.0, gt=0)
    host_cores: Int = Field(64, ge=1)
    time_limit_s: Seconds = Field(1.0, ge=0)
    solver: Literal["auto", "highs", "cbc", "greedy"] = "greedy"
    target_efficiency: Num = Field(0.5, gt=0, le=1)
    sessions_per_core: Num = Field(0.0, ge=0)
    # Scaling: None takes ScalingPolicy's default (see SCALING_KEYS).
    min_hosts: Int | None = Field(None, ge=0)
    warm_hosts: Int | None = Field(None, ge=0)
    min_gpu_nodes: Int | None = Field(None, ge=0)
    warm_gpu_nodes: Int | None = Field(None, ge=0)
    max_starting: Int | None = Field(None, ge=1)
    idle_timeout_s: Seconds | None = Field(None, ge=0)
    host_cold_start_s: Seconds | None = Field(None, ge=0)
    gpu_cold_start_s: Seconds | None = Field(None, ge=0)
    target_utilisation: Num | None = Field(None, gt=0, le=1)

    def spec(self, cluster: ClusterSpec) -> PlannerSpec:
        settings = {k: getattr(self, k) for k in SCALING_KEYS}
        per_node = max(1, cluster.cores_per_host // self.host_cores)
        return PlannerSpec(
            period_s=self.period_s,
            host_cores=self.host_cores,
            time_limit_s=self.time_limit_s,
            solver=self.solver,
            target_efficiency=self.target_efficiency,
            sessions_per_core=self.sessions_per_core,
            cpu_scaling=scaling_policy(per_node * cluster.cpu_hosts, settings, "cpu"),
            gpu_scaling=scaling_policy(cluster.gpu_nodes, settings, "gpu"),
        )


class Training(_Model):
    steps: Int = Field(ge=1)
    train_s: Seconds = Field(ge=0)
    staleness_s: Seconds | None = Field(None, gt=0)
    resample: bool = True

    def spec(self) -> TrainingSpec:
        return TrainingSpec(self.steps, self.train_s, self.staleness_s, self.resample)


# ---- the file ----------------------------------------------------------------------------------------
class WorkloadFile(_Model):
    name: str | None = None
    description: str = ""
    seed: Int = Field(0, ge=0)
    cluster: Cluster = Cluster()
    static: Static = Static()
    sources: list[SourceModel] = Field(min_length=1)
    planner: Planner = Planner()
    training: Training | None = None

    @classmethod
    def parse(cls, doc: Any, origin: str = "<workload>") -> Workload:
        """Validate a parsed YAML document into a Workload."""
        if not isinstance(doc, dict):
            raise InvalidSpec("workload", f"{origin}: the top level must be a mapping")
        try:
            model = cls.model_validate(doc)
        except ValidationError as exc:
            raise invalid_spec(exc) from None
        return model.workload(origin)

    def workload(self, origin: str) -> Workload:
        self._check_fits()
        cluster = self.cluster.spec()
        sources: tuple[Source, ...] = tuple(s.spec() for s in self.sources)
        api_names = {a.name for a in cluster.apis}
        for i, s in enumerate(sources):
            if isinstance(s, SearchSource):
                missing = set(s.apis) - api_names
                if missing:
                    declared = f"not declared under cluster.apis: {sorted(missing)}"
                    raise InvalidSpec(f"sources[{i}].apis", declared)
            if isinstance(s, CodingSource) and cluster.cpu_hosts == 0:
                raise InvalidSpec("cluster.cpu_hosts.count", "a coding source needs sandbox hosts")
            if isinstance(s, RewardSource | SearchSource) and cluster.gpu_nodes == 0:
                raise InvalidSpec("cluster.gpu_nodes.count", "reward and judge actions need GPU nodes")
        try:
            planner = self.planner.spec(cluster)
        except InvalidSpec as exc:
            raise InvalidSpec(f"planner ({exc.field})", exc.message) from None
        return Workload(
            name=self.name or origin,
            seed=self.seed,
            cluster=cluster,
            static=self.static.spec(),
            sources=sources,
            description=self.description,
            planner=planner,
            training=None if self.training is None else self.training.spec(),
        )

    def _check_fits(self) -> None:
        """What each field allows alone can still be impossible together: an action or session
        that no host or GPU node can ever hold would otherwise stop a pooled run mid-way (naming an
        action, not the field) or leave it waiting for ever; two services or APIs of one name
        would silently be one. Each is refused here, naming the field."""
        c, g = self.cluster.cpu_hosts, self.cluster.gpu_nodes
        if c.count and c.cores % c.numa_nodes:
            raise InvalidSpec(
                "cluster.cpu_hosts.numa_nodes",
                f"{c.cores} cores do not split evenly over {c.numa_nodes} NUMA nodes",
            )
        for gpu in g.mig:
            if not 0 <= gpu < g.gpus:
                raise InvalidSpec("cluster.gpu_nodes.mig", f"no GPU {gpu} on a node of {g.gpus} GPUs")
        apis: set[str] = set()
        for k, api in enumerate(self.cluster.apis):
            if api.name in apis:
                raise InvalidSpec(f"cluster.apis[{k}].name", f"API {api.name!r} is declared twice")
            apis.add(api.name)
        services: dict[str, str] = {}
        for i, src in enumerate(self.sources):
            at = f"sources[{i}]"
            if isinstance(src, Coding) and c.count:
                if src.tool.cores > c.cores:
                    raise InvalidSpec(f"{at}.tool.cores", f"{src.tool.cores} cores, a host has {c.cores}")
                if src.test.cores_min > c.cores:
                    raise InvalidSpec(
                        f"{at}.test.cores_min", f"{src.test.cores_min} cores, a host has {c.cores}"
                    )
                if src.memory_gib > c.memory_gib:
                    raise InvalidSpec(
                        f"{at}.memory_gib",
                        f"a trajectory holds {src.memory_gib:g} GiB for its life, a host has "
                        f"{c.memory_gib:g} (cluster.cpu_hosts.memory_gib)",
                    )
            declared: list[tuple[str, str, float, float, dict[int, float], str]] = []
            if isinstance(src, Reward):
                declared = [
                    (f"{at}.services[{j}]", s.name, s.params_b, src.bytes_per_param, src.efficiency, at)
                    for j, s in enumerate(src.services)
                ]
            elif isinstance(src, Search):
                j = src.judge
                declared = [
                    (f"{at}.judge", j.name, j.params_b, j.bytes_per_param, j.efficiency, f"{at}.judge")
                ]
            for path, name, params_b, bpp, eff, eff_at in declared:
                if name in services:
                    raise InvalidSpec(
                        f"{path}.name", f"service {name!r} is already declared at {services[name]}"
                    )
                services[name] = path
                if not g.count:
                    continue  # refused below, with the field that says so
                try:
                    lo = min_gpus(params_b, bpp, g.memory_headroom, g.memory_gb)
                except InvalidSpec as exc:
                    raise InvalidSpec(f"{path}.params_b", exc.message) from None
                if not any(lo <= m <= g.gpus for m in eff):
                    raise InvalidSpec(
                        f"{eff_at}.efficiency",
                        f"{name} needs {lo} GPUs or more (weights and headroom) and nodes have "
                        f"{g.gpus}: none of the TP sizes {sorted(eff)} fits",
                    )
                tp = self.static.gpus_per_replica
                # A replica wider than a node stays pending (the run says so); one that fits a
                # node must hold the weights and run at a TP size the source gives E(m) for.
                if tp <= g.gpus and (tp < lo or tp not in eff):
                    raise InvalidSpec(
                        "static.gpus_per_replica",
                        f"{name}'s static replica of {tp} GPUs: it needs {lo} or more and a TP "
                        f"size of {eff_at}.efficiency ({sorted(eff)})",
                    )


def invalid_spec(exc: ValidationError) -> InvalidSpec:
    """The first error as an InvalidSpec naming the field's path (``sources[0].think.median_s``)."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    if err["type"] == "union_tag_invalid":
        loc.append("kind")
    elif len(loc) > 2 and loc[0] == "sources" and loc[2] in ("coding", "reward", "search"):
        del loc[2]  # the union's tag, not a field of the file
    parts: list[str | int] = []
    key = ""
    for i, part in enumerate(loc):
        if i + 1 < len(loc) and loc[i + 1] == "[key]":
            key = str(part)  # pydantic's marker follows a mapping's key: name the key, not a field
            continue
        if part == "[key]":
            continue
        parts.append(part if isinstance(part, int) else str(part))
    message = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
    # A ValueError of a validator reads "Value error, <ours>": the path already says where.
    message = message.removeprefix("Value error, ")
    if key:
        message = f"key {key!r}: {message}"
    return InvalidSpec(field_path(parts), message)
