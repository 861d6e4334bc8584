"""``tangram node-agent``: publish this node's GPU inventory on its Node and follow MIG requests.

The agent reads NVML (or a fake topology), writes the labels and annotations of
``arl_tangram.gpu.nodeinfo`` on its own Node, and applies MIG layouts only by setting the NVIDIA MIG
manager's ``nvidia.com/mig.config`` label to a config the operator asked for. It never calls an NVML
setter. With ``--fake`` it also plays the MIG manager for its fake GPUs (the test bed has none).
The blocking Kubernetes client runs only in worker threads (``asyncio.to_thread``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from arl_tangram.gpu import nodeinfo
from arl_tangram.gpu.fake import TOPOLOGIES, apply_layout
from arl_tangram.gpu.inventory import NodeInventory, describe
from arl_tangram.gpu.mig import MigError
from arl_tangram.gpu.nvml import NvmlUnavailable
from arl_tangram.gpu.source import read_inventory
from arl_tangram.loop import stop_on_signals

log = logging.getLogger("tangram.node-agent")

# Polling, not watching: NVML has no change events for MIG or NVLink, and one GET per interval per node
# is far below what a watch costs the API server across a large fleet.
DEFAULT_INTERVAL_S = 15.0
# Utilisation changes constantly; republishing it every poll would rewrite the Node object that every
# controller in the cluster watches.
DEFAULT_REFRESH_S = 300.0


@dataclass
class NodeView:
    labels: dict[str, str]
    annotations: dict[str, str]


class NodeClient(Protocol):
    """The two calls the agent makes on its own Node (blocking; run in a thread)."""

    def read(self, name: str) -> NodeView: ...

    def patch(self, name: str, body: Mapping[str, Any]) -> None: ...


class KubernetesNodeClient:
    """``NodeClient`` over the official client: in-cluster credentials, else a kubeconfig."""

    def __init__(self, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
        self._api = client.CoreV1Api()

    def read(self, name: str) -> NodeView:
        meta = self._api.read_node(name).metadata
        if meta is None:
            return NodeView({}, {})
        return NodeView(dict(meta.labels or {}), dict(meta.annotations or {}))

    def patch(self, name: str, body: Mapping[str, Any]) -> None:
        self._api.patch_node(name, dict(body))


class NodeAgent:
    """One node's agent: ``step`` reads the GPUs and the Node and writes what changed."""

    def __init__(
        self,
        client: NodeClient,
        node: str,
        fake: str | None = None,
        refresh_s: float = DEFAULT_REFRESH_S,
    ) -> None:
        self.client = client
        self.node = node
        self.fake = fake
        self.refresh_s = refresh_s
        self._fake_inv: NodeInventory | None = None
        self._last_refresh = float("-inf")

    def _read(self) -> tuple[NodeInventory | None, str]:
        if self._fake_inv is not None:
            return self._fake_inv, ""
        try:
            inv = read_inventory(self.fake, self.node)
        except NvmlUnavailable as exc:
            return None, str(exc)
        if self.fake is not None:
            self._fake_inv = inv
        return inv, ""

    def _play_mig_manager(self, view: NodeView, inv: NodeInventory) -> NodeInventory:
        """Fake nodes only: do what the MIG manager would once its label names a new config."""
        config = view.labels.get(nodeinfo.MIG_CONFIG_LABEL)
        text = view.annotations.get(nodeinfo.ANNOTATION_MIG_REQUEST)
        if config is None or text is None or view.labels.get(nodeinfo.MIG_STATE_LABEL) == "success":
            return inv
        try:
            request = nodeinfo.parse_mig_request(text, inv)
        except MigError:
            return inv
        if request.config != config:
            return inv
        self._fake_inv = apply_layout(inv, request.gpus)
        view.labels[nodeinfo.MIG_STATE_LABEL] = "success"
        self.client.patch(self.node, {"metadata": {"labels": {nodeinfo.MIG_STATE_LABEL: "success"}}})
        log.info("fake MIG manager applied %s on %s", config, self.node)
        return self._fake_inv

    def step_blocking(self, now: float) -> nodeinfo.NodePatch:
        """One round (blocking): returns the patch it applied (empty when the Node was up to date)."""
        inv, error = self._read()
        view = self.client.read(self.node)
        if inv is not None and self.fake is not None:
            inv = self._play_mig_manager(view, inv)
        refresh = now - self._last_refresh >= self.refresh_s
        patch = nodeinfo.reconcile_node(view.labels, view.annotations, inv, error, refresh)
        if patch:
            self.client.patch(self.node, patch.body())
            if nodeinfo.ANNOTATION_INVENTORY in patch.annotations:
                self._last_refresh = now
            changed = sorted([*patch.labels, *patch.annotations])
            log.info("node %s: updated %s", self.node, ", ".join(changed))
        if error:
            log.warning("%s", error)
        return patch

    async def step(self) -> nodeinfo.NodePatch:
        return await asyncio.to_thread(self.step_blocking, time.monotonic())

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step()
            except Exception as exc:  # the API server may be briefly away; try again next round
                log.warning("node %s: round failed: %s", self.node, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tangram node-agent", description=__doc__.splitlines()[0])
    p.add_argument("--once", action="store_true", help="print the inventory and exit (no Kubernetes)")
    p.add_argument("--json", action="store_true", help="with --once: print the inventory as JSON")
    p.add_argument("--fake", metavar="TOPOLOGY", choices=sorted(TOPOLOGIES), help="serve a fake topology")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="Node name (default $NODE_NAME)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig outside a cluster (default: in-cluster)")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds between rounds")
    p.add_argument(
        "--refresh", type=float, default=DEFAULT_REFRESH_S, help="seconds between utilisation updates"
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    node = args.node or socket.gethostname()
    if args.once:
        try:
            inv = read_inventory(args.fake, node)
        except NvmlUnavailable as exc:
            print(f"tangram node-agent: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(json.loads(inv.to_json()), indent=2) if args.json else describe(inv))
        return 0
    if args.interval <= 0:
        print("tangram node-agent: --interval must be > 0", file=sys.stderr)
        return 2
    try:
        client = KubernetesNodeClient(args.kubeconfig)
    except Exception as exc:  # no in-cluster credentials and no kubeconfig: say so in one line
        print(f"tangram node-agent: cannot reach Kubernetes: {exc}", file=sys.stderr)
        return 2
    agent = NodeAgent(client, node, args.fake, args.refresh)

    async def serve() -> None:
        await agent.run(args.interval, stop_on_signals())

    asyncio.run(serve())
    return 0
