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

from arl_tangram.api.actionpool import WORKDIR_BYTES_PER_FILE
from arl_tangram.sandbox import child, isolation
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
