"""Small helpers for the fork server's processes, which import as little as they can (every
module a forking process holds is paid again by each fork): no contextlib, typing or dataclasses."""

from __future__ import annotations

import builtins

# The builtins this module's functions see: a copy made at import. ``suppress`` ends the sandboxed
# program's run (child.py), after the program's code could reassign ``builtins.issubclass``.
globals()["__builtins__"] = dict(builtins.__dict__)


class suppress:  # contextlib.suppress without importing contextlib
    __slots__ = ("kinds",)

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, value: object, tb: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)
