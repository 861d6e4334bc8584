"""Custom resource models (pure: no kopf, kubernetes or aiohttp). Source of the CRD schemas.

Three kinds in group ``tangram.arl.dev``, version ``v1alpha1``: :class:`ActionPool` (CPU sandboxes),
:class:`RewardModelService` (GPU model services) and :class:`ActionBatch` (the actions of a trainer
step). ``load(obj)`` turns a stored object into its model and raises ``InvalidSpec`` naming the field;
``validate_targets`` checks what only the controller can know (that the named targets exist).
"""

from arl_tangram.api.actionbatch import (
    MAX_ACTIONS,
    MAX_SPEC_BYTES,
    Action,
    ActionBatch,
    ActionBatchSpec,
    ActionBatchStatus,
    ActionResult,
)
from arl_tangram.api.actionpool import LANGUAGES, ActionPool, ActionPoolSpec, ActionPoolStatus
from arl_tangram.api.meta import API_VERSION, GROUP, VERSION, Condition
from arl_tangram.api.quantity import parse_quantity, quantity_bytes
from arl_tangram.api.rewardmodelservice import (
    SERVER_RUNTIMES,
    RewardModelService,
    RewardModelServiceSpec,
    RewardModelServiceStatus,
)
from arl_tangram.api.validation import load, parse, validate_targets

__all__ = [
    "API_VERSION",
    "GROUP",
    "LANGUAGES",
    "MAX_ACTIONS",
    "MAX_SPEC_BYTES",
    "SERVER_RUNTIMES",
    "VERSION",
    "Action",
    "ActionBatch",
    "ActionBatchSpec",
    "ActionBatchStatus",
    "ActionPool",
    "ActionPoolSpec",
    "ActionPoolStatus",
    "ActionResult",
    "Condition",
    "RewardModelService",
    "RewardModelServiceSpec",
    "RewardModelServiceStatus",
    "load",
    "parse",
    "parse_quantity",
    "quantity_bytes",
    "validate_targets",
]
