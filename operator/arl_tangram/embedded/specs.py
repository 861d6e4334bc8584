"""The YAML ``tangram up`` reads: the same ActionPool and RewardModelService objects a cluster takes.

Files (or directories of ``*.yaml``/``*.yml``) may hold several documents and ``kind: List``
objects; every object is validated with the API models, and a bad one is an error naming the file,
the document and the field. Objects of other kinds (an ActionBatch, a Kustomization) are reported
and skipped: they are not specs of what ``tangram up`` runs.

A pool's hosts must fit this machine: a host asking for more cores than ``tangram up`` was given is
run with the cores there are (and the output says so), since a laptop cannot hold the 16-core hosts
a cluster's sample asks for; every other field is used as written.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from arl_tangram.api.actionpool import ActionPool
from arl_tangram.api.meta import API_VERSION
from arl_tangram.api.rewardmodelservice import RewardModelService
from arl_tangram.api.validation import invalid_spec
from arl_tangram.domain.pools import pool_config, whole_cores
from arl_tangram.errors import InvalidSpec

DEFAULT_NAMESPACE = "default"
SERVED_KINDS = ("ActionPool", "RewardModelService")


@dataclass(frozen=True)
class Loaded:
    """What the files declared: pool bodies (plain dicts, as the API server would hand them to the
    controller), reward services, and one line per object skipped or changed to fit."""

    pools: tuple[dict[str, Any], ...]
    services: tuple[RewardModelService, ...]
    notes: tuple[str, ...]


def _files(paths: Sequence[str]) -> Iterator[Path]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
            if not found:
                raise InvalidSpec(raw, "the directory holds no .yaml or .yml file")
            yield from found
        elif path.is_file():
            yield path
        else:
            raise InvalidSpec(raw, "no such file or directory")


def _documents(path: Path) -> Iterator[tuple[str, Mapping[str, Any]]]:
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidSpec(str(path), f"cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidSpec(str(path), f"not valid YAML: {exc}") from None
    for i, doc in enumerate(docs):
        where = f"{path} (document {i + 1})"
        if doc is None:
            continue
        if not isinstance(doc, Mapping):
            raise InvalidSpec(where, f"a Kubernetes object must be a mapping, got {type(doc).__name__}")
        if doc.get("kind") == "List":
            for j, item in enumerate(doc.get("items") or ()):
                if not isinstance(item, Mapping):
                    raise InvalidSpec(f"{where} items[{j}]", "a Kubernetes object must be a mapping")
                yield f"{where} items[{j}]", item
        else:
            yield where, doc


def load(paths: Sequence[str], machine_cores: int, machine_memory_bytes: int) -> Loaded:
    """Read and validate every object in ``paths``; raises :class:`InvalidSpec` naming the culprit."""
    if not paths:
        raise InvalidSpec("-f", "name at least one file or directory of ActionPool/RewardModelService YAML")
    pools: list[dict[str, Any]] = []
    services: list[RewardModelService] = []
    notes: list[str] = []
    seen: dict[tuple[str, str, str], str] = {}
    for path in _files(paths):
        for where, doc in _documents(path):
            kind = doc.get("kind")
            if kind not in SERVED_KINDS:
                notes.append(
                    f"{where}: {kind or 'an object without kind'} skipped (tangram up runs "
                    f"{' and '.join(SERVED_KINDS)}; post actions through the gateway)"
                )
                continue
            if doc.get("apiVersion") != API_VERSION:
                raise InvalidSpec(
                    f"{where} apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}"
                )
            body = _with_namespace(doc)
            meta = body["metadata"]
            ident = (str(kind), meta["namespace"], str(meta.get("name")))
            if ident in seen:
                raise InvalidSpec(
                    where, f"{kind} {ident[1]}/{ident[2]} is declared twice (first in {seen[ident]})"
                )
            seen[ident] = where
            if kind == "ActionPool":
                pool, note = _fit_pool(body, where, machine_cores, machine_memory_bytes)
                pools.append(pool)
                notes.extend(note)
            else:
                services.append(_validate(RewardModelService, body, where))
    if not pools and not services:
        raise InvalidSpec(" ".join(paths), "declares no ActionPool and no RewardModelService")
    return Loaded(tuple(pools), tuple(services), tuple(notes))


def _with_namespace(doc: Mapping[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(dict(doc))
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", DEFAULT_NAMESPACE)
    meta.setdefault("generation", 1)
    meta.setdefault("uid", f"local-{meta['namespace']}-{meta.get('name')}")
    body["metadata"] = meta
    body.pop("status", None)  # status is ours to write
    return body


def _validate(model: type[Any], body: Mapping[str, Any], where: str) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidSpec(f"{where} {invalid_spec(exc).field}", invalid_spec(exc).message) from None


def _fit_pool(
    body: dict[str, Any], where: str, machine_cores: int, machine_memory_bytes: int
) -> tuple[dict[str, Any], list[str]]:
    """The pool as written, validated; hosts larger than the machine are shrunk to it (noted)."""
    model: ActionPool = _validate(ActionPool, body, where)
    try:
        cfg = pool_config(model, uid=body["metadata"]["uid"])
    except InvalidSpec as exc:
        raise InvalidSpec(f"{where} {exc.field}", exc.message) from None
    notes = []
    resources = body["spec"]["template"]["resources"]
    cores = whole_cores(str(resources["cpu"]), "spec.template.resources.cpu")
    name = f"ActionPool {cfg.key}"
    if cores > machine_cores:
        resources["cpu"] = str(machine_cores)
        notes.append(
            f"{name}: hosts of {cores} cores do not fit the {machine_cores} given to tangram up; "
            f"each local host gets {machine_cores}"
        )
    if cfg.host_memory_bytes > machine_memory_bytes:
        resources["memory"] = str(machine_memory_bytes)
        notes.append(
            f"{name}: hosts of {cfg.host_memory_bytes >> 20} MiB do not fit this machine's "
            f"{machine_memory_bytes >> 20} MiB; each local host gets all of it"
        )
    limits = body["spec"].get("limits") or {}
    if int(limits.get("maxCores", 0) or 0) > machine_cores:
        limits["maxCores"] = machine_cores
    return body, notes


def pool_names(pools: Iterable[Mapping[str, Any]]) -> list[str]:
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pools]
