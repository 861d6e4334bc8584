"""``tangram operator``: run the operator (kopf, cluster-wide) until SIGTERM.

Settings come from the environment, as in the Deployment (listed by ``--help``, from
``operator.ENVIRONMENT``). Kubernetes credentials: the pod's ServiceAccount, else KUBECONFIG.
"""

from __future__ import annotations

import argparse
import logging

import kopf

import arl_tangram.controllers  # noqa: F401 - registers the handlers
from arl_tangram import loop
from arl_tangram.controllers.operator import ENVIRONMENT, OperatorSettings


def main(argv: list[str]) -> int:
    width = max(map(len, ENVIRONMENT)) + 1
    epilog = "environment:\n" + "\n".join(
        f"  {name:<{width}} {text}"
        + (f" (default {str(getattr(OperatorSettings, field)).lower()})" if field else "")
        for name, (field, text) in ENVIRONMENT.items()
    )
    parser = argparse.ArgumentParser(
        prog="tangram operator",
        description=__doc__,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--verbose", action="store_true", help="log kopf's own debug messages")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger().setLevel(args.log_level.upper())
    loop.run(kopf.operator(clusterwide=True, standalone=True))
    return 0
