"""Capacity state and placement per resource type, each exposing its DP operator (pure)."""

from arl_tangram.managers.count_op import CountOperator
from arl_tangram.managers.cpu import CpuManager, SandboxHost
from arl_tangram.managers.gpu import BuddyOperator, GpuManager, GpuNode
from arl_tangram.managers.quota import ApiQuota, QuotaManager

__all__ = [
    "ApiQuota",
    "BuddyOperator",
    "CountOperator",
    "CpuManager",
    "GpuManager",
    "GpuNode",
    "QuotaManager",
    "SandboxHost",
]
