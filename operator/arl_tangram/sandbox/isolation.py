"""Linux primitives the sandbox isolates actions with, and a probe of which of them work here.

Python 3.11 has no ``os.unshare``/``os.setns`` and no ``mount``, so these go through libc with ctypes.
Everything here is usable only from the fork server (a plain process without threads): namespaces
change the calling process.

What each primitive buys:
- a PID namespace per action: when the action's first process exits (or is killed on timeout) the
  kernel kills every process left in the namespace, daemonised grandchildren included, and the
  parent's ``waitpid`` returns only once they are all gone. No cgroup is needed.
- one network namespace for the fork server (no interfaces but a down loopback): actions cannot open
  a connection anywhere, the agent's own port included. Created once, not per action, because
  tearing a network namespace down is slow in the kernel.
- one mount namespace for the fork server: the world-writable directories (``/tmp``, ``/dev/shm``...)
  are covered by an empty read-only tmpfs so an action can write only into its workdir.
- a uid per running action (and per session): non-root, cannot read another workdir, cannot signal
  the agent, and ``RLIMIT_NPROC`` (counted per uid) bounds each action's fork bomb separately.
"""

from __future__ import annotations

import ctypes
import errno
import os

from arl_tangram.sandbox import seccomp
from arl_tangram.sandbox.lean import suppress
from arl_tangram.sandbox.zygote_wire import ACTION_USER, IDENTITY_FILES

# No typing at run time: the fork server imports this module and stays lean (see forkserver).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MNT_DETACH = 2
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20
UMOUNT_NOFOLLOW = 8
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36


def write_identity(root: str, uids: range, files: tuple[tuple[str, str], ...] = IDENTITY_FILES) -> None:
    """The passwd and group files an action sees (``zygote_wire.IDENTITY_FILES``): the host's
    entries, then ``ACTION_USER`` for each of ``uids`` (its own group, home /tmp: the action's
    private one). A host entry named ``ACTION_USER`` or numbered in ``uids`` is left out (the
    sandbox image has a user of that name, uid 65532): ``pwd.getpwnam(getpass.getuser())`` must
    give the action's own uid, and every uid of the range the one name. ``files``: each file's
    name in ``root`` and the host's file it is made from, passwd's first, then group's."""
    entries = (
        "".join(f"{ACTION_USER}:x:{u}:{u}:{ACTION_USER}:/tmp:/bin/sh\n" for u in uids),
        "".join(f"{ACTION_USER}:x:{u}:\n" for u in uids),
    )
    for (name, host), extra in zip(files, entries, strict=True):
        try:
            with open(host) as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        kept = []
        for line in lines:
            fields = line.split(":")
            number = fields[2] if len(fields) > 2 else ""
            clash = fields[0] == ACTION_USER or (number.isdigit() and int(number) in uids)
            if not clash:
                kept.append(line + "\n")
        tmp = os.path.join(root, name + ".new")
        with open(tmp, "w") as f:
            f.write("".join(kept) + extra)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(root, name))


def bind_identity(root: str) -> None:
    """In an action's mount namespace: its passwd and group (``write_identity``) over the host's.
    Where the agent wrote none (it cannot switch uids) or the image has no such file, nothing; a
    bind that fails leaves the host's file (a name is not worth failing an action for)."""
    for name, host in IDENTITY_FILES:
        src = os.path.join(root, name)
        if os.path.exists(src) and os.path.exists(host):
            with suppress(OSError):
                mount(src, host, None, MS_BIND)


# World-writable places a non-root action could otherwise leave files in (or read others' from).
SHARED_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
# Where each action gets a tmpfs of its own, empty (child.private_tmp; _zygote.c's private_tmp
# has the same two): what lies there outside is out of its sight.
PRIVATE_TMP_POINTS = ("/tmp", "/dev/shm")
# A container's mqueue filesystem (its runtime mounts it, mode 1777) belongs to the IPC namespace it
# was mounted in, the agent's: a queue made through it by path was every action's, whatever
# namespace the action's own mq_open sees. Covered read-only and empty.
MQUEUE_DIR = "/dev/mqueue"

