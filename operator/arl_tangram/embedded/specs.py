"""The YAML ``tangram up`` reads: the same ActionPool and RewardModelService objects a cluster takes.

Files (or directories of ``*.yaml``, ``*.yml`` and ``*.json``, in any case; a file named twice is
read once) may hold several documents and ``kind: List`` objects; every object is validated with the
API models, and a bad one is an error naming the file, the document and the field. Objects of other
kinds (an ActionBatch, a Kustomization) are reported and skipped: they are not specs of what
``tangram up`` runs; an object of this API group whose kind is none of its kinds (a typo) is refused.

A pool's hosts must fit this machine: a host asking for more cores than ``tangram up`` was given, or
more memory than the machine has, is run with what there is (and the output says so), since a laptop
cannot hold the 16-core hosts a cluster's sample asks for; an action's limits (``maxCores``,
``memory``) shrink with the host that holds them. Every other field is used as written.

Names and namespaces are held to what the API server takes (DNS-1123 subdomain and label): the
gateway refuses any other, so a pool named otherwise would run and never be reachable.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from arl_tangram.api.actionpool import MAX_POOL_NAME_LENGTH, ActionPool
from arl_tangram.api.meta import API_VERSION, DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN, GROUP
from arl_tangram.api.quantity import quantity_bytes
from arl_tangram.api.rewardmodelservice import MAX_SERVICE_NAME_LENGTH, RewardModelService
from arl_tangram.api.validation import KINDS, invalid_spec
from arl_tangram.domain.pools import pool_config
from arl_tangram.errors import InvalidSpec

DEFAULT_NAMESPACE = "default"
# The API server's rule for a namespace: a DNS-1123 label.
MAX_NAMESPACE_LENGTH = 63
SERVED_KINDS = ("ActionPool", "RewardModelService")
# The longest name of each kind (a label value on its pods); the gateway takes no longer one either.
MAX_NAME_LENGTHS = {"ActionPool": MAX_POOL_NAME_LENGTH, "RewardModelService": MAX_SERVICE_NAME_LENGTH}


@dataclass(frozen=True)
class Loaded:
    """What the files declared: pool bodies (plain dicts, as the API server would hand them to the
    controller), reward services, and one line per object skipped or changed to fit."""

    pools: tuple[dict[str, Any], ...]
    services: tuple[RewardModelService, ...]
    notes: tuple[str, ...]


# What a directory is scanned for, as ``kubectl apply -f DIR`` (JSON is YAML too); in any case, as
# files written on case-insensitive file systems often are (``POOL.YAML``).
SPEC_SUFFIXES = (".yaml", ".yml", ".json")


def _files(paths: Sequence[str]) -> Iterator[Path]:
    """Each file ``paths`` name, once: a file named twice (``-f dir -f dir/b.yaml``, or by a link)
    is one declaration, read once, not two declaring every object in it twice."""
    seen: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in SPEC_SUFFIXES and p.is_file())
            if not found:
                raise InvalidSpec(raw, "the directory holds no .yaml, .yml or .json file")
        elif path.exists():
            # A regular file, or a pipe or device, as ``-f <(generate-specs)`` or ``-f /dev/stdin``
            # give: read as a file is (they were refused as "no such file").
            found = [path]
        else:
            raise InvalidSpec(raw, "no such file or directory")
        for file in found:
            real = file.resolve()
            if real not in seen:
                seen.add(real)
                yield file


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
            items = doc.get("items") or ()
            if not isinstance(items, list):
                raise InvalidSpec(
                    f"{where} items", f"a List's items must be a list of objects, got {type(items).__name__}"
                )
            for j, item in enumerate(items):
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
            _check_kind(doc, where)
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
            body = _with_namespace(doc, where, MAX_NAME_LENGTHS[str(kind)])
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


def _check_kind(doc: Mapping[str, Any], where: str) -> None:
    """An object of this project's API group must be one of its kinds: a misspelt ``kind`` (say
    ``ActionPol``) was skipped like a Kustomization, and, beside other files, its pool never ran
    with nothing but a note among the start-up lines saying so."""
    api_version = doc.get("apiVersion")
    if not (isinstance(api_version, str) and api_version.partition("/")[0] == GROUP):
        return
    kind = doc.get("kind")
    if kind in KINDS:
        return
    near = difflib.get_close_matches(str(kind), list(KINDS), n=1, cutoff=0.5)
    raise InvalidSpec(
        f"{where} kind",
        f"{kind!r} is no kind of {GROUP}"
        + (f": did you mean {near[0]!r}?" if near else f" (its kinds: {', '.join(KINDS)})"),
    )


def _with_namespace(doc: Mapping[str, Any], where: str, longest_name: int) -> dict[str, Any]:
    body = copy.deepcopy(dict(doc))
    raw = body.get("metadata") or {}
    if not isinstance(raw, Mapping):
        raise InvalidSpec(
            f"{where} metadata", f"must be a mapping with a name (and a namespace), got {type(raw).__name__}"
        )
    meta = dict(raw)
    if meta.get("namespace") is None:
        meta["namespace"] = DEFAULT_NAMESPACE
    _check_name(meta, "namespace", DNS_LABEL_PATTERN, MAX_NAMESPACE_LENGTH, "DNS-1123 label", where)
    if "name" in meta:  # a missing name is the model's error to report
        _check_name(meta, "name", DNS_SUBDOMAIN_PATTERN, longest_name, "DNS-1123 subdomain", where)
    meta.setdefault("generation", 1)
    meta.setdefault("uid", f"local-{meta['namespace']}-{meta.get('name')}")
    body["metadata"] = meta
    body.pop("status", None)  # status is ours to write
    return body


def _check_name(meta: Mapping[str, Any], key: str, pattern: str, longest: int, what: str, where: str) -> None:
    """The API server refuses any other name (and so does the gateway, for a request naming it)."""
    value = meta[key]
    if not (isinstance(value, str) and len(value) <= longest and re.fullmatch(pattern, value)):
        raise InvalidSpec(
            f"{where} metadata.{key}",
            f"{value!r} is not a Kubernetes {key}: a {what} (lower-case letters, digits and '-'"
            f"{', and dots between' if what.endswith('subdomain') else ''}, starting and ending with a "
            f"letter or digit, at most {longest} characters), e.g. {_suggest(value)!r}",
        )


def _suggest(value: object) -> str:
    fixed = re.sub(r"[^a-z0-9-]+", "-", str(value).lower()).strip("-")
    return fixed[:MAX_NAMESPACE_LENGTH].rstrip("-") or "default"


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
    # The model's values, defaults included: the body may leave out what they fill in.
    spec = body["spec"]
    resources = spec["template"].get("resources") or {}
    name = f"ActionPool {cfg.key}"
    if cfg.host_cores > machine_cores:
        resources["cpu"] = str(machine_cores)
        notes.append(
            f"{name}: hosts of {cfg.host_cores} cores do not fit the {machine_cores} given to tangram up; "
            f"each local host gets {machine_cores}"
        )
    limits = spec.get("limits") or {}
    if cfg.host_memory_bytes > machine_memory_bytes:
        resources["memory"] = str(machine_memory_bytes)
        note = (
            f"{name}: hosts of {cfg.host_memory_bytes >> 20} MiB do not fit this machine's "
            f"{machine_memory_bytes >> 20} MiB; each local host gets all of it"
        )
        # An action may not have more memory than its host (the model's rule on limits.memory).
        action_memory = quantity_bytes(model.spec.limits.memory)
        if action_memory > machine_memory_bytes:
            limits["memory"] = str(machine_memory_bytes)
            note += f", and each action at most that too (limits.memory was {action_memory >> 20} MiB)"
        notes.append(note)
    if "maxCores" in limits and model.spec.limits.max_cores > machine_cores:
        limits["maxCores"] = machine_cores
    if resources:
        spec["template"]["resources"] = resources
    if limits:
        spec["limits"] = limits
    return body, notes


def pool_names(pools: Iterable[Mapping[str, Any]]) -> list[str]:
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pools]
