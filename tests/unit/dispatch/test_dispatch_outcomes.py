"""What an agent's SandboxFusion answer means to the dispatcher (``outcomes.interpret``): the
program's run is ``run_result`` on ``/run_code`` and the driver's run is ``driver`` on
``/run_jupyter``, so a notebook out of time is a timeout, as a program out of time is."""

from __future__ import annotations

import pytest

from arl_tangram.dispatch.outcomes import interpret
from arl_tangram.domain.actions import Outcome, Reason
from arl_tangram.errors import InfrastructureError


def _driver(status: str, return_code: int | None = 0) -> dict[str, object]:
    return {
        "status": status,
        "execution_time": 1.5,
        "return_code": return_code,
        "stdout": "",
        "stderr": "log",
    }


def test_a_notebook_that_ran_succeeds() -> None:
    body = {"status": "Success", "message": "", "driver": _driver("Finished"), "cells": [{"stdout": "1\n"}]}
    outcome = interpret("k", "code", "run_jupyter", body)
    assert outcome.state is Outcome.SUCCEEDED and outcome.reason is None
    assert outcome.duration_s == 1.5 and outcome.response["cells"] == [{"stdout": "1\n"}]


def test_a_notebook_out_of_time_is_a_timeout() -> None:
    body = {
        "status": "Failed",
        "message": "total_timeout 2 s ran out",
        "driver": _driver("TimeLimitExceeded"),
    }
    outcome = interpret("k", "code", "run_jupyter", body)
    assert outcome.state is Outcome.FAILED and outcome.reason is Reason.TIMEOUT
    # Read as /run_code's answer, the same body has no run: not a timeout. The wire picks the field.
    assert interpret("k", "code", "run_code", body).reason is Reason.NON_ZERO_EXIT


def test_a_notebook_whose_kernel_died_failed() -> None:
    body = {"status": "Failed", "message": "cell 1: the kernel died", "driver": _driver("Finished")}
    outcome = interpret("k", "code", "run_jupyter", body)
    assert outcome.state is Outcome.FAILED and outcome.reason is Reason.NON_ZERO_EXIT
    assert outcome.message == "cell 1: the kernel died"


def test_a_notebook_the_sandbox_failed_is_the_platforms_failure() -> None:
    with pytest.raises(InfrastructureError, match="fork server lost"):
        interpret("k", "code", "run_jupyter", {"status": "SandboxError", "message": "fork server lost"})
