"""The inventory shape, the fake topologies and the no-GPU path of the real NVML source."""

from __future__ import annotations

import itertools

import pytest

from arl_tangram.gpu import mig
from arl_tangram.gpu.fake import PCIE_PAIRS, TOPOLOGIES, fake_inventory
from arl_tangram.gpu.inventory import InventoryError, NodeInventory, describe
from arl_tangram.gpu.nvml import NvmlUnavailable, read_nvml


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_every_topology_round_trips_through_json(name: str) -> None:
    inv = fake_inventory(name, "node-a")
    assert NodeInventory.from_json(inv.to_json()) == inv
    assert inv.node == "node-a" and inv.source == f"fake:{name}"
    assert describe(inv).startswith("node node-a:")


def test_fakes_on_two_nodes_have_distinct_uuids() -> None:
    a, b = fake_inventory("mig-h100", "a"), fake_inventory("mig-h100", "b")
    ids_a = {g.uuid for g in a.gpus} | {m.uuid for g in a.gpus for m in g.mig_instances}
    ids_b = {g.uuid for g in b.gpus} | {m.uuid for g in b.gpus for m in g.mig_instances}
    assert not ids_a & ids_b


@pytest.mark.parametrize(
    ("name", "nvswitch", "all_to_all"),
    [
        ("nvswitch-h100", True, True),
        ("nvswitch-h200", True, True),
        ("mig-h100", True, True),
        ("mig-a100", False, True),
        ("mig-a100-40gb", False, True),
        ("pcie-pairs", False, False),
        ("ring4", False, False),
    ],
)
def test_nvlink_detection(name: str, nvswitch: bool, all_to_all: bool) -> None:
    inv = fake_inventory(name)
    assert inv.nvswitch is nvswitch
    assert inv.all_to_all is all_to_all


def test_pcie_pairs_link_only_the_bridged_pairs() -> None:
    inv = fake_inventory("pcie-pairs")
    linked = {(a, b) for a, b in itertools.combinations(range(8), 2) if inv.linked(a, b)}
    assert linked == set(PCIE_PAIRS)
    assert not inv.is_clique([0, 1])
    assert inv.is_clique([0, 2])


def test_ring_links_neighbours_only() -> None:
    inv = fake_inventory("ring4")
    assert inv.linked(0, 1) and inv.linked(3, 0)
    assert not inv.linked(0, 2) and not inv.linked(1, 3)
    assert not inv.is_clique([0, 1, 2, 3])


@pytest.mark.parametrize("name", ["mig-a100", "mig-h100"])
def test_fake_mig_instances_are_a_valid_layout(name: str) -> None:
    inv = fake_inventory(name)
    assert any(g.mig_enabled for g in inv.gpus) and any(not g.mig_enabled for g in inv.gpus)
    for g in inv.gpus:
        if not g.mig_enabled:
            assert not g.mig_instances
            continue
        key = mig.model_key(g.model, g.memory_mib)
        assert key is not None
        model = mig.model_of(key)
        used = 0
        for m in g.mig_instances:
            p = model.profile(m.profile)
            assert m.start in p.starts and m.size == p.memory
            run = ((1 << m.size) - 1) << m.start
            assert not used & run, f"{name} gpu {g.index}: instances overlap"
            used |= run
            assert m.uuid.startswith("MIG-") and 0 < m.memory_mib <= g.memory_mib
        assert sum(model.profile(m.profile).compute for m in g.mig_instances) <= model.compute_slices
        # Free capacity agrees with what still fits next to the instances.
        for prof, free in g.mig_free.items():
            taken = [(m.profile, m.start) for m in g.mig_instances]
            assert (mig.place(model, [prof] * free, taken) is not None) and (
                mig.place(model, [prof] * (free + 1), taken) is None
            )


def test_the_test_beds_gpu_nodes_have_the_fake_topologies_that_match_them() -> None:
    """Each simulated GPU node of the test bed names the fake topology its node agent serves in the
    e2e tests; the topology must be the node: GPU count, model and memory as GPU feature discovery
    labelled it, whole GPUs and MIG instances per profile as the device plugin advertises them."""
    from pathlib import Path

    import yaml

    from arl_tangram.gpu.nodeinfo import label_safe

    nodes = yaml.safe_load((Path(__file__).resolve().parents[3] / "hack/testbed/nodes.yaml").read_text())
    gpu_nodes = [n for n in nodes["nodes"] if n["labels"].get("nvidia.com/gpu.present") == "true"]
    assert {n["name"] for n in gpu_nodes} == {"tb-gpu-0", "tb-mig-0"}
    for n in gpu_nodes:
        labels, capacity = n["labels"], n["capacity"]
        inv = fake_inventory(labels["tangram.arl.dev/testbed-gpu-topology"], n["name"])
        assert len(inv.gpus) == int(labels["nvidia.com/gpu.count"]), n["name"]
        assert {label_safe(g.model) for g in inv.gpus} == {labels["nvidia.com/gpu.product"]}
        assert {g.memory_mib for g in inv.gpus} == {int(labels["nvidia.com/gpu.memory"])}
        assert len(inv.whole_gpus()) == int(capacity["nvidia.com/gpu"]), n["name"]
        per_profile: dict[str, int] = {}
        for g in inv.gpus:
            for m in g.mig_instances:
                per_profile[m.profile] = per_profile.get(m.profile, 0) + 1
        advertised = {
            k.removeprefix("nvidia.com/mig-"): int(v)
            for k, v in capacity.items()
            if k.startswith("nvidia.com/mig-")
        }
        assert per_profile == advertised, n["name"]


def test_mixed_mig_board_has_room_left_on_a_gpu() -> None:
    inv = fake_inventory("mig-a100")
    assert inv.gpus[2].mig_free["1g.10gb"] == 1
    assert all(c == 0 for c in inv.gpus[1].mig_free.values())


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", '{"version": 99}', '{"version": 1, "node": "n"}'],
)
def test_a_document_that_is_not_an_inventory_is_refused_clearly(text: str) -> None:
    with pytest.raises(InventoryError):
        NodeInventory.from_json(text)


def test_inconsistent_nvlink_matrix_is_refused() -> None:
    inv = fake_inventory("ring4")
    bad = ((0, 6, 0, 6), (0, 0, 6, 0), (0, 6, 0, 6), (6, 0, 6, 0))
    with pytest.raises(InventoryError, match="disagree"):
        NodeInventory(inv.node, inv.gpus, bad)


def test_unknown_topology_names_the_choices() -> None:
    with pytest.raises(ValueError, match="nvswitch-h100"):
        fake_inventory("dgx-9000")


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVML")
def test_without_a_gpu_nvml_says_so_in_one_line() -> None:
    with pytest.raises(NvmlUnavailable) as info:
        read_nvml()
    msg = str(info.value)
    assert msg.startswith("NVML unavailable") and "\n" not in msg
