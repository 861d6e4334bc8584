"""Small helpers for the fork server's processes, which import as little as they can (every
module a forking process holds is paid again by each fork): no contextlib, typing or dataclasses."""

from __future__ import annotations


class suppress:  # contextlib.suppress without importing contextlib
    __slots__ = ("kinds",)

    def __init__(self, *kinds: type[BaseException]) -> None:
        self.kinds = kinds

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, value: object, tb: object) -> bool:
        return kind is not None and issubclass(kind, self.kinds)
