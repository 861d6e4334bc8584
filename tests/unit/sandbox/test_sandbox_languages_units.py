"""The language table, its detection, the compile cache and the preload list, without an agent."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from arl_tangram.sandbox import gopackages
from arl_tangram.sandbox.compilecache import CompileCache, CompiledBuild, build_key
from arl_tangram.sandbox.languages import LANGUAGES, command_words, detect, known_name, unavailable_language
from arl_tangram.sandbox.preload import zygote_modules


def entry(size: int, code: int = 0) -> CompiledBuild:
    return CompiledBuild(
        artifacts={"test": b"x" * size}, return_code=code, stdout="", stderr="", compile_s=0.1
    )


def test_build_key_follows_every_input() -> None:
    files = {"main.cpp": b"int main(){}", "util.h": b"#define A 1"}

    def key(
        language: str = "cpp",
        fingerprint: str = "f1",
        command: tuple[str, ...] = ("g++", "main.cpp"),
        files: dict[str, bytes] = files,
        memory_mb: int = 1024,
    ) -> str:
        return build_key(language, fingerprint, list(command), files, memory_mb)

    assert key() == key(files=dict(reversed(list(files.items()))))
    changed = [
        key(files={**files, "util.h": b"#define A 2"}),
        key(files={**files, "other.h": b""}),
        key(files={"main.cpp": files["main.cpp"], "util2.h": files["util.h"]}),
        key(fingerprint="f2"),
        key(command=("g++", "-O2", "main.cpp")),
        key(memory_mb=512),
        key(language="c"),
    ]
    assert key() not in changed
    assert len(set(changed)) == len(changed)


def test_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    one = entry(100).size
    cache = CompileCache(max_bytes=3 * one)
    for name in "abc":
        assert cache.put(name, entry(100))
    assert cache.get("a") is not None  # now the most recently used
    assert cache.put("d", entry(100))
    assert set(cache.entries) == {"a", "c", "d"}
    assert cache.bytes == 3 * one <= cache.max_bytes
    assert cache.stats.evictions == 1
    assert not cache.put("huge", entry(10 * one)), "an entry larger than the cache is not kept"
    assert "huge" not in cache.entries
    assert cache.get("b") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_cache_refuses_a_negative_bound() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        CompileCache(max_bytes=-1)


def test_a_build_under_way_is_waited_for_and_other_keys_are_not() -> None:
    async def scenario() -> list[str]:
        cache = CompileCache()
        order: list[str] = []
        started = asyncio.Event()
        release = asyncio.Event()

        async def builder() -> None:
            async with cache.building("k"):
                order.append("build k")
                started.set()
                await release.wait()
                cache.put("k", entry(10))
            order.append("k kept")

        async def waiter() -> None:
            await started.wait()
            assert await cache.wait_for_build("k")
            order.append("waiter finds k" if cache.get("k") else "waiter finds nothing")

        async def other_key() -> None:
            await started.wait()
            assert not await cache.wait_for_build("other"), "nothing builds 'other'"
            order.append("other key free")
            release.set()

        await asyncio.gather(builder(), waiter(), other_key())
        assert cache.stats.waits == 1
        return order

    assert asyncio.run(scenario()) == ["build k", "other key free", "k kept", "waiter finds k"]


def test_zygote_modules_add_what_every_action_would_import() -> None:
    assert zygote_modules(["json", "numpy", "numpy.random", "pandas"]) == [
        "json",
        "numpy",
        "numpy.random",
        "pandas",
    ]
    assert zygote_modules(["numpy"]) == ["numpy", "numpy.random"]


def test_aliases_name_their_language() -> None:
    assert known_name("js") == "nodejs"
    assert known_name("javascript") == "nodejs"  # ROLL's name (a fence's); refused (422) before
    assert known_name("ts") == "typescript"
    assert known_name("cpp") == "cpp"
    assert known_name("cobol") is None


def test_detect_names_the_missing_binary_and_reads_the_version(tmp_path: Path) -> None:
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho 'g++ (Fake) 99.1'\n")
    fake.chmod(0o755)
    found = detect(path=str(tmp_path))
    assert set(found.found) == {"cpp"}
    cpp = found.found["cpp"]
    assert cpp.version == "g++ (Fake) 99.1"
    assert cpp.binaries["cxx"] == os.path.realpath(fake)
    assert cpp.argv(cpp.language.compile, {})[0] == os.path.realpath(fake)
    assert str(tmp_path) in found.readable()
    assert found.missing["java"] == "'javac' not found on PATH"
    assert set(found.missing) == {lang.name for lang in LANGUAGES} - {"cpp"}
    assert "languages found: cpp (g++ (Fake) 99.1)" in found.summary()


def test_a_binary_is_named_in_argv_as_a_shell_on_the_actions_path_names_it(tmp_path: Path) -> None:
    """Its name where the action's PATH finds that very binary by it (a link's target included,
    as ``/usr/bin/lua`` is ``lua5.2``'s); its path where that PATH finds another or none."""
    real = tmp_path / "lib" / "lua5.2"
    real.parent.mkdir()
    real.write_text("#!/bin/sh\n")
    real.chmod(0o755)
    on_path = tmp_path / "bin"
    on_path.mkdir()
    (on_path / "lua").symlink_to(real)
    other = tmp_path / "other"
    other.mkdir()
    (other / "node").write_text("#!/bin/sh\n")
    (other / "node").chmod(0o755)
    node = str(tmp_path / "lib" / "node")
    tools = {"lua": "lua", "node": "node", "go": "go"}
    binaries = {"lua": str(real), "node": node, "go": str(tmp_path / "go" / "bin" / "go")}
    words = command_words(tools, binaries, f"{on_path}:{other}")
    assert words == {"lua": "lua", "node": node, "go": binaries["go"]}


