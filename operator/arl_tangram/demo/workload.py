"""The demo's rollout: multi-turn coding trajectories built from HumanEval.

Each trajectory is one problem solved by an "agent" in three turns inside one sandbox session:

1. write ``solution.py`` (the problem's prompt and a solution: the canonical one, or a broken one);
2. import it and print the function's signature (a tool call that reads what turn 1 left behind);
3. run the problem's tests against it (a ``test`` action): the reward is 1.0 when they pass.

Between actions the agent "thinks" (the LLM generating its next turn): think times are drawn once
from a seeded exponential distribution, so both allocation styles replay the very same rollout.
Which reward each trajectory *should* get is decided by running its program outside any sandbox
(:func:`~arl_tangram.workloads.humaneval.local_verdict`), never assumed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from arl_tangram.workloads.humaneval import Variant, local_verdict, problems, program

TurnKind = Literal["code", "test"]


@dataclass(frozen=True)
class Turn:
    """One action of a trajectory, and the think time before it is issued."""

    kind: TurnKind
    code: str
    think_s: float


@dataclass(frozen=True)
class Trajectory:
    """One problem's multi-turn session; ``expected_reward`` is the oracle's verdict."""

    index: int
    task_id: str
    variant: Variant
    turns: tuple[Turn, ...]
    expected_reward: float

    @property
    def name(self) -> str:
        return f"t{self.index:03d}-{self.task_id.replace('/', '-').lower()}-{self.variant}"


def _solution(problem: dict[str, str], variant: Variant) -> str:
    # The program without its check call: the prompt (imports, helpers, the signature) and a body.
    full = program(problem, variant).code
    return full[: full.index(problem["test"])].rstrip() + "\n"


def _turns(problem: dict[str, str], variant: Variant, rng: random.Random, think_s: float) -> tuple[Turn, ...]:
    entry = problem["entry_point"]
    source = _solution(problem, variant)
    write = f"from pathlib import Path\nPath('solution.py').write_text({source!r})\nprint('ok')\n"
    inspect = (
        "import inspect\nimport solution\n"
        f"print(solution.{entry}.__name__ + str(inspect.signature(solution.{entry})))\n"
    )
    test = f"from solution import *\n\n{problem['test']}\n\ncheck({entry})\n"
    steps: tuple[tuple[TurnKind, str], ...] = (("code", write), ("code", inspect), ("test", test))
    return tuple(
        Turn(kind, code, rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0) for kind, code in steps
    )


def rollout(count: int, think_s: float, seed: int = 0) -> tuple[list[Trajectory], int]:
    """``count`` trajectories alternating canonical and broken solutions over HumanEval's problems.

    A broken solution that the tests happen to accept is no broken solution: such problems are
    passed over for the broken half (their number is returned beside the trajectories)."""
    if count < 2:
        raise ValueError(f"the demo needs at least 2 trajectories, got {count}")
    rng = random.Random(seed)
    probs = problems()
    out: list[Trajectory] = []
    skipped = 0
    nxt = 0
    while len(out) < count:
        variant: Variant = "canonical" if len(out) % 2 == 0 else "mutated"
        if nxt >= len(probs):
            raise ValueError(f"HumanEval has {len(probs)} problems; too few for {count} trajectories")
        problem = probs[nxt]
        nxt += 1
        verdict = local_verdict(program(problem, variant))
        if variant == "mutated" and verdict == 0:
            skipped += 1
            continue
        out.append(
            Trajectory(
                index=len(out),
                task_id=problem["task_id"],
                variant=variant,
                turns=_turns(problem, variant, rng, think_s),
                expected_reward=1.0 if verdict == 0 else 0.0,
            )
        )
    return out, skipped


def actions_of(trajectories: Sequence[Trajectory]) -> int:
    return sum(len(t.turns) for t in trajectories)
