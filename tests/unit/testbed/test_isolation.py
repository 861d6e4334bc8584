"""The bubblewrap command line and the checks made before a program starts (no process is started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from node_runner import isolation
from node_runner.api import Json, StartError


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ({}, set(isolation.DEFAULT_CAPS)),
        ({"capabilities": {"drop": ["ALL"]}}, set()),
        ({"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}, {"NET_BIND_SERVICE"}),
        (
            {"capabilities": {"drop": ["CAP_NET_RAW", "kill"]}},
            set(isolation.DEFAULT_CAPS) - {"NET_RAW", "KILL"},
        ),
        ({"capabilities": {"add": ["SYS_ADMIN"]}}, set(isolation.DEFAULT_CAPS) | {"SYS_ADMIN"}),
        ({"privileged": True, "capabilities": {"drop": ["ALL"]}}, None),
    ],
)
def test_capabilities_follow_runc_defaults_and_the_security_context(
    context: Json, expected: set[str] | None
) -> None:
    assert isolation.kept_capabilities(context) == expected


def _command(
    tmp_path: Path, container: Json, volumes: dict[str, tuple[Path, bool]] | None = None
) -> list[str]:
    return isolation.bwrap_command(
        "/usr/bin/bwrap",
        ["python3", "-c", "pass"],
        hostname="web-0",
        container=container,
        volumes=volumes or {},
        tmp_dir=tmp_path / "tmp",
        container_dir=tmp_path / "main",
        workdir="/srv",
    )


def _pairs(argv: list[str], flag: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, a in enumerate(argv) if a == flag]


def test_bwrap_command_binds_volumes_tmp_and_drops_capabilities(tmp_path: Path) -> None:
    container = {
        "name": "main",
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "conf", "mountPath": "/etc/conf", "readOnly": True},
            {"name": "token", "mountPath": "/var/run/secrets/x"},
        ],
        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["KILL"]}},
    }
    volumes = {
        "data": (tmp_path / "d", False),
        "conf": (tmp_path / "c", False),
        "token": (tmp_path / "t", True),
    }
    argv = _command(tmp_path, container, volumes)
    assert argv[:6] == [
        "/usr/bin/bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--hostname",
    ]
    assert argv[argv.index("--") + 1 :] == ["python3", "-c", "pass"]
    assert (str(tmp_path / "tmp"), "/tmp") in _pairs(argv, "--bind")
    assert (str(tmp_path / "d"), "/data") in _pairs(argv, "--bind")
    assert (str(tmp_path / "c"), "/etc/conf") in _pairs(argv, "--ro-bind")  # readOnly mount
    # A read-only volume stays read-only, at the path behind the host's /var/run -> /run link.
    assert any(src == str(tmp_path / "t") for src, _ in _pairs(argv, "--ro-bind"))
    assert argv[argv.index("--chdir") + 1] == "/srv"
    caps = [argv[i + 1] for i, a in enumerate(argv) if a == "--cap-add"]
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and caps == ["CAP_KILL"]


def test_a_privileged_container_keeps_its_capabilities(tmp_path: Path) -> None:
    argv = _command(tmp_path, {"name": "main", "securityContext": {"privileged": True}})
    assert "--cap-drop" not in argv and "--cap-add" not in argv


def test_a_mount_of_an_undefined_volume_is_a_start_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(StartError, match="volume 'ghost' is not defined"):
        _command(tmp_path, {"name": "main", "volumeMounts": [{"name": "ghost", "mountPath": "/g"}]})


def test_mount_points_missing_on_the_host_open_their_parents() -> None:
    opened = isolation.opened_parents(["/etc/tangram-no-such-dir/settings", "/tmp/anything", "/etc"])
    assert opened == {"/etc"}  # /tmp is the sandbox's own; /etc exists and needs no mount point


def test_without_bubblewrap_only_the_service_account_volume_is_allowed() -> None:
    isolation.check_unisolated(
        {"name": "c", "volumeMounts": [{"name": "kube-api-access-x1", "mountPath": "/sa"}]}
    )
    with pytest.raises(StartError, match=r"\['/data'\] need bubblewrap"):
        isolation.check_unisolated({"name": "c", "volumeMounts": [{"name": "data", "mountPath": "/data"}]})


def test_check_executable_fails_like_containerd() -> None:
    isolation.check_executable({"name": "c"}, sys.executable, "")
    isolation.check_executable({"name": "c"}, "sh", "/usr/bin:/bin")
    with pytest.raises(StartError, match='exec: "/no/such/program": stat /no/such/program: no such file'):
        isolation.check_executable({"name": "c"}, "/no/such/program", "/bin")
    with pytest.raises(StartError, match='exec: "no-such-tool": executable file not found in \\$PATH'):
        isolation.check_executable({"name": "c"}, "no-such-tool", "/usr/bin:/bin")
    # Inside a volume only the sandbox can tell: not refused here.
    isolation.check_executable({"name": "c", "volumeMounts": [{"mountPath": "/tools"}]}, "/tools/run", "")
