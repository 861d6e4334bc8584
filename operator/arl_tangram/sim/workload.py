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
from arl_tangram.planner.snapshot import ScalingPolicy

BUILTIN = ("ai-coding", "reward-gpu", "deepsearch", "mixed", "memory-tight", "swe")


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
    exec_s: float  # per action, the exec path into the trajectory's pod (a fresh process)
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
    """How the capacity planner scales the pools when a run uses it (``bench sim --planner``).

    The scaling of each pool is the planner's own :class:`ScalingPolicy` (its defaults read from
    the API models); ``max_instances`` is what the cluster holds, set again where the simulation
    attaches (a GPU override changes it)."""

    period_s: float
    host_cores: int
    time_limit_s: float
    solver: str
    target_efficiency: float
    sessions_per_core: float
    cpu_scaling: ScalingPolicy
    gpu_scaling: ScalingPolicy


@dataclass(frozen=True)
class TrainingSpec:
    """RL steps (``bench sim`` reports step time when a workload has them): each step releases the
    workload's trajectories as one batch (a fresh sample: the seed advances per step), rolls out
    until they end or ``staleness_s`` after the release (the rest are cut), replaces each lost
    trajectory by a new one when ``resample``, then trains ``train_s`` with no external demand."""

    steps: int
    train_s: float
    staleness_s: float | None
    resample: bool


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    cluster: ClusterSpec
    static: StaticSpec
    sources: tuple[Source, ...]
    description: str = ""
    planner: PlannerSpec | None = None
    training: TrainingSpec | None = None

    @property
    def has_gpu(self) -> bool:
        return any(isinstance(s, RewardSource | SearchSource) for s in self.sources)


def parse(doc: Any, origin: str = "<workload>") -> Workload:
    """Validate a parsed YAML document into a Workload (an unknown or wrong field is named)."""
    from arl_tangram.sim.workload_file import WorkloadFile  # the file format builds these specs

    return WorkloadFile.parse(doc, origin)


def load(path: str | Path) -> Workload:
    """Read and validate a workload file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InvalidSpec("--workload-file", f"cannot read {p}: {exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidSpec("--workload-file", f"{p} is not UTF-8 text: {exc}") from None
    return parse(read_yaml(text, str(p)), str(p))


def builtin(name: str) -> Workload:
    """One of the workloads shipped with the package."""
    if name not in BUILTIN:
        raise InvalidSpec("--workload", f"unknown workload {name!r}; built-in: {', '.join(BUILTIN)}")
    text = resources.files("arl_tangram.sim").joinpath("workloads", f"{name}.yaml").read_text()
    return parse(read_yaml(text, f"{name}.yaml"), f"{name}.yaml")


def read_yaml(text: str, origin: str) -> Any:
    """The YAML document of a workload file, refusing what a safe load lets through silently: a
    key given twice in a mapping (the last would win) and aliases (``*name``), which a few lines
    turn into billions of values to validate (an anchor alone is harmless). Either is named by
    its path in the file, before anything is built from it."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicate_keys(node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise InvalidSpec("--workload-file", f"{origin} is not valid YAML: {exc}") from None
    except RecursionError:
        raise InvalidSpec("--workload-file", f"{origin}: nested too deeply") from None
    finally:
        loader.dispose()


def field_path(parts: list[str | int]) -> str:
    """``sources[0].think``: a path in the file as the validation errors name one."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "workload"


class _Loader(yaml.SafeLoader):
    """A safe loader that refuses an alias where it meets one, before the composer shares the
    anchored node (which is cheap to load and exponential to walk)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._at: list[str | int] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        # ``index`` is a value's key node in a mapping, an item's position in a sequence, None
        # for a key itself and the document.
        part = index.value if isinstance(index, yaml.ScalarNode) else index
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            at = field_path([*self._at, part] if part is not None else self._at)
            raise InvalidSpec(
                at,
                f"a YAML alias (*{event.anchor}, line {event.start_mark.line + 1}) is not accepted in "
                "a workload file: write the value out",
            )
        if part is not None:
            self._at.append(part)
        try:
            return super().compose_node(parent, index)
        finally:
            if part is not None:
                self._at.pop()


def _no_duplicate_keys(root: yaml.Node) -> None:
    todo: list[tuple[yaml.Node, list[str | int]]] = [(root, [])]
    while todo:
        node, at = todo.pop()
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):
                    continue  # a key that is a list or a mapping: the constructor refuses it
                line = key.start_mark.line + 1
                if key.value in lines:
                    raise InvalidSpec(
                        field_path([*at, key.value]), f"given twice (lines {lines[key.value]} and {line})"
                    )
                lines[key.value] = line
                todo.append((value, [*at, key.value]))
        elif isinstance(node, yaml.SequenceNode):
            todo += [(item, [*at, i]) for i, item in enumerate(node.value)]


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
    gb, feasible = _service_fit(svc, bpp, eff, cluster)
    curve = tuple(sorted(eff.items()))
    return Step(
        think,
        kind,
        "gpu",
        feasible,
        EfficiencyCurve(t1_est, curve),
        EfficiencyCurve(t1_true, curve),
        svc.name,
        gb,
    )


def _service_fit(
    svc: ServiceSpec, bpp: float, eff: dict[int, float], cluster: ClusterSpec
) -> tuple[float, tuple[int, ...]]:
    """A service's weights in GB and the GPU counts (TP sizes) it may run on."""
    lo = min_gpus(svc.params_b, bpp, cluster.memory_headroom, cluster.gpu_memory_gb)
    return svc.params_b * bpp, tuple(k for k in sorted(eff) if k >= lo and k <= cluster.gpus_per_node)


