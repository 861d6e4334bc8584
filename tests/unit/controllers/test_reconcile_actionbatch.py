"""The pure ActionBatch status, table-driven, and the translation of its actions (no cluster)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from arl_tangram.api.actionbatch import ActionBatchSpec, ActionBatchStatus, ActionResult
from arl_tangram.controllers.actionbatch import (
    BatchObservation,
    reconcile_actionbatch,
    recovered_results,
    refused_status,
)
from arl_tangram.domain.actions import ActionOutcome, Outcome, Reason
from arl_tangram.domain.batches import (
    Runner,
    batch_request,
    compact_result,
    fit_results,
    pass_fraction_reward,
    runner_of,
)
from arl_tangram.errors import InvalidSpec

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def spec(n: int = 3, **extra: Any) -> ActionBatchSpec:
    actions = [
        {"id": f"a{i}", "type": "code", "target": "py", "payload": {"code": "print(1)"}} for i in range(n)
    ]
    return ActionBatchSpec.model_validate({"actions": actions, **extra})


def res(i: int, state: str, **kw: Any) -> ActionResult:
    return ActionResult(id=f"a{i}", state=state, **kw)  # type: ignore[arg-type]


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    ("results", "expect"),
    [
        (
            {},
            {
                "Accepted": ("True", "Queued"),
                "Running": ("False", "Waiting"),
                "Complete": ("False", "InProgress"),
            },
        ),
        (
            {"a0": res(0, "Running")},
            {"Running": ("True", "ActionsRunning"), "Complete": ("False", "InProgress")},
        ),
        (
            {f"a{i}": res(i, "Succeeded") for i in range(3)},
            {
                "Running": ("False", "AllFinished"),
                "Complete": ("True", "AllFinished"),
                "Failed": ("False", "NoneFailed"),
            },
        ),
        (
            {
                "a0": res(0, "Succeeded"),
                "a1": res(1, "Failed", reason="PoolNotFound"),
                "a2": res(2, "Cancelled"),
            },
            {"Complete": ("True", "AllFinished"), "Failed": ("True", "SomeFailed")},
        ),
    ],
)
def test_conditions_follow_the_results(
    results: dict[str, ActionResult], expect: dict[str, tuple[str, str]]
) -> None:
    status, ops = reconcile_actionbatch(spec(), BatchObservation(results, (), 1, None, None), NOW)
    got = conds(status)
    for kind, value in expect.items():
        assert got[kind] == value, (kind, got)
    assert ops == []
    counts = status["counts"]
    assert counts["total"] == 3 and sum(counts[k] for k in counts if k != "total") == 3


def test_results_come_in_spec_order_and_the_completion_time_is_set_once() -> None:
    results = {f"a{i}": res(i, "Succeeded") for i in (2, 0, 1)}
    status, _ = reconcile_actionbatch(spec(), BatchObservation(results, (), 1, NOW, None), NOW)
    assert [r["id"] for r in status["results"]] == ["a0", "a1", "a2"]
    assert status["completionTime"] == "2026-12-03T12:00:00Z"


def test_a_batchs_act_window_is_its_own_span() -> None:
    """``act.windowSeconds`` is the span the summary covers: a batch's from its startTime to its
    completionTime, to the status's time while it runs (it was always 0)."""
    start = NOW - timedelta(seconds=90)
    running = {"a0": res(0, "Succeeded"), "a1": res(1, "Running")}
    status, _ = reconcile_actionbatch(spec(2), BatchObservation(running, (), 1, start, None, (1.0,)), NOW)
    assert status["act"]["windowSeconds"] == 90 and status["act"]["count"] == 1
    done = {f"a{i}": res(i, "Succeeded") for i in range(2)}
    obs = BatchObservation(done, (), 1, start, NOW - timedelta(seconds=30), (1.0, 2.0))
    status, _ = reconcile_actionbatch(spec(2), obs, NOW)
    assert status["act"]["windowSeconds"] == 60  # finished: it no longer grows
    # Every action failed before any started (no startTime): there is no span to speak of.
    failed = {f"a{i}": res(i, "Failed", reason="PoolNotFound") for i in range(2)}
    status, _ = reconcile_actionbatch(spec(2), BatchObservation(failed, (), 1, None, None, (0.0, 0.0)), NOW)
    assert status["act"]["windowSeconds"] == 0


