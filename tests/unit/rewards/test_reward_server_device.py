"""The reward runtime's device budget on CUDA when PyTorch sees fewer GPUs than ``--device`` names.

No GPU and no PyTorch here, so PyTorch is a stand-in module: it answers ``is_available`` and
``device_count`` as a CPU-only or one-GPU PyTorch does, and ``mem_get_info`` fails as the real one
does on a device it has not (``AssertionError`` without CUDA, ``RuntimeError`` past the GPUs)."""

from __future__ import annotations

import sys
import types

import pytest

from arl_tangram.rewards.server import ConfigError, _device_capacity


def _torch(gpus: int) -> types.ModuleType:
    torch = types.ModuleType("torch")

    def mem_get_info(device: object) -> tuple[int, int]:
        if gpus == 0:
            raise AssertionError("Torch not compiled with CUDA enabled")
        index = getattr(device, "index", 0) or 0
        if index >= gpus:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return 80 * 2**30, 80 * 2**30

    torch.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: gpus > 0, device_count=lambda: gpus, mem_get_info=mem_get_info
    )
    torch.device = lambda name: types.SimpleNamespace(index=int(name.partition(":")[2] or 0))  # type: ignore[attr-defined]
    return torch


@pytest.mark.parametrize(("gpus", "device"), [(0, "cuda"), (0, "cuda:0"), (1, "cuda:1"), (2, "cuda:7")])
def test_a_device_past_the_gpus_is_named_at_start(
    monkeypatch: pytest.MonkeyPatch, gpus: int, device: str
) -> None:
    """It used to reach ``mem_get_info`` and end the start in PyTorch's traceback."""
    monkeypatch.setitem(sys.modules, "torch", _torch(gpus))
    with pytest.raises(ConfigError, match=f"--device {device}: PyTorch sees {gpus} CUDA device"):
        _device_capacity(device, None)


def test_a_device_that_exists_gets_nine_tenths_of_its_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(2))
    assert _device_capacity("cuda:1", None) == int(80 * 2**30 * 0.9)
