"""The node runner's command line: runs until SIGTERM/SIGINT, then stops every pod process it started."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from .kubelet_api import serve_kubelet_api
from .node import NodeRunner

log = logging.getLogger("node-runner")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="node_runner", description="The kubelet of the test bed's simulated nodes."
    )
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--nodes", required=True, help="YAML file: nodes: [{name, labels, capacity, taints}]")
    p.add_argument("--state-dir", required=True, help="per-pod directories (logs, volumes, PIDs)")
    p.add_argument("--pod-cidr", required=True, help="CIDR the pod IPs come from, e.g. 198.18.4.0/24")
    p.add_argument("--address-device", default="", help="add each pod IP to this interface (lo) while in use")
    p.add_argument("--api-host", default="127.0.0.1")
    p.add_argument("--api-port", type=int, required=True)
    p.add_argument("--ca-file", default="", help="CA of the API server's client certificate (kubelet API)")
    p.add_argument("--kubelet-port", type=int, default=0, help="serve the kubelet API (container logs) here")
    p.add_argument("--tls-cert", default="", help="serving certificate of the kubelet API")
    p.add_argument("--tls-key", default="")
    p.add_argument(
        "--entrypoints", default="", help="YAML: image name -> {command, args} for pods without one"
    )
    p.add_argument("--no-bwrap", action="store_true", help="run pods without bubblewrap even where present")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs until SIGTERM/SIGINT; then stops every pod process it started and exits."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    runner = NodeRunner(args)
    log.info("isolation: %s", f"bubblewrap ({runner.bwrap})" if runner.bwrap else "none (bwrap not found)")

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        runner.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if runner.kubelet_port:
        serve_kubelet_api(runner, args.tls_cert, args.tls_key, args.ca_file)
    runner.register_nodes()
    (runner.state_dir / ".registered").write_text("")
    threading.Thread(target=runner.heartbeat, name="heartbeat", daemon=True).start()
    threading.Thread(target=runner.watch_pods, name="pod-watch", daemon=True).start()
    runner.stopping.wait()
    runner.stop_pods()
    log.info("stopped")
    return 0
