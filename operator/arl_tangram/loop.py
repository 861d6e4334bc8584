"""The event loop the operator's own processes run on: uvloop's.

The operator (with its gateway), ``tangram up`` and the gateway bench's server spend their CPU on
HTTP to and from agents, where uvloop's transports and loop cost less per call than asyncio's
(measured by ``tangram bench gateway``). ``kopf run`` picks uvloop itself when it is installed,
so ``tangram operator`` and ``kopf run -m arl_tangram.controllers`` run on the same loop. The
sandbox agent keeps asyncio's: its fork server and signal handling are tested on it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's loop (asyncio's where uvloop is not built, as on Windows)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def stop_on_signals() -> asyncio.Event:
    """An event the running loop sets at SIGTERM or SIGINT: what every long-running ``tangram``
    process waits on before it shuts down in order."""
    stop = asyncio.Event()
    running = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        running.add_signal_handler(sig, stop.set)
    return stop
