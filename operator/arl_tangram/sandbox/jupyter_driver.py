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
# declared stuck, and for the kernel to start and answer at all.
INTERRUPT_GRACE_S = 5.0
PR_SET_DUMPABLE = 4


def _undumpable() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


# An error kept past the budget keeps this much of its value (its traceback is dropped).
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
    }


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
                evalue = str(content.get("evalue", ""))[:_ERROR_VALUE_KEPT]
                content = {"ename": content.get("ename", ""), "evalue": evalue, "traceback": []}
            cell["error"].append(content)
        elif kind == "status" and content.get("execution_state") == "idle":
            break
    cell["stdout"], cell["stderr"] = "".join(streams["stdout"]), "".join(streams["stderr"])
    try:
        reply = client.get_shell_msg(timeout=INTERRUPT_GRACE_S)
        cell["status"] = reply["content"].get("status", "ok")
    except queue.Empty:
        cell["status"] = "error" if cell["error"] else "ok"
    return cell, interrupted


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Start a kernel, run ``config``'s cells in it, and say what they gave."""
    from jupyter_client.manager import KernelManager

    start = time.monotonic()
    total = float(config["total_timeout"])
    per_cell = float(config.get("cell_timeout") or 0)
    budget = _Budget(int(config["output_bytes"]))
    cells: list[dict[str, Any]] = []
    # The kernel's connection file, IPython's profile and history, and the sockets: in the workdir
    # (the only place an action may write), removed at the end. Relative socket paths keep under
    # the 107 bytes a Unix socket's path may have, however deep the workdir.
    runtime = tempfile.mkdtemp(prefix=".tangram-jupyter-", dir=".")
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.abspath(runtime)
    os.environ["IPYTHONDIR"] = os.path.abspath(os.path.join(runtime, "ipython"))
    # Jupyter's own plotting backend (figures as image/png displays), as a kernel has outside: the
    # sandbox sets Agg for plain programs, which would show nothing.
    os.environ.pop("MPLBACKEND", None)
    manager = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(runtime, "kernel"))
    manager.connection_file = os.path.join(os.path.abspath(runtime), "kernel.json")
    log_path = os.path.join(runtime, "kernel.log")
    status, message = "Finished", ""
    client = None
    try:
        with open(log_path, "wb") as log:
            manager.start_kernel(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=max(total - (time.monotonic() - start), INTERRUPT_GRACE_S))
        for code in config["cells"]:
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
    except Exception as exc:  # the kernel did not start or answer: said, not a traceback
        status, message = "Error", f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            client.stop_channels()
        try:
            manager.shutdown_kernel(now=True)
        except Exception as exc:
            print(f"kernel shutdown: {exc}", file=sys.stderr)
        try:
            with open(log_path, "rb") as log:
                sys.stderr.write(log.read().decode(errors="replace"))
        except OSError:
            pass
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
