"""The uids ``tangram up`` hands to hosts' actions (and kills whatever runs under at stop): refused
below the floor or where an account, group, process or another run uses them, with a base that is
free named instead; with no base, the first free range is taken; a runtime never hands out a uid
past the range it reserved."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.domain.pools import PoolConfig, pool_config
from arl_tangram.errors import InvalidSpec
from arl_tangram.runtime import local
from arl_tangram.runtime.local import (
    DEFAULT_UID_BASE,
    MIN_UID_BASE,
    UID_BLOCK,
    LocalRuntime,
    host_uids,
    reserve_uids,
    uids_needed,
)

# Away from the integration tests' ranges (500000 up) and from other runs of this test.
BASE = 40_000_000 + (os.getpid() % 1000) * 10 * UID_BLOCK


def config(cpu: str = "1") -> PoolConfig:
    doc = {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "py", "namespace": "default", "generation": 1},
        "spec": {"template": {"image": "x", "resources": {"cpu": cpu, "memory": "1Gi"}}},
    }
    return pool_config(ActionPool.model_validate(doc), uid="u")


@pytest.mark.parametrize("base", [0, 1000, MIN_UID_BASE - 1])
def test_a_base_among_the_systems_and_peoples_uids_is_refused(base: int) -> None:
    with pytest.raises(InvalidSpec, match=f"--uid-base: {base} is below {MIN_UID_BASE}"):
        reserve_uids(base, 100)


def test_a_range_in_use_is_refused_naming_the_uid_its_user_and_a_free_base(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local, "uid_users", lambda: [(range(BASE + 7, BASE + 8), "process 4242 (sleep)")])
    with pytest.raises(InvalidSpec) as err:
        reserve_uids(BASE, 100)
    text = str(err.value)
    assert text.startswith("--uid-base:") and f"uid {BASE + 7} is used by process 4242 (sleep)" in text
    offered = re.search(r"pass --uid-base (\d+) \(free now\)", text)
    assert offered is not None, text
    # What it offers is clear of the process and in fact free (the refusal holds nothing).
    assert int(offered[1]) > BASE + 7
    reserve_uids(int(offered[1]), 100).close()


def test_a_real_account_is_seen() -> None:
    # Every machine has root; a range over uid 0 is below the floor, so ask the finder directly.
    assert any(0 in uids and "account" in who for uids, who in local.uid_users())


def test_a_process_is_seen_by_any_of_its_ids() -> None:
    mine = os.getpid()
    assert any(os.geteuid() in uids and who.startswith(f"process {mine} ") for uids, who in local.uid_users())


def test_two_runs_never_hold_the_same_uids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "uid_users", list)  # nothing else on the machine uses any uid
    first = reserve_uids(BASE, 100)
    try:
        with pytest.raises(InvalidSpec, match="another tangram up on this machine holds uids"):
            reserve_uids(BASE + 50, 100)
        monkeypatch.setattr(local, "DEFAULT_UID_BASE", BASE)
        second = reserve_uids(None, 100)
        try:
            assert second.uids.start >= first.uids.stop
        finally:
            second.close()
    finally:
        first.close()
    reserve_uids(BASE, 100).close()  # released at close


def test_with_no_base_the_first_free_range_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    used = range(DEFAULT_UID_BASE, DEFAULT_UID_BASE + 3 * UID_BLOCK + 5)
    monkeypatch.setattr(local, "uid_users", lambda: [(used, "alice's subordinate ids (/etc/subuid)")])
    taken = reserve_uids(None, 300)
    try:
        assert taken.uids.start >= used.stop and taken.uids.start % UID_BLOCK == 0
        assert len(taken.uids) == 300
    finally:
        taken.close()


def test_hosts_fit_in_what_is_needed_however_they_come_and_go(tmp_path: Path) -> None:
    small, big = config("1"), config("2")
    cores = 4
    need = uids_needed([small, big], cores)
    runtime = LocalRuntime(tmp_path, range(cores), uid_base=BASE, uid_stop=BASE + need)
    # First fit at its worst: narrow hosts with gaps between them, then a wide one.
    taken: list[range] = []
    for width in (small, small, small):
        uids = runtime._uid_range(width)
        assert uids is not None
        taken.append(uids)
        runtime._hosts[f"h{len(taken)}"] = _placeholder(uids, f"h{len(taken)}")
    del runtime._hosts["h2"]
    uids = runtime._uid_range(big)
    assert uids is not None and uids.stop <= BASE + need
    assert host_uids(big) == len(uids)


def test_a_runtime_starts_no_host_past_its_reserved_uids(tmp_path: Path) -> None:
    pool = config("1")
    runtime = LocalRuntime(tmp_path, [0], uid_base=BASE, uid_stop=BASE + host_uids(pool) - 1)
    asyncio.run(runtime.create_host(pool, "py-a", None))
    assert runtime.started == [], "its stop would kill what runs under uids not reserved"
    [waiting] = runtime.hosts(pool.key)  # not dropped: it waits, saying why
    assert waiting.phase == "starting" and waiting.pending and "do not fit below" in waiting.pending


def _placeholder(uids: range, name: str) -> local.LocalHost:
    host = object.__new__(local.LocalHost)
    host.uids = uids
    host.name = name
    return host
