"""CPU manager: exclusive NUMA-local core sets, pinning by memory and load, release discipline."""

from __future__ import annotations

import pytest

from arl_tangram.core.action import Action, Fixed
from arl_tangram.errors import InvalidSpec
from arl_tangram.managers.cpu import CpuManager, SandboxHost


def act(i: int, traj: str = "t", mem: float = 1.0) -> Action:
    return Action(f"a{i}", traj, "cpu", (1, 2, 4, 8), Fixed(1.0), memory_gib=mem)


def numa_of(host: SandboxHost, cores: tuple[int, ...]) -> set[int]:
    return {i for i, node in enumerate(host.numa) for c in cores if c in node}


def test_core_sets_are_exclusive_and_numa_local_when_possible() -> None:
    host = SandboxHost.uniform("h", 16, 2, 64.0)
    mgr = CpuManager([host])
    g1 = mgr.place(act(1, "a"), 6, 0.0)
    g2 = mgr.place(act(2, "b"), 8, 0.0)
    assert g1 is not None and g2 is not None
    assert not set(g1.unit_ids) & set(g2.unit_ids)
    assert len(numa_of(host, g1.unit_ids)) == 1 and len(numa_of(host, g2.unit_ids)) == 1
    g3 = mgr.place(act(3, "c"), 2, 0.0)  # fits only in the node g1 left room in
    assert g3 is not None and numa_of(host, g3.unit_ids) == numa_of(host, g1.unit_ids)
    assert mgr.free_units() == 0
    assert mgr.place(act(4, "d"), 1, 0.0) is None


def test_spanning_numa_nodes_only_when_no_single_node_holds_it() -> None:
    host = SandboxHost.uniform("h", 8, 2, 64.0)
    mgr = CpuManager([host])
    g = mgr.place(act(1), 6, 0.0)
    assert g is not None and len(g.unit_ids) == 6 and len(numa_of(host, g.unit_ids)) == 2


def test_release_returns_cores_and_refuses_double_release() -> None:
    mgr = CpuManager([SandboxHost.uniform("h", 4, 1, 8.0)])
    g = mgr.place(act(1), 4, 0.0)
    assert g is not None
    mgr.release(g, 1.0)
    assert mgr.free_units() == 4
    with pytest.raises(ValueError, match="twice"):
        mgr.release(g, 2.0)


def test_released_cores_go_back_to_their_own_numa_node() -> None:
    host = SandboxHost.uniform("h", 8, 2, 8.0)
    mgr = CpuManager([host])
    grants = [mgr.place(act(i, f"t{i}"), k, 0.0) for i, k in enumerate((3, 5))]  # 5 spans both nodes
    for g in grants:
        assert g is not None
        mgr.release(g, 1.0)
    assert host.free == [set(node) for node in host.numa]
    with pytest.raises(ValueError, match="not on this host"):
        host.give_back([99])


def test_pinning_follows_memory_then_load_and_unpins_at_the_end() -> None:
    a = SandboxHost.uniform("a", 8, 1, 3.0)
    b = SandboxHost.uniform("b", 8, 1, 3.0)
    mgr = CpuManager([a, b])
    g1 = mgr.place(act(1, "t1", mem=2.0), 4, 0.0)
    g2 = mgr.place(act(2, "t2", mem=2.0), 1, 0.0)
    assert g1 is not None and g2 is not None and g1.host != g2.host  # balanced by free cores
    assert mgr.place(act(3, "t3", mem=2.0), 1, 0.0) is None  # no host has 2 GiB left
    mgr.end_trajectory("t1")
    assert mgr.place(act(4, "t3", mem=2.0), 1, 0.0) is not None


def test_draining_host_keeps_its_sessions_but_takes_no_new_ones() -> None:
    a = SandboxHost.uniform("a", 8, 1, 64.0)
    mgr = CpuManager([a, SandboxHost.uniform("b", 2, 1, 64.0)])
    g = mgr.place(act(1, "old"), 1, 0.0)
    assert g is not None and g.host == "a"
    a.draining = True
    assert mgr.place(act(2, "old"), 1, 0.0) is not None  # pinned session still runs there
    g_new = mgr.place(act(3, "new"), 1, 0.0)
    assert g_new is not None and g_new.host == "b"
    with pytest.raises(ValueError, match="running actions or pinned"):
        mgr.remove_host("a")


def test_bad_hosts_are_rejected_with_the_field() -> None:
    with pytest.raises(InvalidSpec, match=r"host\[x\]"):
        SandboxHost.uniform("x", 7, 2, 1.0)
    with pytest.raises(InvalidSpec, match="unique"):
        CpuManager([SandboxHost.uniform("x", 2, 1, 1.0), SandboxHost.uniform("x", 2, 1, 1.0)])


def test_a_host_takes_no_session_beyond_its_cap() -> None:
    host = SandboxHost.uniform("h0", 8, 1, 64.0)
    host.max_sessions = 2
    other = SandboxHost.uniform("h1", 2, 1, 64.0)
    mgr = CpuManager([host, other])
    grants = [
        mgr.place(Action(f"a{i}", f"t{i}", "cpu", (1,), Fixed(1.0), memory_gib=1.0), 1, 0.0) for i in range(4)
    ]
    hosts = [g.host for g in grants if g is not None]
    assert hosts.count("h0") == 2 and hosts.count("h1") == 2  # h0 had cores left, but its cap is 2
    assert mgr.place(Action("a9", "t9", "cpu", (1,), Fixed(1.0), memory_gib=1.0), 1, 0.0) is None
    # It waits for cores of h1 only: h0 takes no more sessions.
    assert mgr.session_hosts(Action("x", "tx", "cpu", (1,), Fixed(1.0), memory_gib=1.0)) == ["h1"]
