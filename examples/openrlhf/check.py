"""Send the request OpenRLHF's remote reward model client sends (``--remote_rm_url``: requests.post
with ``{"query", "prompts", "labels"}``, reading ``rewards``) with a right and a half-right answer.

Usage: python check.py URL     (URL as in --remote_rm_url, with ?pool= for test-based rewards)
"""

from __future__ import annotations

import sys

import requests

TESTS = (
    "from solution import add\n\n"
    "def test_small():\n    assert add(1, 2) == 3\n\n"
    "def test_negative():\n    assert add(-1, -2) == -3\n"
)
PROMPT = "Write add(a, b).\n"
ANSWERS = [
    "```python\ndef add(a, b):\n    return a + b\n```",
    "```python\ndef add(a, b):\n    return abs(a) + abs(b)\n```",
]


def remote_rm(url: str, queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """OpenRLHF's request shape (one POST of the whole micro-batch, JSON, a 180 s timeout)."""
    data = {"query": queries, "prompts": prompts, "labels": labels}
    response = requests.post(url=url, json=data, headers={"Content-Type": "application/json"}, timeout=180)
    response.raise_for_status()
    rewards: list[float] = response.json()["rewards"]
    return rewards


def main(url: str) -> int:
    rewards = remote_rm(url, [PROMPT + a for a in ANSWERS], [PROMPT] * 2, [TESTS] * 2)
    print(f"rewards: {rewards}")
    return 0 if rewards == [1.0, 0.5] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
