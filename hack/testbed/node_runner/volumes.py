"""A pod's volumes made real as directories in its pod directory: emptyDir, hostPath, configMap,
secret, downwardAPI and projected (service-account token, ConfigMaps, Secrets, downward API)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .api import Json
from .podspec import Lookup

# token(audience or None, expirationSeconds) -> a token for the pod's service account (TokenRequest).
TokenSource = Callable[[str | None, int], str]
# A volume: its host directory and whether containers see it read-only.
Volumes = dict[str, tuple[Path, bool]]


def write_files(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)


def select_items(data: dict[str, str], items: list[Json] | None) -> dict[str, bytes | str]:
    """All keys of a ConfigMap or Secret as files, or only `items` (key -> path) when given."""
    if not items:
        return dict(data)
    return {it["path"]: data[it["key"]] for it in items if it["key"] in data}


def projected_files(
    spec: Json, lookup: Lookup, field: Callable[[str], str], token: TokenSource
) -> dict[str, bytes | str]:
    """The files of a projected volume, source by source (later sources win on the same path)."""
    files: dict[str, bytes | str] = {}
    for src in spec.get("sources") or []:
        if "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            files[t["path"]] = token(t.get("audience") or None, int(t.get("expirationSeconds", 3607)))
        for kind in ("configMap", "secret"):
            if kind in src:
                ref = src[kind]
                data = lookup(kind, ref["name"], bool(ref.get("optional")))
                files.update(select_items(data or {}, ref.get("items")))
        if "downwardAPI" in src:
            for it in src["downwardAPI"].get("items") or []:
                files[it["path"]] = field(it["fieldRef"]["fieldPath"])
    return files


def prepare_volumes(
    pod: Json, pod_dir: Path, lookup: Lookup, field: Callable[[str], str], token: TokenSource
) -> tuple[Volumes, list[str]]:
    """Materialises the pod's volumes under pod_dir/volumes; returns them and a message for each volume
    of a type the test bed lacks (it becomes an empty directory). Raises ConfigError while a ConfigMap
    or Secret a volume needs is missing."""
    volumes: Volumes = {}
    problems: list[str] = []
    for v in pod["spec"].get("volumes") or []:
        name = v["name"]
        root = pod_dir / "volumes" / name
        root.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in v:
            root.chmod(0o777)  # as the kubelet makes it: writable whatever user the containers run as
            volumes[name] = (root, False)
        elif "hostPath" in v:
            hp = Path(v["hostPath"]["path"])
            if v["hostPath"].get("type") in ("DirectoryOrCreate",):
                hp.mkdir(parents=True, exist_ok=True)
            volumes[name] = (hp, False)
        elif "configMap" in v or "secret" in v:
            kind = "configMap" if "configMap" in v else "secret"
            ref = v[kind]
            data = lookup(kind, ref.get("name") or ref.get("secretName", ""), bool(ref.get("optional")))
            write_files(root, select_items(data or {}, ref.get("items")))
            volumes[name] = (root, True)
        elif "downwardAPI" in v:
            items = v["downwardAPI"]["items"]
            write_files(root, {it["path"]: field(it["fieldRef"]["fieldPath"]) for it in items})
            volumes[name] = (root, True)
        elif "projected" in v:
            write_files(root, projected_files(v["projected"], lookup, field, token))
            volumes[name] = (root, True)
        else:
            problems.append(f"volume {name}: unsupported volume type {sorted(set(v) - {'name'})}")
            volumes[name] = (root, False)
    return volumes, problems
