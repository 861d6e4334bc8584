"""Reaping: what the agent and the fork server do about processes an action (or a lost fork
server) leaves behind. Lean imports: the fork server imports this module.

The agent as the child subreaper of what its fork servers leave behind.

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

import os
import signal
import time

from arl_tangram.sandbox import isolation
from arl_tangram.sandbox.lean import suppress


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
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with suppress(ChildProcessError):
            # Not blocking: one killed now is reaped on the SIGCHLD its death sends.
            os.waitpid(pid, os.WNOHANG)
    return len(orphans)


# ---- the fork server's side: an action's leftovers, and a session interpreter's company ----------
def _threads_and_children(pid: int) -> tuple[int, list[int]]:
    """How many threads ``pid`` has, and its children (each thread keeps its own list). ``OSError``
    when ``pid`` is gone; a thread that ends while it is read has no children left to give."""
    tasks = os.listdir(f"/proc/{pid}/task")
    children: list[int] = []
    for tid in tasks:
        with suppress(OSError), open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
            children += [int(child) for child in fh.read().split()]
    return len(tasks), children


def company_of(pid: int) -> str | None:
    """What the interpreter ``pid`` runs beside its main thread once a call has answered:
    ``"processes"`` (children that are more than unreaped zombies), ``"threads"``, or ``None``.
    (A thread the call joined may still be leaving the kernel's list: it is frozen with the rest,
    which costs nothing.)"""
    try:
        threads, children = _threads_and_children(pid)
    except OSError:
        return None  # it is gone already: its exit is reported through the pidfd
    if any(is_live(child) for child in children):
        return "processes"
    return "threads" if threads > 1 else None


def unreaped_children(pid: int) -> int:
    """How many children of ``pid`` have exited and wait to be reaped (zombies)."""
    try:
        _, children = _threads_and_children(pid)
    except OSError:
        return 0
    return sum(1 for child in children if not is_live(child))


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children's children too), zombies left out."""
    found: list[int] = []
    todo = [pid]
    while todo:
        try:
            _, kids = _threads_and_children(todo.pop())
        except OSError:
            continue
        for kid in kids:
            if is_live(kid):
                found.append(kid)
                todo.append(kid)
    return found


def is_live(pid: int) -> bool:
    """Whether ``pid`` runs: some thread of it that is no zombie (a process whose main thread
    called ``pthread_exit`` shows its leader as one while its other threads run on)."""
    state = proc_state(f"/proc/{pid}/stat")
    if state not in (b"Z", b""):
        return True
    if state == b"":
        return False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(proc_state(f"/proc/{pid}/task/{tid}/stat") not in (b"Z", b"X", b"") for tid in tids)


def proc_state(stat_path: bytes | str) -> bytes:
    """The state letter in a /proc stat file (b"" when it is gone)."""
    try:
        with open(stat_path, "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b""


def all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (or already exiting)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    return all(proc_state(f"/proc/{pid}/task/{tid}/stat") in (b"T", b"t", b"Z", b"X", b"") for tid in tasks)


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def sweep_without_pidns(pgid: int, call_id: int, uid: int | None, keep: set[int]) -> None:
    """Clean-up when there is no PID namespace: the process group, then every process of the action's
    own uid (as root; nothing can leave a uid). Without uids: processes carrying the action's env
    marker (what it exec'd), and our orphans (we are the child subreaper) that carry no marker of
    another action (Python-level forks show the environment block they were started with, ours).
    The last may end another running action's daemon early; a start-up warning names this mode."""
    with suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    if uid is not None:
        kill_uid(uid, keep)
        return
    me = os.getpid()
    marker = f"TANGRAM_ACTION_ID={call_id}".encode()
    for _ in range(50):  # orphans of killed orphans come to us in turn
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    env = fh.read().split(b"\0")
                with open(f"/proc/{name}/stat", "rb") as fh:
                    fields = fh.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            ours = int(fields[1]) == me and fields[0] != b"Z"
            others = any(e.startswith(b"TANGRAM_ACTION_ID=") and e != marker for e in env)
            if marker in env or (ours and not others):
                with suppress(OSError):
                    os.kill(int(name), signal.SIGKILL)
                found = True
        reap_exited_children(keep)
        if not found:
            return


def uid_processes(uid: int, me: int) -> list[int]:
    """PIDs (other than ``me``) whose real uid is ``uid``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                found.append(int(name))
        except OSError:
            continue
    return found


def reap_exited_children(keep: set[int]) -> None:
    """Reap the exited children we do not track: orphans of actions, ours as the child subreaper."""
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[1].decode() == me:
            with suppress(ChildProcessError):
                os.waitpid(int(name), os.WNOHANG)


def kill_uid(uid: int, keep: set[int], deadline_s: float = 5.0) -> None:
    """SIGKILL every process of ``uid`` from a helper running as that uid: kill(-1) reaches exactly
    the processes it may signal, which for a non-root uid are that uid's own (never the caller).
    Killed orphans become our children (we are their subreaper): reaping them while the helper
    repeats lets it see the uid empty. ``keep``: tracked children, reaped through their pidfds.
    ``deadline_s``: how long it repeats at most."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            # Repeat until no process of the uid is left: a fork bomb may create children while the
            # kernel walks, and a killed process stays listed until its parent has reaped it.
            # (kill(-1) itself cannot tell: it succeeds whenever any other process exists.)
            deadline = time.monotonic() + deadline_s
            while time.monotonic() < deadline:
                os.kill(-1, signal.SIGKILL)
                if not uid_processes(uid, os.getpid()):
                    break
                time.sleep(0.001)
        except BaseException:
            pass
        os._exit(0)
    keep = {*keep, pid}
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        reap_exited_children(keep)
        time.sleep(0.0005)
    reap_exited_children(keep)
