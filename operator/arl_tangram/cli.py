"""The ``tangram`` command.

A thin dispatcher: each subcommand lives in the module that owns the capability and is imported only
when used, so that ``tangram bench sim`` never pays for aiohttp and the sandbox agent never imports
pulp. Each target is ``module:function`` taking the remaining argv and returning an exit status.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# The exit status of a command Ctrl-C ended, as a shell reports one (128 + SIGINT).
INTERRUPTED = 130
# name -> (target, one-line help). "bench" has subcommands of its own.
COMMANDS: dict[str, tuple[str, str]] = {
    "crds": ("arl_tangram.api.crdgen:main", "write (or --check) the CRDs generated from the API models"),
    "sandbox-agent": (
        "arl_tangram.sandbox.cli:main",
        "run the sandbox agent (HTTP server running actions)",
    ),
    "operator": (
        "arl_tangram.controllers.main:main",
        "run the operator (controllers, scheduler, dispatcher)",
    ),
    "up": (
        "arl_tangram.embedded.up:main",
        "run ActionPools/RewardModelServices from YAML on this machine (no cluster) until Ctrl-C",
    ),
    "demo": (
        "arl_tangram.demo.main:main",
        "a HumanEval rollout: pod-per-trajectory vs tangram, really executed (--simulate: the simulator)",
    ),
    "node-agent": ("arl_tangram.gpu.agent:main", "publish this node's GPU inventory; follow MIG requests"),
    "reward-runtime": (
        "arl_tangram.rewards.server:main",
        "serve reward models on a GPU chunk (evict/restore)",
    ),
}
BENCH: dict[str, tuple[str, str]] = {
    "e2e": (
        "arl_tangram.controllers.bench:main",
        "the operator on an API server: batch vs direct, dedicated vs shared",
    ),
    "exec": ("arl_tangram.sandbox.bench:main", "code execution: native API vs /run_code vs fresh process"),
    "sim": ("arl_tangram.sim.bench:main_sim", "simulated workloads under each scheduler policy"),
    "sched": ("arl_tangram.sim.bench:main_sched", "scheduler decision latency, paper vs tangram"),
    "plan": ("arl_tangram.planner.bench:main", "capacity planner: MILP (HiGHS, CBC) vs greedy placement"),
    "gpu": ("arl_tangram.gpu.bench:main", "GPUs for equal ACT with MIG on/off; NVLink-aware vs naive chunks"),
    "gateway": ("arl_tangram.gateway.bench:main", "/run_code through the gateway vs straight to an agent"),
}


def _usage() -> str:
    lines = ["usage: tangram COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<15} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<9} {help_}" for name, (_, help_) in BENCH.items()]
    lines += ["", "Run `tangram COMMAND --help` for a command's options."]
    return "\n".join(lines)


def _load(target: str) -> Callable[[list[str]], int]:
    module_name, func_name = target.split(":")
    module = importlib.import_module(module_name)
    func: Callable[[list[str]], int] = getattr(module, func_name)
    return func


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tangram`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from arl_tangram import __version__

        print(__version__)
        return 0
    name, rest = args[0], args[1:]
    if name == "bench":
        if not rest or rest[0] not in BENCH:
            print(f"tangram bench: choose one of {', '.join(BENCH)}", file=sys.stderr)
            return 2
        name = f"bench {rest[0]}"
        target = BENCH[rest[0]][0]
        rest = rest[1:]
    elif name in COMMANDS:
        target = COMMANDS[name][0]
    else:
        print(f"tangram: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return int(_load(target)(rest) or 0)
    except KeyboardInterrupt:
        # Ctrl-C before the command stops by its own signal handlers (installed once it serves):
        # in its imports or while it reads its input. What it had started, its own ``finally``
        # clauses stopped on the way here; a traceback from deep in an import tells nothing more.
        print(f"tangram {name}: interrupted", file=sys.stderr)
        return INTERRUPTED
