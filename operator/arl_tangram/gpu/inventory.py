"""The GPU inventory of one node: what NVML reports, in one plain, serialisable shape.

Two sources fill it (``arl_tangram.gpu.nvml`` from the real driver, ``arl_tangram.gpu.fake`` from named
topologies); everything downstream (the node agent's labels, the GPU manager, the MIG planner, the
GPU check) reads only this module's types. Standard library only: the GPU check imports it on machines
that have nothing but torch, nvidia-ml-py and numpy.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# Schema version of the JSON shape (the Node annotation); bump when a field changes meaning.
INVENTORY_VERSION = 1


class InventoryError(ValueError):
    """An inventory that contradicts itself or a JSON document that is not an inventory."""


@dataclass(frozen=True)
class MigInstance:
    """One MIG GPU instance: its profile (``3g.40gb``), device UUID (``MIG-...``), memory and placement
    (first memory slice and number of memory slices, as NVML reports it)."""

    profile: str
    uuid: str
    memory_mib: int
    start: int
    size: int
    gpu_instance_id: int = 0


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    compute_capability: tuple[int, int]
    pci_bus_id: str
    numa_node: int | None = None
    utilization_pct: int | None = None
    memory_used_mib: int | None = None
    mig_enabled: bool = False
    mig_pending: bool | None = None  # MIG mode after the next GPU reset, when it differs
    mig_instances: tuple[MigInstance, ...] = ()
    # Profiles that could still be created on this GPU -> how many more (NVML's remaining capacity).
    mig_free: dict[str, int] = field(default_factory=dict)
    nvswitch_links: int = 0  # active NVLinks that end on an NVSwitch

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


@dataclass(frozen=True)
class NodeInventory:
    """Every GPU of one node and the NVLink links between them.

    ``nvlink[a][b]`` counts the active NVLinks that join GPU ``a`` directly to GPU ``b`` (by index);
    links to an NVSwitch are counted per GPU in ``nvswitch_links`` instead, since a switch joins every
    GPU that reaches it."""

    node: str
    gpus: tuple[GpuInfo, ...]
    nvlink: tuple[tuple[int, ...], ...]
    driver: str = ""
    source: str = "nvml"

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if [g.index for g in self.gpus] != list(range(n)):
            raise InventoryError(f"node {self.node}: GPU indices must be 0..{n - 1} in order")
        if len(self.nvlink) != n or any(len(row) != n for row in self.nvlink):
            raise InventoryError(f"node {self.node}: the NVLink matrix must be {n}x{n}")
        for a, b in itertools.combinations(range(n), 2):
            if self.nvlink[a][b] != self.nvlink[b][a]:
                raise InventoryError(f"node {self.node}: NVLink counts of GPUs {a} and {b} disagree")
        if len({g.uuid for g in self.gpus}) != n:
            raise InventoryError(f"node {self.node}: GPU UUIDs must be unique")

    def linked(self, a: int, b: int) -> bool:
        """True when GPUs ``a`` and ``b`` reach each other over NVLink (directly or via NVSwitch)."""
        if a == b:
            return True
        if self.gpus[a].nvswitch_links > 0 and self.gpus[b].nvswitch_links > 0:
            return True
        return self.nvlink[a][b] > 0

    @property
    def nvswitch(self) -> bool:
        """True when every GPU reaches an NVSwitch (an HGX/DGX board)."""
        return bool(self.gpus) and all(g.nvswitch_links > 0 for g in self.gpus)

    @property
    def all_to_all(self) -> bool:
        """True when every pair of GPUs shares NVLink (NVSwitch or a full direct mesh)."""
        n = len(self.gpus)
        return all(self.linked(a, b) for a, b in itertools.combinations(range(n), 2))

    def link_matrix(self) -> list[list[bool]]:
        """Whether each pair of GPUs shares NVLink, as a boolean matrix."""
        n = len(self.gpus)
        return [[self.linked(a, b) for b in range(n)] for a in range(n)]

    def is_clique(self, members: Sequence[int]) -> bool:
        """True when every two of ``members`` share NVLink."""
        return all(self.linked(a, b) for a, b in itertools.combinations(members, 2))

    def whole_gpus(self) -> list[GpuInfo]:
        """GPUs not in MIG mode (they are allocated whole, in chunks)."""
        return [g for g in self.gpus if not g.mig_enabled]

    def to_json(self) -> str:
        """Compact JSON (the Node annotation and ``--once --json``)."""
        doc = asdict(self)
        doc["version"] = INVENTORY_VERSION
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeInventory:
        """Parse what ``to_json`` wrote; names the problem when it is not an inventory."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InventoryError(f"inventory is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InventoryError("inventory must be a JSON object")
        version = doc.pop("version", None)
        if version != INVENTORY_VERSION:
            raise InventoryError(f"inventory version {version!r} is not {INVENTORY_VERSION}")
        try:
            return _inventory_from_dict(doc)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InventoryError):
                raise
            raise InventoryError(f"inventory is malformed: {exc!r}") from exc


def _inventory_from_dict(doc: dict[str, Any]) -> NodeInventory:
    gpus = []
    for g in doc["gpus"]:
        g = dict(g)
        g["compute_capability"] = tuple(g["compute_capability"])
        g["mig_instances"] = tuple(MigInstance(**m) for m in g.get("mig_instances", ()))
        g["mig_free"] = {str(k): int(v) for k, v in g.get("mig_free", {}).items()}
        gpus.append(GpuInfo(**g))
    return NodeInventory(
        node=str(doc["node"]),
        gpus=tuple(gpus),
        nvlink=tuple(tuple(int(x) for x in row) for row in doc["nvlink"]),
        driver=str(doc.get("driver", "")),
        source=str(doc.get("source", "nvml")),
    )


def describe(inv: NodeInventory) -> str:
    """A human-readable table of the inventory (``tangram node-agent --once``)."""
    topo = "NVSwitch" if inv.nvswitch else ("all-to-all NVLink" if inv.all_to_all else "partial NVLink")
    if len(inv.gpus) < 2:
        topo = "single GPU"
    lines = [f"node {inv.node}: {len(inv.gpus)} GPUs ({inv.source}, driver {inv.driver or '?'}), {topo}"]
    for g in inv.gpus:
        cc = f"{g.compute_capability[0]}.{g.compute_capability[1]}"
        util = "-" if g.utilization_pct is None else f"{g.utilization_pct}%"
        numa = "-" if g.numa_node is None else str(g.numa_node)
        lines.append(
            f"  gpu {g.index} {g.uuid} {g.model} {g.memory_gib:.0f}GiB cc {cc} pci {g.pci_bus_id} "
            f"numa {numa} util {util} mig {'on' if g.mig_enabled else 'off'}"
        )
        for m in g.mig_instances:
            lines.append(f"    mig {m.profile} {m.uuid} {m.memory_mib}MiB slices {m.start}+{m.size}")
        if g.mig_enabled and g.mig_free:
            free = ", ".join(f"{p} x{c}" for p, c in sorted(g.mig_free.items()) if c > 0) or "none"
            lines.append(f"    mig free: {free}")
    n = len(inv.gpus)
    if n > 1 and not inv.nvswitch:
        lines.append("  nvlink links:")
        for a in range(n):
            lines.append("    " + " ".join(f"{inv.nvlink[a][b]:>2}" if a != b else " X" for b in range(n)))
    return "\n".join(lines)
