"""Framing between the agent and its fork servers: a 4-byte length, then a ``marshal``-ed dict.

``marshal`` carries ``bytes`` (program output) without base64 and is the fastest serializer in the
standard library. It is not safe against hostile input, which is fine here: both ends are our own
processes, and the socket is never inherited by an action (the child closes every descriptor but
0, 1 and 2 before running anything).
"""

from __future__ import annotations

import marshal
import struct

# Avoid importing typing at run time: the fork server imports this module, and every megabyte the fork
# server holds makes each fork and each child's exit slower.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HEADER = struct.Struct("<I")
# How long past its deadline (and the kill then) a call waits for the zygote's exit record before the
# fork server answers it without the record (``ForkServer._give_up``; the agent names it in the
# verdict). The record follows the kill at once unless something keeps the zygote from reaping the
# action or its namespace (a process only the zygote could reap, which it never does; one stuck in
# the kernel): a call must answer whatever its program did. Long enough for a large address space
# to be torn down after the kill.
UNREAPED_GRACE_S = 5.0
MAX_FRAME = 256 * 1024 * 1024
# A session interpreter's answer to a call: the call's nonce, its exit status, and their MAC under
# the interpreter's key (``session_mac``), as integers and nothing else. The other way, the fork
# server's frames above; but the interpreter runs a session's code in its own process, so what it
# sends is read without marshal, which trusts the lengths in its data (a 9-byte frame made it build a
# tuple of 2**31 slots).
SESSION_ANSWER = struct.Struct("<qiQ")
# A call to a session interpreter, before its marshalled request: the request's length and the
# call's nonce, which its answer carries back.
SESSION_CALL = struct.Struct("<Iq")
# The key of a session's interpreter, the first bytes on its control socket, read before any code of
# the session's runs. Nothing secret comes later on that socket, which the session's code shares
# and can read ahead of the loop (MSG_PEEK): an answer is taken for a call only with the MAC of its
# nonce and status, which the key alone gives.
SESSION_KEY_SIZE = 16
_MASK = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK


def siphash24(key: bytes, data: bytes) -> int:
    """SipHash-2-4 of ``data`` under a 16-byte ``key`` (Aumasson and Bernstein): _zygote.c's
    siphash24, which answers a session's calls, in Python, which checks them."""
    k0, k1 = struct.unpack("<QQ", key)
    v0, v1 = 0x736F6D6570736575 ^ k0, 0x646F72616E646F6D ^ k1
    v2, v3 = 0x6C7967656E657261 ^ k0, 0x7465646279746573 ^ k1

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & _MASK
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _MASK
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _MASK
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _MASK
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    whole = len(data) - len(data) % 8
    for i in range(0, whole, 8):
        (m,) = struct.unpack_from("<Q", data, i)
        v3 ^= m
        rounds(2)
        v0 ^= m
    last = (len(data) & 0xFF) << 56 | int.from_bytes(data[whole:], "little")
    v3 ^= last
    rounds(2)
    v0 ^= last
    v2 ^= 0xFF
    rounds(4)
    digest: int = v0 ^ v1 ^ v2 ^ v3
    return digest


def session_mac(key: bytes, nonce: int, status: int) -> int:
    """The MAC that makes a session interpreter's answer its loop's: of the call's nonce and status."""
    return siphash24(key, struct.pack("<qi", nonce, status))


def encode(message: dict[str, Any]) -> bytes:
    """One frame for ``message``."""
    body = marshal.dumps(message)
    return HEADER.pack(len(body)) + body


def decode_frames(buffer: bytearray) -> list[dict[str, Any]]:
    """Pop every complete frame off the front of ``buffer`` (mutated in place)."""
    out: list[dict[str, Any]] = []
    offset = 0
    size = len(buffer)
    while size - offset >= HEADER.size:
        (length,) = HEADER.unpack_from(buffer, offset)
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes exceeds the limit of {MAX_FRAME}")
        end = offset + HEADER.size + length
        if end > size:
            break
        out.append(marshal.loads(bytes(buffer[offset + HEADER.size : end])))
        offset = end
    if offset:
        del buffer[:offset]
    return out
