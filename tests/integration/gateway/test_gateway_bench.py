"""``tangram bench gateway`` runs end to end (a real agent, real gateway and forwarder processes, real
HTTP) and every call of every method is answered: the bench's numbers come from calls that worked.
Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_gateway_bench_answers_every_call_of_every_method() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "bench", "gateway", "--requests", "40", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    cases = {(c["method"], c["concurrency"]): c for c in report["cases"]}
    assert set(cases) == {(m, c) for m in ("direct", "forwarder", "gateway", "gateway+auth") for c in (1, 16)}
    assert all(c["errors"] == 0 and c["rps"] > 0 for c in cases.values()), cases
    assert set(report["targets"]) == {"gateway", "gateway+auth"}
    assert isinstance(report["floor_p50_added_ms_c1"], float)
    # A warm cache: the stand-in review server was asked once per review, not per request.
    assert report["review_calls"] == 2
    parts = {(row["method"], row["part"]) for row in report["cpu"]}
    assert ("forwarder", "gateway") in parts and ("gateway+auth", "gateway") in parts
