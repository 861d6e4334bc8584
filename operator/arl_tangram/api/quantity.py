"""Kubernetes resource quantities (``4Gi``, ``500m``, ``2``): one pattern for the schema, one parser.

The pattern is the non-negative subset of Kubernetes' own quantity grammar, so whatever the models
accept the API server accepts too, and a typo such as ``4Gx`` is rejected on both sides with a message
that names the field.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, Field

QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# Splits a quantity that already matched QUANTITY_PATTERN into its number and its suffix.
_SPLIT_RE = re.compile(r"^(?P<number>[0-9.]+)(?P<suffix>.*)$")

EXAMPLES = "e.g. 4Gi, 512Mi, 2, 500m"


def parse_quantity(text: str) -> Decimal:
    """The value of a quantity in base units (bytes, cores). Raises ValueError naming the problem."""
    parts = _SPLIT_RE.match(text) if isinstance(text, str) and _QUANTITY_RE.fullmatch(text) else None
    if parts is None:
        raise ValueError(f"{text!r} is not a valid quantity ({EXAMPLES})")
    suffix = parts["suffix"]
    try:
        value = Decimal(parts["number"])
    except InvalidOperation as exc:  # unreachable after the pattern; kept so no input escapes as a crash
        raise ValueError(f"{text!r} is not a valid quantity ({EXAMPLES})") from exc
    if suffix in _BINARY:
        return value * _BINARY[suffix]
    if suffix in _DECIMAL:
        return value * _DECIMAL[suffix]
    # Exponent form, e.g. 1e3 or 12E-2.
    return value * (Decimal(10) ** int(suffix[1:]))


def quantity_bytes(text: str) -> int:
    """A memory quantity in whole bytes (rounded up, as the kubelet does)."""
    value = parse_quantity(text)
    whole = int(value)
    return whole if whole == value else whole + 1


def _check_quantity(text: str) -> str:
    parse_quantity(text)
    return text


def _check_positive_quantity(text: str) -> str:
    if parse_quantity(text) <= 0:
        raise ValueError(f"{text!r} must be greater than zero")
    return text


_SCHEMA = {"pattern": QUANTITY_PATTERN}

Quantity = Annotated[str, Field(max_length=64, json_schema_extra=_SCHEMA), AfterValidator(_check_quantity)]
"""A non-negative Kubernetes quantity such as ``4Gi`` or ``500m``."""

PositiveQuantity = Annotated[
    str,
    Field(max_length=64, json_schema_extra=_SCHEMA),
    AfterValidator(_check_quantity),
    AfterValidator(_check_positive_quantity),
]
"""A Kubernetes quantity that must be greater than zero (CPU and memory sizes)."""