def test_a_batch_held_by_many_pools_still_has_a_status_the_api_server_takes() -> None:
    """Each held target adds its reason to the Running condition's message; a batch spread over
    hundreds of pools that have no host coming made it longer than the CRD's 32768 characters, and
    the API server refused every write of the status (nothing shown, for as long as they waited)."""
    n = 300
    s = ActionBatchSpec.model_validate(
        {
            "actions": [
                {"id": f"a{i}", "type": "code", "target": f"pool-{i}", "payload": {"code": ""}}
                for i in range(n)
            ]
        }
    )
    held = tuple(
        f"ActionPool pool-{i} has no host coming: 0/12 nodes are available: 12 Insufficient cpu"
        for i in range(n)
    )
    status, _ = reconcile_actionbatch(s, BatchObservation({}, (), 1, None, None, held_by=held), NOW)
    ActionBatchStatus.model_validate(status)  # the CRD's schema, as the models mirror it
    running = next(c for c in status["conditions"] if c["type"] == "Running")
    assert running["message"].startswith(f"0 running, {n} waiting (ActionPool pool-0 has no host")
    assert running["message"].endswith("more characters)")


def test_ttl_after_finished_deletes_the_batch_when_due_and_not_before() -> None:
    done = {f"a{i}": res(i, "Succeeded") for i in range(3)}
    s = spec(ttlSecondsAfterFinished=60)
    _, early = reconcile_actionbatch(s, BatchObservation(done, (), 1, NOW, NOW), NOW + timedelta(seconds=59))
    _, due = reconcile_actionbatch(s, BatchObservation(done, (), 1, NOW, NOW), NOW + timedelta(seconds=60))
    assert early == [] and len(due) == 1
    _, unfinished = reconcile_actionbatch(s, BatchObservation({}, (), 1, NOW, None), NOW + timedelta(days=1))
    assert unfinished == []


def test_outputs_are_dropped_latest_first_to_fit_the_budget() -> None:
    big = [res(i, "Succeeded", output="x" * 600) for i in range(4)]
    fitted, used, left_out = fit_results(big, 1500)
    assert used <= 1500 and left_out == 0
    assert fitted[0].output and not fitted[-1].output and fitted[-1].truncated


def test_results_past_the_budget_even_without_outputs_are_left_out_and_counted() -> None:
    """1024 results with long ids and reasons took about 400 KiB of a 1 KiB budget: only outputs
    were dropped, so the status exceeded the budget its user set."""
    n = 1024
    long_id = "x" * 120
    actions = [
        {"id": f"{long_id}{i:04d}", "type": "code", "target": "py", "payload": {"code": "1"}}
        for i in range(n)
    ]
    s = ActionBatchSpec.model_validate({"actions": actions, "results": {"budgetBytes": 1024}})
    results = {
        a.id: ActionResult(id=a.id, state="Failed" if i % 2 else "Running", reason="R" * 200, attempts=1)
        for i, a in enumerate(s.actions)
    }
    status, _ = reconcile_actionbatch(s, BatchObservation(results, (), 1, NOW, None), NOW)
    ActionBatchStatus.model_validate(status)
    kept = status["results"]
    assert status["resultBytes"] <= 1024
    assert sum(len(json.dumps(r, separators=(",", ":"))) for r in kept) <= 1024
    assert kept and status["resultsOmitted"] == n - len(kept)
    # Running actions' results go first: what is kept is finished, in spec order.
    assert all(r["state"] == "Failed" for r in kept) and kept[0]["id"] == s.actions[1].id
    assert status["counts"]["failed"] == n // 2 and status["counts"]["running"] == n // 2
    omitted = next(c for c in status["conditions"] if c["type"] == "ResultsOmitted")
    assert omitted["status"] == "True" and omitted["reason"] == "OverBudget"
    assert omitted["message"].startswith(f"{n - len(kept)} of {n} result(s) left out")
    assert "budgetBytes (1024)" in omitted["message"]


