"""What one run of the demo's rollout measured: each action, and the cores held over time."""

from __future__ import annotations

from dataclasses import dataclass, field

from arl_tangram.core.stats import percentile


@dataclass(frozen=True)
class ActionRecord:
    """One action as its trajectory saw it: issued, answered, and where it ran.

    ``act_s`` (action completion time) runs from the moment the trajectory issues the action to
    its answer: waiting for a sandbox, starting one, queueing and running all count."""

    trajectory: str
    turn: int
    kind: str
    issued_s: float
    act_s: float
    exec_s: float
    exit_code: int | None
    host: str | None
    cores: tuple[int, ...]


@dataclass(frozen=True)
class Hold:
    """``cores`` cores held exclusively from ``start_s`` to ``end_s`` (seconds into the rollout)."""

    start_s: float
    end_s: float
    cores: int
    what: str


@dataclass
class RunRecord:
    """One allocation style's rollout."""

    mode: str
    label: str
    machine_cores: int
    actions: list[ActionRecord] = field(default_factory=list)
    holds: list[Hold] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)
    rollout_s: float = 0.0
    startup_s: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def acts(self) -> list[float]:
        return [a.act_s for a in self.actions]

    def mean_act(self) -> float:
        return sum(self.acts) / len(self.acts) if self.acts else 0.0

    def act_percentile(self, q: float) -> float:
        return percentile(self.acts, q)

    def cpu_seconds_held(self) -> float:
        return sum((h.end_s - h.start_s) * h.cores for h in self.holds)

    def cpu_seconds_busy(self) -> float:
        return sum(a.exec_s * len(a.cores) for a in self.actions)
