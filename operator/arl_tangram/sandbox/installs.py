"""What the Node packages' and the Go modules' installs share (nodepackages.py, gopackages.py)."""

from __future__ import annotations

import os
import shutil


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
