"""Pod spec expansion as a kubelet does it: $(VAR), quantities, the downward API, env, argv, ports."""

from __future__ import annotations

import re

import pytest
from node_runner import podspec
from node_runner.api import ConfigError, Json, StartError

POD: Json = {
    "metadata": {
        "name": "web-0",
        "namespace": "prod",
        "uid": "u-1",
        "labels": {"app": "web"},
        "annotations": {"team": "rl"},
    },
    "spec": {"nodeName": "tb-cpu-0", "serviceAccountName": "runner"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "1"),
        ("x-$(A)-$(B)", "x-1-two"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # undefined names stay as written
        ("$(A", "$(A"),  # unterminated
        ("$A", "$A"),  # only $(...) is a reference
        ("cost: $$5", "cost: $5"),
        ("$", "$"),
        ("", ""),
        ("$(A)$(A)", "11"),
    ],
)
def test_expand_follows_kubelet(text: str, expected: str) -> None:
    assert podspec.expand(text, {"A": "1", "B": "two"}) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", 0.5), ("2", 2.0), ("1Gi", 2.0**30), ("1k", 1000.0), ("1e3", 1000.0), ("64Mi", 64 * 2.0**20)],
)
def test_quantity(text: str, value: float) -> None:
    assert podspec.quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("bad", ["12parsecs", "", "m", "1.2.3Gi"])
def test_quantity_names_bad_input(bad: str) -> None:
    with pytest.raises(ValueError, match="not a resource quantity"):
        podspec.quantity(bad)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("metadata.name", "web-0"),
        ("metadata.namespace", "prod"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['app']", "web"),
        ("metadata.annotations['team']", "rl"),
        ("metadata.labels['absent']", ""),
        ("spec.nodeName", "tb-cpu-0"),
        ("spec.serviceAccountName", "runner"),
        ("status.podIP", "198.18.0.7"),
        ("status.hostIP", "127.0.0.1"),
    ],
)
def test_field_value_reads_the_downward_api(path: str, value: str) -> None:
    assert podspec.field_value(POD, path, "198.18.0.7", "127.0.0.1") == value


def test_an_unknown_downward_api_field_is_a_start_error_naming_it() -> None:
    with pytest.raises(StartError, match=r"spec\.nope"):
        podspec.field_value(POD, "spec.nope", "", "")


def test_resource_field_refs_use_the_divisor_and_fall_back_to_node_capacity() -> None:
    main = {"name": "main", "resources": {"limits": {"cpu": "1500m", "memory": "1Gi"}}}
    side = {"name": "side", "resources": {"requests": {"cpu": "250m"}}}
    capacity = {"cpu": "16", "memory": "64Gi"}

    def value(ref: Json, container: Json = main) -> str:
        return podspec.resource_value([main, side], container, ref, capacity)

    assert value({"resource": "limits.cpu"}) == "2"  # rounded up, as kubelet does
    assert value({"resource": "limits.cpu", "divisor": "1m"}) == "1500"
    assert value({"resource": "limits.memory", "divisor": "1Mi"}) == "1024"
    assert value({"resource": "requests.cpu", "containerName": "side", "divisor": "1m"}) == "250"
    assert value({"resource": "requests.memory"}, side) == str(64 * 2**30)  # unset: node capacity


def _lookup(objects: dict[tuple[str, str], dict[str, str]]) -> podspec.Lookup:
    def lookup(kind: str, name: str, optional: bool) -> dict[str, str] | None:
        if (kind, name) in objects:
            return objects[(kind, name)]
        if optional:
            return None
        raise ConfigError(f'{kind} "{name}" not found')

    return lookup


def _env(spec: Json, objects: dict[tuple[str, str], dict[str, str]] | None = None) -> dict[str, str]:
    return podspec.container_env(
        spec,
        {"PATH": "/bin", "HOME": "/root"},
        "prod",
        _lookup(objects or {}),
        lambda path: podspec.field_value(POD, path, "198.18.0.7", "127.0.0.1"),
        lambda ref: f"resource:{ref['resource']}",
    )


