"""Names and quantities are the whole string: a final newline is not part of a valid one.

Python's ``re.match`` with a pattern ending in ``$`` accepts a string with one trailing ``\\n``
(``$`` matches before it), so ``"4Gi\\n"`` or ``"team-a\\n"`` passed checks meant to refuse what the
API server refuses. Each check below is one place a name or a quantity comes from outside.
"""

from __future__ import annotations

import pytest

from arl_tangram.api.quantity import parse_quantity
from arl_tangram.domain.services import is_object_name
from arl_tangram.errors import InvalidSpec


@pytest.mark.parametrize("text", ["4Gi\n", "2\n", "500m\n"])
def test_a_quantity_with_a_trailing_newline_is_refused(text: str) -> None:
    assert parse_quantity(text.strip()) > 0
    with pytest.raises(ValueError, match="not a valid quantity"):
        parse_quantity(text)


def test_an_object_name_with_a_trailing_newline_is_none() -> None:
    assert is_object_name("rm") and not is_object_name("rm\n")


def test_a_namespace_setting_with_a_trailing_newline_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from arl_tangram.controllers.operator import OperatorSettings

    monkeypatch.setenv("TANGRAM_GATEWAY_NAMESPACE", "team-a\n")
    with pytest.raises(InvalidSpec, match="not a namespace name"):
        OperatorSettings.from_env()
