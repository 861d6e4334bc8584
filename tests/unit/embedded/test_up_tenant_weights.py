"""``tangram up``'s scheduler weighs tenants as the operator's does, from the operator's variable."""

from __future__ import annotations

from pathlib import Path

import yaml

from arl_tangram.controllers.operator import ENVIRONMENT
from arl_tangram.dispatch.dispatcher import TENANT_WEIGHTS_ENV
from arl_tangram.embedded.specs import load
from arl_tangram.embedded.up import Embedded, listen


def test_the_variable_is_the_operators() -> None:
    assert TENANT_WEIGHTS_ENV in ENVIRONMENT


def test_the_weights_reach_the_scheduler(tmp_path: Path) -> None:
    doc = {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": "py"},
        "spec": {"template": {"image": "local", "resources": {"cpu": "1", "memory": "1Gi"}}},
    }
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(doc))
    loaded = load([str(tmp_path / "pool.yaml")], 1, 8 * 2**30)
    with listen(0) as sock:
        embedded = Embedded(loaded, (0,), tmp_path, sock, range(0), tenant_weights={"team-a": 3.0})
        assert embedded.dispatcher.scheduler.weights == {"team-a": 3.0}  # type: ignore[attr-defined]
