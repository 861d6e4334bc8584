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
MAX_FRAME = 256 * 1024 * 1024
# A session interpreter's answer to a call: the call's id and its exit status, as two integers and
# nothing else. The other way, the fork server's frames above; but the interpreter runs a session's
# code in its own process, so what it sends is read without marshal, which trusts the lengths in its
# data (a 9-byte frame made it build a tuple of 2**31 slots).
SESSION_ANSWER = struct.Struct("<qi")


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
