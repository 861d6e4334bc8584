"""What the Node packages' and the Go modules' installs share (nodepackages.py, gopackages.py): a
tool run in a staging directory of its own beside the target, its tree then put in place whole."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping

INSTALL_TIMEOUT_S = 600.0
# In ``staged_install``'s environment values: the staging directory (not known before it is made).
STAGING = "{staging}"


def staged_install(
    prefix: str,
    inputs: Mapping[str, str],
    argv: list[str],
    made: str,
    target: str,
    what: str,
    env: Mapping[str, str] | None = None,
) -> str | None:
    """Copy ``inputs`` (name in the staging directory -> source file) into a fresh directory under
    ``prefix``, run ``argv`` there, and put the tree it made (``made``, relative to that directory)
    at ``target``; ``env`` is added to this process's (``STAGING`` in a value stands for the
    staging directory). Returns why it could not (``what`` failed, and the tool's last lines), or
    None."""
    os.makedirs(prefix, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".install-", dir=prefix)
    try:
        for name, source in inputs.items():
            os.makedirs(os.path.dirname(os.path.join(staging, name)), exist_ok=True)
            shutil.copyfile(source, os.path.join(staging, name))
        cwd = os.path.dirname(os.path.join(staging, next(iter(inputs)))) if inputs else staging
        done = subprocess.run(
            argv,
            cwd=cwd,
            env={**os.environ, **{k: v.replace(STAGING, staging) for k, v in (env or {}).items()}},
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            return f"{what} failed ({done.returncode}): " + " | ".join(lines[-3:])
        replace_tree(os.path.join(staging, made), target)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{what} failed: {exc}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_tree(new: str, target: str) -> None:
    """Put the tree ``new`` at ``target`` whole, readable by every uid (actions run under their
    own): renamed into place, so a reader sees the old tree or the new one (or, for an instant,
    none), never half of one."""
    for base, dirs, files in os.walk(new):
        for name in dirs + files:
            path = os.path.join(base, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | (0o555 if name in dirs else 0o444))
    os.chmod(new, 0o755)
    old = target + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(target):
        os.rename(target, old)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def install_main(
    argv: list[str] | None,
    lacking: str,
    found_what: str,
    install: Callable[[], str | None],
    find: Callable[[], tuple[str, dict[str, str], dict[str, str]]],
) -> int:
    """A ``python -m`` entry point that installs (``make install``; the sandbox image passes
    ``--require``, and there a failure fails the build), then says what is where."""
    required = "--require" in (sys.argv[1:] if argv is None else argv)
    why = install()
    if why is not None:
        print(f"sandbox: {lacking}: {why}", file=sys.stderr)
        return 1 if required else 0
    where, found, missing = find()
    print(f"sandbox: {found_what} in {where or 'nowhere'}: {', '.join(found)}")
    if missing:
        print(f"sandbox: missing {', '.join(missing)}", file=sys.stderr)
    return 0
