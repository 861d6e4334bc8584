# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Fixtures of the reliability suite: the e2e tier's test bed and namespaces (its conftest, loaded
under another name), an operator of two replicas per module, and the split between what `make test`
runs and what only `make test-chaos` runs.

Every test here is marked ``reliability`` (run alone: ``pytest -m reliability tests/reliability``)
and ``e2e`` (it needs the test bed). Tests marked ``chaos_long`` run only when TANGRAM_CHAOS=1, which
``make test-chaos`` sets; `make test` skips them with a reason naming that target.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

_spec = importlib.util.spec_from_file_location("tangram_e2e_conftest", E2E / "conftest.py")
assert _spec is not None and _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)

from operator_harness import Operator, install, sa_kubeconfig  # noqa: E402
from testbed import REPO, Cluster  # noqa: E402

cluster = _e2e.cluster
namespace = _e2e.namespace
_dump_on_failure = _e2e._dump_on_failure
pytest_runtest_makereport = _e2e.pytest_runtest_makereport

CHAOS = os.environ.get("TANGRAM_CHAOS", "") not in ("", "0")


def pytest_collection_finish(session: pytest.Session) -> None:
    """The e2e tier's build of the control plane (first run only), before any test here starts."""
    _e2e.E2E_DIR = HERE  # this private copy of the e2e conftest looks for this directory's items
    _e2e.pytest_collection_finish(session)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test bed this copy of the e2e conftest started is stopped, even where no test here ran."""
    _e2e._stop_testbed_we_started()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "chaos_long: part of the reliability suite that only `make test-chaos` runs"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="long reliability scenario: run it with `make test-chaos`")
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.reliability)
            item.add_marker(pytest.mark.e2e)
            if not CHAOS and item.get_closest_marker("chaos_long"):
                item.add_marker(skip)


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """Two replicas of ``tangram operator`` with the operator ServiceAccount's token."""
    install(cluster)
    work = tmp_path_factory.mktemp("operator")
    op = Operator(cluster, work, sa_kubeconfig(cluster, work / "kubeconfig"))
    op.start("op-a")
    op.start("op-b")
    try:
        yield op
    finally:
        op.stop_all()
        dest = REPO / "artifacts" / "reliability" / "operator"
        dest.mkdir(parents=True, exist_ok=True)
        for log in sorted(work.glob("*.log")):
            (dest / log.name).write_text(log.read_text())