def test_env_applies_env_from_then_env_in_order_with_expansion() -> None:
    objects = {
        ("configMap", "settings"): {"MODE": "fast", "HOME": "/data"},
        ("secret", "keys"): {"TOKEN": "s3"},
    }
    spec = {
        "name": "main",
        "envFrom": [
            {"prefix": "CFG_", "configMapRef": {"name": "settings"}},
            {"secretRef": {"name": "keys"}},
        ],
        "env": [
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "GREETING", "value": "hi-$(POD)-$(CFG_MODE)-$(LATER)"},
            {"name": "LATER", "value": "x"},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "MODE"}}},
            {"name": "EMPTY"},
        ],
    }
    env = _env(spec, objects)
    assert env["CFG_MODE"] == "fast" and env["CFG_HOME"] == "/data" and env["HOME"] == "/root"
    assert env["TOKEN"] == "s3"
    assert env["GREETING"] == "hi-web-0-fast-$(LATER)"  # only names defined before it expand
    assert env["CPU"] == "resource:limits.cpu"
    assert env["MODE"] == "fast"
    assert env["EMPTY"] == ""
    assert env["PATH"] == "/bin"


def test_env_from_a_missing_config_map_is_a_config_error_unless_optional() -> None:
    ref = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k"}}}
    with pytest.raises(ConfigError, match="absent"):
        _env({"name": "main", "env": [ref]})
    optional = {
        "name": "X",
        "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k", "optional": True}},
    }
    assert "X" not in _env({"name": "main", "env": [optional]})


def test_a_missing_key_in_a_present_config_map_names_the_key() -> None:
    ref = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "nokey"}}}
    with pytest.raises(ConfigError, match="couldn't find key nokey in configMap prod/settings"):
        _env({"name": "main", "env": [ref]}, {("configMap", "settings"): {"MODE": "fast"}})


ENTRYPOINTS: dict[str, Json] = {
    "arl-tangram-operator": {"command": ["tangram", "operator"]},
    "tagged:1.0": {"command": ["exact"], "args": ["--default"]},
}


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("arl-tangram-operator", ["tangram", "operator"]),
        ("arl-tangram-operator:0.1.0", ["tangram", "operator"]),
        ("arl-tangram-operator@sha256:abc", ["tangram", "operator"]),
        ("tagged:1.0", ["exact", "--default"]),
    ],
)
def test_argv_comes_from_the_entrypoints_map_when_no_command_is_given(
    image: str, expected: list[str]
) -> None:
    assert podspec.container_argv({"name": "c", "image": image}, ENTRYPOINTS) == expected


def test_args_replace_the_entrypoints_default_args_and_a_command_wins() -> None:
    assert podspec.container_argv({"name": "c", "image": "tagged:1.0", "args": ["a"]}, ENTRYPOINTS) == [
        "exact",
        "a",
    ]
    spec = {"name": "c", "image": "arl-tangram-operator", "command": ["sh"], "args": ["-c", "true"]}
    assert podspec.container_argv(spec, ENTRYPOINTS) == ["sh", "-c", "true"]


def test_an_image_without_command_or_entrypoint_is_a_start_error_naming_the_image() -> None:
    with pytest.raises(StartError, match=re.escape("'registry.example/other:2'")):
        podspec.container_argv({"name": "c", "image": "registry.example/other:2"}, ENTRYPOINTS)


def test_ports_resolve_by_number_or_name() -> None:
    spec = {"name": "c", "ports": [{"name": "gateway", "containerPort": 8080}]}
    assert podspec.port_number(spec, 9090) == 9090
    assert podspec.port_number(spec, "9090") == 9090
    assert podspec.port_number(spec, "gateway") == 8080
    with pytest.raises(ValueError, match="no port named 'metrics'"):
        podspec.port_number(spec, "metrics")


@pytest.mark.parametrize(
    ("name", "hostname", "expected"),
    [
        ("web-0", None, "web-0"),
        ("web-0", "box", "box"),
        ("p" + "a" * 61 + "z-1a2b3c", None, "p" + "a" * 61 + "z"),
        ("p" + "a" * 61 + "-" + "b" * 8, None, "p" + "a" * 61),
        ("p" + "a" * 60 + ".-" + "b" * 8, None, "p" + "a" * 60),
    ],
)
def test_the_hostname_is_cut_to_63_characters_as_kubelet_does(
    name: str, hostname: str | None, expected: str
) -> None:
    """A pod's name may take 253 characters, a hostname 63 (bwrap's sethostname fails beyond): kubelet
    cuts it there, then drops a trailing '-' or '.'."""
    pod = {"metadata": {"name": name}, "spec": {"hostname": hostname} if hostname else {}}
    assert podspec.hostname(pod) == expected
