"""The npm packages Node programs are given (sandbox/nodepackages.py): one list, pinned, found or
reported missing. npm itself is faked here only where the test is about what happens when it
fails or is not needed; the real install is ``make install``'s, and the agent tests use it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from arl_tangram.sandbox import nodepackages


def _lock() -> dict[str, dict[str, object]]:
    packages: dict[str, dict[str, object]] = json.loads(Path(nodepackages.LOCK).read_text())["packages"]
    return packages


def test_the_lock_pins_exactly_the_manifest() -> None:
    """Every dependency of the manifest is in the lock at the version the manifest pins, and the
    lock names no registry (npm ci fetches from whatever registry its configuration names)."""
    manifest = json.loads(Path(nodepackages.MANIFEST).read_text())
    lock = _lock()
    assert lock[""]["dependencies"] == manifest["dependencies"]
    for name, version in manifest["dependencies"].items():
        assert lock[f"node_modules/{name}"]["version"] == version, name
    assert all("resolved" not in entry for entry in lock.values())
    assert all(entry.get("integrity") for path, entry in lock.items() if path)
    assert "js-md5" in nodepackages.wanted() and "lodash" in nodepackages.wanted()


def _tree(where: Path, packages: tuple[str, ...]) -> Path:
    modules = where / "node_modules"
    for name in packages:
        (modules / name).mkdir(parents=True)
        (modules / name / "package.json").write_text("{}")
    return modules


def test_find_names_each_missing_package_and_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wanted = nodepackages.wanted()
    modules = _tree(tmp_path, wanted[1:])
    monkeypatch.setenv(nodepackages.NODE_MODULES_ENV, str(modules))
    where, found, missing = nodepackages.find()
    assert where == os.path.realpath(modules)
    assert set(found) == set(wanted[1:])
    assert list(missing) == [wanted[0]] and str(modules) in missing[wanted[0]]
    monkeypatch.setenv(nodepackages.NODE_MODULES_ENV, str(tmp_path / "nowhere"))
    where, found, missing = nodepackages.find()
    assert (where, found, set(missing)) == ("", {}, set(wanted))


def _fake_npm(tmp_path: Path, script: str) -> str:
    npm = tmp_path / "npm"
    npm.write_text("#!/bin/sh\n" + script)
    npm.chmod(0o755)
    return str(npm)


def test_install_does_nothing_when_the_tree_is_the_lock(tmp_path: Path) -> None:
    """A second ``make install`` does not run npm again (a fake npm that fails would show it)."""
    modules = _tree(tmp_path, nodepackages.wanted())
    record = {"packages": {p: {"version": e.get("version")} for p, e in _lock().items() if p}}
    (modules / ".package-lock.json").write_text(json.dumps(record))
    npm = _fake_npm(tmp_path, "exit 1\n")
    assert nodepackages.install(npm=npm, prefix=str(tmp_path)) is None
    record["packages"]["node_modules/lodash"]["version"] = "4.0.0"
    (modules / ".package-lock.json").write_text(json.dumps(record))
    why = nodepackages.install(npm=npm, prefix=str(tmp_path))
    assert why is not None and "npm ci failed (1)" in why
    # A failed install leaves the tree there as it was, and no staging directory behind.
    assert (modules / "lodash" / "package.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node_modules", "npm"]


def test_install_replaces_the_tree_whole(tmp_path: Path) -> None:
    """What npm ci made goes into place at once, readable by every uid; the old tree is gone."""
    old = _tree(tmp_path, ("stale",))
    npm = _fake_npm(
        tmp_path,
        "mkdir -p node_modules/lodash && echo '{}' > node_modules/lodash/package.json"
        " && chmod 700 node_modules/lodash\n",
    )
    assert nodepackages.install(npm=npm, prefix=str(tmp_path)) is None
    assert not (old / "stale").exists()
    assert (old / "lodash" / "package.json").is_file()
    assert (old / "lodash").stat().st_mode & 0o005 == 0o005
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node_modules", "npm"]


def test_link_at_points_the_root_at_the_packages_or_removes_it(tmp_path: Path) -> None:
    modules = _tree(tmp_path / "pkgs", ("lodash",))
    root = tmp_path / "root"
    root.mkdir()
    nodepackages.link_at(str(root), str(modules))
    assert os.readlink(root / "node_modules") == str(modules)
    nodepackages.link_at(str(root), str(modules))  # an agent restarted on the same root
    assert os.readlink(root / "node_modules") == str(modules)
    nodepackages.link_at(str(root), "")
    assert not os.path.lexists(root / "node_modules")
