"""The bubblewrap command line and the checks made before a program starts (no process is started)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from node_runner import isolation
from node_runner.api import ConfigError, Json, StartError


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


def test_a_path_every_sandbox_gets_fresh_is_named() -> None:
    assert isolation.hidden_in_sandbox("/tmp/checkout/.venv/bin") == "tmp"
    assert isolation.hidden_in_sandbox("/run/x") == "run"
    assert isolation.hidden_in_sandbox("/work/checkout/.venv/bin") is None
    assert isolation.hidden_in_sandbox("/tmpfoo/.venv/bin") is None
    assert isolation.hidden_in_sandbox("relative/tmp") is None


def test_check_executable_fails_like_containerd() -> None:
    isolation.check_executable({"name": "c"}, sys.executable, "")
    isolation.check_executable({"name": "c"}, "sh", "/usr/bin:/bin")
    with pytest.raises(StartError, match='exec: "/no/such/program": stat /no/such/program: no such file'):
        isolation.check_executable({"name": "c"}, "/no/such/program", "/bin")
    with pytest.raises(StartError, match='exec: "no-such-tool": executable file not found in \\$PATH'):
        isolation.check_executable({"name": "c"}, "no-such-tool", "/usr/bin:/bin")
    # Inside a volume only the sandbox can tell: not refused here.
    isolation.check_executable({"name": "c", "volumeMounts": [{"mountPath": "/tools"}]}, "/tools/run", "")


def test_identity_takes_the_containers_user_over_the_pods() -> None:
    pod = {
        "securityContext": {"runAsUser": 1000, "runAsGroup": 2000, "supplementalGroups": [5, 3], "fsGroup": 7}
    }
    assert isolation.identity(pod, {"name": "c"}) == isolation.Identity(1000, 2000, (3, 5, 7))
    container = {"name": "c", "securityContext": {"runAsUser": 65532}}
    assert isolation.identity(pod, container) == isolation.Identity(65532, 2000, (3, 5, 7))
    assert isolation.identity({}, container) == isolation.Identity(65532, 65532)  # group defaults to the uid
    assert isolation.identity({}, {"name": "c"}) is None  # the image's user: root here


POD_META: Json = {"name": "op-0", "namespace": "sys", "uid": "u-9"}


@pytest.mark.parametrize(
    ("pod_sc", "sc", "message"),
    [
        (
            {"runAsNonRoot": True},
            {},
            'runAsNonRoot and image will run as root (pod: "op-0_sys(u-9)", container: c)',
        ),
        ({}, {"runAsNonRoot": True, "runAsUser": 0}, "container's runAsUser breaks non-root policy"),
        ({"runAsNonRoot": True, "runAsUser": 65532}, {}, None),
        ({"runAsNonRoot": True}, {"runAsNonRoot": False}, None),  # the container's setting wins
        ({}, {}, None),
    ],
)
def test_run_as_non_root_is_checked_as_the_kubelet_does(pod_sc: Json, sc: Json, message: str | None) -> None:
    pod = {"metadata": POD_META, "spec": {"securityContext": pod_sc}}
    container = {"name": "c", "securityContext": sc}
    if message is None:
        isolation.check_non_root(pod, container)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        isolation.check_non_root(pod, container)


def test_closed_ancestors_are_the_directories_others_cannot_enter(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "open" / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "open").chmod(0o755)
    assert str(closed) in isolation.closed_ancestors([str(closed / "open" / "bin" / "python")])
    assert str(closed / "open") not in isolation.closed_ancestors([str(closed / "open" / "bin" / "python")])


def test_missing_mount_point_parents_are_made_world_readable() -> None:
    def dirs(target: str) -> list[str]:
        args = isolation.mount_point_parents(target)
        assert args[0::4] == ["--perms"] * (len(args) // 4) and args[1::4] == ["0755"] * (len(args) // 4)
        return args[3::4]

    assert dirs("/run/secrets/kubernetes.io/serviceaccount") == [
        "/run",
        "/run/secrets",
        "/run/secrets/kubernetes.io",
    ]
    assert dirs("/etc/tangram-no-such-dir/settings") == ["/etc/tangram-no-such-dir"]  # /etc is the host's
    assert dirs("/data") == []


def test_a_non_root_user_runs_through_setpriv_with_no_capabilities_left(tmp_path: Path) -> None:
    container = {
        "name": "main",
        "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}},
    }
    argv = isolation.bwrap_command(
        "/usr/bin/bwrap",
        ["tangram", "operator"],
        hostname="op-0",
        container=container,
        volumes={},
        tmp_dir=tmp_path / "tmp",
        container_dir=tmp_path / "main",
        workdir=str(tmp_path / "main" / "work"),
        user=isolation.Identity(65532, 65532, (7,)),
        reachable=[sys.executable],
    )
    program = argv[argv.index("--") + 1 :]
    assert program == [
        "setpriv", "--reuid", "65532", "--regid", "65532", "--groups", "7", "--inh-caps", "-all",
        "--bounding-set", "-all,+net_bind_service", "--", "tangram", "operator",
    ]  # fmt: skip
    caps = {argv[i + 1] for i, a in enumerate(argv) if a == "--cap-add"}
    assert caps == {"CAP_NET_BIND_SERVICE", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"}  # setpriv's, then gone
    assert (str(tmp_path / "main"), str(tmp_path / "main")) in _pairs(argv, "--bind")  # its working directory


def test_a_read_only_root_remounts_root_tmp_and_run_after_the_mounts(tmp_path: Path) -> None:
    container = {
        "name": "main",
        "securityContext": {"readOnlyRootFilesystem": True},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    argv = isolation.bwrap_command(
        "/usr/bin/bwrap",
        ["true"],
        hostname="op-0",
        container=container,
        volumes={"tmp": (tmp_path / "scratch", False)},
        tmp_dir=tmp_path / "tmp",
        container_dir=tmp_path / "main",
        workdir=str(tmp_path / "main" / "work"),
    )
    remounted = [argv[i + 1] for i, a in enumerate(argv) if a == "--remount-ro"]
    assert remounted == ["/run", "/"]  # /tmp is the emptyDir's, which stays writable
    assert argv.index("--remount-ro") > argv.index(str(tmp_path / "scratch"))  # after the volume's bind
    assert argv[argv.index("--chdir") + 1] == "/"  # no writable default working directory
    assert str(tmp_path / "main") not in argv
