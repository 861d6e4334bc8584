"""The Go module Go programs are built in, as under SandboxFusion's image: testify and its kin.

SandboxFusion copies its runtime's ``go.mod`` and ``go.sum`` (module ``SeedSandbox``, ``go 1.22``, its
dependencies in the image's module cache) into each program's directory, and builds (``go``) or tests
(``go_test``) the program's file there, in module mode. So a program may import
``github.com/stretchr/testify/assert`` (every HumanEval-X Go test does, run as ``go_test``). (A
program named by its file is not in the module's package tree, so the module's ``go`` line does
not set its language version: the toolchain's does, there as here.) We take its module name and
``go`` line and, of its requirements, testify (assert, require, mock, suite) with what testify needs
(``gomodule/go.mod`` beside this file, with its ``go.sum``: the one list); the rest of its list
(OpenTelemetry, gorm, zap, viper, cobra, ...) is libraries no benchmark's program imports.

Where they live: the module cache is ``<python prefix>/lib/tangram-go/mod``, filled by ``make install``
and the sandbox image (``python -m arl_tangram.sandbox.gopackages``: ``go mod download``);
``TANGRAM_GOMODCACHE`` names another. The agent writes ``go.mod`` and ``go.sum`` at its workdir root,
the parent of every workdir (Go looks for ``go.mod`` in each directory up from the build's), and runs
Go with ``GOMODCACHE`` there, read-only, and no proxy. A request's own ``go.mod`` is nearer and wins,
as in SandboxFusion, where the request's files are written over the copied ones. Without the cache
complete, no ``go.mod`` is written and Go builds outside a module as before; ``/v1/health`` and the
start-up line name the modules missing.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Iterable
from typing import Any

from arl_tangram.sandbox.installs import STAGING, install_main, staged_install

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE_DIR = os.path.join(HERE, "gomodule")
# What the workdir root gets, copied from MODULE_DIR.
MODULE_FILES = ("go.mod", "go.sum")
MODCACHE_ENV = "TANGRAM_GOMODCACHE"
# The module's packages, compiled into the build cache with the standard library
# (languages._warm_go_cache), so that no program pays for compiling them.
PACKAGES = tuple(f"github.com/stretchr/testify/{name}" for name in ("assert", "require", "mock", "suite"))


def install_prefix() -> str:
    """Where ``install`` puts the cache: beside the Python that runs the agent (its venv or
    installation), a directory actions can already read."""
    return os.path.join(sys.prefix, "lib", "tangram-go")


def required() -> dict[str, str]:
    """Every module ``go.mod`` requires (direct or not), with its version."""
    modules: dict[str, str] = {}
    block = False
    with open(os.path.join(MODULE_DIR, "go.mod"), encoding="utf-8") as gomod:
        for raw in gomod:
            line = raw.split("//", 1)[0].strip()
            if line == "require (":
                block = True
            elif block and line == ")":
                block = False
            elif block and line:
                path, version = line.split()[:2]
                modules[path] = version
            elif line.startswith("require "):
                path, version = line.split()[1:3]
                modules[path] = version
    return modules


def _escaped(path: str) -> str:
    """A module path as the module cache spells it (an upper-case letter as ``!`` and the lower)."""
    return "".join(f"!{c.lower()}" if c.isupper() else c for c in path)


def find() -> tuple[str, dict[str, str], dict[str, str]]:
    """The module cache (its real path; "" unless it holds every required module), each module
    found there by its directory, and each missing one with why."""
    override = os.environ.get(MODCACHE_ENV, "")
    where = override or os.path.join(install_prefix(), "mod")
    real = os.path.realpath(where)
    how = (
        f"{MODCACHE_ENV}={override}"
        if override
        else "`python -m arl_tangram.sandbox.gopackages` fills it (make install does)"
    )
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    for path, version in required().items():
        module = os.path.join(real, f"{_escaped(path)}@{version}")
        if os.path.isfile(os.path.join(module, "go.mod")) or os.path.isdir(module):
            found[path] = module
        else:
            missing[path] = f"{version} not in {where}; {how}"
    return ("" if missing else real), found, missing


# A test importing what tests commonly import, run once at start-up (languages._warm_go_build): the
# vet facts ``go test`` computes for each imported package are then in the build cache.
WARM_TEST = "tangram_warm_test.go"
_WARM_STD = (
    "bufio",
    "bytes",
    "container/heap",
    "errors",
    "fmt",
    "math",
    "math/big",
    "os",
    "reflect",
    "regexp",
    "sort",
    "strconv",
    "strings",
    "time",
    "unicode",
)


def write_warm_test(directory: str, with_module: bool) -> None:
    """Write ``WARM_TEST`` in ``directory``: the common standard packages, and the module's too."""
    imports = [*_WARM_STD, *(PACKAGES if with_module else ())]
    lines = ["package main", "", "import (", '\t"testing"', *(f'\t_ "{p}"' for p in imports), ")", ""]
    lines.append("func TestWarm(t *testing.T) {}")
    with open(os.path.join(directory, WARM_TEST), "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")


