"""Pod spec expansion as a kubelet does it (pure): $(VAR) references, resource quantities, the downward
API, a container's environment (env, envFrom, valueFrom), its command line and its named ports.

Everything that needs the API server (ConfigMaps, Secrets) comes in as a `Lookup` callable, so these
functions run without a cluster."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from .api import ConfigError, Json, StartError

# lookup(kind, name, optional) -> the object's data; None when it is missing and optional. Raises
# ConfigError when it is missing and required.
Lookup = Callable[[str, str, bool], dict[str, str] | None]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubelet's $(VAR) expansion: defined names are replaced, $$ escapes, the rest stays as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env.get(name, f"$({name})"))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
}  # fmt: skip


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2Gi", "1e3") as a number."""
    m = re.fullmatch(
        r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(value).strip()
    )
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a resource quantity: {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def field_value(pod: Json, path: str, pod_ip: str, host_ip: str) -> str:
    """A downward API fieldRef (env valueFrom, downwardAPI volume items) of this pod."""
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    values = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path not in values:
        raise StartError(f"unsupported downward API field {path!r}")
    return str(values[path])


# A hostname is at most this long (sethostname(2) refuses a longer one, so bwrap would fail to start).
HOSTNAME_MAX = 63


def hostname(pod: Json) -> str:
    """The pod's hostname as kubelet sets it: ``spec.hostname`` or else the pod's name, cut to 63
    characters and then of a trailing '-' or '.' (a pod's name may be up to 253 characters)."""
    name = str(pod["spec"].get("hostname") or pod["metadata"]["name"])
    # Something is always left: a pod's name starts with a letter or a digit.
    return name if len(name) <= HOSTNAME_MAX else name[:HOSTNAME_MAX].rstrip("-.")


def resource_value(containers: list[Json], container: Json, ref: Json, node_capacity: dict[str, str]) -> str:
    """A resourceFieldRef: the container's request or limit (the node's capacity when it sets none),
    divided by the divisor and rounded up, as kubelet reports it."""
    kind, _, name = str(ref["resource"]).partition(".")
    target = container
    if ref.get("containerName"):
        target = next((x for x in containers if x["name"] == ref["containerName"]), container)
    value = ((target.get("resources") or {}).get(kind) or {}).get(name)
    if value is None:
        value = node_capacity.get(name, "0")
    divisor = quantity(ref.get("divisor", "1"))
    return str(math.ceil(quantity(value) / divisor))


def container_env(
    spec: Json,
    base: dict[str, str],
    namespace: str,
    lookup: Lookup,
    field: Callable[[str], str],
    resource: Callable[[Json], str],
) -> dict[str, str]:
    """The environment a container starts with: `base` (PATH, HOME, KUBERNETES_SERVICE_*), then envFrom
    in order, then env in order, each value $(VAR)-expanded against what is defined before it."""
    env = dict(base)
    for src in spec.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind in ("configMap", "secret"):
            ref = src.get(f"{kind}Ref")
            if ref:
                data = lookup(kind, ref["name"], bool(ref.get("optional")))
                env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in spec.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
            continue
        vf = var.get("valueFrom") or {}
        if "fieldRef" in vf:
            env[name] = field(vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[name] = resource(vf["resourceFieldRef"])
        else:
            for kind in ("configMap", "secret"):
                ref = vf.get(f"{kind}KeyRef")
                if ref:
                    data = lookup(kind, ref["name"], bool(ref.get("optional")))
                    if data is not None and ref["key"] in data:
                        env[name] = data[ref["key"]]
                    elif not ref.get("optional"):
                        raise ConfigError(
                            f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}"
                        )
        if name not in env and not vf:
            env[name] = ""
    return env


def entrypoint_for(entrypoints: dict[str, Json], image: str) -> tuple[list[str], list[str]] | None:
    """The command an image would run, from the --entrypoints map (keys: image names, with or without
    tag; a digest is ignored)."""
    base = image.rsplit("@", 1)[0]
    if ":" in base.rsplit("/", 1)[-1]:
        base = base.rsplit(":", 1)[0]
    entry = entrypoints.get(image) or entrypoints.get(base)
    if entry is None:
        return None
    return list(entry.get("command") or []), list(entry.get("args") or [])


def container_argv(spec: Json, entrypoints: dict[str, Json]) -> list[str]:
    """command + args, with the image's entrypoint (from --entrypoints) where the container gives none."""
    command = list(spec.get("command") or [])
    args = list(spec.get("args") or [])
    if not command:
        image = str(spec.get("image", ""))
        entry = entrypoint_for(entrypoints, image)
        if entry is None:
            raise StartError(
                f"container {spec['name']}: the test bed runs no images, so it needs a command "
                f"(or an entry for image {image!r} in the node runner's --entrypoints file)"
            )
        command, default_args = entry
        args = args or default_args
    return command + args


def port_number(spec: Json, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in spec.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {spec['name']} has no port named {port!r}")