def declared_services(wl: Workload) -> dict[str, tuple[float, tuple[int, ...]]]:
    """Every model service the workload declares (reward services, judges), in declaration order:
    its weights in GB and the GPU counts it may run on."""
    out: dict[str, tuple[float, tuple[int, ...]]] = {}
    for src in wl.sources:
        if isinstance(src, RewardSource):
            for svc in src.services:
                out.setdefault(svc.name, _service_fit(svc, src.bytes_per_param, src.efficiency, wl.cluster))
        elif isinstance(src, SearchSource):
            j = src.judge
            out.setdefault(j.name, _service_fit(j, src.bytes_per_param, src.efficiency, wl.cluster))
    return out


# The longest time a workload file may give (a duration, a period, a release time, a lognormal's
# mean): 1e7 s, about 116 days, far past any rollout. The clock is a float: a run that reaches
# many times this (lognormal tails, queueing) still resolves microseconds (ulp(1e9 s) = 1.2e-7 s);
# a 1e300 s think time left every later action 0 s long and the ACT inf or nan.
MAX_SECONDS = 1e7

# The most CPU hosts, and the most GPU nodes, a workload may declare: each is built before the
# first event (10^5 hosts took 7 s and 0.4 GB; 10^7 did not finish), and no pool the operator
# schedules comes near it.
MAX_NODES = 100_000

# The most actions (and, for a reward source, on/off cycles per service) one workload may ask of
# the generator: about ten times the largest built-in at full scale, and minutes of simulation. A
# slip of units (``period_s: 0.0006`` for 600, ``on_utilization: 50000``) otherwise made the
# generator loop for hours before printing anything.
MAX_ACTIONS = 2_000_000


def _reward_static_duration(src: RewardSource, wl: Workload) -> float:
    """A request's mean duration on ``static``'s replica (its TP size): the unit in which a reward
    source's ``on_utilization`` defines its arrival rate."""
    tp = wl.static.gpus_per_replica
    return src.t1.mean / (src.efficiency.get(tp, 1.0) * tp)


def check_size(wl: Workload) -> float:
    """Refuse a workload whose sources would generate more than ``MAX_ACTIONS`` actions (expected),
    naming the source's fields and the figure, before any is generated; the actions of all its
    sources (at most, for trajectories; expected, for reward sources) when it passes."""
    total = 0.0
    for si, src in enumerate(wl.sources):
        at = f"sources[{si}]"
        n: float
        if isinstance(src, CodingSource):
            n, fields = src.trajectories * src.actions_max, "trajectories x actions.max"
        elif isinstance(src, SearchSource):
            n, fields = src.trajectories * src.calls_max, "trajectories x calls.max"
        else:
            cycles = src.horizon_s / src.period_s + 1
            if cycles > MAX_ACTIONS:
                raise InvalidSpec(
                    f"{at}.period_s",
                    f"period_s {src.period_s:g} gives {cycles:.3g} on/off cycles per service over "
                    f"horizon_s {src.horizon_s:g}; at most {MAX_ACTIONS:,} (period_s >= "
                    f"{src.horizon_s / MAX_ACTIONS:.3g})",
                )
            rate_on = src.on_utilization / _reward_static_duration(src, wl)
            on_s = min(src.horizon_s, cycles * src.period_s * src.on_fraction)
            n, fields = len(src.services) * on_s * rate_on, "services x on time x on_utilization"
        if n > MAX_ACTIONS:
            raise InvalidSpec(
                at,
                f"{fields} gives about {n:.3g} actions; the simulator takes at most "
                f"{MAX_ACTIONS:,} per source (use --scale for a fraction of it)",
            )
        total += n
    return total


def generate(wl: Workload) -> list[Trajectory]:
    """Every trajectory of the workload, the same for a given seed whatever the policy."""
    check_size(wl)
    out: list[Trajectory] = []
    for si, src in enumerate(wl.sources):
        rng = random.Random(f"{wl.seed}:{si}")
        if isinstance(src, CodingSource):
            tool_est = Fixed(src.tool.mean)
            # One DoP range for every test of the source, up to a host's cores: a test runs on one
            # host, so no policy grants more, and a range to cores_max 1e9 took minutes to build
            # (and the scheduler walks it at every decision).
            top = min(src.test_cores_max, wl.cluster.cores_per_host)
            test_feasible = feasible_range(src.test_cores_min, top)
            for t in range(src.trajectories):
                n = rng.randint(src.actions_min, src.actions_max)
                steps = []
                for i in range(n):
                    think = src.think.sample(rng)
                    is_test = (i + 1) % src.test_every == 0 or (src.test_last and i == n - 1)
                    if is_test:
                        model = Amdahl(src.test_t1.sample(rng), rng.uniform(src.test_p_min, src.test_p_max))
                        steps.append(Step(think, "test", "cpu", test_feasible, model, model))
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
            rate_on = src.on_utilization / _reward_static_duration(src, wl)
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
    if not out:
        # Nothing to run: every policy would read "complete" with an ACT of 0.
        raise InvalidSpec(
            "sources",
            "the workload generates no actions (a reward source's horizon_s, on_fraction and "
            "on_utilization, or --scale, leave it none)",
        )
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
