"""Rewards from trainer-shaped requests (pure): the samples each shape carries, and a test-based
reward's action (the pass fraction of tests run in a sandbox).

A test-based reward runs the policy's answer against the sample's ``label``: pytest source that
imports the answer as the module ``solution`` (``from solution import add``). The answer's code is
its last fenced code block when it has one (models answer in Markdown), else the whole answer. A
label without any ``def test`` is run as a plain script: its reward is 1.0 when it exits 0. A label
that never names ``solution`` is refused: it cannot look at the answer, so it would give every
answer the same reward (a dataset's test cases as JSON, or a math answer like ``42``, are valid
Python that exits 0: each scored 1.0 for any answer, without a word).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from arl_tangram.errors import InvalidSpec

SOLUTION_FILE = "solution.py"
TESTS_FILE = "test_solution.py"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTEST_TEST = re.compile(r"^\s*(async\s+)?def\s+test", re.MULTILINE)
_NAMES_SOLUTION = re.compile(r"\bsolution\b")


@dataclass(frozen=True)
class Fields:
    """What a request's shape calls its list of samples, sample ``i`` and its label (``{i}``), so
    that a refusal names the caller's own field (OpenRLHF's ``labels[2]``, not ``items[2].label``)."""

    items: str
    sample: str
    label: str

    def of(self, i: int) -> str:
        return self.sample.format(i=i)

    def label_of(self, i: int) -> str:
        return self.label.format(i=i)


NATIVE_FIELDS = Fields("items", "items[{i}]", "items[{i}].label")
OPENRLHF_FIELDS = Fields("query", "query[{i}]", "labels[{i}]")
SLIME_FIELDS = Fields("response", "response", "label")


def listed(name: str) -> Fields:
    """The fields of a shape whose samples are the list (or single text) ``name`` and that has no
    label (vLLM's and SGLang's: a test-based reward cannot be asked through them)."""
    return Fields(name, f"{name}[{{i}}]", f"{name}[{{i}}]")


@dataclass(frozen=True)
class Sample:
    """One thing to score."""

    prompt: str | list[dict[str, Any]]
    response: str
    label: Any = None


# End-of-turn and end-of-text markers a trainer's detokenised text may still end with (OpenRLHF
# decodes with skip_special_tokens=False): they close the answer and are no part of its program
# (ChatML, Llama 3, Phi, Gemma, SentencePiece, DeepSeek's full-width bars).
_END_MARKERS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "</s>",
    "<end_of_turn>",
    "<eos>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)


def _without_end_markers(text: str) -> str:
    """``text`` less the markers (and the whitespace between them) it ends with; linear in the text
    (a pattern with nested repetition took seconds on a long run of spaces, on the event loop)."""
    end, found = len(text.rstrip()), False
    while True:
        marker = next((m for m in _END_MARKERS if text.endswith(m, 0, end)), None)
        if marker is None:
            break
        end, found = end - len(marker), True
        while end and text[end - 1].isspace():
            end -= 1
    return text[:end] + "\n" if found else text


def answer_code(response: str) -> str:
    """The program in a model's answer: its last fenced block (a Python one when there is any),
    else the whole answer less the end-of-turn markers it ends with."""
    blocks: list[tuple[str, str]] = _FENCE.findall(response)
    if not blocks:
        return _without_end_markers(response)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def test_payload(sample: Sample, label_field: str) -> dict[str, Any]:
    """The ``test`` action (an ActionBatch-style payload) whose pass fraction is the sample's reward;
    ``label_field`` names the label as the caller's shape does."""
    if not isinstance(sample.label, str) or not sample.label.strip():
        raise InvalidSpec(label_field, "a test-based reward needs the tests (Python source) as the label")
    if not _NAMES_SOLUTION.search(sample.label):
        raise InvalidSpec(
            label_field,
            f"never names `solution`, the module the answer is saved as (`from solution import f`), "
            f"so it would give every answer the same reward; a dataset's test cases (inputs and "
            f"outputs) or a reference answer must first be written as Python tests of `solution` "
            f"(label starts {sample.label[:40]!r})",
        )
    files = {SOLUTION_FILE: answer_code(sample.response), TESTS_FILE: sample.label}
    if _PYTEST_TEST.search(sample.label):
        command = f"python -m pytest -q -p no:cacheprovider {TESTS_FILE}"
    else:
        command = f"python {TESTS_FILE}"
    return {"command": command, "files": files}


def openrlhf_samples(
    query: Sequence[str], prompts: Sequence[str] | None, labels: Sequence[Any] | None
) -> list[Sample]:
    """OpenRLHF sends ``query`` = prompt + response; the response is what follows the prompt."""
    for name, values in (("prompts", prompts), ("labels", labels)):
        if values is not None and len(values) != len(query):
            raise InvalidSpec(name, f"has {len(values)} entries; query has {len(query)}")
    out = []
    for i, text in enumerate(query):
        prompt = prompts[i] if prompts is not None else ""
        out.append(Sample(prompt, _after_prompt(text, prompt), labels[i] if labels is not None else None))
    return out


# How much of a prompt's end finds where it ends in a query whose prompt was cut from the left.
_PROMPT_TAIL = 256


def _after_prompt(text: str, prompt: str) -> str:
    """What follows the prompt in OpenRLHF's ``query``. It starts with the prompt, or holds it
    after padding or a BOS token (decoded with the special tokens), or holds only its end (a prompt
    longer than the trainer's maximum is cut from the left); with none of these, all of it."""
    if not prompt:
        return text
    if text.startswith(prompt):
        return text[len(prompt) :]
    at = text.find(prompt)
    if at >= 0:
        return text[at + len(prompt) :]
    tail = prompt[-_PROMPT_TAIL:]
    at = text.find(tail)
    return text[at + len(tail) :] if at >= 0 else text


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[Sample]:
    """vLLM's score pairs: one ``text_1`` against each ``text_2``, or pairwise for equal lists."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    if not firsts or not seconds:
        raise InvalidSpec("text_1" if not firsts else "text_2", "must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise InvalidSpec("text_1", f"has {len(firsts)} texts; give 1 or as many as text_2 ({len(seconds)})")
    return [Sample(a, b) for a, b in zip(firsts, seconds, strict=True)]


def texts(value: str | list[str], where: str) -> list[Sample]:
    """One conversation or a list, each scored whole (classify and pooling shapes)."""
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise InvalidSpec(where, "must not be empty")
    return [Sample("", text) for text in items]
