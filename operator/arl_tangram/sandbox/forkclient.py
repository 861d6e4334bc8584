"""The agent's side of one fork server: start it, send it frames, route its answers to futures."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import marshal
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeAlias

from arl_tangram.errors import InfrastructureError
from arl_tangram.sandbox import wire

log = logging.getLogger(__name__)
_ids = itertools.count(1)
Answer: TypeAlias = Callable[[dict[str, Any] | BaseException], None]


def forkserver_environment() -> dict[str, str]:
    """The fork server's whole environment: a few harmless variables.

    Not the agent's: every action is a fork of the fork server, and /proc/self/environ shows the
    environment the process was *started* with, whatever the action's own was replaced by. Tokens,
    kubeconfig paths or credentials in the agent's environment must never be in that block.
    """
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        # What `python` has under C.UTF-8: UTF-8, and surrogateescape on stdin and stdout (a
        # lone surrogate printed, as from a file name read as bytes, is written, not an error).
        "PYTHONIOENCODING": "utf-8:surrogateescape",
        "LD_BIND_NOW": "1",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def next_id() -> int:
    """A process-wide unique action id (also the marker in the action's environment)."""
    return next(_ids)


class ForkServerClient:
    """One fork server process and the asyncio plumbing to talk to it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        # id -> what to call with the answer (or with the exception when the fork server is lost)
        self.waiting: dict[int, Answer] = {}
        self.hello: asyncio.Future[dict[str, Any]] | None = None
        self._task: asyncio.Task[None] | None = None
        self._outq: list[bytes] = []
        self._lost = False  # the read loop has ended: nothing more will be answered

    async def start(self) -> dict[str, Any]:
        """Start the process; returns its hello (pid and isolation report)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        # Once per fork server at start-up: a blocking spawn is fine here.
        self.proc = subprocess.Popen(  # noqa: ASYNC220
            [
                sys.executable,
                "-m",
                "arl_tangram.sandbox.forkserver",
                str(theirs.fileno()),
                marshal.dumps(self.config).hex(),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=forkserver_environment(),
            # Not in the agent's process group: a Ctrl-C at the agent's terminal is the agent's to
            # handle; the fork server ends when the agent closes the socket.
            start_new_session=True,
        )
        theirs.close()
        self.reader, self.writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        self.hello = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop())
        return await asyncio.wait_for(self.hello, timeout=60)

    async def _read_loop(self) -> None:
        assert self.reader is not None
        buf = bytearray()
        try:
            while True:
                chunk = await self.reader.read(1 << 20)
                if not chunk:
                    break
                buf += chunk
                for msg in wire.decode_frames(buf):
                    if msg.get("op") == "hello":
                        if self.hello is not None and not self.hello.done():
                            if "error" in msg:
                                err = InfrastructureError(f"the fork server could not start: {msg['error']}")
                                self.hello.set_exception(err)
                            else:
                                self.hello.set_result(msg)
                        continue
                    answer = self.waiting.pop(msg.get("id", -1), None)
                    if answer is not None:
                        answer(msg)
                # Frames the answers queued (the callers' next actions) go out at the end of this
                # chunk, not a loop turn later.
                self._flush()
        finally:
            self._lost = True
            err = InfrastructureError("the fork server exited")
            if self.hello is not None and not self.hello.done():
                self.hello.set_exception(err)
            waiting, self.waiting = self.waiting, {}
            for answer in waiting.values():
                answer(err)

    @property
    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.proc is not None and self.proc.poll() is None

    def submit(self, msg: dict[str, Any], answer: Answer) -> None:
        """Send ``msg`` (which carries an ``id``); ``answer`` is called exactly once, synchronously,
        with the reply dict, or with an ``InfrastructureError`` if the fork server is lost."""
        # Not ``alive`` (a waitpid per call; the caller has just asked it): a fork server that died
        # since is answered for by the read loop, which ends at its socket's end and answers
        # everything still waiting; once it has ended, nothing would be.
        if self.writer is None or self._lost:
            answer(InfrastructureError("the fork server is not running"))
            return
        self.waiting[msg["id"]] = answer
        self._queue(wire.encode(msg))

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """``submit`` and wait for the reply."""
        return await self.send_call(msg)

    def send_call(self, msg: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """``submit`` now (frames go out in the order of these calls); the future gets the reply."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()

        def answer(reply: dict[str, Any] | BaseException) -> None:
            if fut.done():
                return
            if isinstance(reply, BaseException):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

        self.submit(msg, answer)
        return fut

    def _queue(self, frame: bytes) -> None:
        # Frames queued in one loop iteration go out in one write: one system call and one wake-up
        # of the fork server for a burst of requests instead of one each.
        if not self._outq:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outq.append(frame)

    def _flush(self) -> None:
        if self.writer is not None and not self.writer.is_closing() and self._outq:
            self.writer.write(b"".join(self._outq))
        self._outq.clear()

    async def close(self) -> None:
        """Stop the process: closing the socket ends its loop; its children die with it."""
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        if self.proc is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout=5)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
