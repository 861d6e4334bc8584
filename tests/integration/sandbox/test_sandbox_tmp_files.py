"""Each action's private /tmp and /dev/shm bound their files as well as their bytes. tmpfs counts
bytes only, and an empty file costs the kernel about a kilobyte that no size counts (300,000 of them
in a 64 MB tmpfs took 255 MB of this machine's memory, measured): without a bound, one action's empty
files could take gigabytes of its host's memory, and the kubelet would kill the host with every
action on it. Real agents, real actions, real tmpfs mounts (this machine's kernel)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import requests
from sandbox_agent_harness import C_BUILT, Agent, start_agent, stop_agent

from arl_tangram.api.actionpool import WORKDIR_BYTES_PER_FILE
from arl_tangram.sandbox import child
from arl_tangram.sandbox.workfiles import WORKDIR_MIN_FILES, workdir_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="private /tmp mounts need root")

MEMORY_MB = 256  # the agent's default memory per action: the size of each private /tmp and /dev/shm
FILES = workdir_files(MEMORY_MB)  # 16,384: one per 16 KiB, above the floor of 4,096
# Empty files in /tmp, then in /dev/shm, until one cannot be made (or twice as many as may be, so
# that a bound that does not hold fails the test without filling the machine).
MANY = f"""
import errno, json, os
seen = {{}}
for d in ("/tmp", "/dev/shm"):
    made, why = 0, "never stopped"
    try:
        while made < {2 * FILES}:
            os.close(os.open(f"{{d}}/e{{made}}", os.O_CREAT | os.O_WRONLY, 0o600))
            made += 1
    except OSError as exc:
        why = errno.errorcode[exc.errno]
    seen[d] = [why, made, os.statvfs(d).f_files]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module", params=["c", "python"])
def agent(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """An agent on each zygote loop: a session's interpreter makes its /tmp and /dev/shm in its own
    child, which is the C zygote's code (``private_tmp`` in _zygote.c) or the Python loop's."""
    if request.param == "c" and not C_BUILT:
        pytest.skip("the C fork loop is not built here (no C compiler at install)")
    root = tmp_path_factory.mktemp(f"tmpfiles-{request.param}") / "work"
    running = start_agent(root, "--memory-mb", str(MEMORY_MB), "--fork-loop", request.param)
    yield running
    stop_agent(running)


def _stopped_at_the_bound(body: dict[str, object], files: int = FILES) -> dict[str, list[object]]:
    """What ``MANY`` saw: in /tmp and in /dev/shm, ENOSPC a few files short of ``files``."""
    assert body["exit_code"] == 0, body
    seen: dict[str, list[object]] = json.loads(str(body["stdout"]))
    for d in ("/tmp", "/dev/shm"):
        why, made, bound = seen[d]
        assert (why, bound) == ("ENOSPC", files), seen
        # The root directory and the path to the workdir root's mount point (where it lies below)
        # take a few of them.
        assert isinstance(made, int) and files - 16 <= made < files, seen
    return seen


def test_an_actions_empty_files_stop_at_the_bound_in_tmp_and_in_shm(agent: Agent) -> None:
    assert FILES > WORKDIR_MIN_FILES  # the size's rule is what is held, not only the floor
    seen = _stopped_at_the_bound(agent.execute(MANY, timeout_s=60))
    # The namespace it filled is not given to another action: the next has all its room.
    assert _stopped_at_the_bound(agent.execute(MANY, timeout_s=60)) == seen


def test_a_sessions_interpreter_has_the_bound_of_its_own_memory(agent: Agent) -> None:
    """A persistent session's interpreter makes its /tmp and /dev/shm in its own child (the C
    zygote's ``private_tmp``, or the Python loop's), not ahead as an action's are, sized by the
    session's memory limit: its files are bounded by that."""
    memory_mb = MEMORY_MB // 2
    made = agent.post("/v1/sessions", {"persistent": True, "memory_mb": memory_mb})
    assert made.status_code in (200, 201), made.text
    sid = made.json()["session_id"]
    try:
        _stopped_at_the_bound(agent.execute(MANY, timeout_s=60, session_id=sid), workdir_files(memory_mb))
    finally:
        requests.delete(f"{agent.url}/v1/sessions/{sid}", timeout=30)


def test_the_bound_follows_the_size() -> None:
    child.set_tmp_files(WORKDIR_BYTES_PER_FILE, WORKDIR_MIN_FILES)
    try:
        assert child.tmp_options(0) == "mode=1777"  # no size, no bound: the kernel's defaults
        assert child.tmp_options(1 << 30) == f"size={1 << 30},nr_inodes={workdir_files(1024)},mode=1777"
        assert child.tmp_options(1 << 20) == f"size={1 << 20},nr_inodes={WORKDIR_MIN_FILES},mode=1777"
    finally:
        child.set_tmp_files(0, 0)


@pytest.mark.skipif(not C_BUILT, reason="the C fork loop is not built here (no C compiler at install)")
def test_the_c_loop_mounts_what_the_python_loop_mounts() -> None:
    """The C zygote makes an action's /tmp and /dev/shm itself where no namespace was made ahead:
    its options are those of ``child.tmp_options``, for any size an action's memory may be."""
    from arl_tangram.sandbox import _zygote  # type: ignore[attr-defined]

    sizes = [0, 1, 4095, 1 << 20, WORKDIR_BYTES_PER_FILE * WORKDIR_MIN_FILES + 1, 3 << 30, (1 << 40) + 12345]
    for rule in ((WORKDIR_BYTES_PER_FILE, WORKDIR_MIN_FILES), (0, 0), (4096, 1), (WORKDIR_BYTES_PER_FILE, 0)):
        child.set_tmp_files(*rule)
        _zygote.set_tmp_files(*rule)
        try:
            assert [_zygote.tmp_options(s) for s in sizes] == [child.tmp_options(s) for s in sizes], rule
        finally:
            child.set_tmp_files(0, 0)
            _zygote.set_tmp_files(0, 0)
    with pytest.raises(ValueError, match="negative"):
        _zygote.set_tmp_files(-1, 0)