# The symbols of the running process (libc included); ctypes.util.find_library would pull in
# subprocess and friends, several megabytes every fork then has to copy.
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# rt_sigaction's number (the calls glibc refuses for its own signals go to the kernel directly).
_RT_SIGACTION = {"x86_64": 13, "aarch64": 134}


def default_reserved_signals() -> None:
    """Signals 32 and 33 back to their default (_zygote.c's twin, whose comment says why)."""
    nr = _RT_SIGACTION.get(os.uname().machine)
    if nr is None:
        return
    for sig in (32, 33):
        act = (ctypes.c_ulong * 4)(0, 0, 0, 0)  # SIG_DFL, no flags, no restorer, empty mask
        if _libc.syscall(ctypes.c_long(nr), ctypes.c_long(sig), act, None, ctypes.c_long(8)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"rt_sigaction({sig}): {os.strerror(err)}")


def unshare(flags: int) -> None:
    """``unshare(2)`` for the calling process."""
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40


def loopback_netns(home_fd: int) -> tuple[int, tuple[int, ...]]:
    """A new network namespace with its loopback up, as a descriptor, and descriptors of its socket
    counts (``/proc/net/sockstat`` and ``sockstat6`` as seen from inside it: ``netns_idle`` reads
    them from anywhere); the caller stays in (is put back into) the namespace ``home_fd`` names."""
    import fcntl
    import socket
    import struct

    unshare(CLONE_NEWNET)
    fd = -1
    stats: list[int] = []
    try:
        fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            ifreq = struct.pack("16sH22x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING)
            fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, ifreq)
        for name in ("sockstat", "sockstat6"):  # no sockstat6 where IPv6 is off
            with suppress(FileNotFoundError):
                stats.append(os.open(f"/proc/thread-self/net/{name}", os.O_RDONLY | os.O_CLOEXEC))
    except BaseException:
        for opened in (fd, *stats):
            if opened >= 0:
                os.close(opened)
        raise
    finally:
        setns(home_fd, CLONE_NEWNET)
    return fd, tuple(stats)


# The counts of ``/proc/net/sockstat`` (and ``sockstat6``) that may show an action's sockets after
# its processes are gone, as (line, field). Which of them a kernel keeps per namespace differs (the
# TIME_WAIT count became per namespace only in recent kernels; "orphan" is the host's everywhere):
# ``own_socket_counts`` measures that once, and only those are read.
SOCKET_COUNTS = (("sockets", "used"), ("TCP", "inuse"), ("TCP", "tw"), ("UDP", "inuse"), ("TCP6", "inuse"))


