"""ActionBatch actions -> :class:`ActionRequest`, and outcomes -> compact results and status (pure).

A batch action's ``payload`` is free-form in the CRD (the API server cannot know each target's
shape); it is checked here, when the action is translated, so that a bad payload fails that action
with ``InvalidPayload`` naming the field and blocks nothing else.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from arl_tangram.api.actionbatch import Action, ActionBatchSpec, ActionCounts, ActionResult
from arl_tangram.api.meta import ActStats, stored_size
from arl_tangram.core.stats import percentile
from arl_tangram.domain.actions import ActionOutcome, ActionRequest
from arl_tangram.errors import InvalidSpec, UnsupportedType

# What a pool's languages mean to the agent: the runtime a code action runs under.
LANGUAGE_RUNTIMES: dict[str, str] = {"python": "python", "bash": "bash"}


class CodePayload(BaseModel):
    """The payload of a ``code`` or ``test`` action: a program (``code``) or a shell ``command`` run
    in a working directory that holds ``files`` (text; ``filesBase64`` for bytes)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    language: str = "python"
    code: str | None = None
    command: str | None = None
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    files_base64: dict[str, str] = Field(default_factory=dict, alias="filesBase64")
    fetch_files: list[str] = Field(default_factory=list, alias="fetchFiles")
    args: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_program(self) -> CodePayload:
        if (self.code is None) == (self.command is None):
            raise ValueError("give exactly one of code (a program in `language`) or command (a shell line)")
        return self


def _payload_error(exc: ValidationError) -> InvalidSpec:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or "payload"
    return InvalidSpec(f"payload.{where}" if where != "payload" else where, first.get("msg", "invalid"))


def action_payload(kind: str, payload: Mapping[str, Any], languages: Sequence[str]) -> dict[str, Any]:
    """What is sent for an action of ``kind``, the same at both doors (a batch, the gateway).

    ``http`` is in the API, but nothing serves it yet: its payload went to the agent's code runner
    as it was, so ``{runtime: nodejs, code: ...}`` ran on a pool that offers no nodejs."""
    if kind in ("code", "test"):
        return native_payload(kind, payload, languages)
    if kind == "http":
        raise UnsupportedType(
            "type",
            "http actions are not served by this release; run the call from a code action "
            "(on a pool with network access) instead",
        )
    return dict(payload)


def native_payload(kind: str, payload: Mapping[str, Any], languages: Sequence[str]) -> dict[str, Any]:
    """The agent's ``/v1/execute`` body (without cores) for a code or test action's payload."""
    try:
        body = CodePayload.model_validate(payload)
    except ValidationError as exc:
        raise _payload_error(exc) from None
    if body.command is not None:
        runtime, code = "bash", body.command
    else:
        if body.language not in languages:
            raise InvalidSpec(
                "payload.language", f"{body.language!r} is not among the pool's languages {list(languages)}"
            )
        runtime = LANGUAGE_RUNTIMES.get(body.language, body.language)
        code = body.code or ""
    files = {path: base64.b64encode(text.encode()).decode() for path, text in body.files.items()}
    for path, data in body.files_base64.items():
        try:
            base64.b64decode(data, validate=True)
        except ValueError:
            raise InvalidSpec(f"payload.filesBase64.{path}", "is not valid base64") from None
        files[path] = data
    out: dict[str, Any] = {"runtime": runtime, "code": code, "files": files}
    if body.stdin is not None:
        out["stdin"] = body.stdin
    if body.fetch_files:
        out["fetch_files"] = body.fetch_files
    if body.args:
        out["args"] = body.args
    return out


def action_key(batch_uid: str, action_id: str) -> str:
    """The logical action's key: stable across operator restarts (the batch's uid never changes)."""
    return f"{batch_uid}/{action_id}"


