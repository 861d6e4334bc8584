"""What the node agent writes on its Node, and what it reads back: labels, annotations, MIG requests.

Pure functions over plain dicts (no Kubernetes client here), so the protocol is tested table-driven
and the operator parses the same shapes it asks for.

Published by the agent (the operator and schedulers read them):

| key | kind | value |
|---|---|---|
| ``tangram.arl.dev/gpu.count`` | label | GPUs on the node |
| ``tangram.arl.dev/gpu.model`` | label | model of GPU 0, label-safe (``NVIDIA-H100-80GB-HBM3``) |
| ``tangram.arl.dev/gpu.memory-mib`` | label | memory of GPU 0 in MiB |
| ``tangram.arl.dev/gpu.nvlink`` | label | ``nvswitch``, ``all-to-all``, ``partial`` or ``none`` |
| ``tangram.arl.dev/gpu.mig`` | label | ``true`` when any GPU is in MIG mode |
| ``tangram.arl.dev/gpu.source`` | label | ``nvml`` or ``fake`` |
| ``tangram.arl.dev/gpu-inventory`` | annotation | the whole inventory as JSON (``NodeInventory.to_json``) |
| ``tangram.arl.dev/mig-layout-status`` | annotation | JSON: the request being applied and its state |

Written by the operator (the agent acts on it): ``tangram.arl.dev/mig-layout`` (annotation), a JSON
``{"config": NAME, "gpus": {"INDEX": ["3g.40gb", ...] or null}}``. NAME must be a config the operator
wrote into the NVIDIA MIG manager's ConfigMap with the same layout (``mig_parted_config`` renders
it). The agent checks the layout against its own GPUs, then sets the MIG manager's label
``nvidia.com/mig.config=NAME`` (removing the previous config's ``nvidia.com/mig.config.state``)
and mirrors the state the MIG manager then writes (``pending``, ``rebooting``, ``success``,
``failed``) into its status annotation. Without a request it never
touches ``nvidia.com/mig.config``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arl_tangram.gpu import mig
from arl_tangram.gpu.inventory import InventoryError, NodeInventory

PREFIX = "tangram.arl.dev/"
LABEL_COUNT = PREFIX + "gpu.count"
LABEL_MODEL = PREFIX + "gpu.model"
LABEL_MEMORY = PREFIX + "gpu.memory-mib"
LABEL_NVLINK = PREFIX + "gpu.nvlink"
LABEL_MIG = PREFIX + "gpu.mig"
LABEL_SOURCE = PREFIX + "gpu.source"
ANNOTATION_INVENTORY = PREFIX + "gpu-inventory"
ANNOTATION_MIG_REQUEST = PREFIX + "mig-layout"
ANNOTATION_MIG_STATUS = PREFIX + "mig-layout-status"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_STATES = ("pending", "rebooting", "success", "failed")
PUBLISHED_LABELS = (LABEL_COUNT, LABEL_MODEL, LABEL_MEMORY, LABEL_NVLINK, LABEL_MIG, LABEL_SOURCE)
_CONFIG_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


def label_safe(text: str) -> str:
    """A label value from free text: runs of other characters become one dash, at most 63 long."""
    out = re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-_.")
    return out[:63].rstrip("-_.")


def nvlink_kind(inv: NodeInventory) -> str:
    if len(inv.gpus) < 2:
        return "none"
    if inv.nvswitch:
        return "nvswitch"
    if inv.all_to_all:
        return "all-to-all"
    n = len(inv.gpus)
    return "partial" if any(inv.linked(a, b) for a in range(n) for b in range(a + 1, n)) else "none"


def inventory_labels(inv: NodeInventory) -> dict[str, str]:
    """The labels that describe the node's GPUs."""
    first = inv.gpus[0] if inv.gpus else None
    return {
        LABEL_COUNT: str(len(inv.gpus)),
        LABEL_MODEL: label_safe(first.model) if first else "none",
        LABEL_MEMORY: str(first.memory_mib) if first else "0",
        LABEL_NVLINK: nvlink_kind(inv),
        LABEL_MIG: "true" if any(g.mig_enabled for g in inv.gpus) else "false",
        LABEL_SOURCE: "fake" if inv.source.startswith("fake") else "nvml",
    }


def inventory_from_annotations(annotations: Mapping[str, str]) -> NodeInventory | None:
    """The inventory an agent published on a Node, or None when there is none."""
    text = annotations.get(ANNOTATION_INVENTORY)
    return None if text is None else NodeInventory.from_json(text)


def tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    """Whether a pod with ``tolerations`` tolerates ``taint`` (Kubernetes' matching rules)."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def schedulable_inventory(
    node: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]] = ()
) -> NodeInventory | None:
    """The inventory published on a Node object (a plain dict, as the API returns it) when a new pod
    with ``tolerations`` may go there: None when no agent published one, or the node is cordoned,
    not Ready or tainted ``NoSchedule``/``NoExecute`` against the pod. The inventory carries the
    Node's own name (what a pod is pinned to), whatever name the agent was given.
    ``InventoryError`` when the annotation is not an inventory."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    inv = inventory_from_annotations(meta.get("annotations") or {})
    if inv is None or spec.get("unschedulable"):
        return None
    for taint in spec.get("taints") or ():
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return None
    ready = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return None
    name = str(meta.get("name") or inv.node)
    return inv if inv.node == name else dataclasses.replace(inv, node=name)


@dataclass(frozen=True)
class MigRequest:
    """A MIG layout the operator asked for: the MIG manager config ``config`` and, per GPU index, its
    profiles (None: MIG off)."""

    config: str
    gpus: dict[int, tuple[str, ...] | None]

    def to_json(self) -> str:
        gpus = {str(i): (None if p is None else list(p)) for i, p in sorted(self.gpus.items())}
        return json.dumps({"config": self.config, "gpus": gpus}, separators=(",", ":"), sort_keys=True)


