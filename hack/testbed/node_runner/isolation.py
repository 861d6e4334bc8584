"""How a container's processes are isolated: the bubblewrap command line (own PID/IPC/UTS namespaces,
the host filesystem read-only, volumes bound at their mount paths, a container's capability set), and
the checks a container runtime makes before it starts a program."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from .api import ConfigError, Json, StartError

# What containerd grants a container that asks for nothing (runc's default set).
DEFAULT_CAPS = [
    "CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID",
    "SETFCAP", "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE",
]  # fmt: skip
SANDBOX_OWN = {"proc", "dev", "tmp", "run", "sys", "lost+found"}  # made fresh for each sandbox
# The service-account volume the API server injects: the only mount that can be done without a mount
# namespace (in-cluster clients then fail, as they would with automountServiceAccountToken: false).
SA_VOLUME_PREFIX = "kube-api-access"


# What runs a container's program as its runAsUser/runAsGroup inside the sandbox (util-linux).
SETPRIV = "setpriv"


@dataclass(frozen=True)
class Identity:
    """The user a container runs as: securityContext runAsUser/runAsGroup (the container's over the
    pod's), with the pod's supplementalGroups and fsGroup as supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def identity(pod_spec: Json, container: Json) -> Identity | None:
    """The container's user, or None when neither sets runAsUser (it runs as the image's user, which
    is root here: there are no images)."""
    pod_sc = pod_spec.get("securityContext") or {}
    sc = container.get("securityContext") or {}
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    if uid is None:
        return None
    gid = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if pod_sc.get("fsGroup") is not None:
        groups.append(int(pod_sc["fsGroup"]))
    return Identity(int(uid), int(uid if gid is None else gid), tuple(sorted(set(groups))))


def check_non_root(pod: Json, container: Json) -> None:
    """runAsNonRoot as the kubelet checks it before it creates the container (with the kubelet's
    messages; the pod then waits in CreateContainerConfigError)."""
    pod_sc = pod["spec"].get("securityContext") or {}
    sc = container.get("securityContext") or {}
    if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        return
    meta = pod["metadata"]
    where = f'(pod: "{meta["name"]}_{meta["namespace"]}({meta["uid"]})", container: {container["name"]})'
    who = identity(pod["spec"], container)
    if who is None:
        raise ConfigError(f"container has runAsNonRoot and image will run as root {where}")
    if who.uid == 0:
        raise ConfigError(f"container's runAsUser breaks non-root policy {where}")


def read_only_root(container: Json) -> bool:
    return bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))


def closed_ancestors(paths: list[str]) -> set[str]:
    """The directories on the way to `paths` that others may not enter (/root is 0700): a container
    running as another user needs them opened (as tmpfs directories holding read-only binds of their
    entries, each with its own permissions), or it could not reach the interpreter behind PATH."""
    opened: set[str] = set()
    for path in paths:
        parent = os.path.dirname(os.path.realpath(path))
        while parent != "/":
            try:
                if not os.stat(parent).st_mode & 0o001:
                    opened.add(parent)
            except OSError:
                pass
            parent = os.path.dirname(parent)
    return opened


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


def mount_point_parents(target: str) -> list[str]:
    """bwrap arguments making the missing directories above a mount point world-readable (bwrap would
    make them 0700, which only root could pass: a container running as another user could not reach
    its service-account token under /run/secrets)."""
    out: list[str] = []
    parts = target.strip("/").split("/")[:-1]
    for i in range(len(parts)):
        parent = "/" + "/".join(parts[: i + 1])
        if parts[0] in SANDBOX_OWN or not os.path.lexists(parent):
            out += ["--perms", "0755", "--dir", parent]
    return out


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
    user: Identity | None = None,
    reachable: list[str] | None = None,
) -> list[str]:
    """The command under bubblewrap: read-only host, own PID/IPC/UTS, volumes, capabilities, user.

    `volumes` maps each pod volume to its host directory and whether it is read-only; `tmp_dir` becomes
    /tmp; `container_dir` (which holds the default working directory) is bound at its own path when
    `workdir` is in it. With readOnlyRootFilesystem "/", /tmp and /run are read-only (volumes mounted
    on them stay as they are) and a container without workingDir starts in "/".
    With `user` the program runs as that user through setpriv, with no capabilities (what a non-root
    process keeps across exec) and its bounding set limited to the container's; `reachable` are the
    paths such a user must be able to reach (the interpreter behind PATH)."""
    mounts = container.get("volumeMounts") or []
    b = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
    b += ["--hostname", hostname]
    # The root is bwrap's own tmpfs with the host's directories bound read-only into it. A mount
    # point that does not exist on the host (/etc/settings) needs a writable parent: such parents
    # become tmpfs directories holding read-only binds of the host's entries.
    opened = opened_parents([str(m["mountPath"]) for m in mounts])
    if user is not None and (user.uid, user.gid) != (0, 0):
        opened |= closed_ancestors(reachable or [])
    b += host_binds("/", opened)
    ro_root = read_only_root(container)
    b += ["--ro-bind", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/run"]
    b += ["--bind", str(tmp_dir), "/tmp"]
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
        target = os.path.realpath(m["mountPath"])
        b += [*mount_point_parents(target), "--ro-bind" if ro else "--bind", str(src), target]
    if ro_root and not container.get("workingDir"):
        workdir = "/"  # no writable default working directory: "/" of a read-only image
    if workdir.startswith(str(container_dir) + "/"):
        # The default working directory, bound after the volumes so that one mounted over an
        # ancestor of it (an emptyDir at /tmp with the state directory under /tmp) cannot hide it.
        b += [*mount_point_parents(str(container_dir)), "--bind", str(container_dir), str(container_dir)]
    if ro_root:
        # Read-only only now: the mount points of the volumes (the service-account token's under /run)
        # had to be made first. A volume mounted at /tmp or /run itself stays as it is.
        targets = {os.path.realpath(m["mountPath"]) for m in mounts}
        b += [arg for d in ("/run", "/tmp", "/") if d not in targets for arg in ("--remount-ro", d)]
    b += ["--chdir", workdir]
    keep = kept_capabilities(container.get("securityContext") or {})
    if user is not None and (user.uid, user.gid) != (0, 0):
        # setpriv needs these three to change user and bounding set; the program has none of them.
        bounding = (
            ",".join(["-all", *(f"+{c.lower()}" for c in sorted(keep or []))]) if keep is not None else ""
        )
        keep = None if keep is None else keep | {"SETUID", "SETGID", "SETPCAP"}
        groups = ["--groups", ",".join(map(str, user.groups))] if user.groups else ["--clear-groups"]
        setpriv = [SETPRIV, "--reuid", str(user.uid), "--regid", str(user.gid), *groups, "--inh-caps", "-all"]
        argv = [*setpriv, *(["--bounding-set", bounding] if bounding else []), "--", *argv]
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


def hidden_in_sandbox(path: str) -> str | None:
    """The top directory of ``path`` that every sandboxed container gets fresh (``SANDBOX_OWN``),
    which hides what the host has below it; None when the sandbox sees ``path``. A checkout under
    /tmp put the project's virtual environment there: every pod then failed with ``bwrap: execvp
    tangram: No such file or directory``."""
    parts = Path(path).parts
    return parts[1] if len(parts) > 1 and parts[0] == "/" and parts[1] in SANDBOX_OWN else None


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
