"""A stand-in for the ``pynvml`` module that answers NVML's queries from a fake inventory.

No NVIDIA driver exists on the test machines, so the real NVML source is exercised against this
module: the same function names, arguments, ctypes out-parameters and error classes as nvidia-ml-py,
its answers taken from a fake board. Reading it back through ``read_nvml`` must give that board.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from arl_tangram.gpu import mig
from arl_tangram.gpu.inventory import NodeInventory

NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_ENABLE = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_NVLINK_DEVICE_TYPE_GPU = 0
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
NVML_NVLINK_MAX_LINKS = 18
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
c_nvmlGpuInstance_t = ctypes.c_void_p
# nvidia-ml-py's profile enum -> the profile id a GPU reports for it (1g, 2g, 3g, 4g, 7g, 1g+me, 1g x2).
ENUM_TO_SLICES = {0: (1, 1), 1: (2, 2), 2: (3, 4), 3: (4, 4), 4: (7, 8), 7: (1, 1, "+me"), 9: (1, 2)}
SWITCH_BUS = "00000000:C0:00.0"


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_DriverNotLoaded(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


@dataclass
class _Mig:
    gpu: int
    k: int


class StandInNvml:
    """Module-like object: ``sys.modules["pynvml"] = StandInNvml(inv)``."""

    def __init__(self, inv: NodeInventory, remote_type: bool = True, numa_query: bool = True) -> None:
        self.inv = inv
        self.remote_type = remote_type
        self.numa_query = numa_query
        self.initialised = 0
        self.calls: list[str] = []
        for name, value in globals().items():
            if name.startswith(("NVML", "c_nvml")):
                setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)

    # ---- system ----
    def nvmlInit(self) -> None:
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.inv.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    # ---- one GPU (handles are indices; MIG device handles are _Mig) ----
    def _gpu(self, h: Any) -> Any:
        return self.inv.gpus[h]

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._gpu(h).model)

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        if isinstance(h, _Mig):
            return str(self.inv.gpus[h.gpu].mig_instances[h.k].uuid)
        return str(self._gpu(h).uuid)

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        if isinstance(h, _Mig):
            mib = self.inv.gpus[h.gpu].mig_instances[h.k].memory_mib
            return SimpleNamespace(total=mib << 20, used=0, free=mib << 20)
        g = self._gpu(h)
        return SimpleNamespace(total=g.memory_mib << 20, used=(g.memory_used_mib or 0) << 20, free=0)

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return tuple(self._gpu(h).compute_capability)  # type: ignore[return-value]

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._gpu(h).pci_bus_id.encode())

    def nvmlDeviceGetNumaNodeId(self, h: int) -> int:
        if not self.numa_query:
            raise NVMLError_NotSupported()
        numa = self._gpu(h).numa_node
        return -1 if numa is None else int(numa)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self._gpu(h).utilization_pct or 0, memory=0)

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        g = self._gpu(h)
        if mig.model_key(g.model, g.memory_mib) is None:
            raise NVMLError_NotSupported()
        mode = NVML_DEVICE_MIG_ENABLE if g.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    # ---- NVLink ----
    def _remote(self, h: int) -> list[tuple[str, int]]:
        g = self._gpu(h)
        if g.nvswitch_links:
            return [(SWITCH_BUS, NVML_NVLINK_DEVICE_TYPE_SWITCH)] * g.nvswitch_links
        out = []
        for b, count in enumerate(self.inv.nvlink[h]):
            out += [(self.inv.gpus[b].pci_bus_id, NVML_NVLINK_DEVICE_TYPE_GPU)] * count
        return out

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        links = self._remote(h)
        if not links:
            raise NVMLError_NotSupported()
        if link >= NVML_NVLINK_MAX_LINKS:
            raise NVMLError_InvalidArgument()
        return NVML_FEATURE_ENABLED if link < len(links) else 0

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        if not self.remote_type:
            raise NVMLError_NotSupported()
        return self._remote(h)[link][1]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=self._remote(h)[link][0].encode())

    # ---- MIG ----
    def _table(self, h: int) -> mig.MigModel:
        g = self._gpu(h)
        key = mig.model_key(g.model, g.memory_mib)
        if key is None or not g.mig_enabled:
            raise NVMLError_NotSupported()
        return mig.model_of(key)

    def _profile(self, h: int, enum: int) -> mig.MigProfile:
        table = self._table(h)
        if enum not in ENUM_TO_SLICES:
            raise NVMLError_NotSupported()
        compute, memory, *me = ENUM_TO_SLICES[enum]
        for p in table.profiles:
            if (
                p.compute == compute
                and p.memory * 8 // table.memory_slices == memory
                and (p.name.endswith("+me") == bool(me))
            ):
                return p
        raise NVMLError_NotSupported()

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: int, enum: int, version: int = 2) -> Any:
        p = self._profile(h, enum)
        g = self._gpu(h)
        return SimpleNamespace(
            id=p.profile_id,
            instanceCount=p.limit,
            sliceCount=p.compute,
            memorySizeMB=g.memory_mib * p.memory // self._table(h).memory_slices,
            name=f"MIG {p.name}".encode(),
        )

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: int, profile_id: int) -> int:
        p = self._table(h).by_id(profile_id)
        assert p is not None
        return self._gpu(h).mig_free.get(p.name, 0)

    def nvmlDeviceGetGpuInstances(self, h: int, profile_id: int, array: Any, count_ref: Any) -> int:
        p = self._table(h).by_id(profile_id)
        assert p is not None
        mine = [k for k, m in enumerate(self._gpu(h).mig_instances) if m.profile == p.name]
        for j, k in enumerate(mine):
            array[j] = ((h << 8) | k) + 1  # an opaque handle (never 0: a NULL pointer reads as None)
        count_ref._obj.value = len(mine)
        return 0

    def nvmlGpuInstanceGetInfo(self, handle: int) -> Any:
        h, k = (handle - 1) >> 8, (handle - 1) & 0xFF
        m = self.inv.gpus[h].mig_instances[k]
        return SimpleNamespace(
            id=m.gpu_instance_id, profileId=0, placement=SimpleNamespace(start=m.start, size=m.size)
        )

    def nvmlDeviceGetMaxMigDeviceCount(self, h: int) -> int:
        return 7 if self._gpu(h).mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: int, i: int) -> _Mig:
        if i >= len(self._gpu(h).mig_instances):
            raise NVMLError_NotSupported()
        return _Mig(h, i)

    def nvmlDeviceGetGpuInstanceId(self, dev: _Mig) -> int:
        return int(self.inv.gpus[dev.gpu].mig_instances[dev.k].gpu_instance_id)
