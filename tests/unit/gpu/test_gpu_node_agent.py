"""The node agent's protocol on its Node: published labels, MIG requests through the MIG manager's label.

``reconcile_node`` is pure and tested table-driven. The agent's rounds run against ``MemoryNodes``, an
in-memory stand-in for the API server's Node merge-patch (no API server runs in the unit tier; the
e2e tier runs the agent against the test bed's)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest

from arl_tangram.gpu import nodeinfo as ni
from arl_tangram.gpu.agent import NodeAgent, NodeView
from arl_tangram.gpu.fake import fake_inventory
from arl_tangram.gpu.inventory import NodeInventory


class MemoryNodes:
    """Nodes as label and annotation maps; ``patch`` merges like a strategic-merge patch (None
    removes a key)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeView] = {}
        self.patches = 0

    def read(self, name: str) -> NodeView:
        v = self.nodes[name]
        return NodeView(dict(v.labels), dict(v.annotations))

    def patch(self, name: str, body: Mapping[str, Any]) -> None:
        self.patches += 1
        v = self.nodes[name]
        meta = body["metadata"]
        for part, target in (("labels", v.labels), ("annotations", v.annotations)):
            for k, val in meta.get(part, {}).items():
                if val is None:
                    target.pop(k, None)
                else:
                    target[k] = val


def test_labels_describe_the_board() -> None:
    labels = ni.inventory_labels(fake_inventory("mig-h100"))
    assert labels == {
        ni.LABEL_COUNT: "8",
        ni.LABEL_MODEL: "NVIDIA-H100-80GB-HBM3",
        ni.LABEL_MEMORY: "81559",
        ni.LABEL_NVLINK: "nvswitch",
        ni.LABEL_MIG: "true",
        ni.LABEL_SOURCE: "fake",
    }
    assert ni.inventory_labels(fake_inventory("pcie-pairs"))[ni.LABEL_NVLINK] == "partial"
    assert ni.inventory_labels(fake_inventory("mig-a100"))[ni.LABEL_NVLINK] == "all-to-all"


def test_label_safe_values() -> None:
    assert ni.label_safe("NVIDIA A100-SXM4-80GB") == "NVIDIA-A100-SXM4-80GB"
    assert ni.label_safe("  x/y (z) ") == "x-y-z"
    assert len(ni.label_safe("a" * 100)) == 63


def _request(config: str, gpus: dict[str, list[str] | None]) -> str:
    return json.dumps({"config": config, "gpus": gpus})


INV = fake_inventory("mig-a100", "n1")
PUBLISHED = {**ni.inventory_labels(INV)}
ANN = {ni.ANNOTATION_INVENTORY: INV.to_json()}


