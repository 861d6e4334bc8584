"""The real NVML source read against a stand-in ``pynvml`` (``nvml_standin``: no driver here) that
answers from each fake board: what ``read_nvml`` builds must be that board."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from nvml_standin import StandInNvml

from arl_tangram.gpu.fake import TOPOLOGIES, fake_inventory
from arl_tangram.gpu.inventory import NodeInventory
from arl_tangram.gpu.nvml import NvmlUnavailable, read_nvml


def _read(monkeypatch: pytest.MonkeyPatch, nvml: StandInNvml) -> NodeInventory:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return read_nvml("node-x")


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
@pytest.mark.parametrize("old_driver", [False, True])
def test_read_nvml_rebuilds_each_board(
    monkeypatch: pytest.MonkeyPatch, topology: str, old_driver: bool
) -> None:
    want = fake_inventory(topology, "node-x")
    # An older driver answers neither the remote device type of a link nor the NUMA node.
    nvml = StandInNvml(want, remote_type=not old_driver, numa_query=not old_driver)
    got = _read(monkeypatch, nvml)
    assert nvml.initialised == 0, "NVML left initialised"
    if old_driver:  # NUMA then comes from sysfs, which does not know these invented bus ids
        want = dataclasses.replace(
            want, gpus=tuple(dataclasses.replace(g, numa_node=None) for g in want.gpus)
        )
    assert got == dataclasses.replace(want, driver="550.54.15", source="nvml")


def test_a_missing_library_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = StandInNvml(fake_inventory("ring4"))

    def refuse() -> None:
        raise nvml.NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    import nvml_standin

    nvml.NVMLError = nvml_standin.NVMLError
    nvml.NVMLError_LibraryNotFound = nvml_standin.NVMLError_LibraryNotFound
    nvml.NVMLError_DriverNotLoaded = nvml_standin.NVMLError_DriverNotLoaded
    nvml.nvmlInit = refuse  # type: ignore[method-assign]
    with pytest.raises(NvmlUnavailable, match="no GPU here"):
        _read(monkeypatch, nvml)