def parse_mig_request(text: str, inv: NodeInventory) -> MigRequest:
    """The request in the annotation, checked against the node's GPUs (``mig.MigError`` says why not)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise mig.MigError(f"{ANNOTATION_MIG_REQUEST} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"config", "gpus"} or not isinstance(doc["gpus"], dict):
        raise mig.MigError(f'{ANNOTATION_MIG_REQUEST} must be {{"config": NAME, "gpus": {{INDEX: [...]}}}}')
    config = doc["config"]
    if not isinstance(config, str) or not _CONFIG_NAME.fullmatch(config):
        raise mig.MigError(f"config {config!r} is not a valid label value")
    gpus: dict[int, tuple[str, ...] | None] = {}
    for key, profiles in doc["gpus"].items():
        if not str(key).isdigit() or int(key) >= len(inv.gpus):
            raise mig.MigError(f"node {inv.node} has no GPU {key!r}")
        gpu = inv.gpus[int(key)]
        if profiles is None:
            gpus[gpu.index] = None
            continue
        if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
            raise mig.MigError(f"GPU {key}: profiles must be a list of names")
        table = mig.model_key(gpu.model, gpu.memory_mib)
        if table is None:
            raise mig.MigError(f"GPU {key} ({gpu.model}) does not support MIG")
        model = mig.model_of(table)
        for p in profiles:
            model.profile(p)
        if not mig.valid_layout(model, profiles):
            raise mig.MigError(f"GPU {key} ({table}) cannot hold {profiles}")
        gpus[gpu.index] = tuple(sorted(profiles))
    return MigRequest(config, gpus)


def mig_parted_config(request: MigRequest) -> dict[str, Any]:
    """The MIG manager (mig-parted) config for a request: put it under ``config.yaml`` of the MIG
    manager's ConfigMap before writing the request annotation."""
    entries: list[dict[str, Any]] = []
    for index, profiles in sorted(request.gpus.items()):
        if profiles is None:
            entries.append({"devices": [index], "mig-enabled": False})
            continue
        counts: dict[str, int] = {}
        for p in profiles:
            counts[p] = counts.get(p, 0) + 1
        entries.append({"devices": [index], "mig-enabled": True, "mig-devices": counts})
    return {"version": "v1", "mig-configs": {request.config: entries}}


@dataclass
class NodePatch:
    """Labels and annotations to set (a value) or remove (None); empty when the node is up to date."""

    labels: dict[str, str | None] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.labels or self.annotations)

    def body(self) -> dict[str, Any]:
        """A strategic-merge patch body for the Node."""
        meta: dict[str, Any] = {}
        if self.labels:
            meta["labels"] = self.labels
        if self.annotations:
            meta["annotations"] = self.annotations
        return {"metadata": meta}


def _status(config: str, state: str, message: str = "") -> str:
    return json.dumps({"config": config, "state": state, "message": message}, sort_keys=True)


def _static(doc: str | None) -> Any:
    """An inventory document without its fast-changing readings (utilisation, memory in use)."""
    if doc is None:
        return None
    try:
        parsed = json.loads(doc)
        for g in parsed.get("gpus", []):
            g.pop("utilization_pct", None)
            g.pop("memory_used_mib", None)
    except (json.JSONDecodeError, AttributeError, TypeError):
        return doc
    return parsed


def reconcile_node(
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    inv: NodeInventory | None,
    error: str = "",
    refresh: bool = False,
) -> NodePatch:
    """What the agent must change on its Node so that it shows ``inv`` and follows a MIG request.

    ``inv`` None means NVML failed (``error`` says why): the published inventory is withdrawn so that
    nothing is scheduled onto GPUs nobody can see. A MIG request is acted on only when it parses and
    fits this node's GPUs; the MIG manager's label is set only when it differs from the request.
    Readings that change all the time (utilisation) are republished only with ``refresh``, so the
    Node object, which every controller watches, is not rewritten on each poll."""
    patch = NodePatch()
    if inv is None:
        for key in PUBLISHED_LABELS:
            if key in labels:
                patch.labels[key] = None
        if ANNOTATION_INVENTORY in annotations:
            patch.annotations[ANNOTATION_INVENTORY] = None
        if error and annotations.get(ANNOTATION_MIG_STATUS) != _status("", "unavailable", error):
            patch.annotations[ANNOTATION_MIG_STATUS] = _status("", "unavailable", error)
        return patch
    for key, value in inventory_labels(inv).items():
        if labels.get(key) != value:
            patch.labels[key] = value
    doc = inv.to_json()
    old = annotations.get(ANNOTATION_INVENTORY)
    if old != doc and (refresh or _static(old) != _static(doc)):
        patch.annotations[ANNOTATION_INVENTORY] = doc
    text = annotations.get(ANNOTATION_MIG_REQUEST)
    if text is None:
        return patch
    try:
        request = parse_mig_request(text, inv)
    except (mig.MigError, InventoryError) as exc:
        status = _status("", "rejected", str(exc))
    else:
        if labels.get(MIG_CONFIG_LABEL) != request.config:
            patch.labels[MIG_CONFIG_LABEL] = request.config
            if MIG_STATE_LABEL in labels:
                # The state is the previous config's: a stale "success" must not read as this one's.
                patch.labels[MIG_STATE_LABEL] = None
            status = _status(request.config, "requested")
        else:
            state = labels.get(MIG_STATE_LABEL, "pending")
            status = _status(request.config, state if state in MIG_STATES else "pending")
    if annotations.get(ANNOTATION_MIG_STATUS) != status:
        patch.annotations[ANNOTATION_MIG_STATUS] = status
    return patch
