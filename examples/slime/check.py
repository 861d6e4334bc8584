"""Send the request slime's ``remote_rm`` sends (aiohttp, ``{"prompt", "response", "label"}`` as
JSON to ``--rm-url``, the answer's JSON being the reward) for a right and a wrong answer.

Usage: python check.py URL     (URL as in --rm-url, with ?pool= for test-based rewards)
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp

TESTS = "from solution import square\n\ndef test_square():\n    assert square(3) == 9\n"


async def remote_rm(session: aiohttp.ClientSession, url: str, prompt: str, response: str, label: Any) -> Any:
    """slime's request shape: one POST per sample; ``raise_for_status``; the JSON body is the reward."""
    payload = {"prompt": prompt, "response": response, "label": label}
    async with session.post(url, json=payload) as resp:
        resp.raise_for_status()
        return await resp.json()


async def score(url: str) -> list[Any]:
    connector = aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        answers = ["def square(x):\n    return x * x\n", "def square(x):\n    return x + x\n"]
        return list(
            await asyncio.gather(*(remote_rm(session, url, "Write square(x).", a, TESTS) for a in answers))
        )


def main(url: str) -> int:
    rewards = asyncio.run(score(url))
    print(f"rewards: {rewards}")
    return 0 if rewards == [1.0, 0.0] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