@pytest.mark.parametrize(
    ("labels", "annotations", "want_labels", "want_state"),
    [
        # No request: the MIG manager's label is never touched.
        ({}, {}, {**PUBLISHED}, None),
        (PUBLISHED, ANN, {}, None),
        # A valid request sets the label once, then mirrors the MIG manager's progress.
        (
            PUBLISHED,
            {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-1", {"3": ["3g.40gb", "3g.40gb"]})},
            {ni.MIG_CONFIG_LABEL: "t-1"},
            "requested",
        ),
        (
            {**PUBLISHED, ni.MIG_CONFIG_LABEL: "t-1", ni.MIG_STATE_LABEL: "rebooting"},
            {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-1", {"3": ["3g.40gb", "3g.40gb"]})},
            {},
            "rebooting",
        ),
        (
            {**PUBLISHED, ni.MIG_CONFIG_LABEL: "t-1", ni.MIG_STATE_LABEL: "failed"},
            {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-1", {"3": ["3g.40gb", "3g.40gb"]})},
            {},
            "failed",
        ),
        # A previous config's state is removed with the new request: its "success" is not this one's.
        (
            {**PUBLISHED, ni.MIG_CONFIG_LABEL: "old", ni.MIG_STATE_LABEL: "success"},
            {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-1", {"3": ["3g.40gb", "3g.40gb"]})},
            {ni.MIG_CONFIG_LABEL: "t-1", ni.MIG_STATE_LABEL: None},
            "requested",
        ),
        # Requests this node cannot follow are rejected and change nothing.
        (
            PUBLISHED,
            {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-2", {"3": ["4g.40gb", "4g.40gb"]})},
            {},
            "rejected",
        ),
        (PUBLISHED, {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("t-3", {"9": None})}, {}, "rejected"),
        (PUBLISHED, {**ANN, ni.ANNOTATION_MIG_REQUEST: "{not json"}, {}, "rejected"),
        (PUBLISHED, {**ANN, ni.ANNOTATION_MIG_REQUEST: _request("bad name!", {})}, {}, "rejected"),
    ],
)
def test_reconcile_node(
    labels: dict[str, str], annotations: dict[str, str], want_labels: dict[str, str], want_state: str | None
) -> None:
    patch = ni.reconcile_node(labels, annotations, INV)
    assert patch.labels == want_labels
    status = patch.annotations.get(ni.ANNOTATION_MIG_STATUS)
    assert (None if status is None else json.loads(status)["state"]) == want_state


def test_without_nvml_the_published_inventory_is_withdrawn() -> None:
    patch = ni.reconcile_node(PUBLISHED, ANN, None, "NVML unavailable: no library")
    assert all(v is None for v in patch.labels.values()) and set(patch.labels) == set(PUBLISHED)
    assert patch.annotations[ni.ANNOTATION_INVENTORY] is None
    assert json.loads(patch.annotations[ni.ANNOTATION_MIG_STATUS])["state"] == "unavailable"


def test_utilisation_alone_is_republished_only_on_refresh() -> None:
    busy = NodeInventory.from_json(INV.to_json().replace('"utilization_pct":0', '"utilization_pct":57'))
    assert busy != INV
    assert not ni.reconcile_node(PUBLISHED, ANN, busy)
    assert ni.reconcile_node(PUBLISHED, ANN, busy, refresh=True).annotations


def test_mig_parted_config_renders_the_request() -> None:
    req = ni.parse_mig_request(_request("t-1", {"3": ["1g.10gb", "3g.40gb", "1g.10gb"], "0": None}), INV)
    assert ni.mig_parted_config(req) == {
        "version": "v1",
        "mig-configs": {
            "t-1": [
                {"devices": [0], "mig-enabled": False},
                {"devices": [3], "mig-enabled": True, "mig-devices": {"1g.10gb": 2, "3g.40gb": 1}},
            ]
        },
    }


def test_fake_agent_publishes_then_follows_a_request_to_success() -> None:
    nodes = MemoryNodes()
    # As on a node the MIG manager configured before: a config and its state.
    nodes.nodes["n1"] = NodeView({ni.MIG_CONFIG_LABEL: "old", ni.MIG_STATE_LABEL: "success"}, {})
    agent = NodeAgent(nodes, "n1", fake="mig-a100")
    agent.step_blocking(0.0)
    view = nodes.read("n1")
    assert view.labels[ni.LABEL_MIG] == "true" and view.labels[ni.MIG_CONFIG_LABEL] == "old"
    published = ni.inventory_from_annotations(view.annotations)
    assert published is not None and not published.gpus[3].mig_enabled
    before = nodes.patches
    assert not agent.step_blocking(1.0)  # nothing changed: no write
    assert nodes.patches == before

    view.annotations[ni.ANNOTATION_MIG_REQUEST] = _request("t-1", {"3": ["3g.40gb", "3g.40gb"]})
    nodes.nodes["n1"] = view
    agent.step_blocking(2.0)  # the agent asks the MIG manager
    assert nodes.read("n1").labels[ni.MIG_CONFIG_LABEL] == "t-1"
    agent.step_blocking(3.0)  # the fake MIG manager applies it; the new inventory is published
    view = nodes.read("n1")
    assert view.labels[ni.MIG_STATE_LABEL] == "success"
    assert json.loads(view.annotations[ni.ANNOTATION_MIG_STATUS])["state"] == "success"
    published = ni.inventory_from_annotations(view.annotations)
    assert published is not None
    assert [m.profile for m in published.gpus[3].mig_instances] == ["3g.40gb", "3g.40gb"]
    assert published.gpus[3].uuid == INV.gpus[3].uuid


def test_real_agent_never_plays_the_mig_manager() -> None:
    nodes = MemoryNodes()
    nodes.nodes["n1"] = NodeView({}, {ni.ANNOTATION_MIG_REQUEST: _request("t-1", {})})
    agent = NodeAgent(nodes, "n1", fake=None)
    agent.step_blocking(0.0)  # no NVML here (or a real one): either way no state label is written
    assert ni.MIG_STATE_LABEL not in nodes.read("n1").labels


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arl_tangram", "node-agent", *args], capture_output=True, text=True, timeout=60
    )


def test_once_prints_a_fake_inventory() -> None:
    out = _cli("--once", "--fake", "pcie-pairs", "--node", "n9")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("node n9: 8 GPUs (fake:pcie-pairs")
    as_json = _cli("--once", "--json", "--fake", "ring4")
    assert NodeInventory.from_json(json.dumps(json.loads(as_json.stdout))).source == "fake:ring4"


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVML")
def test_once_without_a_gpu_fails_with_one_line() -> None:
    out = _cli("--once")
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and "NVML unavailable" in out.stderr
    assert "Traceback" not in out.stderr
