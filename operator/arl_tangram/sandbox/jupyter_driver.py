"""The program of a ``jupyter`` action (SandboxFusion's ``/run_jupyter``): runs a notebook's cells in
a real IPython kernel, one after another in one namespace, and prints what each cell gave as JSON.

It runs inside the sandbox as the action's own program (``python jupyter_driver.py CONFIG``), under
the action's uid, limits and namespaces, with the kernel as its child: whatever a cell does, it does
as any program there would. It is run by path, not imported: the standard library and
jupyter_client only, none of the agent's modules.

CONFIG is a JSON file in the workdir (the action's code): ``cells``, ``cell_timeout`` (0: none),
``total_timeout``, ``output_bytes`` (the most the answer may take: ``_Budget``), ``start_timeout``
(the kernel's start) and ``stop_timeout`` (an interrupted cell's stop, a cell's reply). It is read and
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

# The name the kernel's runtime directory starts with, in the workdir (the agent removes any such
# directory a killed driver left in a session's workdir).
RUNTIME_PREFIX = ".tangram-jupyter-"
# The end of the kernel's own log kept in the driver's stderr.
LOG_KEPT = 64 << 10
# How long after the last cell's idle output still coming is waited for.
LATE_OUTPUT_S = 0.1
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

    def take(self, value: Any, item: bool = False) -> bool:
        """Whether ``value`` fits, taking its bytes if so; ``item``: it is one of a list's items,
        which costs its separator too."""
        cost = len(json.dumps(value)) + (2 if item else 0)
        if cost > self.left:
            return False
        self.left -= cost
        return True

    def text(self, text: str) -> tuple[str, bool]:
        """``text``, or the longest start of it that fits, and whether it was cut."""
        if self.take(text):
            return text, False
        # Escapes make a character take 1 to 12 bytes, and a longer start never costs less: the
        # longest start that fits is found by halving (a few dozen encodings at most).
        fits, too_long = 0, len(text)
        while too_long - fits > 1:
            mid = (fits + too_long) // 2
            if len(json.dumps(text[:mid])) <= self.left:
                fits = mid
            else:
                too_long = mid
        part = text[:fits]
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


# The statuses a kernel replies with; any other is kept as "error" (a cell's own reply on the shell
# socket could say anything, of any length, past what its cell's reserve holds).
_STATUSES = ("ok", "error", "aborted")
# What the answer holds whatever the cells print: its own frame, and per cell the cell's frame and
# one error's frame with its name (up to ``_ENAME_KEPT`` bytes), each with the separator before it.
# Reserved before the cells' outputs share the rest (``_Budget``).
_ANSWER_FRAME = 1024
_ENAME_KEPT = 100
_CELL_RESERVE = (
    len(json.dumps({**_empty_cell(), "status": max(_STATUSES, key=len)}))
    + len(json.dumps({"ename": "", "evalue": "", "traceback": []}))
    + 4  # the separators before the cell and before its error
)


def _ename(error: dict[str, Any], kept: int) -> str:
    """An error's name, cut to what the cell's reserve holds (``kept`` bytes of JSON besides its quotes)."""
    name = str(error.get("ename", ""))[:kept]
    while len(json.dumps(name)) > kept + 2:
        name = name[:-1]
    return name


class _Stuck(Exception):
    """The kernel did not finish a cell: it died, or went on when interrupted (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class _Cells:
    """The cells run so far, each found by its execute request's id: output a kernel sends late
    (a child's writes to descriptor 1 reach it through a reader thread, after the cell's idle)
    still goes to the cell that made it."""

    def __init__(self, output_bytes: int, count: int) -> None:
        """For ``count`` cells, in an answer of at most ``output_bytes``."""
        spare = output_bytes - _ANSWER_FRAME - count * _CELL_RESERVE
        # The errors' names past the budget get at most half of what the frames leave: with many
        # cells their full names would leave nothing for any cell's output (or less than nothing),
        # although the answer would hold much of it.
        self.name_kept = min(_ENAME_KEPT, max(spare, 0) // (2 * count)) if count else _ENAME_KEPT
        self.budget = _Budget(spare - count * self.name_kept)
        self.by_id: dict[str, dict[str, Any]] = {}  # in the order the cells ran
        self.streams: dict[str, dict[str, list[str]]] = {}

    def begin(self, msg_id: str) -> dict[str, Any]:
        cell = self.by_id[msg_id] = _empty_cell()
        self.streams[msg_id] = {"stdout": [], "stderr": []}
        return cell

    def record(self, msg: dict[str, Any]) -> str | None:
        """Put ``msg``'s output in its cell; its id when it says the cell went idle."""
        msg_id: str | None = msg.get("parent_header", {}).get("msg_id")
        cell = self.by_id.get(msg_id or "")
        if cell is None or msg_id is None:
            return None
        kind, content = msg["header"]["msg_type"], msg["content"]
        budget = self.budget
        if kind == "stream":
            name = content.get("name")
            if name in ("stdout", "stderr") and not cell[f"{name}_truncated"]:
                text, cut = budget.text(content.get("text", ""))
                self.streams[msg_id][name].append(text)  # joined once, in ``result``
                cell[f"{name}_truncated"] = cut
        elif kind in ("display_data", "execute_result"):
            data = content.get("data", {})
            if budget.take(data, item=True):
                cell["display"].append(data)
            else:
                cell["display_truncated"] = True
        elif kind == "error":
            if budget.take(content, item=True):
                cell["error"].append(content)
            elif not cell["error_truncated"]:
                # The first error past the budget keeps its name (the cell's reserve pays for it)
                # and as much of its value as fits; the cell's later ones are dropped, or a cell
                # sending errors without end would take the answer past what the agent returns.
                evalue, _ = budget.text(str(content.get("evalue", ""))[:_ERROR_VALUE_KEPT])
                cell["error"].append(
                    {"ename": _ename(content, self.name_kept), "evalue": evalue, "traceback": []}
                )
                cell["error_truncated"] = True
        elif kind == "status" and content.get("execution_state") == "idle":
            return msg_id
        return None

    def result(self) -> list[dict[str, Any]]:
        """The cells, their streams joined."""
        for msg_id, cell in self.by_id.items():
            cell["stdout"], cell["stderr"] = ("".join(self.streams[msg_id][n]) for n in ("stdout", "stderr"))
        return list(self.by_id.values())

    def drain(self, client: Any, wait_s: float) -> None:
        """Record what has come for the cells within ``wait_s`` of the last message."""
        while True:
            try:
                self.record(client.get_iopub_msg(timeout=wait_s))
            except queue.Empty:
                return


def _run_cell(client: Any, manager: Any, code: str, limit_s: float, grace_s: float, cells: _Cells) -> bool:
    """Run one cell, its outputs recorded in ``cells``; whether its time ran out (then it was
    interrupted, as a notebook's Interrupt does, and its error is the kernel's KeyboardInterrupt).
    ``grace_s``: how long an interrupted cell may take to stop, and a cell's reply to come."""
    msg_id = client.execute(code, allow_stdin=False, stop_on_error=False)
    cell = cells.begin(msg_id)
    deadline = time.monotonic() + limit_s
    interrupted = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if interrupted:
                raise _Stuck("the kernel did not stop the cell when interrupted", timed_out=True)
            manager.interrupt_kernel()
            interrupted = True
            deadline = time.monotonic() + grace_s
            continue
        try:
            msg = client.get_iopub_msg(timeout=min(left, 1.0))
        except queue.Empty:
            if not manager.is_alive():
                raise _Stuck("the kernel died", timed_out=False) from None
            continue
        if cells.record(msg) == msg_id:
            break
    cell["status"] = "error" if cell["error"] else "ok"
    deadline = time.monotonic() + grace_s
    while (left := deadline - time.monotonic()) > 0:
        # This cell's reply (a late one of an earlier cell is passed over).
        try:
            reply = client.get_shell_msg(timeout=left)
        except queue.Empty:
            break
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            status = reply["content"].get("status", cell["status"])
            cell["status"] = status if status in _STATUSES else "error"
            break
    return interrupted


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
    per_cell = float(config["cell_timeout"])  # 0 or less: no limit of the cell's own
    ran = _Cells(int(config["output_bytes"]), len(codes))
    # The kernel's connection file, IPython's profile and history, and the sockets: in the workdir
    # (the only place an action may write), removed at the end (and by the agent, in a session,
    # should this process be killed first). Relative socket paths keep under the 107 bytes a Unix
    # socket's path may have, however deep the workdir.
    runtime = tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=".")
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.abspath(runtime)
    os.environ["IPYTHONDIR"] = os.path.abspath(os.path.join(runtime, "ipython"))
    # Jupyter's user directories too: HOME is the workdir, so a request file such as
    # ``.local/share/jupyter/kernels/python3/kernel.json`` named the command started as the kernel
    # (SandboxFusion's HOME is its server's, out of a request's reach). The kernel is the
    # installed ipykernel's, found beside this Python.
    os.environ["JUPYTER_DATA_DIR"] = os.path.abspath(os.path.join(runtime, "data"))
    os.environ["JUPYTER_CONFIG_DIR"] = os.path.abspath(os.path.join(runtime, "config"))
    os.environ.pop("JUPYTER_PATH", None)
    os.environ.pop("JUPYTER_CONFIG_PATH", None)
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
                limit = left if by_total else per_cell
                timed_out = _run_cell(client, manager, code, limit, float(config["stop_timeout"]), ran)
                if timed_out and by_total:
                    status, message = "TimeLimitExceeded", f"total_timeout {total:g} s ran out"
                    break
            # What the last cells' children wrote may reach the kernel's reader thread after their
            # idle: a moment for it, as a notebook's page shows it when it comes.
            ran.drain(client, LATE_OUTPUT_S)
        except _Stuck as exc:
            status = "TimeLimitExceeded" if exc.timed_out else "Error"
            message = f"cell {len(ran.by_id)}: {exc}"
        except Exception as exc:  # the kernel did not start, or stopped answering: said, not a traceback
            status = "Error"
            what = "the kernel did not start" if client is None else f"cell {len(ran.by_id)}"
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
    return {"status": status, "message": message, "cells": ran.result()}


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