def batch_request(
    namespace: str,
    batch_uid: str,
    spec: ActionBatchSpec,
    action: Action,
    pool_languages: Sequence[str] | None,
) -> ActionRequest:
    """One batch action as a request; raises InvalidSpec (the action fails with InvalidPayload)."""
    payload = action_payload(action.type, action.payload, pool_languages or ("python",))
    units = action.units
    return ActionRequest(
        key=action_key(batch_uid, action.id),
        namespace=namespace,
        target=action.target,
        kind=action.type,
        payload=payload,
        units_min=units.min if units else 1,
        units_max=units.max if units else 1,
        timeout_s=float(action.timeout_seconds) if action.timeout_seconds else None,
        session=action.session_id,
        # The API's priority is "higher runs first"; the scheduler's class 0 is the most urgent.
        priority=max(0, 1000 - action.priority),
        max_retries=spec.retry_policy.max_retries,
        backoff_s=float(spec.retry_policy.backoff_seconds),
    )


# pytest's final line ("1 failed, 3 passed, 1 warning in 0.12s", framed in "=" without -q; an item
# may be two words: "3 subtests passed"), its colours taken off first; and the banner of a session
# that was stopped ("!!! _pytest.outcomes.Exit: ... !!!", "!!! Interrupted: ... !!!"; not -x's
# "!!! stopping after 1 failures !!!", whose summary stands).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PYTEST_SUMMARY = re.compile(
    r"^=*\s*((?:\d+ [a-z]+(?: [a-z]+)?(?:, )?)+) in \d+(?:\.\d+)?s(?: \([0-9:]+\))?\s*=*$"
)
_PYTEST_COUNT = re.compile(r"(\d+) ([a-z]+(?: [a-z]+)?)")
_PYTEST_STOPPED = re.compile(r"^!{3,} (?:_pytest\.outcomes\.Exit|Interrupted|KeyboardInterrupt)\b.*!{3,}$")
# What a test can end as, by the word pytest counts it with, and which earn: a pass, and a test
# expected to fail that passed. A skipped or expected-to-fail test earns nothing: an answer could
# skip or xfail what it cannot pass (``pytest.skip()`` in the solution, or
# ``builtins.AssertionError = pytest.skip.Exception``).
_TEST_ENDS = {"passed", "failed", "error", "errors", "skipped", "xfailed", "xpassed"}
_EARNS = ("passed", "xpassed")
# A command that is one plain run of pytest (no shell operators, quotes or redirections), and the
# options with which it prints no summary line or lets the program's own prints through (-s).
_PYTEST_WORD = re.compile(r"(?:^|[\s;&|(/`\"'])(?:py\.?test|-m\s*pytest)(?:$|[\s;&|)`\"'])")
_PYTHON_SCRIPT = re.compile(r"^python3?(?:\.\d+)? [\w\-./]+\.py(?: [\w\-.:=/$]+)*$")
_PYTEST_PLAIN = re.compile(r"^(?:python3?(?:\.\d+)? -m pytest|pytest)(?: [\w\-.:=/$]+)*$")
_PYTEST_UNSURE = re.compile(
    r"(?:^| )(?:-\w*q\w*q\w*|(?:-q|--quiet) (?:-q|--quiet)|-\w*s\w*|--capture=no|--co|--collect-only)(?= |$)"
    r"|no:terminal"
)
_QUIET = re.compile(r"(?:^| )(?:-\w*q\w*|--quiet)(?= |$)")
_PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg", "conftest.py")

# How a test action's output is read for its reward (``runner_of``): "pytest", a plain run of
# pytest that prints its summary; "script", a program that runs no pytest (its status alone);
# "unknown", a command that runs pytest in some other way (its summary, where it prints one).
Runner = Literal["pytest", "script", "unknown"]


