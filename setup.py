"""The one compiled part: the sandbox zygote's fork loop (see operator/arl_tangram/sandbox/_zygote.c).

Optional on purpose: without a C compiler the package installs anyway and the sandbox forks from
its Python loop (slower; the agent says so at start-up). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "arl_tangram.sandbox._zygote",
            ["operator/arl_tangram/sandbox/_zygote.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
