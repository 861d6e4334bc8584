"""Request bodies of the agent's HTTP APIs, validated with pydantic (types are not coerced loosely).

``RunCodeRequest`` mirrors SandboxFusion's ``POST /run_code`` field for field so that existing trainers
switch by changing a URL; the native ``ExecuteRequest`` adds what the operator needs (core grants,
sessions, counts of cores).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from arl_tangram.domain.actions import SANDBOXFUSION_WIRES


def _encodable(text: str) -> str:
    # JSON may carry lone surrogates (``"\\ud800"``); they are no text and would fail later, when
    # the program, its stdin or a path is encoded for the system.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate at position {exc.start}, which is not text") from exc
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``/run_code`` request."""

    model_config = ConfigDict(extra="ignore")

    # Finite and positive: a NaN or negative compile limit was accepted and reached the timers.
    compile_timeout: float = Field(
        10, gt=0, allow_inf_nan=False, description="wall-clock limit of the compile step, seconds"
    )
    run_timeout: float = Field(
        10, gt=0, allow_inf_nan=False, description="wall-clock limit of the run, seconds"
    )
    # 0 or less (SandboxFusion's -1, its default): no limit asked, as SandboxFusion reads any of them.
    memory_limit_MB: int = Field(
        -1, description="memory limit in MB (at least 16); 0 or less (-1): the most the pool allows"
    )
    code: Text
    stdin: Text | None = None
    language: str
    files: dict[Text, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[Text] = Field(default_factory=list)
    args: list[Text] = Field(default_factory=list, description="extra pytest arguments")

    @field_validator("memory_limit_MB")
    @classmethod
    def _usable_memory(cls, value: int) -> int:
        # Named here as the client named it (the limit below was refused as ``memory_mb``).
        if 0 < value < 16:
            raise ValueError("at least 16 MB, or 0 or less (SandboxFusion's -1) for the most the pool allows")
        return value


# What a jupyter action's driver may take beyond its cells' total_timeout: its kernel's start
# (SandboxFusion gives its driver 10 s beyond the total for it), and the stop of a cell the total
# interrupts, with the answer after it.
JUPYTER_START_S = 10.0
JUPYTER_STOP_S = 5.0
JUPYTER_MARGIN_S = JUPYTER_START_S + JUPYTER_STOP_S


class RunJupyterRequest(BaseModel):
    """SandboxFusion's ``/run_jupyter`` request: cells run one after another in one IPython kernel."""

    model_config = ConfigDict(extra="ignore")

    cells: list[Text] = Field(description="the notebook's code cells, run in order in one kernel")
    # SandboxFusion documents cell_timeout and enforces neither; here a cell over its limit is
    # interrupted (its error is the kernel's KeyboardInterrupt) and the next one runs, and the
    # total ends the notebook. 0 or less: no limit of the cell's own (SandboxFusion refuses none).
    cell_timeout: float = Field(
        0, allow_inf_nan=False, description="seconds each cell may run (0 or less: only the total limits it)"
    )
    total_timeout: float = Field(
        45, gt=0, allow_inf_nan=False, description="seconds all the cells may run together"
    )
    kernel: Literal["python3"] = "python3"
    files: dict[Text, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[Text] = Field(default_factory=list)


class Notebook(BaseModel):
    """A ``jupyter`` action's code, as JSON: what its driver runs (``/run_jupyter`` makes it from
    SandboxFusion's request; the native API takes it as ``code``)."""

    model_config = ConfigDict(extra="forbid")

    cells: list[Text]
    cell_timeout: float = Field(0, allow_inf_nan=False, description="0 or less: no limit of the cell's own")
    total_timeout: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="the cells' time together; default: the action's timeout"
    )


# ``/run_code``'s answer to "send it again later" (the platform failed: a host lost, retries spent;
# or back-pressure: a bound is full; or a gateway replica is a standby), where the other routes
# answer 503 or 429; the agent's and the gateway's alike. verl's client retries a 504 (three tries,
# backing off) and scores any other error status as a sandbox error (-1) at once: answered 503, a
# host lost mid-step, or an agent's full queue, made wrong rewards for every sample it held.
# Retry-After still says when; OpenRLHF's and slime's clients retry any failure, and the
# operator's own client retries 504 as it does 503.
RETRY_LATER_STATUS = 504
RETRY_LATER_INSTEAD_OF = frozenset({429, 503})


# The paths that answer in SandboxFusion's shape (``status``/``message``, 504 to retry), the agent's
# and the gateway's alike.
SANDBOXFUSION_PATHS = tuple(f"/{wire}" for wire in SANDBOXFUSION_WIRES)


def run_code_status(status: int) -> int:
    """``/run_code``'s status for what another route answers ``status``."""
    return RETRY_LATER_STATUS if status in RETRY_LATER_INSTEAD_OF else status


class ExecuteRequest(BaseModel):
    """The native ``POST /v1/execute`` request."""

    model_config = ConfigDict(extra="forbid")

    runtime: str = "python"
    code: Text
    stdin: Text | None = None
    timeout_s: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, ge=16)
    cores: list[int] | None = Field(None, description="the exact cores granted by the scheduler")
    ncores: int = Field(1, ge=1, description="when no grant is given: how many cores to take")
    session_id: str | None = None
    compile_timeout_s: float | None = Field(None, gt=0, description="compiled languages: the compile's limit")
    files: dict[Text, str] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[Text] = Field(default_factory=list)
    args: list[Text] = Field(default_factory=list)


class SessionRequest(BaseModel):
    """``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")

    persistent: bool = Field(False, description="keep a Python interpreter whose globals survive calls")
    ttl_s: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, ge=16)
