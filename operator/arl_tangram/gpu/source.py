"""One entry point for an inventory, whichever source: real NVML, or a named fake topology."""

from __future__ import annotations

from arl_tangram.gpu.inventory import NodeInventory


def read_inventory(fake: str | None = None, node: str | None = None) -> NodeInventory:
    """The node's inventory: the fake ``fake`` topology when named, else NVML (``NvmlUnavailable``
    when there is none)."""
    if fake is not None:
        from arl_tangram.gpu.fake import fake_inventory

        return fake_inventory(fake, node or "fake-node")
    from arl_tangram.gpu.nvml import read_nvml

    return read_nvml(node)
