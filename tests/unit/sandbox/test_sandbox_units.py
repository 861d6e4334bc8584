"""Pure pieces of the sandbox: framing, paths, core allocation, settings, response shapes."""

from __future__ import annotations

import contextlib
import errno
import marshal
import os
from pathlib import Path

import pytest

from arl_tangram.errors import CapacityExceeded, InvalidSpec
from arl_tangram.sandbox import isolation, wire, workfiles, zygote_wire
from arl_tangram.sandbox.cli import build_parser, config_from_args, parse_listen
from arl_tangram.sandbox.config import parse_cores
from arl_tangram.sandbox.cores import CorePool
from arl_tangram.sandbox.executor import ActionResult
from arl_tangram.sandbox.server import sandboxfusion_response


# ---- wire --------------------------------------------------------------------------------------------
def test_frames_survive_arbitrary_splits() -> None:
    messages = [{"id": i, "stdout": bytes([i]) * (i * 1000), "flag": i % 2 == 0} for i in range(20)]
    stream = b"".join(wire.encode(m) for m in messages)
    buf = bytearray()
    got = []
    for start in range(0, len(stream), 777):
        buf += stream[start : start + 777]
        got += wire.decode_frames(buf)
    assert got == messages
    assert buf == bytearray()


def test_oversized_frame_is_refused() -> None:
    buf = bytearray(wire.HEADER.pack(wire.MAX_FRAME + 1))
    with pytest.raises(ValueError, match="exceeds"):
        wire.decode_frames(buf)


# ---- paths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", "", "a\0b"])
def test_escaping_paths_are_named_and_refused(path: str) -> None:
    with pytest.raises(InvalidSpec) as err:
        workfiles.split_relpath("files[x]", path)
    assert err.value.field == "files[x]"


def test_reading_never_follows_links_out(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("s")
    work = tmp_path / "work"
    work.mkdir()
    (work / "link").symlink_to(tmp_path / "secret")
    (work / "dir").symlink_to(tmp_path)
    (work / "rel").symlink_to("../secret")
    assert workfiles.read_file(str(work), "f", "link", 100) is None
    assert workfiles.read_file(str(work), "f", "rel", 100) is None
    assert workfiles.read_file(str(work), "f", "dir/secret", 100) is None
    workfiles.write_file(str(work), "f", "a/b/c.txt", b"data", uid=None)
    assert workfiles.read_file(str(work), "f", "a/b/c.txt", 100) == b"data"
    with pytest.raises(InvalidSpec, match="over the limit"):
        workfiles.read_file(str(work), "f", "a/b/c.txt", 2)
    with pytest.raises(InvalidSpec):
        workfiles.write_file(str(work), "f", "link", b"x", uid=None)
    assert (tmp_path / "secret").read_text() == "s"


def test_links_that_stay_in_the_workdir_are_read_through(tmp_path: Path) -> None:
    """SandboxFusion returns a fetched file through a link (``ln -s real.txt alias.txt``, a linked
    directory); here nothing came back and nothing said why. A link out of the workdir, absolute
    (to /proc's magic links too) or by ``..``, still gives nothing."""
    if not _has_openat2():
        pytest.skip("openat2 (Linux 5.6) is needed to follow links safely")
    (tmp_path / "secret").write_text("s")
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "real.txt").write_text("real")
    (work / "sub" / "f").write_text("deep")
    (work / "alias.txt").symlink_to("real.txt")
    (work / "subl").symlink_to("sub")
    (work / "sub" / "up").symlink_to("../real.txt")
    (work / "out").symlink_to("../secret")
    (work / "abs").symlink_to(tmp_path / "secret")
    (work / "magic").symlink_to("/proc/self/root/etc/hostname")
    read = {p: workfiles.read_file(str(work), "f", p, 100) for p in ("alias.txt", "subl/f", "sub/up")}
    assert read == {"alias.txt": b"real", "subl/f": b"deep", "sub/up": b"real"}
    for path in ("out", "abs", "magic", "subl/../out"):
        with contextlib.suppress(InvalidSpec):  # ``..`` is refused by name before any lookup
            assert workfiles.read_file(str(work), "f", path, 100) is None, path


def _has_openat2() -> bool:
    try:
        root = os.open("/", os.O_RDONLY)
        try:
            os.close(isolation.open_beneath(root, ".", os.O_RDONLY))
        finally:
            os.close(root)
    except OSError as exc:
        return exc.errno != errno.ENOSYS
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a directory's owner needs root")
def test_a_discarded_workdir_is_sealed_from_its_former_owner(tmp_path: Path) -> None:
    """The uid goes back to the pool before the janitor has removed the tree: its next holder must
    find the former workdir closed, even if the action had opened its mode."""
    work = tmp_path / "a1"
    workfiles.make_workdir(str(work), uid=40001)
    os.chmod(work, 0o777)  # as the action itself may
    workfiles.seal(str(work))
    info = work.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)
    workfiles.seal(str(tmp_path / "gone"))  # already removed: nothing to do


