"""The static baseline's measured figures: ``calibration.yaml``, read by every workload.

Pod start-up and the exec path of a pod-per-trajectory sandbox are measured through a real API
server (``calibration.yaml`` says how, where and when); a workload file may still set its own
figures under ``static``, and those win. Nothing here is tuned to a result.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arl_tangram.errors import InvalidSpec

Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PodStart(_Strict):
    """Creation to Ready of one pod alone: lognormal median and sigma of the log."""

    median_s: Positive
    sigma: NonNegative
    samples: int = Field(ge=1)
    source: str = Field(min_length=1)  # which measurement the figures are copied from


class Provenance(_Strict):
    """How the figures were measured: free text a reader can repeat."""

    measured_on: str
    date: str
    method: str
    not_modelled: str


class Calibration(_Strict):
    """The figures the static model reads (see ``calibration.yaml``)."""

    pod_start: PodStart
    pod_admission_per_s: Positive  # pods a burst brings to Ready per second, end to end
    exec_s: NonNegative  # one action's exec in its pod: a fresh interpreter per call (median)
    exec_samples: int = Field(ge=1)
    provenance: Provenance


@functools.cache
def calibration() -> Calibration:
    """The checked-in calibration (read once)."""
    text = resources.files("arl_tangram.sim").joinpath("calibration.yaml").read_text()
    try:
        return Calibration.model_validate(yaml.safe_load(text))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InvalidSpec("calibration." + ".".join(str(x) for x in err["loc"]), err["msg"]) from exc
