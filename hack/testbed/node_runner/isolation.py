"""How a container's processes are isolated: the bubblewrap command line (own PID/IPC/UTS namespaces,
the host filesystem read-only, volumes bound at their mount paths, a container's capability set), and
the checks a container runtime makes before it starts a program."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
from pathlib import Path

from .api import Json, StartError

# What containerd grants a container that asks for nothing (runc's default set).
DEFAULT_CAPS = [
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
    "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
]  # fmt: skip
SANDBOX_OWN = {"proc", "dev", "tmp", "run", "sys", "lost+found"}  # made fresh for each sandbox
# The service-account volume the API server injects: the only mount that can be done without a mount
# namespace (in-cluster clients then fail, as they would with automountServiceAccountToken: false).
SA_VOLUME_PREFIX = "kube-api-access"


def set_pdeathsig() -> None:
    """Child side of Popen without bubblewrap: die with the runner (PR_SET_PDEATHSIG = 1)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def host_binds(directory: str, opened: set[str]) -> list[str]:
    """bwrap arguments mirroring `directory` read-only, opening up (as tmpfs) the directories in `opened`."""
    out: list[str] = []
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        if directory == "/" and entry in SANDBOX_OWN:
            continue
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif path in opened:
            out += ["--dir", path, *host_binds(path, opened)]
        elif os.path.isdir(path) or os.path.isfile(path):
            out += ["--ro-bind-try", path, path]
    return out


def opened_parents(mount_paths: list[str]) -> set[str]:
    """The host directories that must become writable (tmpfs holding read-only binds of their entries)
    so that bwrap can create the mount points that do not exist on the host (/etc/settings)."""
    opened: set[str] = set()
    for path in mount_paths:
        target = os.path.realpath(path)
        if os.path.lexists(target) or target.split("/")[1] in SANDBOX_OWN:
            continue
        parent = os.path.dirname(target)
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        while parent != "/":
            opened.add(parent)
            parent = os.path.dirname(parent)
    return opened


def kept_capabilities(security_context: Json) -> set[str] | None:
    """The capabilities a container keeps (names without CAP_): runc's default set with
    securityContext.capabilities drop/add applied; None when privileged (it keeps all)."""
    if security_context.get("privileged"):
        return None
    caps = security_context.get("capabilities") or {}
    drop = {x.upper().removeprefix("CAP_") for x in caps.get("drop") or []}
    add = {x.upper().removeprefix("CAP_") for x in caps.get("add") or []}
    return ((set() if "ALL" in drop else set(DEFAULT_CAPS) - drop) | add) - {"ALL"}


def bwrap_command(
    bwrap: str,
    argv: list[str],
    *,
    hostname: str,
    container: Json,
    volumes: dict[str, tuple[Path, bool]],
    tmp_dir: Path,
    container_dir: Path,
    workdir: str,
) -> list[str]:
    """The command under bubblewrap: read-only host, own PID/IPC/UTS, volumes, capabilities.

    `volumes` maps each pod volume to its host directory and whether it is read-only; `tmp_dir` becomes
    /tmp; `container_dir` (logs, the default working directory) is bound at its own path."""
    mounts = container.get("volumeMounts") or []
    b = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    b += ["--hostname", hostname]
    # The root is bwrap's own tmpfs with the host's directories bound read-only into it. A mount
    # point that does not exist on the host (/etc/settings) needs a writable parent: such parents
    # become tmpfs directories holding read-only binds of the host's entries.
    b += host_binds("/", opened_parents([str(m["mountPath"]) for m in mounts]))
    b += ["--ro-bind", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run"]
    b += ["--bind", str(tmp_dir), "/tmp", "--bind", str(container_dir), str(container_dir)]
    for m in mounts:
        name = m["name"]
        if name not in volumes:
            raise StartError(f"container {container['name']}: volume {name!r} is not defined in the pod")
        src, vol_ro = volumes[name]
        if m.get("subPath"):
            src = src / m["subPath"]
        ro = vol_ro or bool(m.get("readOnly"))
        # Resolved through the host's symlinks (/var/run -> /run): bwrap creates mount points only
        # in its own directories, never through a link in a read-only bind.
        b += ["--ro-bind" if ro else "--bind", str(src), os.path.realpath(m["mountPath"])]
    b += ["--chdir", workdir]
    keep = kept_capabilities(container.get("securityContext") or {})
    if keep is not None:
        b += ["--cap-drop", "ALL"]
        for cap in sorted(keep):
            b += ["--cap-add", "CAP_" + cap]
    return [*b, "--", *argv]


def check_unisolated(container: Json) -> None:
    """Without a mount namespace only the injected service-account volume can be done without."""
    mounts = container.get("volumeMounts") or []
    unsupported = [m["mountPath"] for m in mounts if not m.get("name", "").startswith(SA_VOLUME_PREFIX)]
    if unsupported:
        raise StartError(f"volume mounts {unsupported} need bubblewrap (bwrap) on the test bed host")


def check_executable(container: Json, program: str, path_env: str) -> None:
    """Fails like containerd when the entrypoint cannot be found (bwrap would exit 1 instead)."""
    mounts = [str(m["mountPath"]) for m in container.get("volumeMounts") or []]
    if "/" in program:
        if any(program.startswith(m.rstrip("/") + "/") for m in mounts):
            return  # inside a volume: only the sandbox can tell
        if os.access(program, os.X_OK) and not os.path.isdir(program):
            return
        raise StartError(f'exec: "{program}": stat {program}: no such file or directory')
    if shutil.which(program, path=path_env) is None:
        raise StartError(f'exec: "{program}": executable file not found in $PATH')