def test_writing_refuses_planted_fifos_links_and_files_without_blocking(tmp_path: Path) -> None:
    """What untrusted code may leave in a session's workdir where the caller uploads next. Opening
    the FIFO for writing used to block (forever: nobody reads it), here and on the agent's loop."""
    (tmp_path / "outside").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dirlink").symlink_to(tmp_path / "outside")
    (tmp_path / "plain").write_bytes(b"keep")
    # With a reader first (the write would then go through, not hang, were it not refused), then
    # without one.
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(InvalidSpec, match="cannot write"):
            workfiles.write_file(str(tmp_path), "f", "fifo", b"x", uid=None)
    finally:
        os.close(reader)
    for path in ("fifo", "dirlink/x", "plain/x"):
        with pytest.raises(InvalidSpec, match="cannot write"):
            workfiles.write_file(str(tmp_path), "f", path, b"x", uid=None)
    assert list((tmp_path / "outside").iterdir()) == []
    assert (tmp_path / "plain").read_bytes() == b"keep"
    workfiles.write_file(str(tmp_path), "f", "plain", b"new", uid=None)
    assert (tmp_path / "plain").read_bytes() == b"new"


# ---- cores ----------------------------------------------------------------------------------------------
def test_cores_are_exclusive() -> None:
    pool = CorePool([0, 1, 2, 3])
    a = pool.take(2)
    b = pool.take(frozenset({2}))
    assert a == [0, 1]
    assert b == [2]
    assert pool.take(2) is None  # only core 3 is free
    assert pool.take([1]) is None  # held
    assert pool.take([3]) == [3]
    assert pool.busy == 4
    pool.release([0, 1])
    assert pool.take(2) == [0, 1]


def test_bad_grants_are_clear_errors() -> None:
    pool = CorePool([0, 1])
    with pytest.raises(InvalidSpec, match="do not belong"):
        pool.check(frozenset({7}))
    with pytest.raises(CapacityExceeded):
        pool.check(3)
    with pytest.raises(InvalidSpec):
        pool.check(0)
    with pytest.raises(InvalidSpec):
        pool.check(frozenset())