def _as_the_api_server_stores(value: Any) -> bytes:
    """JSON as the API server writes a custom object (Go's encoding/json, as seen on the test bed):
    UTF-8 unescaped, but ``<``, ``>``, ``&``, U+2028 and U+2029 escaped as six bytes each."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char in "<>&\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text.encode()


@pytest.mark.parametrize(
    "output",
    [
        "\u2588" * 300,  # a progress bar (tqdm's blocks): 3 bytes each in UTF-8
        "\U0001f600" * 250,  # emoji: 4 bytes each
        "std::vector<std::pair<int,int>> && x;\n" * 25,  # a compiler's error: <, > and & take 6 bytes
    ],
)
def test_the_results_budget_counts_bytes_as_the_api_server_stores_them(output: str) -> None:
    """Results were measured in characters of Python's JSON: outputs of progress bars, emoji or
    C++ errors took up to 6 times their budget in the object (a status of the largest budget,
    384 KiB, then passed etcd's limit with the spec beside it, and the API server refused it)."""
    results = {f"a{i}": res(i, "Failed", output=output) for i in range(40)}
    budget = 16 * 1024
    s = spec(40, results={"budgetBytes": budget, "outputBytesPerAction": 1024})
    status, _ = reconcile_actionbatch(s, BatchObservation(results, (), 1, NOW, NOW), NOW)
    stored = sum(len(_as_the_api_server_stores(r)) for r in status["results"])
    assert status["resultBytes"] == stored <= budget
    assert status["results"][0]["output"] == output  # outputs dropped from the latest first


def test_results_within_the_budget_leave_nothing_out_and_say_nothing_of_it() -> None:
    done = {f"a{i}": res(i, "Succeeded") for i in range(3)}
    status, _ = reconcile_actionbatch(spec(), BatchObservation(done, (), 1, NOW, NOW), NOW)
    assert status["resultsOmitted"] is None and "ResultsOmitted" not in conds(status)


def test_results_that_fit_again_clear_the_results_omitted_condition() -> None:
    """A restarted operator runs again the left-out actions of a batch not complete: as Running
    their results are small, and the status may fit its budget again. ``resultsOmitted`` then went
    (a merge patch's null), but the ``ResultsOmitted=True`` condition it read back stayed, still
    saying how many results were left out of a status that now holds every one."""
    before = [
        {
            "type": "ResultsOmitted",
            "status": "True",
            "reason": "OverBudget",
            "message": "3 of 3 result(s) left out of status.results",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-12-03T11:00:00Z",
        }
    ]
    running = {f"a{i}": res(i, "Running") for i in range(3)}
    status, _ = reconcile_actionbatch(spec(), BatchObservation(running, before, 1, NOW, None), NOW)
    assert status["resultsOmitted"] is None and len(status["results"]) == 3
    omitted = next(c for c in status["conditions"] if c["type"] == "ResultsOmitted")
    assert omitted["status"] == "False" and omitted["reason"] == "WithinBudget", omitted
    assert "left out" not in omitted["message"], omitted


def test_a_restarted_operator_reads_results_back_from_status() -> None:
    status = {
        "results": [
            {"id": "a0", "state": "Running", "attempts": 2},
            {"id": "a1", "state": "Succeeded"},
            {"bogus": True},
        ]
    }
    got = recovered_results(status)
    assert set(got) == {"a0", "a1"} and got["a0"].attempts == 2


def test_compact_result_keeps_the_tail_of_the_output() -> None:
    out = ActionOutcome("k", Outcome.FAILED, Reason.NON_ZERO_EXIT, exit_code=1, stdout="a" * 100 + "END")
    r = compact_result("a0", out, 10)
    assert r.output == "a" * 7 + "END" and r.truncated and r.reason == "NonZeroExit"


@pytest.mark.parametrize(
    ("exit_code", "output", "runner", "reward"),
    [
        (0, "....\n4 passed in 0.1s\n", "pytest", 1.0),
        (1, "3 passed, 1 failed in 0.2s", "pytest", 0.75),
        (1, "===== 1 failed, 3 passed, 1 warning in 61.20s (0:01:01) =====", "pytest", 0.75),
        (1, "1 failed, 1 error in 0.2s", "pytest", 0.0),
        (1, "1 passed, 1 error in 0.1s", "pytest", 0.5),
        (0, "1 passed, 1 warning in 0.1s", "pytest", 1.0),
        (0, "1 passed, 3 subtests passed in 0.66s", "pytest", 1.0),
        (1, "2 failed, 1 passed, 2 subtests passed in 0.5s", "pytest", 1 / 3),
        (0, "\x1b[32m===== 3 passed in 0.1s =====\x1b[0m", "pytest", 1.0),
        (0, "1000 passed in 12.00s (0:00:12)", "pytest", 1.0),
        (0, "1 passed, 1 xpassed in 0.1s", "pytest", 1.0),  # an xfail(strict=False) that passed
        (1, "F\n!!!!!!! stopping after 1 failures !!!!!!!\n1 failed, 1 passed in 0.1s", "pytest", 0.5),  # -x
        (0, "no summary: a command that may not be pytest", "unknown", 1.0),
        (0, "no summary", "script", 1.0),
        (2, "no summary", "unknown", 0.0),
        (2, "1 error in 0.1s", "pytest", 0.0),
        (5, "no tests ran in 0.01s", "pytest", 0.0),
        # What the program under test does to its own run cannot raise its reward: a second
        # summary after pytest's (an exit function's), a status of 0 with no summary from a pytest
        # run (os._exit(0) while pytest imported it), a failure whose only summary claims every
        # test passed, a session it stopped with status 0 after one test, tests it skipped or
        # marked expected to fail, a summary printed by a program that runs no pytest; an exit
        # function's os._exit(0) keeps the honest fraction.
        (1, "F.\n1 failed, 1 passed in 0.05s\n10 passed in 0.01s\n", "pytest", 0.0),
        (0, "1 passed, 2 skipped in 0.1s\n3 passed in 0.1s\n", "pytest", 0.0),
        (0, "", "pytest", 0.0),
        (1, "10 passed in 0.1s", "pytest", 0.0),
        (0, "1 passed in 0.74s\n!!!!!!!!!! _pytest.outcomes.Exit: bye !!!!!!!!!!\n", "pytest", 0.0),
        (0, "1 passed, 2 skipped in 0.1s", "pytest", 1 / 3),
        (0, "1 passed, 2 xfailed in 0.1s", "pytest", 1 / 3),
        (0, "F.\n1 failed, 1 passed in 0.05s\n", "pytest", 0.5),
        (1, "1 failed in 0.1s\nnot a summary: 5 passed\n", "pytest", 0.0),
        (1, "9 passed, 1 failed in 0.1s", "script", 0.0),
    ],
)
def test_test_actions_reward_the_pass_fraction(
    exit_code: int, output: str, runner: Runner, reward: float
) -> None:
    assert pass_fraction_reward(exit_code, output, runner=runner) == pytest.approx(reward)


@pytest.mark.parametrize(
    ("payload", "runner"),
    [
        ({"runtime": "pytest", "code": "def test_x(): pass"}, "pytest"),
        ({"runtime": "pytest", "code": "def test_x(): pass", "args": ["-x", "-v"]}, "pytest"),
        ({"runtime": "pytest", "code": "def test_x(): pass", "args": ["-q"]}, "unknown"),  # -qq: no summary
        (
            {"runtime": "pytest", "code": "def test_x(): pass", "args": ["-s"]},
            "unknown",
        ),  # prints pass through
        ({"runtime": "bash", "code": "python -m pytest -q -p no:cacheprovider test_solution.py"}, "pytest"),
        ({"runtime": "bash", "code": "pytest -q -n $TANGRAM_DOP"}, "pytest"),
        ({"runtime": "bash", "code": "python3 -m pytest -x tests/"}, "pytest"),
        ({"runtime": "bash", "code": "pytest -qq tests/"}, "unknown"),
        ({"runtime": "bash", "code": "pytest -q -q"}, "unknown"),
        ({"runtime": "bash", "code": "python -m pytest -p no:terminal"}, "unknown"),
        ({"runtime": "bash", "code": "pytest --co"}, "unknown"),
        (
            {"runtime": "bash", "code": "pytest -q", "files": {"pytest.ini": "[pytest]\naddopts = -q\n"}},
            "unknown",
        ),
        ({"runtime": "bash", "code": "pytest -q || true"}, "unknown"),  # not one plain run
        ({"runtime": "bash", "code": 'bash -c "pytest -q test_solution.py"'}, "unknown"),
        ({"runtime": "bash", "code": "python -mpytest -q"}, "unknown"),
        ({"runtime": "bash", "code": "python check.py"}, "script"),
        ({"runtime": "bash", "code": "make test"}, "unknown"),  # may run pytest inside
        ({"runtime": "bash", "code": "tox -q"}, "unknown"),
        ({"runtime": "bash", "code": "python check.py && echo done"}, "unknown"),
        ({"runtime": "c", "code": "int main(void) { return 0; }"}, "script"),
        ({"runtime": "bash", "code": "python test_solution.py"}, "script"),  # a label run as a script
        ({"runtime": "python", "code": "print(1)"}, "script"),
        ({"runtime": "python", "code": "import pytest\nraise SystemExit(pytest.main(['-q']))"}, "unknown"),
    ],
)
def test_how_test_actions_are_read(payload: dict[str, Any], runner: Runner) -> None:
    assert runner_of(payload) == runner


def test_batch_actions_become_requests_with_files_and_priorities() -> None:
    s = ActionBatchSpec.model_validate(
        {
            "actions": [
                {
                    "id": "t",
                    "type": "test",
                    "target": "py",
                    "units": {"min": 1, "max": 4},
                    "priority": 5,
                    "sessionId": "traj",
                    "payload": {
                        "command": "pytest -n $TANGRAM_DOP",
                        "files": {"test_x.py": "def test(): pass\n"},
                    },
                }
            ],
            "retryPolicy": {"maxRetries": 4},
        }
    )
    req = batch_request("ns", "uid-1", s, s.actions[0], ("python",))
    assert req.key == "uid-1/t" and req.session == "traj" and (req.units_min, req.units_max) == (1, 4)
    assert req.payload["runtime"] == "bash" and req.payload["code"] == "pytest -n $TANGRAM_DOP"
    assert base64.b64decode(req.payload["files"]["test_x.py"]) == b"def test(): pass\n"
    assert req.max_retries == 4 and req.priority == 995  # higher API priority, more urgent class


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"code": "1", "command": "ls"}, "payload"),
        ({}, "payload"),
        ({"code": "1", "language": "cobol"}, "payload.language"),
        ({"code": "1", "stdinn": "typo"}, "payload.stdinn"),
        ({"code": "1", "filesBase64": {"a": "!!"}}, "payload.filesBase64.a"),
    ],
)
def test_bad_payloads_fail_naming_the_field(payload: dict[str, Any], field: str) -> None:
    s = ActionBatchSpec.model_validate(
        {"actions": [{"id": "a", "type": "code", "target": "py", "payload": payload}]}
    )
    with pytest.raises(InvalidSpec) as err:
        batch_request("ns", "u", s, s.actions[0], ("python", "bash"))
    assert err.value.field == field


def test_a_refused_spec_shows_in_the_complete_condition_that_kubectl_get_prints() -> None:
    """``kubectl get actionbatches`` prints the Complete condition's status and reason: a batch
    refused with Accepted=False alone showed empty columns, as one the operator never saw."""
    status = refused_status(
        3, [], "spec.actions: the spec takes 700000 bytes", datetime(2026, 1, 1, tzinfo=UTC)
    )
    conds = {c["type"]: c for c in status["conditions"]}
    for kind in ("Accepted", "Complete"):
        assert conds[kind]["status"] == "False" and conds[kind]["reason"] == "InvalidSpec"
        assert conds[kind]["message"] == "spec.actions: the spec takes 700000 bytes"
        assert conds[kind]["observedGeneration"] == 3
    assert status["observedGeneration"] == 3
