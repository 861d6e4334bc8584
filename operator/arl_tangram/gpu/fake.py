"""Fake GPU topologies: the inventories of real boards, for tests, demos and nodes without GPUs.

Each is what NVML would report on such a board (names, memory sizes in MiB, compute capability, PCI
bus ids, NUMA nodes, NVLink links, MIG instances placed as the driver would place them), so that
everything reading an inventory is exercised on the shapes it meets in clusters.
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Callable, Sequence

from arl_tangram.gpu import mig
from arl_tangram.gpu.inventory import GpuInfo, MigInstance, NodeInventory

FAKE_DRIVER = "550.90.07 (fake)"

# NVML's memory totals of each board (MiB), as reported by nvidia-smi.
H100_SXM = ("NVIDIA H100 80GB HBM3", 81559, (9, 0))
H200_SXM = ("NVIDIA H200", 143771, (9, 0))
H100_NVL = ("NVIDIA H100 NVL", 95830, (9, 0))
A100_SXM_80 = ("NVIDIA A100-SXM4-80GB", 81920, (8, 0))
A100_SXM_40 = ("NVIDIA A100-SXM4-40GB", 40960, (8, 0))


def _uuid_of(kind: str, node: str, *parts: int) -> str:
    # Stable across runs (tests and labels compare them), distinct per node and GPU.
    return str(_uuid.uuid5(_uuid.NAMESPACE_URL, f"tangram-fake/{kind}/{node}/" + "/".join(map(str, parts))))


def _bus(i: int) -> str:
    # Two sockets, four GPUs each, as HGX boards enumerate them.
    buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
    return f"00000000:{buses[i % 8]:02X}:00.0"


def _gpu(
    node: str,
    i: int,
    board: tuple[str, int, tuple[int, int]],
    numa: int,
    mig_profiles: Sequence[str] | None = None,
    nvswitch_links: int = 0,
) -> GpuInfo:
    name, mem, cc = board
    instances: tuple[MigInstance, ...] = ()
    free: dict[str, int] = {}
    if mig_profiles is not None:
        key = mig.model_key(name, mem)
        assert key is not None, name
        model = mig.model_of(key)
        placed = mig.place(model, mig_profiles)
        if placed is None:
            raise mig.MigError(f"fake topology: {key} cannot hold {list(mig_profiles)}")
        placed.sort(key=lambda ps: ps[1])
        per_slice = mem // model.memory_slices
        instances = tuple(
            MigInstance(
                profile=p,
                uuid="MIG-" + _uuid_of("mig", node, i, start),
                memory_mib=per_slice * model.profile(p).memory - 64,  # less what the instance reserves
                start=start,
                size=model.profile(p).memory,
                gpu_instance_id=gi + 1,
            )
            for gi, (p, start) in enumerate(placed)
        )
        free = mig.remaining_capacity(model, placed)
    return GpuInfo(
        index=i,
        uuid="GPU-" + _uuid_of("gpu", node, i),
        model=name,
        memory_mib=mem,
        compute_capability=cc,
        pci_bus_id=_bus(i),
        numa_node=numa,
        utilization_pct=0,
        memory_used_mib=0,
        mig_enabled=mig_profiles is not None,
        mig_instances=instances,
        mig_free=free,
        nvswitch_links=nvswitch_links,
    )


def _links(n: int, pairs: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], ...]:
    m = [[0] * n for _ in range(n)]
    for a, b, count in pairs:
        m[a][b] = m[b][a] = count
    return tuple(tuple(r) for r in m)


def nvswitch_board(node: str, board: tuple[str, int, tuple[int, int]] = H100_SXM) -> NodeInventory:
    """8 SXM GPUs on NVSwitch (HGX H100/H200): 18 NVLinks from each GPU to the switches."""
    gpus = tuple(_gpu(node, i, board, i // 4, nvswitch_links=18) for i in range(8))
    return NodeInventory(node, gpus, _links(8, []), FAKE_DRIVER, "fake:nvswitch-h100")


def h200_board(node: str) -> NodeInventory:
    inv = nvswitch_board(node, H200_SXM)
    return NodeInventory(inv.node, inv.gpus, inv.nvlink, inv.driver, "fake:nvswitch-h200")


# NVLink bridges of the PCIe-pairs board. The bridges join GPUs under different PCIe switches of one
# socket, so nvidia-smi's order (by bus id) does not follow them: an allocator that cuts chunks by index
# puts TP-2 replicas across PCIe, one that reads the matrix does not.
PCIE_PAIRS = ((0, 2), (1, 3), (4, 6), (5, 7))


def pcie_pairs(node: str) -> NodeInventory:
    """8 PCIe H100 NVL cards joined in pairs by NVLink bridges (12 links per pair)."""
    gpus = tuple(_gpu(node, i, H100_NVL, i // 4) for i in range(8))
    links = _links(8, [(a, b, 12) for a, b in PCIE_PAIRS])
    return NodeInventory(node, gpus, links, FAKE_DRIVER, "fake:pcie-pairs")


def ring4(node: str) -> NodeInventory:
    """4 A100-40GB in an NVLink ring 0-1-2-3-0 (6 links per neighbour), no switch."""
    gpus = tuple(_gpu(node, i, A100_SXM_40, 0) for i in range(4))
    ring = [(i, (i + 1) % 4, 6) for i in range(4)]
    return NodeInventory(node, gpus, _links(4, ring), FAKE_DRIVER, "fake:ring4")


# MIG layouts of the two MIG boards: mixed profiles, with room left on some GPUs.
A100_MIG_LAYOUT: dict[int, tuple[str, ...]] = {
    0: ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),
    1: ("1g.10gb",) * 7,
    2: ("4g.40gb", "1g.20gb"),
}
H100_MIG_LAYOUT: dict[int, tuple[str, ...]] = {
    4: ("3g.40gb", "3g.40gb"),
    5: ("2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"),
    6: ("4g.40gb", "1g.10gb", "1g.10gb", "1g.10gb"),
    7: ("3g.40gb", "1g.20gb", "1g.20gb"),
}


def mig_a100(node: str) -> NodeInventory:
    """4 A100-SXM4-80GB, all-to-all NVLink (4 of each GPU's 12 links to every peer); GPUs 0-2 in MIG
    mode with mixed profiles (GPU 2 has room for more), GPU 3 whole."""
    gpus = tuple(_gpu(node, i, A100_SXM_80, i // 2, A100_MIG_LAYOUT.get(i)) for i in range(4))
    pairs = [(a, b, 4) for a in range(4) for b in range(a + 1, 4)]
    return NodeInventory(node, gpus, _links(4, pairs), FAKE_DRIVER, "fake:mig-a100")


def mig_h100(node: str) -> NodeInventory:
    """8 H100 80GB on NVSwitch; GPUs 0-3 whole, 4-7 in MIG mode with mixed profiles."""
    gpus = tuple(_gpu(node, i, H100_SXM, i // 4, H100_MIG_LAYOUT.get(i), 18) for i in range(8))
    return NodeInventory(node, gpus, _links(8, []), FAKE_DRIVER, "fake:mig-h100")


def apply_layout(inv: NodeInventory, gpus: dict[int, tuple[str, ...] | None]) -> NodeInventory:
    """The inventory after the MIG manager applied ``gpus`` (index -> profiles, None: MIG off): what a
    fake node reports once its agent plays the MIG manager's part (the test bed has none)."""
    out = list(inv.gpus)
    for index, profiles in gpus.items():
        old = inv.gpus[index]
        board = (old.model, old.memory_mib, old.compute_capability)
        new = _gpu(inv.node, index, board, old.numa_node or 0, profiles, old.nvswitch_links)
        out[index] = GpuInfo(**{**new.__dict__, "uuid": old.uuid, "pci_bus_id": old.pci_bus_id})
    return NodeInventory(inv.node, tuple(out), inv.nvlink, inv.driver, inv.source)


# The test bed's MIG node (hack/testbed/nodes.yaml, tb-mig-0): mig-parted's "all-1g.5gb" on GPU 0 and
# "all-3g.20gb" on GPU 1, the resources the device plugin's mixed strategy advertises there.
A100_40_MIG_LAYOUT: dict[int, tuple[str, ...]] = {0: ("1g.5gb",) * 7, 1: ("3g.20gb", "3g.20gb")}


def mig_a100_40gb(node: str) -> NodeInventory:
    """2 A100-SXM4-40GB joined by NVLink (12 links), both in MIG mode: seven 1g.5gb instances on GPU 0,
    two 3g.20gb on GPU 1 (the test bed's ``tb-mig-0``)."""
    gpus = tuple(_gpu(node, i, A100_SXM_40, 0, A100_40_MIG_LAYOUT[i]) for i in range(2))
    return NodeInventory(node, gpus, _links(2, [(0, 1, 12)]), FAKE_DRIVER, "fake:mig-a100-40gb")


TOPOLOGIES: dict[str, Callable[[str], NodeInventory]] = {
    "nvswitch-h100": nvswitch_board,
    "nvswitch-h200": h200_board,
    "pcie-pairs": pcie_pairs,
    "ring4": ring4,
    "mig-a100": mig_a100,
    "mig-h100": mig_h100,
    "mig-a100-40gb": mig_a100_40gb,
}


def fake_inventory(topology: str, node: str = "fake-node") -> NodeInventory:
    """The inventory of a named fake topology (see ``TOPOLOGIES``)."""
    try:
        build = TOPOLOGIES[topology]
    except KeyError:
        choices = ", ".join(TOPOLOGIES)
        raise ValueError(f"unknown fake GPU topology {topology!r}; choose one of {choices}") from None
    return build(node)