# ---- settings ----------------------------------------------------------------------------------------
def test_core_lists_and_listen_addresses() -> None:
    assert parse_cores("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(InvalidSpec, match="cores"):
        parse_cores("a-b")
    assert parse_listen("0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert parse_listen("[::1]:9") == ("::1", 9)
    with pytest.raises(InvalidSpec, match="listen"):
        parse_listen("localhost")


def test_agent_options_fail_fast() -> None:
    parser = build_parser()
    with pytest.raises(InvalidSpec, match="runtime"):
        config_from_args(parser.parse_args(["--runtimes", "python,cobol"]))
    with pytest.raises(InvalidSpec, match="cores"):
        config_from_args(parser.parse_args(["--cores", "4096"]))
    config = config_from_args(
        parser.parse_args(["--listen", "127.0.0.1:0", "--timeout", "3", "--nproc", "9"])
    )
    assert config.limits.timeout_s == 3
    assert config.limits.nproc == 9
    assert config.cores == sorted(os.sched_getaffinity(0))


# ---- SandboxFusion shape -----------------------------------------------------------------------------
def _result(outcome: str, exit_code: int | None) -> ActionResult:
    return ActionResult(
        outcome=outcome,
        exit_code=exit_code,
        signal=None,
        stdout="o",
        stderr="e",
        stdout_truncated=False,
        stderr_truncated=False,
        wall_s=0.5,
        cpu_s=0.1,
        max_rss_kb=1,
        cores=[0],
        files={"a.txt": b"hi", "gone.txt": None},
        message="boom" if outcome == "sandbox_error" else "",
    )


@pytest.mark.parametrize(
    ("outcome", "exit_code", "status", "run_status", "return_code"),
    [
        ("ok", 0, "Success", "Finished", 0),
        ("failed", 2, "Failed", "Finished", 2),
        ("timeout", -9, "Failed", "TimeLimitExceeded", None),
        ("memory_limit_exceeded", 1, "Failed", "Finished", 1),
        ("sandbox_error", 249, "SandboxError", "Error", 249),
    ],
)
def test_sandboxfusion_statuses(
    outcome: str, exit_code: int, status: str, run_status: str, return_code: int | None
) -> None:
    body = sandboxfusion_response(_result(outcome, exit_code))
    assert body["status"] == status
    assert body["run_result"]["status"] == run_status
    assert body["run_result"]["return_code"] == return_code
    assert body["run_result"]["memory_limit_exceeded"] is (outcome == "memory_limit_exceeded")
    assert body["compile_result"] is None
    assert body["files"] == {"a.txt": "aGk="}
    assert body["message"] == ("boom" if status == "SandboxError" else "")


# ---- isolation planning --------------------------------------------------------------------------------
def test_hidden_ancestors_are_covered_once(tmp_path: Path) -> None:
    private = tmp_path / "home"
    (private / "py" / "lib").mkdir(parents=True)
    private.chmod(0o700)
    tmp_path.chmod(0o755)
    covers = isolation._covers([], [str(private / "py" / "lib")])
    assert str(private) in covers or any(str(private).startswith(c + "/") for c in covers)
    assert all(not any(c != d and c.startswith(d + "/") for d in covers) for c in covers)


# ---- the zygote's request format ------------------------------------------------------------------
def _msg(**extra: object) -> dict[str, object]:
    msg: dict[str, object] = {
        "id": 7,
        "uid": 40001,
        "workdir": "/srv/sandbox/a7",
        "cores": [1, 3],
        "limits": {"cpu": 11, "as": 1 << 30, "nproc": 0},
        "env": {"HOME": "/srv/sandbox/a7", "PATH": "/usr/bin", "TANGRAM_CORES": "1,3"},
        "code": "print('\u00e9\ud800')",  # a lone surrogate, as JSON may carry one
        "argv": None,
    }
    msg.update(extra)
    return msg


def test_zygote_request_round_trips() -> None:

    data = zygote_wire.encode_request(_msg(), interp=False, base_env={})
    req = zygote_wire.decode_request(data)
    assert req["id"] == 7 and req["uid"] == 40001 and req["interp"] is False
    assert req["cores"] == [1, 3] and req["workdir"] == "/srv/sandbox/a7"
    # Zero means "no limit": not sent; CPU and address space by their resource numbers.
    import resource

    assert req["limits"] == [(resource.RLIMIT_CPU, 11), (resource.RLIMIT_AS, 1 << 30)]
    assert req["env"] == {
        "HOME": "/srv/sandbox/a7",
        "PATH": "/usr/bin",
        "TANGRAM_CORES": "1,3",
        "TANGRAM_ACTION_ID": "7",
    }
    assert req["code"] == "print('\u00e9\ud800')" and req["argv"] is None
    bash = zygote_wire.decode_request(
        zygote_wire.encode_request(
            _msg(uid=None, argv=["/bin/bash", "-c", "echo hi"]), interp=True, base_env={}
        )
    )
    assert bash["uid"] is None and bash["interp"] is True and bash["argv"] == ["/bin/bash", "-c", "echo hi"]


def test_zygote_request_carries_only_the_environment_that_differs() -> None:

    base = {"PATH": "/usr/bin", "HOME": "/base", "GONE": "x"}
    data = zygote_wire.encode_request(_msg(), interp=False, base_env=base)
    # The spans after the limits: workdir, env, delta, code, argv.
    assert zygote_wire.span(b"HOME=/srv/sandbox/a7\0TANGRAM_CORES=1,3\0TANGRAM_ACTION_ID=7\0GONE\0") in data
    assert b"HOME=/srv/sandbox/a7\0PATH=/usr/bin\0" in data  # the whole environment too, for the C side


@pytest.mark.parametrize("name", ["", "A=B", "NUL\0"])
def test_zygote_request_refuses_environment_names_the_kernel_cannot_hold(name: str) -> None:

    with pytest.raises(ValueError, match="cannot be set"):
        zygote_wire.encode_request(_msg(env={name: "v"}), interp=False, base_env={})


def test_zygote_records_parse() -> None:

    assert zygote_wire.parse_record(zygote_wire.spawn_record(5, 1234)) == ("s", 5, 1234)
    assert zygote_wire.parse_record(zygote_wire.error_record(5, "fork: EAGAIN")) == ("e", 5, "fork: EAGAIN")
    assert zygote_wire.parse_record(zygote_wire.exit_record(1234, 256, 0.5, 9000)) == (
        "x",
        1234,
        256,
        0.5,
        9000,
        False,
    )
    assert zygote_wire.parse_record(zygote_wire.exit_record(1234, 249 << 8, 0.0, 0, True))[5] is True
    assert zygote_wire.parse_record(zygote_wire.exit_record(1234, None, 0.0, 0))[2] is None
    ready = b"R" + marshal.dumps((["a note"], "c", ["heapq", "json"]))
    assert zygote_wire.parse_record(ready) == ("r", ["a note"], "c", ["heapq", "json"])
    with pytest.raises(ValueError, match="unknown record"):
        zygote_wire.parse_record(b"?junk")


def test_infra_cores_split_the_pool_in_disjoint_halves() -> None:
    from arl_tangram.sandbox.config import infra_cores

    assert infra_cores([0]) is None
    assert infra_cores([]) is None
    assert infra_cores([1, 0]) == ([0], [1])
    assert infra_cores([3, 1, 2, 1]) == ([1], [2, 3])
    fork_server, http = infra_cores(list(range(8))) or ([], [])
    assert fork_server == [0, 1, 2, 3] and http == [4, 5, 6, 7]


def test_infra_affinity_is_on_by_default_and_can_be_turned_off() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args([])).infra_affinity is True
    assert config_from_args(parser.parse_args(["--no-infra-affinity"])).infra_affinity is False
