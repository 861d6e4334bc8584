"""What the zygote imports for ``--preload``: the named modules and the parts of them every action
would otherwise import again.

An action forked from the zygote finds a preloaded module in ``sys.modules`` and pays nothing to
import it. But packages load some submodules lazily (numpy 2 loads ``numpy.random`` on first use),
and the fork server reseeds numpy's global generator in every child so that no two actions share
its stream: with only ``numpy`` preloaded, each child then imported ``numpy.random`` itself,
measured at about 35 ms per action (against 4 ms with it preloaded). Such companions are added here.
"""

from __future__ import annotations

from collections.abc import Iterable

# module -> the submodules every action touches once the module is loaded (see above).
COMPANIONS: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy.random",),
}


def zygote_modules(names: Iterable[str]) -> list[str]:
    """``names`` in order, each followed by its companions, without repeats."""
    out: list[str] = []
    for name in names:
        for module in (name, *COMPANIONS.get(name, ())):
            if module not in out:
                out.append(module)
    return out
