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
    "TANGRAM_RESULTS_MEMORY_MIB": ("64", ("results_memory_mib", 64)),
    "TANGRAM_GATEWAY_NAMESPACE": ("rl", ("gateway_namespace", "rl")),
    "TANGRAM_GATEWAY_POOLS": ("rl/py, team-b/swe", ("gateway_pools", (("rl", "py"), ("team-b", "swe")))),
    "TANGRAM_GATEWAY_SERVICES": ("rl/rm", ("gateway_services", (("rl", "rm"),))),
    "TANGRAM_TENANT_WEIGHTS": (
        "team-a=3, team-b=0.5",
        ("tenant_weights", (("team-a", 3.0), ("team-b", 0.5))),
    ),
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


@pytest.mark.parametrize("mib", ["1g", "-5", "", "0.5"])
def test_a_bad_results_memory_names_the_variable(monkeypatch: pytest.MonkeyPatch, mib: str) -> None:
    from arl_tangram.errors import InvalidSpec

    monkeypatch.setenv("TANGRAM_RESULTS_MEMORY_MIB", mib)
    with pytest.raises(InvalidSpec) as err:
        OperatorSettings.from_env()
    assert err.value.field == "TANGRAM_RESULTS_MEMORY_MIB" and repr(mib) in err.value.message


def test_the_gateway_defaults_reach_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's SandboxFusion client posts to a fixed ``http://HOST:8080/run_code``: in a cluster no
    request of it could name a pool, and the operator had no way to set a default."""
    monkeypatch.setenv("TANGRAM_GATEWAY_NAMESPACE", "rl")
    monkeypatch.setenv("TANGRAM_GATEWAY_POOLS", "rl/py")
    monkeypatch.setenv("TANGRAM_GATEWAY_SERVICES", "rl/rm,other/judge")
    config = OperatorSettings.from_env().gateway_config()
    assert config.default_namespace == "rl" and dict(config.default_pools) == {"rl": "py"}
    assert dict(config.default_services) == {"rl": "rm", "other": "judge"}


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("TANGRAM_GATEWAY_POOLS", "py", "is not NAMESPACE/NAME"),
        ("TANGRAM_GATEWAY_POOLS", "rl/Py", "is not NAMESPACE/NAME"),
        ("TANGRAM_GATEWAY_SERVICES", "rl/a,rl/b", "given twice"),
        ("TANGRAM_GATEWAY_NAMESPACE", "Team_A", "not a namespace name"),
    ],
)
def test_bad_gateway_defaults_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    from arl_tangram.errors import InvalidSpec

    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidSpec, match=says) as err:
        OperatorSettings.from_env()
    assert err.value.field == variable


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("team-a", "not TENANT=WEIGHT"),
        ("team-a=0", "not TENANT=WEIGHT"),
        ("team-a=-1", "not TENANT=WEIGHT"),
        ("team-a=nan", "not TENANT=WEIGHT"),
        ("team-a=inf", "not TENANT=WEIGHT"),
        ("=2", "not TENANT=WEIGHT"),
        ("team-a=heavy", "not TENANT=WEIGHT"),
        ("team-a=1,team-a=2", "given twice"),
        ("team-a=2", "only the tangram policy"),
    ],
)
def test_bad_tenant_weights_name_the_variable(monkeypatch: pytest.MonkeyPatch, value: str, says: str) -> None:
    from arl_tangram.errors import InvalidSpec

    if "policy" in says:
        monkeypatch.setenv("TANGRAM_POLICY", "paper")
    monkeypatch.setenv("TANGRAM_TENANT_WEIGHTS", value)
    with pytest.raises(InvalidSpec, match=says) as err:
        OperatorSettings.from_env()
    assert err.value.field == "TANGRAM_TENANT_WEIGHTS"


def test_tenant_weights_reach_the_scheduler_and_only_a_policy_that_weighs() -> None:
    """The scheduler's fair share had weights, but the dispatcher made it with none: every tenant
    weighed 1 whatever the cluster wanted, and nothing said so."""
    from arl_tangram.dispatch.agent import AgentClient
    from arl_tangram.dispatch.dispatcher import Dispatcher
    from arl_tangram.errors import InvalidSpec

    d = Dispatcher(AgentClient(), tenant_weights={"team-a": 3.0})
    assert getattr(d.scheduler, "weights", None) == {"team-a": 3.0}
    with pytest.raises(InvalidSpec, match="only the tangram policy"):
        Dispatcher(AgentClient(), policy="paper", tenant_weights={"team-a": 3.0})
    assert not getattr(Dispatcher(AgentClient(), policy="paper").scheduler, "weights", {})
