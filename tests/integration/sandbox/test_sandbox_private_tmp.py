"""The fork server's pooled mount namespaces (forkserver.PrivateTmp): one goes back to the pool only
when its /tmp and /dev/shm hold what they held fresh, whatever an action left there and however.

Real mounts, as root, inside a mount namespace of the test's own (nothing reaches the host's).
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from sandbox_agent_harness import C_BUILT

from arl_tangram.api.actionpool import WORKDIR_BYTES_PER_FILE
from arl_tangram.sandbox import child, isolation, memguard
from arl_tangram.sandbox.forkserver import PrivateTmp
from arl_tangram.sandbox.workfiles import WORKDIR_MIN_FILES, workdir_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")


def _in_own_mounts(check: Callable[[], None]) -> None:
    """Run ``check`` in a child in a private mount namespace of its own; fail as it fails."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            isolation.unshare(isolation.CLONE_NEWNS)
            # Private, or the tmpfs mounts below would propagate to the host's /tmp.
            isolation.mount("none", "/", None, isolation.MS_REC | isolation.MS_PRIVATE)
            check()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the check failed (its traceback is above)"


def _inside(mnt: PrivateTmp, step: Callable[[], None]) -> None:
    """Run ``step`` in ``mnt``'s mount namespace, as an action would."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            isolation.setns(mnt.ns, isolation.CLONE_NEWNS)
            step()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _left_file() -> None:
    Path("/tmp/left").write_text("x")


def _left_nothing() -> None:
    Path("/tmp/gone").write_text("x")
    os.unlink("/tmp/gone")
    os.mkdir("/dev/shm/gone")
    os.rmdir("/dev/shm/gone")


def _left_a_directory() -> None:
    os.makedirs("/dev/shm/sem/deep")
    Path("/dev/shm/sem/deep/f").write_text("x")


def _cleaned_up() -> None:
    os.unlink("/tmp/left")
    shutil.rmtree("/dev/shm/sem")


def test_a_namespace_is_clean_only_as_fresh(tmp_path: Path) -> None:
    root = tmp_path / "work"
    root.mkdir()

    def check() -> None:
        # The root is bound back in its place where it lies under /tmp (as the default root lies
        # under /dev/shm): a fresh /tmp then holds the way to its mount point.
        mnt = PrivateTmp.make(str(root), 1 << 20)
        try:
            assert mnt.sizes is not None, "tmpfs directories count their entries in their size"
            assert mnt.clean()
            _inside(mnt, _left_nothing)
            assert mnt.clean()
            _inside(mnt, _left_file)
            assert not mnt.clean()
            _inside(mnt, _left_a_directory)
            assert not mnt.clean()
            _inside(mnt, _cleaned_up)
            assert mnt.clean()
            # The same answers from the listing, where the sizes would not say.
            mnt.sizes = None
            assert mnt.clean()
            _inside(mnt, _left_file)
            assert not mnt.clean()
        finally:
            mnt.close()

    _in_own_mounts(check)


def test_a_namespace_made_ahead_has_the_bound(tmp_path: Path) -> None:
    """Its /tmp and /dev/shm hold one file per ``WORKDIR_BYTES_PER_FILE`` of their size (an action's
    empty files cost the kernel memory no size counts: test_sandbox_tmp_files.py)."""
    root = tmp_path / "work"
    root.mkdir()

    def counts() -> None:
        for d in ("/tmp", "/dev/shm"):
            assert os.statvfs(d).f_files == workdir_files(128), d

    def check() -> None:
        child.set_tmp_files(WORKDIR_BYTES_PER_FILE, WORKDIR_MIN_FILES)
        mnt = PrivateTmp.make(str(root), 128 << 20)
        try:
            _inside(mnt, counts)
        finally:
            mnt.close()

    _in_own_mounts(check)


# /var/tmp and the lock directories that are directories here (isolation.TMP_SHARERS).
SCRATCH = isolation.shared_tmp_points()


def _make_private_tmp(loop: str) -> Callable[[str, int], None]:
    """The fork loop's own ``private_tmp``: the C zygote's (made in an action's child where no
    namespace was made ahead, or a session's) or the Python loop's (which makes the pool's too)."""
    if loop == "python":
        return child.private_tmp
    if not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    from arl_tangram.sandbox import _zygote  # type: ignore[attr-defined]

    made: Callable[[str, int], None] = _zygote.private_tmp
    return made


@pytest.mark.skipif(not SCRATCH, reason="no /var/tmp or lock directory on this machine")
@pytest.mark.parametrize("loop", ["c", "python"])
def test_var_tmp_and_the_lock_dirs_are_directories_of_the_private_tmp(loop: str, tmp_path: Path) -> None:
    """Each is empty and writable by all, as outside, holds only its own files, and lies on the
    private /tmp's tmpfs: its room is /tmp's (no more may be written than before), counted where
    /tmp's is."""
    make = _make_private_tmp(loop)
    root = tmp_path / "work"
    root.mkdir()

    # A fresh /tmp holds the way to the root's mount point where the root lies under it.
    way = [root.relative_to("/tmp").parts[0]] if root.is_relative_to("/tmp") else []

    def check() -> None:
        make(str(root / "x"), 1 << 20)
        tmp = os.stat("/tmp")
        assert os.listdir("/tmp") == way
        for d in SCRATCH:
            st = os.stat(d)
            assert (os.listdir(d), st.st_dev, oct(st.st_mode & 0o7777)) == ([], tmp.st_dev, "0o1777"), d
            Path(d, "mine").write_text(d)
        assert os.stat("/dev/shm").st_dev != tmp.st_dev
        for d in SCRATCH:
            assert os.listdir(d) == ["mine"], d
        assert "mine" not in os.listdir("/tmp")
        # One room: what /var/tmp holds leaves /tmp that much less.
        with pytest.raises(OSError, match="No space left"):
            Path(SCRATCH[0], "big").write_bytes(b"x" * (2 << 20))
        Path(SCRATCH[0], "big").unlink()
        Path(SCRATCH[0], "half").write_bytes(b"x" * (700 << 10))
        with pytest.raises(OSError, match="No space left"):
            Path("/tmp/half").write_bytes(b"x" * (700 << 10))

    _in_own_mounts(check)
    assert all(not os.path.exists(d + "/mine") for d in SCRATCH)


def _left_in_var_tmp() -> None:
    assert os.stat(SCRATCH[0]).st_dev == os.stat("/tmp").st_dev, "not the private /tmp's"
    Path(SCRATCH[0], "left").write_bytes(b"x" * (256 << 10))


@pytest.mark.skipif(not SCRATCH, reason="no /var/tmp or lock directory on this machine")
def test_a_namespace_with_a_file_left_in_var_tmp_is_not_clean(tmp_path: Path) -> None:
    """A pooled namespace one action wrote /var/tmp in is not given to the next, and what is there
    counts in the memory guard's count of the action's /tmp."""
    root = tmp_path / "work"
    root.mkdir()

    def check() -> None:
        mnt = PrivateTmp.make(str(root), 1 << 20)
        try:
            assert mnt.clean()
            _inside(mnt, _left_in_var_tmp)
            assert memguard.fs_used(mnt.tmp) >= 256 << 10
            assert not mnt.clean()
            mnt.sizes = None  # the listing says the same
            assert not mnt.clean()
        finally:
            mnt.close()

    _in_own_mounts(check)
