"""The npm packages Node and TypeScript programs find, as under SandboxFusion's image.

SandboxFusion's ``nodejs`` runner links its runtime's ``node_modules`` into each program's directory,
so ``require('js-md5')`` (HumanEval-X's JavaScript ``string_to_md5``) or ``import _ from 'lodash'``
works there. Its package list is the ``jest`` runner's too; we take the packages a plain program
uses (``node-package.json`` beside this file, pinned, with its lock) and leave out the test and DOM
tooling (jest, babel, jsdom, testing-library) and puppeteer (it downloads a browser).

Where they live: ``<python prefix>/lib/tangram-node/node_modules``, installed by ``make install`` and
the sandbox image with ``python -m arl_tangram.sandbox.nodepackages`` (``npm ci`` of the lock);
``TANGRAM_NODE_MODULES`` names another ``node_modules``. The agent links it at its workdir root,
the parent of every workdir: Node looks for ``node_modules`` in each directory up from the program's,
so both ``require`` and ES ``import`` find the packages (``NODE_PATH`` serves ``require`` only), and no
workdir holds anything the request did not put there. Without them Node runs as before, and
``/v1/health`` and the start-up line name the packages missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from arl_tangram.sandbox.installs import install_main, staged_install

HERE = os.path.dirname(os.path.abspath(__file__))
# The one list of packages and versions: npm's own manifest and lock, installed as they are.
MANIFEST = os.path.join(HERE, "node-package.json")
LOCK = os.path.join(HERE, "node-package-lock.json")
NODE_MODULES_ENV = "TANGRAM_NODE_MODULES"
# The name Node looks for in every directory up from a program's.
NODE_MODULES = "node_modules"


def install_prefix() -> str:
    """Where ``install`` puts them: beside the Python that runs the agent (its venv or installation),
    a directory actions can already read."""
    return os.path.join(sys.prefix, "lib", "tangram-node")


def wanted() -> tuple[str, ...]:
    """The packages programs are given, by name (the manifest's dependencies)."""
    with open(MANIFEST, encoding="utf-8") as manifest:
        dependencies: dict[str, str] = json.load(manifest)["dependencies"]
    return tuple(sorted(dependencies))


def find() -> tuple[str, dict[str, str], dict[str, str]]:
    """The ``node_modules`` directory (its real path; "" when there is none), each wanted package
    found there by its directory, and each missing one with why."""
    override = os.environ.get(NODE_MODULES_ENV, "")
    where = override or os.path.join(install_prefix(), NODE_MODULES)
    real = os.path.realpath(where)
    how = (
        f"{NODE_MODULES_ENV}={override}"
        if override
        else "`python -m arl_tangram.sandbox.nodepackages` installs them (make install does)"
    )
    if not os.path.isdir(real):
        return "", {}, {name: f"no {where}; {how}" for name in wanted()}
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name in wanted():
        package = os.path.join(real, name)
        if os.path.isfile(os.path.join(package, "package.json")):
            found[name] = package
        else:
            missing[name] = f"not in {real}; {how}"
    return real, found, missing


def link_at(root: str, node_modules: str) -> None:
    """Make ``<root>/node_modules`` point at ``node_modules`` (replacing a link left by an earlier
    agent), or remove such a link when there is nothing to point at."""
    link = os.path.join(root, NODE_MODULES)
    if os.path.islink(link):
        os.unlink(link)
    if node_modules:
        os.symlink(node_modules, link)


def install(npm: str | None = None, prefix: str | None = None) -> str | None:
    """``npm ci`` of the lock into ``prefix`` (default ``install_prefix()``), when what is there is
    not already it. Returns why it could not, or None."""
    npm = npm or shutil.which("npm")
    if npm is None:
        return "npm not found on PATH"
    prefix = prefix or install_prefix()
    installed = os.path.join(prefix, NODE_MODULES, ".package-lock.json")
    with open(LOCK, "rb") as lock:
        want = json.loads(lock.read())["packages"]
    if os.path.isfile(installed) and _same(installed, want):
        return None
    # npm ci writes next to the manifest: a directory of its own, then put in place whole.
    return staged_install(
        prefix,
        {"package.json": MANIFEST, "package-lock.json": LOCK},
        [npm, "ci", "--omit=dev", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
        made=NODE_MODULES,
        target=os.path.join(prefix, NODE_MODULES),
        what="npm ci",
    )


def _same(installed: str, want: dict[str, dict[str, object]]) -> bool:
    """Whether npm's record of an installed tree holds every package of the lock at its version."""
    try:
        with open(installed, encoding="utf-8") as record:
            have = json.load(record).get("packages", {})
    except (OSError, ValueError):
        return False
    return all(
        have.get(path, {}).get("version") == entry.get("version") for path, entry in want.items() if path
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m arl_tangram.sandbox.nodepackages [--require]``: install them."""
    return install_main(
        argv, "Node programs get no npm packages", "npm packages for Node programs", install, find
    )


if __name__ == "__main__":
    raise SystemExit(main())