def _counts(stats: tuple[int, ...]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for fd in stats:
        for line in os.pread(fd, 4096, 0).decode("ascii", "replace").splitlines():
            name, _, rest = line.partition(":")
            fields = rest.split()
            for key, value in zip(fields[::2], fields[1::2], strict=False):
                with suppress(ValueError):
                    out[(name, key)] = int(value)
    return out


def own_socket_counts(home_fd: int) -> frozenset[tuple[str, str]]:
    """Which ``SOCKET_COUNTS`` are each namespace's own on this kernel. One namespace is given a
    socket of each kind (a listener, a TIME_WAIT, a UDP socket, an IPv6 listener where there is
    IPv6); a count another, empty namespace reads as 0 is per namespace. One it reads otherwise
    is the host's: checked, it would drop every namespace (about 1 ms each to make again, in the
    fork server's loop) whenever the host had such a socket."""
    import socket

    probe, probe_stats = loopback_netns(home_fd)
    held: list[socket.socket] = []
    try:
        setns(probe, CLONE_NEWNET)
        try:
            server = socket.socket()
            held.append(server)
            server.bind(("127.0.0.1", 0))
            server.listen()
            client = socket.create_connection(server.getsockname(), timeout=5)
            held.append(client)
            accepted, _ = server.accept()
            accepted.close()  # closed first: this side goes to TIME_WAIT once the client closes
            client.recv(1)
            client.close()
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            held.append(udp)
            udp.bind(("127.0.0.1", 0))
            with suppress(OSError):  # no IPv6 in this kernel or namespace
                six = socket.socket(socket.AF_INET6)
                held.append(six)
                six.bind(("::1", 0))
                six.listen()
        finally:
            setns(home_fd, CLONE_NEWNET)
        empty, empty_stats = loopback_netns(home_fd)
        try:
            held_counts, empty_counts = _counts(probe_stats), _counts(empty_stats)
        finally:
            for fd in (empty, *empty_stats):
                os.close(fd)
        own = {c for c in SOCKET_COUNTS if held_counts.get(c, 0) > 0 and empty_counts.get(c, -1) == 0}
        if ("sockets", "used") in own:
            own.discard(("TCP6", "inuse"))  # counted in "sockets: used" too: sockstat6 need not be read
        return frozenset(own)
    finally:
        for sock in held:
            sock.close()
        for fd in (probe, *probe_stats):
            os.close(fd)


def netns_idle(stats: tuple[int, ...], own: frozenset[tuple[str, str]]) -> bool:
    """Whether the network namespace whose sockstat files ``stats`` are holds no socket, by the
    counts ``own`` (``own_socket_counts``): none open, none closing, none in TIME_WAIT. Its
    processes all gone is not enough: a port an action closed first stays in TIME_WAIT for a
    minute, and a listener whose descriptor was in flight (SCM_RIGHTS) when the action ended lives
    until the kernel collects it; a later action there could not bind that port, or reached the
    old listener. A pread of sockstat (and of sockstat6 where one of its counts is read)."""
    if not own:
        return True
    # sockstat6 (second) only where a count of its own is read: one pread less per action.
    counts = _counts(stats if any(name.endswith("6") for name, _ in own) else stats[:1])
    return not any(counts.get(c, 0) for c in own)


def setns(fd: int, nstype: int) -> None:
    """``setns(2)``: join (for PID: make the children join) the namespace behind ``fd``."""
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """``mount(2)``."""
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def umount2(target: str, flags: int) -> None:
    """``umount2(2)``."""
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


# The workdir root this process made a shared mount of, in a mount namespace of its own
# (``own_mount_namespace``); "" until then.
_shared_root = ""


def own_mount_namespace(root: str) -> str | None:
    """Give this process (single-threaded: the agent, before its loop starts) a mount namespace of
    its own, where ``root`` is a shared mount: workdirs mounted under it later
    (``workfiles.make_workdir``) reach the fork server's namespace and every action's, which are its
    slaves, and all of them go with this process, however it ends. ``None`` if done, else why not."""
    global _shared_root
    real = os.path.realpath(root)
    try:
        os.makedirs(real, mode=0o711, exist_ok=True)
        unshare(CLONE_NEWNS)
        mount("none", "/", None, MS_REC | MS_PRIVATE)
        mount(real, real, None, MS_BIND)
        mount("none", real, None, MS_SHARED)
    except OSError as exc:
        return exc.strerror or str(exc)
    _shared_root = real
    return None


def shared_root(root: str) -> bool:
    """Whether ``root`` is the shared mount ``own_mount_namespace`` made in this process."""
    return bool(_shared_root) and os.path.realpath(root) == _shared_root


_fallocate = _libc.fallocate64  # off_t of 64 bits whatever the build's
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def reserve(fd: int, length: int) -> None:
    """``fallocate(2)`` of ``length`` bytes from 0 of the file behind ``fd``: room for them taken
    now (ENOSPC now, where there is none), its content left as it is. Not glibc's
    ``posix_fallocate``, which writes zeros where the filesystem cannot do it. Kernels before 6.9
    abort a tmpfs one on any signal (the agent's SIGCHLD among them): tried again then."""
    while _fallocate(fd, 0, 0, length) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, f"fallocate: {os.strerror(err)}")