def _fake_go(tmp_path: Path, build_exit: int) -> tuple[Path, Path]:
    """A ``go`` that reports a cache, logs each call with its GOCACHE, and builds with ``build_exit``."""
    cache, log = tmp_path / "cache", tmp_path / "calls.log"
    fake = tmp_path / "bin" / "go"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$* GOCACHE=$GOCACHE GOTOOLCHAIN=$GOTOOLCHAIN" >>{log}\n'
        'case "$1" in\n'
        "  version) echo 'go version go9.9 linux/amd64';;\n"
        f"  env) echo {cache};;\n"
        f"  build) echo 'compile: out of disk' >&2; exit {build_exit};;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    return fake, log


@pytest.mark.parametrize("with_module", [False, True], ids=["no-module-cache", "module-cache"])
def test_go_detection_fills_the_build_cache_actions_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_module: bool
) -> None:
    """Actions cannot write Go's build cache, so a cold one would fail every import of a standard
    package not yet in it: detection compiles the standard library there first (and testify, where
    the module cache is complete), with the actions' own settings (the cache keys are theirs), once
    for go and go_test together."""
    modcache = tmp_path / "mod"
    if with_module:
        for path, version in gopackages.required().items():
            (modcache / f"{path}@{version}").mkdir(parents=True)
    monkeypatch.setenv(gopackages.MODCACHE_ENV, str(modcache))
    fake, log = _fake_go(tmp_path, build_exit=0)
    found = detect(path=str(fake.parent))
    assert "go" in found.found and "go_test" in found.found, found.missing
    builds = [line for line in log.read_text().splitlines() if line.startswith("build ")]
    packages = " ".join(("std", *(gopackages.PACKAGES if with_module else ())))
    assert builds == [f"build {packages} GOCACHE={tmp_path / 'cache'} GOTOOLCHAIN=local"]
    assert found.go_modcache() == (str(modcache) if with_module else "")
    assert found.found["go_test"].env.get("GOMODCACHE") == (str(modcache) if with_module else None)


def test_go_is_not_offered_when_its_standard_library_does_not_build(tmp_path: Path) -> None:
    fake, _ = _fake_go(tmp_path, build_exit=1)
    found = detect(path=str(fake.parent))
    assert "go" not in found.found
    assert "go build std" in found.missing["go"] and "compile: out of disk" in found.missing["go"]


def test_a_changed_toolchain_changes_its_fingerprint(tmp_path: Path) -> None:
    fake = tmp_path / "gcc"
    fake.write_text("#!/bin/sh\necho 'gcc 1'\n")
    fake.chmod(0o755)
    before = detect(path=str(tmp_path)).found["c"].fingerprint
    fake.write_text("#!/bin/sh\necho 'gcc 2'\n")
    assert detect(path=str(tmp_path)).found["c"].fingerprint != before


def test_unavailable_languages_get_sandboxfusions_answers() -> None:
    status, body = unavailable_language("cobol", ["python", "cpp"], {})
    assert status == 422
    assert body["detail"][0]["loc"] == ["body", "language"]
    status, body = unavailable_language("rust", ["python"], {"rust": "'rustc' not found on PATH"})
    assert status == 200
    assert body["status"] == "SandboxError"
    assert "'rustc' not found on PATH" in str(body["message"])
    assert body["run_result"] is None and body["compile_result"] is None


