"""The generated CRDs and the samples against a real API server: what `kubectl` users will do first."""

from __future__ import annotations

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