def runner_of(payload: Mapping[str, Any]) -> Runner:
    """How a native payload's test run is read: ``"pytest"`` for the ``pytest`` runtime (plain
    ``pytest FILE``) with no arguments of its own that quieten it or stop capturing, or a command
    that is one plain run of pytest with none of those, and no configuration file of its own among
    the files (its ``addopts`` could); ``"script"`` for code that does not name pytest and for a
    command that is one plain run of a Python file (a label run as a script); ``"unknown"`` for the
    rest (``make test``, ``tox``, a shell script may run pytest inside)."""
    runtime, code = payload.get("runtime"), payload.get("code")
    files = payload.get("files") or {}
    configured = any(name.rsplit("/", 1)[-1] in _PYTEST_CONFIGS for name in files)
    if runtime == "pytest":  # a -q of its arguments is read as unsure: a second one drops the summary
        args = " ".join(map(str, payload.get("args") or []))
        sure = not (configured or _PYTEST_UNSURE.search(args) or _QUIET.search(args))
        return "pytest" if sure else "unknown"
    text = code.strip() if isinstance(code, str) else ""
    if runtime != "bash":  # a program: it runs pytest only where its code says so
        return "unknown" if "pytest" in text else "script"
    if _PYTEST_PLAIN.match(text) and not (configured or _PYTEST_UNSURE.search(text)):
        return "pytest"
    # One plain run of a Python file (a label with no tests, run as a script) prints no summary of
    # pytest's; any other command (make, tox, a shell script) may run pytest inside.
    return "script" if _PYTHON_SCRIPT.match(text) and not _PYTEST_WORD.search(text) else "unknown"


def pass_fraction_reward(exit_code: int | None, stdout: str, *, runner: Runner = "unknown") -> float:
    """A test action's reward: the fraction of its tests that passed, from pytest's summary line on
    stdout (a skipped or expected-to-fail test earns nothing). The program under test shares
    pytest's process and output, so nothing it prints may raise its reward:
    - a program that runs no pytest (``runner`` "script") is judged by its status alone: 1.0 for 0
      (a summary it printed itself, "9 passed, 1 failed", earned 0.9 with status 1);
    - one summary line is read, and only where there is exactly one; with more (an exit function
      printing "10 passed in 0.1s"), a status of 0 earns 1.0 only if every one says all passed;
    - only stdout is read (pytest writes its summary there), never stderr;
    - a session that was stopped (``pytest.exit(returncode=0)`` after one test) earns 0;
    - a status other than 0 and 1 (pytest's "tests failed") earns 0, and so does a summary that
      says every test passed with a status of 1;
    - with no summary, a plain run of pytest (``runner`` "pytest", which prints one) earns 0: the
      program ended the process before pytest could report (``os._exit(0)`` while pytest imported
      it); another command earns 1.0 for status 0.
    In-process a program can still write to pytest's own saved descriptors, or print freely where
    capture is off (``-s``); that is beyond this reading."""
    if runner == "script":
        return 1.0 if exit_code == 0 else 0.0
    text = _ANSI.sub("", stdout)
    summaries: list[dict[str, int]] = []
    for line in text.splitlines():
        line = line.strip()
        if _PYTEST_STOPPED.match(line):
            return 0.0
        found = _PYTEST_SUMMARY.match(line)
        if found:
            counts: dict[str, int] = {}
            for n, what in _PYTEST_COUNT.findall(found.group(1)):
                if what in _TEST_ENDS:  # not warnings, deselected, reruns, nor "subtests passed"
                    key = "error" if what.startswith("error") else what
                    counts[key] = counts.get(key, 0) + int(n)
            summaries.append(counts)
    if exit_code not in (0, 1):
        return 0.0
    if len(summaries) == 1:
        (counts,) = summaries
        total = sum(counts.values())
        passed = sum(counts.get(end, 0) for end in _EARNS)
        if not total or (exit_code == 1 and passed >= total):
            return 0.0
        return passed / total
    if summaries:
        all_passed = all(sum(c.values()) == sum(c.get(e, 0) for e in _EARNS) > 0 for c in summaries)
        return 1.0 if exit_code == 0 and all_passed else 0.0
    return 1.0 if exit_code == 0 and runner != "pytest" else 0.0