def place_at(root: str, modcache: str) -> None:
    """Write ``go.mod`` and ``go.sum`` at ``root`` when ``modcache`` is the complete cache, or
    remove those an earlier agent wrote there when it is not ("")."""
    for name in MODULE_FILES:
        target = os.path.join(root, name)
        if os.path.lexists(target):
            os.unlink(target)
        if modcache:
            shutil.copyfile(os.path.join(MODULE_DIR, name), target)
            os.chmod(target, 0o444)


@functools.cache
def module_files() -> dict[str, bytes]:
    """``go.mod`` and ``go.sum``, as SandboxFusion copies them into each Go program's directory."""
    files = {}
    for name in MODULE_FILES:
        with open(os.path.join(MODULE_DIR, name), "rb") as f:
            files[name] = f.read()
    return files


def go_env(modcache: str) -> dict[str, str]:
    """What Go's builds get besides the language's own environment: the cache, and no workspace
    file of the host's (``go.work``) in the way."""
    return {"GOMODCACHE": modcache, "GOWORK": "off"} if modcache else {}


def install(go: str | None = None, prefix: str | None = None) -> str | None:
    """``go mod download`` of every required module into ``<prefix>/mod`` (default
    ``install_prefix()``), unless it holds them already. Returns why it could not, or None."""
    go = go or shutil.which("go")
    if go is None:
        return "go not found on PATH"
    prefix = prefix or install_prefix()
    target = os.path.join(prefix, "mod")
    if all(os.path.isdir(os.path.join(target, f"{_escaped(p)}@{v}")) for p, v in required().items()):
        return None
    return staged_install(
        prefix,
        {os.path.join("module", name): os.path.join(MODULE_DIR, name) for name in MODULE_FILES},
        [go, "mod", "download", "all"],
        made="mod",
        target=target,
        what="go mod download",
        env={
            "GOMODCACHE": os.path.join(STAGING, "mod"),
            # Writable, so that the tree can be renamed and removed (replace_tree makes it
            # readable to all; only its owner writes it).
            "GOFLAGS": "-modcacherw",
            "GOWORK": "off",
            "GOTOOLCHAIN": "local",
        },
    )


def locked_files(root: str, toolchains: Iterable[Any]) -> list[str]:
    """The files a Go build reads under a shared flock (``lockedfile.Read``, traced with Go 1.26):
    the go.mod and go.sum at the workdir root, the build cache's own files (trim.txt) and the
    module cache's ziphash files. Actions read them but must not be able to hold them for one
    another (child.set_private_copies)."""
    found = {os.path.join(root, name) for name in MODULE_FILES if os.path.isfile(os.path.join(root, name))}
    for toolchain in toolchains:
        cache = toolchain.env.get("GOCACHE", "")
        if os.path.isabs(cache) and os.path.isdir(cache):
            found.update(
                entry.path
                for entry in os.scandir(cache)
                if entry.name.endswith(".txt") and entry.is_file(follow_symlinks=False)
            )
        if toolchain.go_modcache:
            download = os.path.join(toolchain.go_modcache, "cache", "download")
            for directory, _, names in os.walk(download):
                found.update(os.path.join(directory, name) for name in names if name.endswith(".ziphash"))
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    """``python -m arl_tangram.sandbox.gopackages [--require]``: fill the cache."""
    return install_main(
        argv, "Go programs get no module (testify)", "Go modules for Go programs", install, find
    )


if __name__ == "__main__":
    raise SystemExit(main())