def own_proc() -> None:
    """Give the calling process, the first of its PID namespace's actions in a mount namespace of
    its own, a /proc of that PID namespace: it sees its own processes only, under the PIDs they
    have there. Mounted over what /proc showed before (the host's, or the last action's in a reused
    namespace), not after unmounting it: see the comment on _zygote.c's own_proc, whose twin this
    is (the Python loop's)."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a throwaway forked child; its exit status: what ``body`` returned, the errno
    of an OSError it raised, or 100 for anything else."""
    pid = os.fork()
    if pid == 0:
        code = 100
        try:
            code = body()
        except OSError as exc:
            code = exc.errno or 100
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _why_not(code: int) -> str | None:
    """A probe child's exit status as a probe's answer: ``None`` (it works), or why not."""
    if code == 0:
        return None
    return os.strerror(code) if 0 < code < 100 else f"the probe ended with status {code}"


def probe_own_proc() -> str | None:
    """Whether an action can be given its own /proc here (tried in a throwaway child in fresh PID
    and mount namespaces): ``None`` if so, else why not."""

    def mounted() -> int:
        own_proc()
        return 0 if os.listdir("/proc/1") and os.readlink("/proc/self") == "1" else 102

    def in_namespaces() -> int:
        unshare(CLONE_NEWNS | CLONE_NEWPID)
        return _in_child(mounted)  # the namespace's first process

    return _why_not(_in_child(in_namespaces))


def probe_own_ipc() -> str | None:
    """Whether an action can be given its own IPC namespace here (tried in a throwaway child):
    ``None`` if so, else why not."""

    def unshared() -> int:
        unshare(CLONE_NEWIPC)
        return 0

    return _why_not(_in_child(unshared))


