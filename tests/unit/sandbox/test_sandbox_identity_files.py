"""The passwd and group files an action sees (``isolation.write_identity``), written from host files
of the test's own: the host's entries kept, one entry per action uid, all of one name, and host
entries that would clash with those left out (the sandbox image has a user named as the actions
are, and a host uid may fall in the range)."""

from __future__ import annotations

from pathlib import Path

from arl_tangram.sandbox.isolation import write_identity
from arl_tangram.sandbox.zygote_wire import ACTION_USER


def _write(tmp_path: Path, passwd: str, group: str, uids: range) -> tuple[list[str], list[str]]:
    host_passwd, host_group = tmp_path / "passwd", tmp_path / "group"
    host_passwd.write_text(passwd)
    host_group.write_text(group)
    root = tmp_path / "root"
    root.mkdir()
    write_identity(str(root), uids, ((".passwd", str(host_passwd)), (".group", str(host_group))))
    return (root / ".passwd").read_text().splitlines(), (root / ".group").read_text().splitlines()


def test_host_entries_stay_and_every_uid_gets_the_one_name(tmp_path: Path) -> None:
    passwd, group = _write(
        tmp_path,
        # No final newline: the entries after it still start on their own line.
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin",
        "root:x:0:\nnogroup:x:65534:\n",
        range(40000, 40003),
    )
    assert passwd == [
        "root:x:0:0:root:/root:/bin/bash",
        "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin",
        *(f"{ACTION_USER}:x:{u}:{u}:{ACTION_USER}:/tmp:/bin/sh" for u in range(40000, 40003)),
    ]
    assert group == ["root:x:0:", "nogroup:x:65534:", *(f"{ACTION_USER}:x:{u}:" for u in range(40000, 40003))]


def test_host_entries_that_would_clash_are_left_out(tmp_path: Path) -> None:
    """The image's own user of that name (uid 65532) would answer ``getpwnam('sandbox')`` first; a
    host uid inside the range would keep its own name for the action that draws it."""
    passwd, group = _write(
        tmp_path,
        f"root:x:0:0:root:/root:/bin/bash\n{ACTION_USER}:x:65532:65532::/home/{ACTION_USER}:/bin/sh\n"
        "builder:x:40001:40001::/home/builder:/bin/sh\n",
        f"root:x:0:\n{ACTION_USER}:x:65532:\nbuilders:x:40001:\n",
        range(40000, 40002),
    )
    assert passwd == [
        "root:x:0:0:root:/root:/bin/bash",
        *(f"{ACTION_USER}:x:{u}:{u}:{ACTION_USER}:/tmp:/bin/sh" for u in range(40000, 40002)),
    ]
    assert group == ["root:x:0:", *(f"{ACTION_USER}:x:{u}:" for u in range(40000, 40002))]


def test_no_host_file_still_names_the_actions(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    missing = str(tmp_path / "absent")
    write_identity(str(root), range(7, 8), ((".passwd", missing), (".group", missing)))
    assert (root / ".passwd").read_text() == f"{ACTION_USER}:x:7:7:{ACTION_USER}:/tmp:/bin/sh\n"
    assert (root / ".group").read_text() == f"{ACTION_USER}:x:7:\n"