# Which Debian (or npm) package brings each toolchain binary into the sandbox image.
IMAGE_PACKAGES = {
    "g++": "g++",
    "gcc": "gcc",
    "javac": "default-jdk-headless",
    "java": "default-jdk-headless",
    "go": "golang-go",
    "rustc": "rustc",
    "node": "nodejs",
    "esbuild": "esbuild",
    "perl": "perl",
    "php": "php-cli",
    "ruby": "ruby",
    "lua": "lua5.2",
    "Rscript": "r-base-core",
    "ldmd2": "ldc",
    "iverilog": "iverilog",
    "vvp": "iverilog",
    "scalac": "scala",
    "scala": "scala",
}


def test_the_sandbox_image_installs_every_toolchain_and_the_scientific_set() -> None:
    dockerfile = Path(__file__).resolve().parents[3] / "sandbox-images" / "Dockerfile"
    text = dockerfile.read_text()
    for language in LANGUAGES:
        for binary in language.tools.values():
            assert binary in IMAGE_PACKAGES, f"{language.name}: no image package known for {binary!r}"
            assert IMAGE_PACKAGES[binary] in text, (
                f"{language.name}: the image lacks {IMAGE_PACKAGES[binary]}"
            )
    for module in ("numpy", "pandas", "scipy", "sympy", "networkx", "scikit-learn"):
        assert module in text


def test_the_jvm_heap_leaves_room_for_what_the_jvm_reserves_besides() -> None:
    from arl_tangram.sandbox.languages import JVM_RESERVE_MB, jvm_heap_mb

    for memory in (256, 512, 1024, 4096, 24000, 200_000):
        heap = jvm_heap_mb(memory)
        assert heap >= 32
        assert memory <= 416 or memory - heap >= JVM_RESERVE_MB
        assert heap <= 0.75 * memory or heap == 32


def _failed(stderr: bytes, code: int = 1) -> dict[str, object]:
    """A compile's reply: its driver exited ``code`` (no signal of its own), saying ``stderr``."""
    return {"exit_code": code, "signal": None, "stderr": stderr}


@pytest.mark.parametrize(
    ("reply", "kept"),
    [
        ({"exit_code": 1, "signal": None, "stderr": b"main.cpp:1: error"}, True),
        # Killed by the kernel's OOM killer on a host another action filled: the moment's doing.
        ({"exit_code": -9, "signal": 9, "stderr": b""}, False),
        ({"exit_code": 1, "signal": None, "stderr": b"", "memory_error": True}, False),
        # The OOM killer kills the largest process, which the driver outlives: each toolchain's
        # driver's own words for it (as they print them), or a shell's 128 + the signal.
        (_failed(b"g++: fatal error: Killed signal terminated program cc1plus\n"), False),
        (_failed(b"collect2: fatal error: ld terminated with signal 9 [Killed]\n"), False),
        (
            _failed(b"internal/unsafeheader: /usr/local/go/pkg/tool/linux_amd64/compile: signal: killed\n"),
            False,
        ),
        (_failed(b"error: linking with `cc` failed: signal: 9 (SIGKILL)\n"), False),
        (_failed(b"Error: Error executing /usr/bin/ldc2: Killed\n"), False),
        (_failed(b'/usr/bin/scalac: line 21: 12687 Killed                  "$@"\n', 137), False),
        # A process or thread refused (the host's or the pod's processes full): the moment's too.
        (
            _failed(b"gcc: fatal error: cannot execute 'cc1': vfork: Resource temporarily unavailable\n"),
            False,
        ),
        (_failed(b"runtime: failed to create new OS thread (have 4 already; errno=11)\n", 2), False),
        (
            _failed(b"java.lang.OutOfMemoryError: unable to create native thread: possibly out of memory\n"),
            False,
        ),
        (_failed(b"./main.go:3:2: undefined: killed\n"), True),
    ],
)
def test_a_compile_failed_by_the_moment_is_not_kept(reply: dict[str, object], kept: bool) -> None:
    """A failed compile is kept for its key (the source fails the same way every time), but not one
    killed by a signal: that was every later identical request's verdict, a compile error."""
    from types import SimpleNamespace
    from typing import Any

    from arl_tangram.sandbox.builds import Builder

    builder = Builder(detection=SimpleNamespace(), max_timeout_s=60)  # type: ignore[arg-type]
    toolchain: Any = SimpleNamespace(language=SimpleNamespace(reports_compile=True))

    async def dispatch(msg: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        return [0], {"stdout": b"", "wall_s": 0.1, **reply}

    msg = {"workdir": "/nonexistent", "env": {}, "limits": {}}
    built = asyncio.run(builder._compile(toolchain, ["cc"], msg, {}, dispatch, 10.0, "key"))
    assert built.stop is not None, "the build failed"
    assert (builder.cache.get("key") is not None) == kept