# Landlock (Linux 5.13+): an unprivileged process's own limits on what it may do to files. ABI 2
# (5.19) at least: under ABI 1 a rename or link across directories is always refused, EXDEV.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_VERSION = 1  # landlock_create_ruleset's flag: the ABI version, no ruleset
_LANDLOCK_PATH_BENEATH = 1
LANDLOCK_MIN_ABI = 2
# Every right that changes the filesystem (reading and executing are not restricted), by ABI.
_FS_WRITE_FILE = 1 << 1
_FS_CHANGES = sum(1 << bit for bit in (1, *range(4, 13)))  # write, remove, make dir/file/link...
_FS_REFER = 1 << 13  # ABI 2: link and rename across directories
_FS_TRUNCATE = 1 << 14  # ABI 3
# Where an action changes files as it would outside: its workdir, its own /tmp and /dev/shm (and,
# without a mount namespace, the host's, as before). It writes devices (/dev/null, a pty) and
# /proc's files (a thread's name), which change nothing on disk: each device by name, not /dev's
# tree, where a file bound in (Kubernetes' /dev/termination-log, mode 0666) would be written too
# (Landlock walks up across mounts). _zygote.c's restrict_writes has the same lists.
WRITABLE_TREES = ("/tmp", "/dev/shm")
WRITTEN_FILES_IN = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
    "/proc",
)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (or with it disabled)."""
    abi = _libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(0, int(abi))


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def restrict_writes(workdir: str) -> None:
    """Leave this process (and what it starts) able to change files only in ``workdir``,
    ``WRITABLE_TREES`` and, by writing, ``WRITTEN_FILES_IN`` (_zygote.c's restrict_writes is
    its twin). Why: an image's world-writable places beyond the ones covered by name (php's
    /var/lib/php/sessions, mode 1733; Kubernetes' /dev/termination-log, 0666) held what one action
    left for another to read, after both had ended, and let any of them fill the disk. A write
    there is refused, EACCES, as a directory the program may not write is outside; a missing
    path is still ENOENT (a read-only mount would say EROFS for both)."""
    abi = landlock_abi()
    handled = _FS_CHANGES | _FS_REFER | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = ctypes.c_uint64(handled)
    ruleset = _libc.syscall(
        ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0)
    )
    _check(0 if ruleset >= 0 else -1, "landlock_create_ruleset")
    try:
        rules = [(workdir, handled), *((p, handled) for p in WRITABLE_TREES)]
        rules += [(p, handled & (_FS_WRITE_FILE | _FS_TRUNCATE)) for p in WRITTEN_FILES_IN]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                rule = _PathBeneath(access, fd)
                _check(
                    _libc.syscall(
                        ctypes.c_long(_LANDLOCK_ADD_RULE),
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_LANDLOCK_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule {path}",
                )
            finally:
                os.close(fd)
        _check(
            _libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)


def probe_landlock() -> str | None:
    """Whether actions' writes can be confined with Landlock here (``restrict_writes``, tried in a
    throwaway child): ``None`` if so, else why not."""
    abi = landlock_abi()
    if abi < LANDLOCK_MIN_ABI:
        return f"Landlock ABI {abi} (at least {LANDLOCK_MIN_ABI} is needed: Linux 5.19)"
    if not no_new_privs():
        # A root probe restricts itself without it (CAP_SYS_ADMIN); an action of its own uid could not.
        return "no_new_privs is not set, which an action needs to restrict itself"

    def restricted() -> int:
        restrict_writes(os.getcwd())
        return 0

    return _why_not(_in_child(restricted))


_OPENAT2 = 437  # the same number on every architecture (Linux 5.6)
_RESOLVE_NO_XDEV, _RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x01, 0x02, 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """``openat2(dirfd, path)`` following links only while they stay beneath ``dirfd`` and on its
    file system (the kernel refuses one that leaves, EXDEV, and /proc's magic links, ELOOP):
    SandboxFusion returns a fetched file through a link, and a link the program made may point
    anywhere the agent, root, could read. OSError (ENOSYS before Linux 5.6)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | _RESOLVE_NO_XDEV)
    name, size = os.fsencode(path), ctypes.c_size_t(ctypes.sizeof(how))
    fd = _libc.syscall(ctypes.c_long(_OPENAT2), ctypes.c_int(dirfd), name, ctypes.byref(how), size)
    _check(0 if fd >= 0 else -1, f"openat2 {path}")
    return int(fd)


def vm_size_kb(pid: int | str = "self") -> int:
    """A process's address space (``VmSize``), in kB; 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def write_proc(path: str, value: bytes) -> None:
    """Write ``value`` to the /proc file ``path`` in one write (as the kernel reads a setting);
    OSError where it refuses."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def probe_ipc_bounds(with_own_proc: bool) -> str | None:
    """Whether an action's own IPC namespace can be bounded here (child.bound_ipc writes
    /proc/sys/kernel; a container runtime may mount /proc/sys read-only), tried in a throwaway
    child as an action's does it: through its own /proc where it has one. ``None`` if so, else
    why not."""

    def bounded() -> int:
        unshare(CLONE_NEWIPC)
        write_proc("/proc/sys/kernel/msgmni", b"16")
        return 0

    def mounted() -> int:
        own_proc()
        return bounded()

    def in_namespaces() -> int:
        unshare(CLONE_NEWNS | CLONE_NEWPID)
        return _in_child(mounted)

    return _why_not(_in_child(in_namespaces if with_own_proc else bounded))


PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def prepared_seccomp(program: bytes) -> Callable[[], None]:
    """Install the seccomp filter ``program`` (``struct sock_filter``s, seccomp.program) in the
    calling process, with its arguments built now (for a call in a forked child: see
    ``prepared_prctl``)."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    func = _libc.prctl
    args = (ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(fprog), 0, 0)

    def call(_keep: object = (buffer, fprog)) -> None:  # the filter's memory lives with the call
        _check(func(*args), "prctl(PR_SET_SECCOMP)")

    return call


def probe_seccomp(program: bytes) -> str | None:
    """Whether the filter installs here and refuses what it should (tried in a throwaway child that
    drops to another uid first, as an action does): ``None`` if so, else why not."""
    install = prepared_seccomp(program)

    def filtered() -> int:
        if os.geteuid() == 0:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        install()
        # keyctl(KEYCTL_GET_KEYRING_ID, ...): refused by the filter, not by its arguments.
        nr = seccomp.DENIED_X86_64["keyrings"]["keyctl"]
        refused = _libc.syscall(ctypes.c_long(nr), 0, -1, 0) == -1 and ctypes.get_errno() == errno.EPERM
        return 0 if refused else 101

    return _why_not(_in_child(filtered))


def no_new_privs() -> bool:
    """Whether the calling process has ``no_new_privs`` set (a filter needs it once uid != 0)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("NoNewPrivs:"):
                return line.split()[1] == "1"
    return False


def resolve_libc() -> None:
    """Look up the libc functions an action's child calls, so that a forked child finds them cached
    (the first attribute access on a ``CDLL`` runs ``dlsym`` and builds a function object)."""
    for name in ("prctl", "unshare", "setns", "mount", "umount2"):
        getattr(_libc, name)


def few_malloc_arenas() -> None:
    """At most two malloc arenas in each child (glibc; inherited through fork). By default glibc
    makes one per thread up to 8 per core, and each reserves 64 MB of address space: under an
    action's memory limit (an address-space limit) a Python program could start only about 20
    threads at 1 GB, where outside a sandbox it starts hundreds. Threads that hold the GIL gain
    nothing from more arenas. (Java's runtime gets MALLOC_ARENA_MAX=1 in its environment.)"""
    mallopt = getattr(_libc, "mallopt", None)  # glibc only
    if mallopt is not None:
        mallopt(-8, 2)  # M_ARENA_MAX


def malloc_trim() -> None:
    """Give freed heap back to the system (less for each fork to copy)."""
    trim = getattr(_libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)


CAP_CHOWN = 0
CAP_KILL = 5
CAP_SETGID = 6
CAP_SETUID = 7


