"""The generated CRDs and the samples against a real API server: what `kubectl` users will do first."""

from __future__ import annotations

import json
from pathlib import Path

from kubernetes import config as k8s_config
from operator_harness import batch_manifest, install, sa_kubeconfig
from testbed import REPO, Cluster

GROUP, VERSION = "tangram.arl.dev", "v1alpha1"


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


async def test_a_batchs_status_and_ttl_deletion_reach_only_its_own_object_not_one_made_again_under_its_name(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """A trainer reusing batch names step after step deletes a batch and makes another under its
    name. The operator's writes for the old one went by name: its results could land on the new
    batch (which then took them as final and never ran its own actions), and its TTL could delete
    the new one. Here the operator's own writes, with its ServiceAccount's token (no operator runs
    in this module, so nothing else writes), carry the old uid: the real API server refuses them (a
    uid in a patch is a precondition, as one in DeleteOptions), they are dropped as for an object
    gone, and the new batch is untouched; with its own uid the same writes land."""
    from arl_tangram.controllers.operator import OperatorSettings, OperatorState

    install(cluster)
    api = k8s_config.new_client_from_config(str(sa_kubeconfig(cluster, tmp_path / "kubeconfig")))
    state = OperatorState(OperatorSettings(namespace="tangram-system", identity="probe"), api=api)
    action = {"id": "a", "type": "code", "target": "py", "payload": {"code": "print(1)"}}

    def made() -> str:
        body = cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, "actionbatches", batch_manifest("again", [action])
        )
        return str(body["metadata"]["uid"])

    def status() -> dict[str, object]:
        body = cluster.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, "actionbatches", "again"
        )
        return dict(body.get("status") or {})

    try:
        old = made()
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches", "again")
        new = made()
        # (a None is a field left out, as in the operator's merge patches)
        written = {"observedGeneration": 1, "completionTime": "2026-01-01T00:00:00Z", "startTime": None}
        await state._patch_batch_status(namespace, "again", old, written)
        assert status() == {}, "the old batch's status was written onto the new one"
        await state._delete_batch(namespace, "again", old)
        assert status() == {}, "the old batch's TTL deleted the new one"  # (a 404 would raise here)
        await state._patch_batch_status(namespace, "again", new, written)
        assert status() == {
            "observedGeneration": 1,
            "completionTime": "2026-01-01T00:00:00Z",
            "resultBytes": 0,
        }
        await state._delete_batch(namespace, "again", new)
        gone = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "actionbatches")
        assert [b["metadata"]["name"] for b in gone["items"]] == []
    finally:
        await state.agent.close()
        api.close()
