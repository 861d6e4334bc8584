"""The operator's settings: each environment variable `tangram operator --help` lists sets its field."""

from __future__ import annotations

import dataclasses

import pytest

from arl_tangram.controllers.operator import ENVIRONMENT, OperatorSettings

# A value for each listed variable, and the field value it must give (none is the default).
SET = {
    "POD_NAMESPACE": ("other-ns", ("namespace", "other-ns")),
    "POD_NAME": ("replica-7", ("identity", "replica-7")),
    "TANGRAM_LISTEN_HOST": ("127.0.0.2", ("listen_host", "127.0.0.2")),
    "TANGRAM_LISTEN_PORT": ("9911", ("listen_port", 9911)),
    "TANGRAM_POLICY": ("paper", ("policy", "paper")),
    "TANGRAM_LEADER_ELECTION": ("false", ("leader_election", False)),
    "TANGRAM_GATEWAY_ANONYMOUS": ("true", ("anonymous", True)),
    "TANGRAM_REWARD_DEVICE": ("cpu", ("reward_device", "cpu")),
    "TANGRAM_GPU_DEVICES": ("visible-devices", ("gpu_devices", "visible-devices")),
}


def test_every_listed_variable_is_read_into_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(SET) == set(ENVIRONMENT), "a variable was listed or read without the other"
    fields = {f.name for f in dataclasses.fields(OperatorSettings)}
    for name, (field, _) in ENVIRONMENT.items():
        assert field is None or field in fields, f"{name} names no field: {field}"
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    defaults = OperatorSettings.from_env()
    for name, (value, (field, want)) in SET.items():
        assert getattr(defaults, field) != want, f"{name}: the test value is the default"
        monkeypatch.setenv(name, value)
        assert getattr(OperatorSettings.from_env(), field) == want, name
        monkeypatch.delenv(name)
        # The default the help shows is the one that applies.
        listed = ENVIRONMENT[name][0]
        if listed is not None:
            assert getattr(defaults, listed) == getattr(OperatorSettings, listed), name


@pytest.mark.parametrize("port", ["http", "-1", "65536", ""])
def test_a_bad_port_names_the_variable(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    from arl_tangram.errors import InvalidSpec

    monkeypatch.setenv("TANGRAM_LISTEN_PORT", port)
    with pytest.raises(InvalidSpec) as err:
        OperatorSettings.from_env()
    assert err.value.field == "TANGRAM_LISTEN_PORT" and repr(port) in err.value.message