def effective_capabilities() -> int:
    """The calling process's effective capability mask (``CapEff`` in /proc/self/status)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def can_switch_uid() -> bool:
    """Whether actions can be given uids of their own: root *with* the capabilities to do so (a
    container may run as root with them dropped)."""
    caps = effective_capabilities()
    needed = (CAP_CHOWN, CAP_KILL, CAP_SETGID, CAP_SETUID)
    return os.geteuid() == 0 and all(caps >> cap & 1 for cap in needed)


def prctl(option: int, arg: int) -> None:
    """``prctl(2)`` with one argument."""
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def prepared_prctl(option: int, arg: int) -> Callable[[], None]:
    """``prctl(option, arg)`` with its arguments converted to C types now, for a call in a forked
    child: building them there costs that child a few dozen copy-on-write page faults (measured:
    about 0.07 ms per call less than ``prctl``)."""
    func = _libc.prctl
    args = (ctypes.c_int(option), ctypes.c_ulong(arg), 0, 0, 0)

    def call() -> None:
        _check(func(*args), "prctl")

    return call


class Isolation:
    """What the fork server managed to set up; reported to the agent and logged at start-up."""

    def __init__(
        self,
        per_action_uid: bool = False,
        pid_namespace: bool = False,
        network_namespace: bool = False,
        private_tmp: bool = False,
        network_allowed: bool = False,
        notes: tuple[str, ...] = (),
        fork_loop: str = "",
        netns_per_action: bool = False,
        own_proc: bool = False,
        seccomp: bool = False,
        own_ipc: bool = False,
        landlock: bool = False,
        workdir_mb: int = 0,
        memory_guard: dict[str, object] | None = None,
    ) -> None:
        self.per_action_uid = per_action_uid
        self.pid_namespace = pid_namespace
        self.network_namespace = network_namespace
        self.private_tmp = private_tmp
        self.network_allowed = network_allowed
        self.notes = notes
        self.fork_loop = fork_loop  # "c" or "python": which zygote loop forks the actions (forkserver)
        self.netns_per_action = netns_per_action  # each action its own network namespace, lo up
        self.own_proc = own_proc  # each action its own /proc (of its PID namespace)
        self.seccomp = seccomp  # each action under the seccomp filter (seccomp.py)
        self.own_ipc = own_ipc  # each action its own System V / POSIX IPC objects
        self.landlock = landlock  # each action's writes confined (restrict_writes)
        self.workdir_mb = workdir_mb  # each workdir a tmpfs of this size (the agent's, not the fork server's)
        # Where the memory left is watched and how much is kept (forkserver._guard_memory; None: off).
        self.memory_guard = memory_guard

    def as_dict(self) -> dict[str, object]:
        """Plain dict (for the wire and for /v1/health)."""
        return {
            "per_action_uid": self.per_action_uid,
            "pid_namespace": self.pid_namespace,
            "network_namespace": self.network_namespace,
            "private_tmp": self.private_tmp,
            "network_allowed": self.network_allowed,
            "fork_loop": self.fork_loop,
            "netns_per_action": self.netns_per_action,
            "own_proc": self.own_proc,
            "seccomp": self.seccomp,
            "own_ipc": self.own_ipc,
            "landlock": self.landlock,
            "workdir_mb": self.workdir_mb,
            "memory_guard": self.memory_guard,
            "notes": list(self.notes),
        }

    def warnings(self) -> list[str]:
        """Human lines for what is weaker than intended, each naming the fallback in use."""
        lines = list(self.notes)
        if not self.per_action_uid:
            who = (
                "ROOT (root without CAP_SETUID/SETGID/CHOWN/KILL)"
                if os.geteuid() == 0
                else "the agent's own uid"
            )
            lines.append(
                f"no uid per action: actions run as {who}; sessions are not isolated from each other by "
                "file permissions (run the agent as root with those capabilities: it drops each action "
                "to a uid of its own)"
            )
        if not self.pid_namespace and self.per_action_uid:
            lines.append(
                "no PID namespace: an action's leftover processes are killed by process group and then "
                "by uid (every process of the action's own uid), one extra fork per action"
            )
        elif not self.pid_namespace:
            lines.append(
                "no PID namespace and not root: leftover processes are killed by process group plus a "
                "/proc scan for the action's env marker; a child that clears its environment and leaves "
                "the group can survive"
            )
        if not self.network_allowed and not self.network_namespace:
            lines.append("no network namespace: actions CAN reach the network (no fallback can block it)")
        elif not self.network_allowed and not self.netns_per_action:
            lines.append(
                "one network namespace for all actions, its loopback down: ports and abstract unix "
                "sockets are shared between actions (needs a PID namespace per action to do better)"
            )
        if not self.private_tmp:
            lines.append("no private mount namespace: actions can write to /tmp and /dev/shm")
        if not self.workdir_mb:
            lines.append(
                "no workdir size limit: an action can fill this host's memory with files (--workdir-mb; "
                "each workdir is a tmpfs of its own where the agent, as root with CAP_SYS_ADMIN, has a "
                "mount namespace of its own)"
            )
        if self.pid_namespace and self.private_tmp and not self.own_proc:
            lines.append(
                "no /proc per action: actions see the host pod's /proc (other actions' command lines "
                "among it; their environments stay unreadable, another uid)"
            )
        return lines


def probe_pid_namespace() -> bool:
    """Whether a PID namespace can be created here (tried in a throwaway child)."""
    try:
        own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        unshare(CLONE_NEWPID)
    except OSError:
        os.close(own)
        return False
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status) == 0
    finally:
        setns(own, CLONE_NEWPID)
        os.close(own)


def _hidden_ancestor(path: str) -> str | None:
    """The topmost ancestor of ``path`` that other users cannot traverse (say, a 0700 /root)."""
    parts = os.path.realpath(path).strip("/").split("/")
    current = ""
    for part in parts[:-1]:
        current += "/" + part
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


def _covers(writable: list[str], readable: list[str]) -> list[str]:
    """Directories to cover with an empty tmpfs: shared writable ones, and hidden ancestors."""
    points = set()
    for shared in SHARED_WRITABLE_DIRS:
        if os.path.isdir(shared) and not os.path.islink(shared) and os.stat(shared).st_mode & 0o002:
            points.add(shared)
    for path in writable + readable:
        hidden = _hidden_ancestor(path)
        if hidden is not None:
            points.add(hidden)
    # Only the outermost: a bind mount under an outer cover carries what lies below it.
    ordered = sorted(points, key=len)
    return [p for i, p in enumerate(ordered) if not any(_under(p, q) for q in ordered[:i])]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def enter_private_namespaces(
    network_allowed: bool,
    writable: list[str],
    readable: list[str],
    pid_namespace: bool = True,
    workdir_mounts: bool = False,
) -> Isolation:
    """Move the calling process into its own network and mount namespaces, as far as permitted.

    In the mount namespace, world-writable directories and directories others cannot traverse are
    covered by an empty read-only tmpfs. ``writable`` (the workdir root) and ``readable`` (the Python
    installation the actions run) are bind-mounted back at their own paths when they lie under a
    cover, the latter read-only: actions then reach the runtime even when it lives under a private
    home directory, and see nothing else there.

    ``workdir_mounts``: the agent mounts each workdir under the workdir root, a shared mount in its
    own namespace (``own_mount_namespace``), where nothing else is shared. Every mount here is then
    made a slave rather than private: the root's copies (and their binds, in this namespace and in
    every action's, made from it) receive those workdirs, and nothing made here goes back.
    """
    iso = Isolation(network_allowed=network_allowed, per_action_uid=can_switch_uid())
    notes: list[str] = []
    if not network_allowed:
        try:
            unshare(CLONE_NEWNET)
            iso.network_namespace = True
        except OSError as exc:
            notes.append(f"unshare(CLONE_NEWNET) failed ({exc.strerror})")
    writable = [os.path.realpath(p) for p in writable]
    readable = [os.path.realpath(p) for p in readable if os.path.exists(p)]
    try:
        covers = _covers(writable, readable)
        unshare(CLONE_NEWNS)
        mount("none", "/", None, MS_REC | (MS_SLAVE if workdir_mounts else MS_PRIVATE))
        # Handles taken inside the new namespace (a bind source must belong to it), before covering.
        handles = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in writable + readable}
        for cover in covers:
            mount("tangram", cover, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
            for path, fd in handles.items():
                if not _under(path, cover):
                    continue
                os.makedirs(path, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
                if path not in writable:
                    mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            mount("tangram", cover, "tmpfs", MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        for fd in handles.values():
            os.close(fd)
        iso.private_tmp = True
        if os.path.isdir(MQUEUE_DIR) and not os.path.islink(MQUEUE_DIR):
            try:
                mount("tangram", MQUEUE_DIR, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
            except OSError as exc:
                notes.append(
                    f"{MQUEUE_DIR} not covered ({exc.strerror}): a queue made there is every action's"
                )
    except OSError as exc:
        notes.append(f"private mount namespace failed ({exc.strerror}); /tmp stays shared")
    iso.pid_namespace = pid_namespace and probe_pid_namespace()
    iso.notes = tuple(notes)
    return iso
