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

_SUFFIX = r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
QUANTITY_PATTERN = r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))" + _SUFFIX
# The same with a non-zero digit in the number, so that the API server itself refuses a zero
# ("0", "0.0Gi") naming its field: a memory of "0" was refused only by the rule comparing
# limits.memory to it, which named the other field.
POSITIVE_QUANTITY_PATTERN = r"^(([0-9]*[1-9][0-9]*(\.[0-9]*)?)|([0-9]*\.[0-9]*[1-9][0-9]*))" + _SUFFIX
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
MAX_QUANTITY = 2**63 - 1
"""The largest value a Kubernetes quantity holds (its docs: larger ones are capped)."""


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
    try:
        if suffix in _BINARY:
            value *= _BINARY[suffix]
        elif suffix in _DECIMAL:
            value *= _DECIMAL[suffix]
        else:  # exponent form, e.g. 1e3 or 12E-2
            value = value.scaleb(int(suffix[1:]))
    except ArithmeticError:  # an exponent past Decimal's range: 1e9999999999, or 1e-9999999999
        value = Decimal("Infinity") if value and not suffix.startswith(("e-", "E-")) else Decimal(0)
    # A value no Kubernetes quantity holds: 1e9999999999 escaped as decimal.Overflow (no error
    # naming the field, the object's handler failing instead), and 1e999999 bytes failed later.
    if value > MAX_QUANTITY:
        raise ValueError(f"{text!r} is larger than the largest quantity Kubernetes holds ({MAX_QUANTITY})")
    return value


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


Quantity = Annotated[
    str,
    Field(max_length=64, json_schema_extra={"pattern": QUANTITY_PATTERN}),
    AfterValidator(_check_quantity),
]
"""A non-negative Kubernetes quantity such as ``4Gi`` or ``500m``."""

PositiveQuantity = Annotated[
    str,
    Field(max_length=64, json_schema_extra={"pattern": POSITIVE_QUANTITY_PATTERN}),
    AfterValidator(_check_quantity),
    AfterValidator(_check_positive_quantity),
]
"""A Kubernetes quantity that must be greater than zero (CPU and memory sizes)."""
