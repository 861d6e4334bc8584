"""The real inventory source: NVML through nvidia-ml-py (``pynvml``), imported only when called.

Read-only by construction: this module calls only NVML queries (``nvmlDeviceGet*``,
``nvmlGpuInstanceGetInfo``, ``nvmlSystemGet*``), never a setter. Where the library or the driver is
missing, ``read_nvml`` raises ``NvmlUnavailable`` whose message is the one line a person needs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import socket
from pathlib import Path
from typing import Any

from arl_tangram.gpu import mig
from arl_tangram.gpu.inventory import GpuInfo, MigInstance, NodeInventory


class NvmlUnavailable(RuntimeError):
    """No usable NVML here: the message says why, in one line."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus_id(value: Any) -> str:
    # NVML pads the domain to 8 hex digits in nvmlDeviceGetPciInfo and to 4 in some remote-link
    # answers; normalise so the two can be matched.
    text = _text(value).upper()
    domain, _, rest = text.partition(":")
    return f"{int(domain, 16):08X}:{rest}" if rest else text


def _import() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"NVML unavailable: nvidia-ml-py is not installed ({exc})") from None
    return pynvml


def init() -> Any:
    """Initialise NVML and return the module; ``NvmlUnavailable`` with one line when it cannot."""
    pynvml = _import()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        hint = ""
        if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
            hint = " (no NVIDIA driver library on this machine: no GPU here)"
        elif isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
            hint = " (the NVIDIA kernel driver is not loaded)"
        raise NvmlUnavailable(f"NVML unavailable: {exc}{hint}") from None
    return pynvml


def _optional(pynvml: Any, fn: Any, *args: Any) -> Any:
    """An NVML query that some GPUs or drivers do not support: None instead of an error."""
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _mig(
    pynvml: Any, handle: Any, name: str, memory_mib: int
) -> tuple[tuple[MigInstance, ...], dict[str, int]]:
    key = mig.model_key(name, memory_mib)
    table = mig.model_of(key) if key is not None and key in mig.MODELS else None
    # MIG devices (the compute instances CUDA sees): UUID and memory, by GPU-instance id.
    devices: dict[int, tuple[str, int]] = {}
    count = _optional(pynvml, pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
    for i in range(count):
        dev = _optional(pynvml, pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i)
        if dev is None:
            continue
        gi = pynvml.nvmlDeviceGetGpuInstanceId(dev)
        devices[gi] = (_text(pynvml.nvmlDeviceGetUUID(dev)), pynvml.nvmlDeviceGetMemoryInfo(dev).total >> 20)
    instances: list[MigInstance] = []
    free: dict[str, int] = {}
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        info = _optional(pynvml, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, enum)
        if info is None:  # drivers before the v2 query: v1 has the same fields but no name
            info = _optional(pynvml, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, enum, 1)
        if info is None:
            continue
        known = table.by_id(info.id) if table is not None else None
        if known is not None:
            profile = known.name
        elif hasattr(info, "name"):
            profile = _text(info.name).removeprefix("MIG ")
        else:
            profile = f"profile-{info.id}"
        free[profile] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, info.id)
        array = (pynvml.c_nvmlGpuInstance_t * max(1, info.instanceCount))()
        found = ctypes.c_uint(0)
        get = pynvml.nvmlDeviceGetGpuInstances
        listed = _optional(pynvml, get, handle, info.id, array, ctypes.byref(found))
        if listed is None:
            continue
        for j in range(found.value):
            gi_info = pynvml.nvmlGpuInstanceGetInfo(array[j])
            uuid, mem = devices.get(gi_info.id, ("", int(info.memorySizeMB)))
            instances.append(
                MigInstance(
                    profile=profile,
                    uuid=uuid,
                    memory_mib=int(mem),
                    start=int(gi_info.placement.start),
                    size=int(gi_info.placement.size),
                    gpu_instance_id=int(gi_info.id),
                )
            )
    instances.sort(key=lambda m: m.start)
    return tuple(instances), free


def _links(pynvml: Any, handle: Any) -> list[tuple[str, int | None]]:
    """(remote PCI bus id, remote device type or None when the driver cannot say) of each active
    NVLink of a GPU."""
    out: list[tuple[str, int | None]] = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _optional(pynvml, pynvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            break  # past the GPU's last link (NVML answers "invalid argument" or "not supported")
        if state != pynvml.NVML_FEATURE_ENABLED:
            continue
        kind = _optional(pynvml, pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        remote = _optional(pynvml, pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
        out.append(("" if remote is None else _bus_id(remote.busId), kind))
    return out


def _sysfs_numa(bus_id: str) -> int | None:
    """The NUMA node of a PCI device from sysfs (drivers whose NVML lacks the query)."""
    domain, _, rest = bus_id.lower().partition(":")
    try:
        node = int(Path(f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def read_nvml(node: str | None = None) -> NodeInventory:
    """The inventory of this machine's GPUs from NVML (read-only)."""
    pynvml = init()
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus: list[GpuInfo] = []
        link_peers: list[list[tuple[str, int | None]]] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(pynvml.nvmlDeviceGetName(h))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            memory_mib = int(mem.total >> 20)
            modes = _optional(pynvml, pynvml.nvmlDeviceGetMigMode, h)
            mig_on = bool(modes and modes[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
            pending = None if not modes or modes[1] == modes[0] else modes[1] == pynvml.NVML_DEVICE_MIG_ENABLE
            instances, free = _mig(pynvml, h, name, memory_mib) if mig_on else ((), {})
            util = _optional(pynvml, pynvml.nvmlDeviceGetUtilizationRates, h)
            numa = _optional(pynvml, pynvml.nvmlDeviceGetNumaNodeId, h)
            bus = _bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId)
            if numa is None or numa < 0:
                numa = _sysfs_numa(bus)
            link_peers.append(_links(pynvml, h))
            gpus.append(
                GpuInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    model=name,
                    memory_mib=memory_mib,
                    compute_capability=tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                    pci_bus_id=bus,
                    numa_node=None if numa is None else int(numa),
                    utilization_pct=None if util is None else int(util.gpu),
                    memory_used_mib=int(mem.used >> 20),
                    mig_enabled=mig_on,
                    mig_pending=pending,
                    mig_instances=instances,
                    mig_free=free,
                )
            )
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML query failed: {exc}") from None
    finally:
        _optional(pynvml, pynvml.nvmlShutdown)
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    n = len(gpus)
    matrix = [[0] * n for _ in range(n)]
    nvswitch_type = getattr(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for a, peers in enumerate(link_peers):
        switch = 0
        for bus, kind in peers:
            b = by_bus.get(bus)
            if kind == nvswitch_type or (kind is None and b is None and bus):
                switch += 1  # a link whose far end is not one of our GPUs ends on a switch
            elif b is not None and b != a:
                matrix[a][b] += 1
        gpus[a] = dataclasses.replace(gpus[a], nvswitch_links=switch)
    # Each end counts the same links; keep the smaller count when a driver reports them unevenly.
    sym = tuple(tuple(min(matrix[a][b], matrix[b][a]) for b in range(n)) for a in range(n))
    return NodeInventory(node or socket.gethostname(), tuple(gpus), sym, driver, "nvml")