FINAL_STATES = frozenset({"Succeeded", "Failed", "Cancelled"})
"""The states an action ends in."""


def output_tail(text: str, limit: int) -> tuple[str, bool]:
    """The last ``limit`` bytes of ``text`` (UTF-8, never half a character) and whether it was cut:
    the end of an output is what says how it ended."""
    data = text.encode()
    if len(data) <= limit:
        return text, False
    return data[len(data) - limit :].decode(errors="ignore"), True


def compact_result(action_id: str, outcome: ActionOutcome, output_limit: int) -> ActionResult:
    """The status entry of a finished action: output is the tail of stdout then stderr."""
    combined = outcome.stdout + (("\n" if outcome.stdout and outcome.stderr else "") + outcome.stderr)
    output, cut = output_tail(combined, output_limit)
    return ActionResult(
        id=action_id,
        state=outcome.state.value,
        exit_code=outcome.exit_code,
        reward=outcome.reward,
        duration_millis=int(outcome.duration_s * 1000),
        queued_millis=int(outcome.queued_s * 1000),
        attempts=outcome.attempts,
        output=output or None,
        truncated=cut or outcome.truncated,
        reason=outcome.reason.value if outcome.reason else None,
    )


def fit_results(results: Sequence[ActionResult], budget_bytes: int) -> tuple[list[ActionResult], int, int]:
    """Results within the byte budget: outputs are dropped (marked truncated), latest first, until the
    results fit; then, if even those do not fit (a thousand results with long ids and reasons take
    more than a small budget), whole results are left out, those of running actions first (they
    carry only an attempt count), then the latest. Returns the results kept, the bytes they take
    (as the API server stores them: ``stored_size``) and how many were left out: a budget the user
    set is one the status keeps."""
    sizes = [stored_size(r.model_dump_json(by_alias=True, exclude_none=True)) for r in results]
    total = sum(sizes)
    out = list(results)
    for i in range(len(out) - 1, -1, -1):
        if total <= budget_bytes:
            break
        if out[i].output:
            slim = out[i].model_copy(update={"output": None, "truncated": True})
            new = stored_size(slim.model_dump_json(by_alias=True, exclude_none=True))
            total += new - sizes[i]
            sizes[i] = new
            out[i] = slim
    if total <= budget_bytes:
        return out, total, 0
    # Indices in the order they go: running ones latest first, then the finished ones latest first.
    order = sorted(range(len(out)), key=lambda i: (out[i].state in FINAL_STATES, -i))
    left_out: set[int] = set()
    for i in order:
        if total <= budget_bytes:
            break
        left_out.add(i)
        total -= sizes[i]
    return [r for i, r in enumerate(out) if i not in left_out], total, len(left_out)


def counts_of(total: int, states: Sequence[str]) -> ActionCounts:
    """Counts per state; actions with no result yet are pending."""
    c = {s: 0 for s in ("Pending", "Running", "Succeeded", "Failed", "Cancelled")}
    for s in states:
        c[s] += 1
    c["Pending"] += total - len(states)
    return ActionCounts(
        total=total,
        pending=c["Pending"],
        running=c["Running"],
        succeeded=c["Succeeded"],
        failed=c["Failed"],
        cancelled=c["Cancelled"],
    )


def act_stats(act_seconds: Sequence[float], window_s: float) -> ActStats | None:
    """ACT summary (queueing plus execution) in milliseconds; None before any action finished."""
    if not act_seconds:
        return None
    values = sorted(act_seconds)
    return ActStats(
        count=len(values),
        window_seconds=int(window_s),
        mean_millis=int(1000 * sum(values) / len(values)),
        p50_millis=int(1000 * percentile(values, 50)),
        p90_millis=int(1000 * percentile(values, 90)),
        p99_millis=int(1000 * percentile(values, 99)),
    )


def rfc3339(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")
