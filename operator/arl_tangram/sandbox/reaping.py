"""The agent as the child subreaper of what its fork servers leave behind.

A fork server that dies (killed, or out of memory) leaves its zygote's children, a session's
interpreter among them, without a parent. With the agent marked as child subreaper they become
the agent's children instead of the host init's (which may be a container runtime that reaps late,
or never): the agent kills and reaps them at once, so that nothing of a lost fork server lingers.

An orphan is told from the agent's own children by its session: the agent starts each fork server
in a session of its own (``start_new_session``) and everything below it inherits that session or
makes a new one, while what the agent starts for itself stays in the agent's session. Fork servers
(``keep``) are reaped by their ``Popen``, never here.
"""

from __future__ import annotations

import contextlib
import os
import signal

from arl_tangram.sandbox import isolation


def become_subreaper() -> bool:
    """Mark this process child subreaper; ``False`` where the kernel refuses."""
    try:
        isolation.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        return False
    return True


def _children() -> list[tuple[int, str, int]]:
    """(pid, state, session id) of this process's children."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # fields: state, ppid, pgrp, session, ...
        if int(fields[1]) == me:
            found.append((int(name), fields[0].decode(), int(fields[3])))
    return found


def reap_orphans(keep: set[int]) -> int:
    """Kill and reap this process's adopted orphans (children not in its own session and not in
    ``keep``); returns how many were found."""
    own_session = os.getsid(0)
    orphans = [(pid, state) for pid, state, sid in _children() if sid != own_session and pid not in keep]
    for pid, state in orphans:
        if state != "Z":
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            # Not blocking: one killed now is reaped on the SIGCHLD its death sends.
            os.waitpid(pid, os.WNOHANG)
    return len(orphans)
