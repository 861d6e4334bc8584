"""What ``tangram up`` reads: the cluster's YAML, validated by the API models, bad objects named by
file, document and field; other kinds skipped with a note; hosts larger than the machine shrunk
to it (with a note), everything else as written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.embedded.specs import load
from arl_tangram.errors import InvalidSpec

GIB = 1 << 30
SAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "samples"


def pool(name: str = "py", cpu: str = "2", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "ActionPool",
        "metadata": {"name": name},
        "spec": {"template": {"image": "x", "resources": {"cpu": cpu, "memory": "1Gi"}}, **spec},
    }


def write(tmp_path: Path, *docs: Any, name: str = "specs.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs))
    return path


def test_the_samples_load_shrunk_to_a_small_machine() -> None:
    loaded = load([str(SAMPLES)], machine_cores=2, machine_memory_bytes=8 * GIB)
    (body,) = loaded.pools
    assert body["metadata"]["namespace"] == "default"
    assert body["spec"]["template"]["resources"]["cpu"] == "2"
    assert body["spec"]["limits"]["maxCores"] == 2
    assert body["spec"]["scaling"]["maxHosts"] == 16, "everything but the host's size is as written"
    assert [s.metadata.name for s in loaded.services] == ["skywork-reward-small"]
    notes = "\n".join(loaded.notes)
    assert "hosts of 16 cores do not fit the 2" in notes and "ActionBatch skipped" in notes


def test_a_pool_that_fits_is_left_as_written(tmp_path: Path) -> None:
    loaded = load([str(write(tmp_path, pool(cpu="2")))], machine_cores=4, machine_memory_bytes=8 * GIB)
    assert loaded.pools[0]["spec"]["template"]["resources"] == {"cpu": "2", "memory": "1Gi"}
    assert loaded.notes == ()


def test_lists_and_several_files_and_namespaces(tmp_path: Path) -> None:
    other = pool("b")
    other["metadata"]["namespace"] = "team-b"
    listed = write(tmp_path, {"apiVersion": "v1", "kind": "List", "items": [pool("a"), other]}, name="l.yaml")
    single = write(tmp_path, pool("c"), name="c.yaml")
    loaded = load([str(listed), str(single)], machine_cores=2, machine_memory_bytes=8 * GIB)
    keys = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in loaded.pools]
    assert keys == ["default/a", "team-b/b", "default/c"]


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        (pool(cpu="1500m"), "spec.template.resources.cpu"),
        ({**pool(), "spec": {"template": {"image": "x"}, "scaling": {"maxHost": 2}}}, "maxHost"),
        ({**pool(), "apiVersion": "tangram.arl.dev/v1"}, "apiVersion"),
        (["not", "an", "object"], "must be a mapping"),
    ],
)
def test_bad_objects_are_named(tmp_path: Path, doc: Any, names: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(InvalidSpec) as err:
        load([str(path)], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert names in str(err.value) and str(path) in str(err.value)


def test_twice_the_same_pool_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, pool("a"), pool("a"))
    with pytest.raises(InvalidSpec, match="declared twice"):
        load([str(path)], machine_cores=2, machine_memory_bytes=8 * GIB)


def test_a_directory_yields_its_specs_whatever_the_case_of_their_suffix(tmp_path: Path) -> None:
    """``POOL.YAML`` (as written on a case-insensitive file system) was skipped without a word, and a
    directory holding only such files was refused as holding none."""
    write(tmp_path, pool("upper"), name="UPPER.YAML")
    write(tmp_path, pool("mixed"), name="mixed.Yml")
    (tmp_path / "json.json").write_text(json.dumps(pool("json")))
    (tmp_path / "notes.txt").write_text("not a spec")
    loaded = load([str(tmp_path)], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert sorted(p["metadata"]["name"] for p in loaded.pools) == ["json", "mixed", "upper"]


def test_a_file_named_twice_is_read_once(tmp_path: Path) -> None:
    """``-f dir -f dir/b.yaml`` (or a link to it) names one file twice: one declaration, not two."""
    specs = tmp_path / "specs"
    specs.mkdir()
    b = write(specs, pool("b"), name="b.yaml")
    (tmp_path / "link.yaml").symlink_to(b)
    loaded = load([str(specs), str(b), str(tmp_path / "link.yaml")], 2, 8 * GIB)
    assert [p["metadata"]["name"] for p in loaded.pools] == ["b"]
    other = write(tmp_path, pool("b"), name="other.yaml")  # a second file declaring it still clashes
    with pytest.raises(InvalidSpec, match="declared twice"):
        load([str(specs), str(other)], 2, 8 * GIB)


def test_nothing_to_run_and_missing_paths_are_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="no such file"):
        load([str(tmp_path / "missing.yaml")], 2, 8 * GIB)
    with pytest.raises(InvalidSpec, match=r"no \.yaml"):
        load([str(tmp_path)], 2, 8 * GIB)
    batch_only = write(tmp_path, {"apiVersion": "tangram.arl.dev/v1alpha1", "kind": "ActionBatch"})
    with pytest.raises(InvalidSpec, match="declares no ActionPool"):
        load([str(batch_only)], 2, 8 * GIB)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("a: [1, 2\n")
    with pytest.raises(InvalidSpec, match="not valid YAML"):
        load([str(bad_yaml)], 2, 8 * GIB)


@pytest.mark.parametrize("template", [{"image": "x"}, {"image": "x", "resources": {"memory": "1Gi"}}])
def test_a_pool_leaving_resources_to_their_defaults_loads(tmp_path: Path, template: dict[str, Any]) -> None:
    doc = pool()
    doc["spec"]["template"] = template
    loaded = load([str(write(tmp_path, doc))], machine_cores=2, machine_memory_bytes=32 * GIB)
    # The model's default host (8 cores) is shrunk to the machine like a written one.
    assert loaded.pools[0]["spec"]["template"]["resources"]["cpu"] == "2"
    assert "hosts of 8 cores do not fit the 2" in "\n".join(loaded.notes)


def test_an_actions_memory_shrinks_with_a_host_larger_than_the_machine(tmp_path: Path) -> None:
    doc = pool(cpu="1", limits={"memory": "512Gi"})
    doc["spec"]["template"]["resources"]["memory"] = "1Ti"
    loaded = load([str(write(tmp_path, doc))], machine_cores=2, machine_memory_bytes=8 * GIB)
    spec = loaded.pools[0]["spec"]
    assert spec["template"]["resources"]["memory"] == spec["limits"]["memory"] == str(8 * GIB)
    assert "limits.memory was 524288 MiB" in "\n".join(loaded.notes)
    # What the controller validates again: the shrunk pool must still be a valid one.
    ActionPool.model_validate(loaded.pools[0])


def test_an_actions_memory_that_fits_is_left_as_written(tmp_path: Path) -> None:
    doc = pool(cpu="1", limits={"memory": "2Gi"})
    doc["spec"]["template"]["resources"]["memory"] = "1Ti"
    loaded = load([str(write(tmp_path, doc))], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert loaded.pools[0]["spec"]["limits"]["memory"] == "2Gi"


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({**pool(), "metadata": "foo"}, "(document 1) metadata:"),
        ({**pool(), "metadata": [1, 2]}, "(document 1) metadata:"),
        ({"apiVersion": "v1", "kind": "List", "items": 5}, "(document 1) items:"),
        (pool(name="Py_Pool"), "(document 1) metadata.name:"),
        (pool(name="py.pool_x"), "(document 1) metadata.name:"),
        ({**pool(), "metadata": {"name": "x", "namespace": "Team_B"}}, "(document 1) metadata.namespace:"),
        ({**pool(), "metadata": {"name": "x", "namespace": "team.b"}}, "(document 1) metadata.namespace:"),
    ],
)
def test_malformed_metadata_and_names_kubernetes_refuses_are_named(
    tmp_path: Path, doc: Any, field: str
) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(InvalidSpec) as err:
        load([str(path)], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert f"{path} {field}" in str(err.value)


def test_a_refused_name_comes_with_one_that_would_do(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpec, match="'py-pool'"):
        load([str(write(tmp_path, pool(name="Py_Pool")))], machine_cores=2, machine_memory_bytes=8 * GIB)


def test_dotted_names_and_dashed_namespaces_load(tmp_path: Path) -> None:
    doc = pool(name="py.v2")
    doc["metadata"]["namespace"] = "team-b"
    loaded = load([str(write(tmp_path, doc))], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert loaded.pools[0]["metadata"]["name"] == "py.v2"


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("ActionPol", "did you mean 'ActionPool'?"),
        ("actionpool", "did you mean 'ActionPool'?"),
        (None, "its kinds:"),
    ],
)
def test_a_misspelt_kind_of_this_api_group_is_refused_not_skipped(
    tmp_path: Path, kind: str | None, said: str
) -> None:
    """Beside a valid pool (a directory of specs) the misspelt one was skipped with a note: its pool
    never ran, and nothing stopped."""
    typo = pool("b")
    typo["kind"] = kind
    path = write(tmp_path, pool("a"), typo)
    with pytest.raises(InvalidSpec) as err:
        load([str(path)], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert f"{path} (document 2) kind:" in str(err.value) and said in str(err.value)


def test_objects_of_other_api_groups_are_still_skipped(tmp_path: Path) -> None:
    other = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    loaded = load([str(write(tmp_path, pool("a"), other))], machine_cores=2, machine_memory_bytes=8 * GIB)
    assert "Kustomization skipped" in "\n".join(loaded.notes)


def test_specs_from_a_pipe_load(tmp_path: Path) -> None:
    """``tangram up -f <(generate-specs)`` names a pipe (``/dev/fd/N``): it loads as a file does.
    It was refused as "no such file or directory", which it is not."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, yaml.safe_dump(pool("piped")).encode())
        os.close(write_end)
        loaded = load([f"/dev/fd/{read_end}"], 2, 8 * GIB)
    finally:
        os.close(read_end)
    assert [p["metadata"]["name"] for p in loaded.pools] == ["piped"]
