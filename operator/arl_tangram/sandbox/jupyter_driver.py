"""The program of a ``jupyter`` action (SandboxFusion's ``/run_jupyter``): runs a notebook's cells in
a real IPython kernel, one after another in one namespace, and prints what each cell gave as JSON.

It runs inside the sandbox as the action's own program (``python jupyter_driver.py CONFIG``), under
the action's uid, limits and namespaces, with the kernel as its child: whatever a cell does, it does
as any program there would. It is run by path, not imported: the standard library and
jupyter_client only, none of the agent's modules.

CONFIG is a JSON file in the workdir (the action's code): ``cells``, ``cell_timeout`` (0: none),
``total_timeout`` and ``output_bytes`` (the most the answer may take: ``_Budget``). It is read and
removed before the first cell runs. One line of JSON goes to stdout at the end, and nothing else
does: ``{"status": "Finished" | "TimeLimitExceeded" | "Error", "message": str, "cells": [...]}``,
each cell as SandboxFusion's runtime records it (``stdout``, ``stderr``; ``display``: each
display's or result's MIME bundle; ``error``: the kernel's error contents, ``ename``, ``evalue``
and ``traceback``), with its ``status`` as the kernel replied and what was cut (``*_truncated``).

Why the output is trusted: this process makes itself non-dumpable before any cell runs, so that a
cell's process (the same uid) cannot open ``/proc/<this>/fd/1`` to write a forged answer into its
stdout, and the kernel starts with its stdin and stdout on /dev/null (a cell's writes to its
descriptors 1 and 2 are captured by the kernel as the cell's streams, as outside). A cell can still
kill this process: then the action has no answer and fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

# Grace for an interrupted cell to end (its KeyboardInterrupt recorded) before the kernel is
# declared stuck, and for a cell's reply once its output is over.
INTERRUPT_GRACE_S = 5.0
# The name the kernel's runtime directory starts with, in the workdir (the agent removes any such
# directory a killed driver left in a session's workdir).
RUNTIME_PREFIX = ".tangram-jupyter-"
# The end of the kernel's own log kept in the driver's stderr.
LOG_KEPT = 64 << 10
PR_SET_DUMPABLE = 4


def _undumpable() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


# An error past the budget keeps at most this much of its value (its traceback is dropped).
_ERROR_VALUE_KEPT = 1000


class _Budget:
    """The bytes of JSON the answer may still take: the agent returns at most so much of a
    program's stdout, and an answer cut there would be no answer at all. Past it, a cell's streams
    and displays are cut (``stdout_truncated``, ``stderr_truncated``, ``display_truncated``) and
    its errors keep their name and the start of their value: the notebook still answers, as a
    program's output over the limit is cut and its verdict kept."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, value: Any) -> bool:
        cost = len(json.dumps(value))
        if cost > self.left:
            return False
        self.left -= cost
        return True

    def text(self, text: str) -> tuple[str, bool]:
        """``text``, or as much of it as fits, and whether it was cut."""
        if self.take(text):
            return text, False
        # The longest start that fits: escapes make a character take 1 to 12 bytes, so the guess
        # shrinks by the share it overshot until it fits (a few encodings, not one per character).
        n = min(len(text), max(self.left - 2, 0))
        while n > 0:
            cost = len(json.dumps(text[:n]))
            if cost <= self.left:
                break
            n = min(n - 1, n * self.left // cost)
        part = text[:n]
        self.take(part)
        self.left = 0  # nothing after a cut: a stream's later text without its middle would mislead
        return part, True


def _empty_cell() -> dict[str, Any]:
    return {
        "stdout": "",
        "stderr": "",
        "display": [],
        "error": [],
        "status": "ok",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "display_truncated": False,
        "error_truncated": False,
    }


# What the answer holds whatever the cells print: its own frame, and per cell the cell's frame and
# one error's name. Reserved before the cells' outputs share the rest (``_Budget``).
_ANSWER_FRAME = 1024
_ENAME_KEPT = 100
_CELL_RESERVE = (
    len(json.dumps(_empty_cell()))
    + len(json.dumps({"ename": "x" * _ENAME_KEPT, "evalue": "", "traceback": []}))
    + 4
)


class _Stuck(Exception):
    """The kernel did not finish a cell: it died, or went on when interrupted (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _run_cell(
    client: Any, manager: Any, code: str, limit_s: float, budget: _Budget
) -> tuple[dict[str, Any], bool]:
    """One cell's outputs, and whether its time ran out (then it was interrupted, as a notebook's
    Interrupt does, and its error is the kernel's KeyboardInterrupt)."""
    cell = _empty_cell()
    streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
    msg_id = client.execute(code, allow_stdin=False, stop_on_error=False)
    deadline = time.monotonic() + limit_s
    interrupted = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if interrupted:
                raise _Stuck("the kernel did not stop the cell when interrupted", timed_out=True)
            manager.interrupt_kernel()
            interrupted = True
            deadline = time.monotonic() + INTERRUPT_GRACE_S
            continue
        try:
            msg = client.get_iopub_msg(timeout=min(left, 1.0))
        except queue.Empty:
            if not manager.is_alive():
                raise _Stuck("the kernel died", timed_out=False) from None
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            name = content.get("name")
            if name in streams and not cell[f"{name}_truncated"]:
                text, cut = budget.text(content.get("text", ""))
                streams[name].append(text)
                cell[f"{name}_truncated"] = cut
        elif kind in ("display_data", "execute_result"):
            data = content.get("data", {})
            if budget.take(data):
                cell["display"].append(data)
            else:
                cell["display_truncated"] = True
        elif kind == "error":
            if not budget.take(content):
                # Its name always (the cell's reserve pays for it), and as much of its value as fits.
                evalue, _ = budget.text(str(content.get("evalue", ""))[:_ERROR_VALUE_KEPT])
                content = {
                    "ename": str(content.get("ename", ""))[:_ENAME_KEPT],
                    "evalue": evalue,
                    "traceback": [],
                }
                cell["error_truncated"] = True
            cell["error"].append(content)
        elif kind == "status" and content.get("execution_state") == "idle":
            break
    cell["stdout"], cell["stderr"] = "".join(streams["stdout"]), "".join(streams["stderr"])
    cell["status"] = "error" if cell["error"] else "ok"
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while (left := deadline - time.monotonic()) > 0:
        # This cell's reply (a late one of an earlier cell is passed over).
        try:
            reply = client.get_shell_msg(timeout=left)
        except queue.Empty:
            break
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            cell["status"] = reply["content"].get("status", cell["status"])
            break
    return cell, interrupted


def _start(manager: Any, log: Any, start_s: float) -> Any:
    """Start the kernel and a client once it answers, within ``start_s``; a start that fails is
    tried once more, as a kernel's start now and then does (SandboxFusion tries until its timeout)."""
    deadline = time.monotonic() + start_s
    for attempt in (1, 2):
        client = None
        try:
            manager.start_kernel(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
            client = manager.client()
            client.start_channels()
            client.wait_for_ready(timeout=max(deadline - time.monotonic(), 1.0) / (3 - attempt))
            return client
        except Exception:
            if client is not None:
                client.stop_channels()
            with contextlib.suppress(Exception):
                manager.shutdown_kernel(now=True)
            if attempt == 2 or time.monotonic() >= deadline:
                raise
    raise AssertionError("unreachable")


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Start a kernel, run ``config``'s cells in it, and say what they gave."""
    from jupyter_client.manager import KernelManager

    codes: list[str] = config["cells"]
    total = float(config["total_timeout"])
    per_cell = max(float(config.get("cell_timeout") or 0), 0.0)
    budget = _Budget(int(config["output_bytes"]) - _ANSWER_FRAME - len(codes) * _CELL_RESERVE)
    cells: list[dict[str, Any]] = []
    # The kernel's connection file, IPython's profile and history, and the sockets: in the workdir
    # (the only place an action may write), removed at the end (and by the agent, in a session,
    # should this process be killed first). Relative socket paths keep under the 107 bytes a Unix
    # socket's path may have, however deep the workdir.
    runtime = tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=".")
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.abspath(runtime)
    os.environ["IPYTHONDIR"] = os.path.abspath(os.path.join(runtime, "ipython"))
    # Jupyter's own plotting backend (figures as image/png displays), as a kernel has outside: the
    # sandbox sets Agg for plain programs, which would show nothing.
    os.environ.pop("MPLBACKEND", None)
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(runtime, "kernel"))
    manager.connection_file = os.path.join(os.path.abspath(runtime), "kernel.json")
    status, message = "Finished", ""
    client = None
    # The kernel's own log (its stderr), read back at the end: a file with no name, which no cell
    # can replace by a FIFO or a link to something endless.
    with tempfile.TemporaryFile() as log:
        try:
            client = _start(manager, log, float(config["start_timeout"]))
            # The total is the cells' time: it starts once the kernel answers (its start has its own).
            start = time.monotonic()
            for code in codes:
                left = total - (time.monotonic() - start)
                if left <= 0:
                    status, message = "TimeLimitExceeded", f"total_timeout {total:g} s ran out"
                    break
                # The cell's own limit, or what is left of the total where that comes first: a cell
                # over its own limit is interrupted and the next one runs; over the total, none does.
                by_total = per_cell <= 0 or left <= per_cell
                cell, timed_out = _run_cell(client, manager, code, left if by_total else per_cell, budget)
                cells.append(cell)
                if timed_out and by_total:
                    status, message = "TimeLimitExceeded", f"total_timeout {total:g} s ran out"
                    break
        except _Stuck as exc:
            status = "TimeLimitExceeded" if exc.timed_out else "Error"
            message = f"cell {len(cells) + 1}: {exc}"
        except Exception as exc:  # the kernel did not start, or stopped answering: said, not a traceback
            status = "Error"
            what = "the kernel did not start" if client is None else f"cell {len(cells) + 1}"
            message = f"{what}: {type(exc).__name__}: {exc}"
        finally:
            if client is not None:
                client.stop_channels()
            try:
                manager.shutdown_kernel(now=True)
            except Exception as exc:
                print(f"kernel shutdown: {exc}", file=sys.stderr)
            log.seek(0, os.SEEK_END)
            log.seek(max(log.tell() - LOG_KEPT, 0))
            sys.stderr.write(log.read(LOG_KEPT).decode(errors="replace"))
            shutil.rmtree(runtime, ignore_errors=True)
    return {"status": status, "message": message, "cells": cells}


def main(argv: list[str]) -> int:
    path = argv[1]
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    os.unlink(path)
    _undumpable()
    answer = run(config)
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
