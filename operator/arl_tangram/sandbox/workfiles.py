"""Reading and writing files inside a workdir on behalf of the caller, without following links out.

The agent runs as root and the workdir belongs to untrusted code, which may plant a symlink such as
``out.txt -> /etc/shadow``. A file is read through links only while they stay in the workdir
(``openat2`` with ``RESOLVE_BENEATH``, as SandboxFusion returns a file through a link); otherwise
every path is walked one component at a time with ``O_NOFOLLOW`` relative to the workdir's
descriptor, and ``..`` or absolute paths are refused up front.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Callable

from arl_tangram.api.actionpool import WORKDIR_BYTES_PER_FILE
from arl_tangram.errors import InvalidSpec
from arl_tangram.sandbox import isolation

MAX_PATH_PARTS = 32
# A workdir is a tmpfs of its own (``make_workdir``) sized by ``--workdir-mb``: its files are the
# host's memory (a pod's, its limit's), and without a bound one action could fill it with files,
# each under ``--fsize-mb``, until the kubelet killed the host and every action on it. tmpfs counts
# bytes, not files, and each file costs the kernel about a kilobyte besides: files are bounded too,
# one per WORKDIR_BYTES_PER_FILE of the size (65,536 for 1 GiB: a checkout of a large repository).
WORKDIR_MIN_FILES = 4096


def split_relpath(field: str, path: str) -> list[str]:
    """The components of a workdir-relative path; ``InvalidSpec`` names the field when it escapes."""
    if not isinstance(path, str) or not path:
        raise InvalidSpec(field, "must be a non-empty relative path")
    if "\0" in path:
        raise InvalidSpec(field, "must not contain NUL bytes")
    # Split on "/" alone: on Linux a backslash is an ordinary character of a name, and
    # SandboxFusion (os.path.join) writes `a\b.txt` as the file of that name, which the program
    # then opens by it (it was made a directory `a` holding `b.txt`). `..\x` is then a name in
    # the workdir too, not a way out of it.
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/"):
        raise InvalidSpec(
            field,
            f"{path!r} is absolute: an action reads and writes only its own working directory (the "
            "rest of the file system is read-only to it), so give the path relative to that directory",
        )
    if any(p == ".." for p in parts):
        raise InvalidSpec(
            field, f"{path!r} leaves the working directory ('..'), the only place an action's files live"
        )
    if not parts or len(parts) > MAX_PATH_PARTS:
        raise InvalidSpec(field, f"{path!r} is not a usable file path")
    return parts


def _open_parent(root: str, parts: list[str], create: bool, uid: int | None) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if uid is not None:
                        os.chown(part, uid, uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


# openat2 refused as a call rather than for the path: none before Linux 5.6 (ENOSYS), a seccomp
# profile's refusal (EPERM), a kernel that knows fewer of its flags (EINVAL, E2BIG).
_NO_OPENAT2 = frozenset({errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG})
_BENEATH_TRIES = 8


def _open_to_read(root: str, parts: list[str]) -> int | None:
    """A descriptor of ``root/parts`` to read, links followed while they stay in ``root``
    (``isolation.open_beneath``); where the kernel cannot (before Linux 5.6), no link at all."""
    flags = os.O_RDONLY | os.O_NONBLOCK  # a FIFO the program left must not hold the agent
    try:
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _ in range(_BENEATH_TRIES):
            try:
                return isolation.open_beneath(rootfd, "/".join(parts), flags)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    continue  # a ".." raced with a mount or rename somewhere: the kernel asks again
                if exc.errno not in _NO_OPENAT2:
                    return None  # missing, a link out (EXDEV, ELOOP), not a directory...
                break
    finally:
        os.close(rootfd)
    try:
        dirfd = _open_parent(root, parts, create=False, uid=None)
    except OSError:
        return None
    try:
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    finally:
        os.close(dirfd)


def read_file(root: str, field: str, path: str, max_bytes: int) -> bytes | None:
    """The content of ``root/path``; ``None`` when it is missing, not a regular file, or a link
    that leaves ``root`` (``_open_to_read``)."""
    fd = _open_to_read(root, split_relpath(field, path))
    if fd is None:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > max_bytes:
            raise InvalidSpec(field, f"{path!r} is {info.st_size} bytes, over the limit of {max_bytes}")
        chunks = []
        remaining = max_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)[:max_bytes]
    finally:
        os.close(fd)


def write_file(root: str, field: str, path: str, data: bytes, uid: int | None) -> None:
    """Write ``data`` to ``root/path`` (parents created), owned by ``uid`` when given."""
    parts = split_relpath(field, path)
    try:
        dirfd = _open_parent(root, parts, create=True, uid=uid)
    except OSError as exc:
        # A link or a file where a directory should be, planted by the session's own code.
        raise InvalidSpec(field, f"cannot write {path!r}: {exc.strerror}") from exc
    try:
        # O_NONBLOCK: opening a FIFO the action planted for writing would otherwise wait for a
        # reader forever, on the agent's event loop. Without a reader it fails (ENXIO) instead.
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        created = True
        try:
            try:
                fd = os.open(parts[-1], flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dirfd)
            except FileExistsError:
                created = False
                fd = os.open(parts[-1], flags, dir_fd=dirfd)
        except OSError as exc:
            raise InvalidSpec(field, f"cannot write {path!r}: {exc.strerror}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InvalidSpec(field, f"cannot write {path!r}: not a regular file")
            if uid is not None:
                os.fchown(fd, uid, uid)
            _write_over(fd, data)
        except OSError as exc:  # ENOSPC: past the workdir's limit (or the host's disk)
            if created:  # refused: nothing of it is left
                with contextlib.suppress(OSError):
                    os.unlink(parts[-1], dir_fd=dirfd)
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise InvalidSpec(field, f"cannot write {path!r}: {why}") from exc
        finally:
            os.close(fd)
    finally:
        os.close(dirfd)


def _write_over(fd: int, data: bytes) -> None:
    """Make the regular file behind ``fd`` hold ``data``. Room for it is taken first (fallocate):
    where there is none (past the workdir's limit), the file a session had is refused, not lost.
    Then it is written over and cut to its length. Where room cannot be taken ahead (a filesystem
    without fallocate), it is emptied first, as before, and a write that fails leaves the part
    written, never new bytes over an old tail."""
    reserved = False
    if data:
        try:
            isolation.reserve(fd, len(data))
            reserved = True
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise
    if not reserved:
        os.ftruncate(fd, 0)
    view, at = memoryview(data), 0
    try:
        while at < len(data):
            at += os.pwrite(fd, view[at:], at)
    except OSError:
        if not reserved:
            os.ftruncate(fd, at)
        raise
    os.ftruncate(fd, len(data))


def workdir_files(size_mb: int) -> int:
    """How many files (and directories) a workdir of ``size_mb`` MB may hold (and an action's
    private /tmp or /dev/shm of that size: ``child.tmp_options``)."""
    return max(WORKDIR_MIN_FILES, (size_mb << 20) // WORKDIR_BYTES_PER_FILE)


def make_workdir(path: str, uid: int | None, size_mb: int = 0) -> None:
    """Create a private workdir (0700, owned by ``uid``): when ``size_mb`` is not 0, a tmpfs of its
    own of that size and ``workdir_files`` files, a write past either failing with ENOSPC, as on a
    full disk. Mounted in the agent's own namespace (``isolation.own_mount_namespace``), it reaches
    the fork server's and every action's."""
    if size_mb:
        os.mkdir(path, 0o700)
        owner = 0 if uid is None else uid
        opts = f"size={size_mb}m,nr_inodes={workdir_files(size_mb)},mode=0700,uid={owner},gid={owner}"
        try:
            isolation.mount("tangram-workdir", path, "tmpfs", isolation.MS_NOSUID | isolation.MS_NODEV, opts)
        except OSError:
            os.rmdir(path)
            raise
        return
    os.mkdir(path, 0o700)
    if uid is not None:
        os.chown(path, uid, uid)


def full(path: str) -> bool:
    """Whether the workdir at ``path``, a tmpfs of its own, has no room left for a page or a file."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail == 0 or st.f_favail == 0


def seal(path: str) -> None:
    """Make a workdir root's own and private (0700): its former owner can no longer enter it, even
    after having opened its mode. Gone already is fine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def remove_tree(path: str, mounted: bool = False) -> None:
    """Remove a workdir, whatever its untrusted owner left in it (modes, links are not followed).
    ``mounted``: a tmpfs of its own (``make_workdir``), detached with all its files at once."""
    if mounted and detach(path):
        return
    shutil.rmtree(path, ignore_errors=True)


def remove_entries(root: str, doomed: Callable[[str], bool]) -> None:
    """Remove the entries of the directory ``root`` whose names are ``doomed``, whatever their
    untrusted owner made them (links are removed, not followed)."""
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if not doomed(entry.name):
                continue
            if entry.is_dir(follow_symlinks=False):
                remove_tree(entry.path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def detach(path: str) -> bool:
    """Detach a workdir's own tmpfs (``make_workdir``) from every namespace it reached, at once and
    whatever it holds (its files are freed once no process uses them), and remove its mount point.
    Whether both were done.

    First its size is cut to what it holds: a process that kept a descriptor of a directory in it
    (a session's interpreter, handed one by a hostile action) could otherwise go on filling it
    after the detach, where no limit anyone sees applies, for as long as it lives.
    """
    try:
        st = os.statvfs(path)
        # Never 0, which a tmpfs takes as no limit: a page and an inode more than nothing.
        pages, inodes = max(1, st.f_blocks - st.f_bfree), max(1, st.f_files - st.f_ffree)
        flags = isolation.MS_REMOUNT | isolation.MS_NOSUID | isolation.MS_NODEV
        cut = f"size={pages * st.f_frsize},nr_inodes={inodes}"
        isolation.mount("tangram-workdir", path, "tmpfs", flags, cut)
    except OSError:
        pass  # detached all the same
    try:
        isolation.umount2(path, isolation.MNT_DETACH | isolation.UMOUNT_NOFOLLOW)
        os.rmdir(path)
    except OSError:
        return False
    return True


def tree_size(path: str) -> int:
    """Bytes used by the regular files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total
