"""``tangram operator``: run the operator (kopf, cluster-wide) until SIGTERM.

Settings come from the environment, as in the Deployment: POD_NAMESPACE (where the Lease lives),
POD_NAME (this replica's identity), TANGRAM_LISTEN_HOST/PORT (health, readiness, metrics, results),
TANGRAM_POLICY (the scheduler policy), TANGRAM_LEADER_ELECTION (false only for a single test
replica). Kubernetes credentials: the pod's ServiceAccount, else KUBECONFIG.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

import arl_tangram.controllers  # noqa: F401 - registers the handlers


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tangram operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--verbose", action="store_true", help="log kopf's own debug messages")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger().setLevel(args.log_level.upper())
    asyncio.run(kopf.operator(clusterwide=True, standalone=True))
    return 0
