"""RewardModelService replicas onto the published inventories: NVLink-joined chunks, MIG instances with
enough memory, nothing handed out twice, device requests the cluster understands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.gpu.fake import fake_inventory
from arl_tangram.gpu.placement import device_request, place_service, to_status

SAMPLE = Path(__file__).resolve().parents[3] / "manifests" / "samples" / "rewardmodelservice-small.yaml"


def _rms(gpu: dict[str, Any], name: str = "rm") -> RewardModelService:
    return RewardModelService.model_validate(
        {"metadata": {"name": name}, "spec": {"model": {"name": "m", "uri": "file:///m"}, "gpu": gpu}}
    )


def test_the_sample_lands_on_mig_slices() -> None:
    rms = RewardModelService.model_validate(yaml.safe_load(SAMPLE.read_text()))
    invs = [fake_inventory("mig-a100", "a"), fake_inventory("mig-h100", "h")]
    got = place_service(rms, invs, 2)
    assert got.unplaced == 0 and len(got.placements) == 2
    by_uuid = {m.uuid: (inv.node, m) for inv in invs for g in inv.gpus for m in g.mig_instances}
    for p in got.placements:
        node, inst = by_uuid[p.uuids[0]]
        assert node == p.node and inst.profile == "1g.10gb"
    assert len({p.uuids for p in got.placements}) == 2
    req = device_request(got.placements[0])
    assert req.resources == {"nvidia.com/mig-1g.10gb": "1"} and req.env["TANGRAM_GPU_UUIDS"].startswith(
        "MIG-"
    )
    status = to_status(got.placements[0], "Evicted", pod="rm-0")
    assert status.gpus == list(got.placements[0].uuids) and status.state == "Evicted"


def test_whole_gpu_replicas_are_nvlink_pairs_and_never_shared() -> None:
    inv = fake_inventory("pcie-pairs", "p")
    got = place_service(_rms({"count": [2], "memory": "60Gi", "nvlink": "Required"}), [inv], 5)
    assert len(got.placements) == 4 and got.unplaced == 1 and "NVLink" in got.reason
    seen: set[str] = set()
    for p in got.placements:
        assert inv.is_clique(p.gpus) and not seen & set(p.uuids)
        seen |= set(p.uuids)
    again = place_service(_rms({"count": [2]}), [inv], 1, taken=seen)
    assert again.unplaced == 1 and not again.placements


def test_taken_devices_are_left_alone() -> None:
    inv = fake_inventory("nvswitch-h100", "n")
    taken = {g.uuid for g in inv.gpus[:6]}
    got = place_service(_rms({"count": [1, 2]}), [inv], 3, taken=taken)
    assert [len(p.uuids) for p in got.placements] == [1, 1] and got.unplaced == 1
    assert not taken & {u for p in got.placements for u in p.uuids}


def test_memory_rules_out_too_small_mig_instances() -> None:
    inv = fake_inventory("mig-h100", "h")
    # 1g.20gb instances hold 20 GB; the 18Gi replica fits them only.
    got = place_service(
        _rms({"count": [1], "migProfile": "1g.20gb", "memory": "18Gi", "nvlink": "None"}), [inv], 3
    )
    assert len(got.placements) == 2 and got.unplaced == 1
    too_big = place_service(
        _rms({"count": [1], "migProfile": "1g.20gb", "memory": "30Gi", "nvlink": "None"}), [inv], 1
    )
    assert too_big.unplaced == 1 and "MIG 1g.20gb" in too_big.reason


def test_visible_devices_strategy_names_the_exact_gpus() -> None:
    inv = fake_inventory("nvswitch-h200", "n")
    p = place_service(_rms({"count": [4]}), [inv], 1).placements[0]
    req = device_request(p, "visible-devices")
    assert req.resources == {} and req.runtime_class == "nvidia"
    assert req.env["NVIDIA_VISIBLE_DEVICES"].split(",") == list(p.uuids) and len(p.uuids) == 4
    assert device_request(p).resources == {"nvidia.com/gpu": "4"}


@pytest.mark.parametrize("replicas", [0, -1])
def test_nothing_asked_nothing_placed(replicas: int) -> None:
    got = place_service(_rms({"count": [1]}), [fake_inventory("ring4")], replicas)
    assert got.placements == [] and got.unplaced == 0


def test_without_inventories_the_reason_says_so() -> None:
    got = place_service(_rms({"count": [1]}), [], 2)
    assert got.unplaced == 2 and "inventory" in got.reason


def test_mig_demand_from_the_sample() -> None:
    from arl_tangram.gpu.placement import mig_demand

    rms = RewardModelService.model_validate(yaml.safe_load(SAMPLE.read_text()))
    d = mig_demand(rms, rate_per_s=10.0, service_s=0.1)
    assert d.memory_gb == pytest.approx(6 * 2**30 / 1e9) and d.compute_slices == 1
    assert d.replicas() == 2  # 1 busy instance at a 0.7 target
    sized = mig_demand(_rms({"count": [1], "migProfile": "3g.40gb", "nvlink": "None"}), 1.0, 0.5)
    assert sized.memory_gb == 40.0 and sized.compute_slices == 3
    with pytest.raises(ValueError, match=r"gpu\.memory"):
        mig_demand(_rms({"count": [1]}), 1.0, 0.1)


@pytest.mark.parametrize(("need", "placed"), [("Required", 0), ("Preferred", 1), ("None", 1)])
def test_nvlink_need_decides_whether_pcie_chunks_are_taken(need: str, placed: int) -> None:
    inv = fake_inventory("ring4", "r")  # no four GPUs share NVLink
    got = place_service(_rms({"count": [4], "nvlink": need}), [inv], 1)
    assert len(got.placements) == placed
    if placed:
        assert sorted(got.placements[0].gpus) == [0, 1, 2, 3]


def test_cliques_come_first_when_pcie_is_allowed() -> None:
    inv = fake_inventory("pcie-pairs", "p")
    got = place_service(_rms({"count": [2], "nvlink": "Preferred"}), [inv], 5)
    assert len(got.placements) == 4  # the four bridged pairs; no fifth pair exists even across PCIe
    assert all(inv.is_clique(p.gpus) for p in got.placements)
