"""Policy names to classes: the one place that knows every policy."""

from __future__ import annotations

from arl_tangram.core.policies.paper import FcfsMinPolicy, PaperPolicy
from arl_tangram.core.policies.static import StaticPolicy
from arl_tangram.core.policies.tangram import TangramPolicy
from arl_tangram.core.scheduler import Scheduler

POLICIES: dict[str, type[Scheduler]] = {
    "static": StaticPolicy,
    "fcfs-min": FcfsMinPolicy,
    "paper": PaperPolicy,
    "tangram": TangramPolicy,
}
