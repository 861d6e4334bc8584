"""The generated CRDs and the samples against a real API server: what `kubectl` users will do first."""

from __future__ import annotations

import json

from testbed import REPO, Cluster


def test_kubectl_apply_dry_run_accepts_the_crds(cluster: Cluster) -> None:
    for mode in ("client", "server"):
        out = cluster.kubectl("apply", f"--dry-run={mode}", "-f", str(REPO / "crds")).stdout
        assert out.count("customresourcedefinition.apiextensions.k8s.io/") == 3, out


def test_every_sample_is_accepted_and_listed_under_the_tangram_category(
    cluster: Cluster, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "manifests" / "samples"))
    listed = cluster.kubectl("get", "tangram", "-n", namespace, "-o", "name").stdout.split()
    kinds = sorted(name.split("/")[0].split(".")[0] for name in listed)
    assert kinds == ["actionbatch", "actionpool", "rewardmodelservice"], listed


def test_kubectl_explain_shows_the_field_descriptions(cluster: Cluster) -> None:
    out = cluster.kubectl("explain", "actionpools.spec.scaling").stdout
    assert "DESCRIPTION" in out
    assert "maxHosts" in out


def test_an_actionbatchs_actions_cannot_change_but_its_ttl_can(cluster: Cluster, namespace: str) -> None:
    """The operator runs the actions it accepted: an edit was stored and ignored until a restart,
    which then ran it in a batch already Complete. The API server refuses it, saying why."""
    batch = (
        "apiVersion: tangram.arl.dev/v1alpha1\nkind: ActionBatch\nmetadata: {name: fixed}\n"
        "spec:\n  actions:\n  - {id: a, type: code, target: py, payload: {code: 'print(1)'}}\n"
    )
    cluster.kubectl("create", "-n", namespace, "-f", "-", stdin=batch)
    action = {"id": "b", "type": "code", "target": "py", "payload": {"code": "2"}}
    added = json.dumps([{"op": "add", "path": "/spec/actions/-", "value": action}])
    for patch in (added, '[{"op": "replace", "path": "/spec/retryPolicy/maxRetries", "value": 5}]'):
        refused = cluster.kubectl(
            "patch", "-n", namespace, "actionbatch", "fixed", "--type=json", "-p", patch, check=False
        )
        assert refused.returncode != 0
        assert "cannot change once the ActionBatch exists" in refused.stderr, refused.stderr
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "actionbatch",
        "fixed",
        "--type=merge",
        "-p",
        '{"spec": {"ttlSecondsAfterFinished": 60}}',
    )
    got = cluster.kubectl(
        "get", "-n", namespace, "actionbatch", "fixed", "-o", "jsonpath={.spec.ttlSecondsAfterFinished}"
    )
    assert got.stdout == "60"
