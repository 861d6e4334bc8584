"""Send the request verl's code reward sends (``call_sandbox_api``: SandboxFusion's ``/run_code``
body, posted with requests to ``reward_model.sandbox_fusion.url``) and check verl's verdict.

Usage: python check.py URL     (URL as in reward_model.sandbox_fusion.url)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import requests


def call_sandbox_api(
    url: str, code: str, stdin: str, timeout: int = 10, memory_limit_mb: int = 1024
) -> dict[str, Any]:
    """verl's request shape: every field it sends, as JSON text with these two headers."""
    payload = json.dumps(
        {
            "compile_timeout": timeout,
            "run_timeout": timeout,
            "code": code,
            "stdin": stdin,
            "memory_limit_MB": memory_limit_mb,
            "language": "python",
            "files": {},
            "fetch_files": [],
        }
    )
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    response = requests.post(url, headers=headers, data=payload, timeout=timeout * 2 + 10)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def verdict(body: dict[str, Any], expected: str) -> bool | int:
    """verl's reading of the answer: True (right), False (wrong answer), -2 (runtime error), -3
    (timeout), -1 (sandbox error)."""
    if body.get("status") == "SandboxError":
        return -1
    run = body.get("run_result") or {}
    if body.get("status") == "Failed":
        return -3 if run.get("status") == "TimeLimitExceeded" else -2
    return str(run.get("stdout", "")).rstrip("\n") == expected.rstrip("\n")


def main(url: str) -> int:
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    right = verdict(call_sandbox_api(url, program, "2 3\n"), "5")
    crash = verdict(call_sandbox_api(url, "raise ValueError('no')", ""), "5")
    print(f"right answer: {right}; crash: {crash}")
    return 0 if (right, crash) == (True, -2) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
