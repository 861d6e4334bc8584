"""The languages beyond Python: how each is compiled and run, and which of them this host can run.

cpp, c, java, junit, go, go_test, rust, nodejs (js), typescript (ts), perl, php, ruby, lua, R, D_ut,
scala and verilog; ``c`` is ours (SandboxFusion has no plain C), the others carry SandboxFusion's names.

Each ``Language`` names the file its code is written to, the toolchain binaries it needs, the
argv of its compile step (none for interpreted languages) and of its run, and which files the
compile leaves behind (what the compile cache keeps). The argv are templates: ``{cc}``-style
fields are the resolved toolchain binaries (named as a shell names them, where an action's PATH
finds them by name: ``command_words``), ``{heap_mb}`` and ``{jars}`` are filled per action,
and a ``{link_flags}`` part stands for the link flags ``detect`` found (none or several arguments).

What is learnt from SandboxFusion's runners (its behaviour, not its code): the compiled binary is
``test`` (C++, Rust) or ``out`` (Go); Java's class is ``Main`` in ``Main.java``, run with ``-ea`` and
any ``.jar`` of the request's files on the class path; C++ is ``-std=c++17`` without optimisation;
Rust is a bare ``rustc`` (its default edition); TypeScript runs the way ``tsx`` runs it (esbuild
strips the types, nothing checks them), so a TypeScript error shows as the run's failure and no
``compile_result`` is reported; ``nodejs``/``js`` and ``typescript``/``ts`` are the same language.

The libraries SandboxFusion's runners give programs, which benchmarks' code relies on:

- C++ is linked with each of ``-lcrypto -lssl -lpthread`` that links on the host (SandboxFusion
  probes them once; HumanEval-X's and MultiPL-E's ``string_to_md5`` call OpenSSL's ``MD5``). Our C
  gets the same probed flags after its ``-lm`` (OpenSSL is a C library; C had ``-lpthread`` before).
  A flag that does not link (no ``libssl-dev``) is left out and ``/v1/health`` names it.
- Java has javatuples on the class path of ``javac`` and ``java``, after ``.`` and before the
  request's own jars (SandboxFusion's ``.:javatuples-1.2.jar``; every MultiPL-E HumanEval-Java
  prompt starts with ``import org.javatuples.*;``). The jar is Debian's ``libjavatuples-java``
  (``/usr/share/java/javatuples*.jar``, its real file; ``TANGRAM_JAVATUPLES_JAR`` names another).
  Without it Java runs as before and ``/v1/health`` and the start-up line say javatuples is missing.
- Node and TypeScript programs find the npm packages SandboxFusion's image gives them (lodash,
  js-md5, ...; ``nodepackages.py`` says which and where), by ``require`` or ``import``.
- Go programs (``go`` and ``go_test``) are built in SandboxFusion's Go module, testify's packages
  in its module cache (``gopackages.py``).

``detect`` runs once at start-up: it resolves every binary on ``PATH`` to its real file (a rustup
proxy to the toolchain's own ``rustc``), reads each toolchain's version, probes the link flags and
finds the jars (the compile cache's key includes all of them: the flags and the jar's path are in
the compile's argv, the version and the jar's size and mtime in the toolchain's fingerprint) and
lists the directories the sandbox must let actions read (a toolchain under a private home
directory, Go's build cache, the jar's directory).
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from arl_tangram.sandbox import gopackages, nodepackages
from arl_tangram.sandbox.isolation import PRIVATE_TMP_POINTS

# Every language name SandboxFusion's /run_code accepts (its request model's literal). A name
# outside this list is refused there by request validation (422 with ``detail``); a name in it that
# this host does not run is answered in SandboxFusion's response shape instead (see server.py).
SANDBOXFUSION_LANGUAGES = (
    "python",
    "cpp",
    "nodejs",
    "go",
    "go_test",
    "java",
    "php",
    "csharp",
    "bash",
    "typescript",
    "sql",
    "rust",
    "cuda",
    "lua",
    "R",
    "perl",
    "D_ut",
    "ruby",
    "scala",
    "julia",
    "pytest",
    "junit",
    "kotlin_script",
    "jest",
    "verilog",
    "python_gpu",
    "lean",
    "swift",
    "racket",
)

# What the JVM reserves beyond its heap when its arenas are limited as below (code cache, class
# space, metaspace, thread stacks), measured: about 320 MB, plus GC tables that grow with the heap
# (a 23 GB heap did not fit a 24 GB limit less 384 MB). The address-space limit an action gets
# covers heap plus these; the heap is what is left, at most three quarters of the limit.
JVM_RESERVE_MB = 384
JVM_MIN_HEAP_MB = 32
JVM_MAX_HEAP_SHARE = 0.75
# The JVM's own reservations, kept small so that it starts under an address-space limit at all
# (by default it reserves several GB and fails to start under 1 GiB).
_JVM_LIMITS = (
    "-Xmx{heap_mb}m",
    "-XX:+UseSerialGC",
    "-XX:ReservedCodeCacheSize=48m",
    "-XX:CompressedClassSpaceSize=48m",
    "-XX:MaxMetaspaceSize=128m",
)
# A compiler JVM that starts fast: C1 only (javac's own run is short).
_JAVAC_FLAGS = tuple(f"-J{flag}" for flag in (*_JVM_LIMITS, "-XX:TieredStopAtLevel=1"))

# Compiled and linked into every C and C++ program beside its source: the threads' default stack
# back to the 8 MB they have outside, where the main stack may grow to the memory limit (the file
# says why; ``Language.main_stack``).
THREAD_STACK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "thread_stack.c")
# A compile template's part that stands for that file, where actions can read it (``detect``).
THREAD_STACK = "{thread_stack}"

# A compile template's part that stands for every top-level ``.java`` file of the workdir (the
# request's and the code's), as SandboxFusion's ``javac *.java``.
JAVA_FILES = "{java_files}"
# A compile template's part that stands for the link flags ``detect`` found (none, one or more).
LINK_FLAGS = "{link_flags}"
# SandboxFusion's optional C++ link flags, in its order: each one that links here is added.
OPTIONAL_LINK_FLAGS = ("-lcrypto", "-lssl", "-lpthread")
# How long the link probes of one compiler may take together (one link when all flags link).
LINK_PROBE_TIMEOUT_S = 30.0

# What a build whose program names no entry (``Language.entry``) reports, as SandboxFusion's Scala.
ENTRY_NOT_FOUND = "Object name not found."


# The jars a language's class path holds (``Language.jars``), each found where a Debian package
# installs it, or where its environment variable says.
@dataclass(frozen=True)
class Jar:
    env: str  # names the jar instead
    pattern: str  # where Debian puts it (a glob: versioned links beside the file)
    package: str  # the Debian package that installs it


JARS: dict[str, Jar] = {
    # SandboxFusion's javatuples-1.2.jar (MultiPL-E's Java imports org.javatuples).
    "javatuples": Jar("TANGRAM_JAVATUPLES_JAR", "/usr/share/java/javatuples*.jar", "libjavatuples-java"),
    # SandboxFusion's junit-platform-console-standalone-1.8.2.jar: the launcher, and the API the
    # tests compile against (Debian's names the engines' jars in its manifest).
    "junit": Jar("TANGRAM_JUNIT_JAR", "/usr/share/java/junit-platform-console-standalone.jar", "junit5"),
}
JAVATUPLES_ENV = JARS["javatuples"].env

# Go's builds: no module download and no toolchain switch (there is no network), no user config;
# the build cache (GOCACHE, filled by ``detect``) and the module cache (gopackages.py) are
# read-only to actions.
_GO_ENV = {"GOTOOLCHAIN": "local", "GOPROXY": "off", "GOFLAGS": "-buildvcs=false", "GOENV": "off"}


# SandboxFusion's pattern for the object ``scala`` runs: the first ``object Name``, unless an
# ``... extends X {`` comes first (then it finds none).
_SCALA_OBJECT = re.compile(r"object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){", re.DOTALL | re.MULTILINE)


def _scala_object(code: str) -> str | None:
    """The object a Scala program runs as, as SandboxFusion finds it; None when it finds none."""
    found = _SCALA_OBJECT.search(code)
    return (found.group(1) or None) if found else None


# SandboxFusion's pattern for a Java source's public class.
_JAVA_PUBLIC_CLASS = re.compile(r"\bpublic\s+(abstract\s+|final\s+)?class\s+(\w+)")


def _java_source_name(code: str) -> str | None:
    """Where SandboxFusion's JUnit runner writes the code: its public class's file, else
    ``Main.java``; nowhere when the code is empty."""
    if not code:
        return None
    found = _JAVA_PUBLIC_CLASS.search(code)
    return f"{found.group(2) if found else 'Main'}.java"


def _php_tagged(code: str) -> str:
    """SandboxFusion's PHP source: leading white space dropped, and ``<?php`` put first where the
    code does not start with it (a program written without the tag would print itself)."""
    code = code.lstrip()
    return code if code.startswith("<?php") else "<?php\n" + code


@dataclass(frozen=True)
class Language:
    """One language: where its code goes, what it needs, how it is built and run."""

    name: str
    source: str  # the workdir file the request's code is written to
    tools: Mapping[str, str]  # template field -> binary looked up on PATH
    run: tuple[str, ...]
    compile: tuple[str, ...] = ()  # empty: nothing to build
    artifacts: tuple[str, ...] = ()  # top-level workdir files (glob patterns) the compile leaves
    aliases: tuple[str, ...] = ()  # other /run_code names for it
    # SandboxFusion reports this language's build as ``compile_result``; when False, a failed
    # build is reported as the run's failure (TypeScript: tsx strips types as it runs).
    reports_compile: bool = True
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment, compile and run
    version_tool: str = ""  # the tool whose ``--version`` (or ``version``) identifies the toolchain
    version_args: tuple[str, ...] = ("--version",)
    # Link flags added to the compile (at its ``{link_flags}``) where they link with its compiler.
    optional_link_flags: tuple[str, ...] = ()
    # Jars (by library name, see ``_find_jar``) put on the class path before the request's own.
    jars: tuple[str, ...] = ()
    # The run's main stack may grow to its memory limit (RLIMIT_STACK, as SandboxFusion sets it):
    # natively compiled programs, whose deep recursion uses the process's own stack (the JVM, Go
    # and V8 keep stacks of their own, which the limit does not change). executor._limits.
    main_stack: bool = False
    # Links thread_stack.c (at ``{thread_stack}``): its main stack may grow only where it can.
    thread_stack: bool = False
    # Its programs find SandboxFusion's npm packages (nodepackages.py: linked at the workdir root).
    node_packages: bool = False
    # Built in SandboxFusion's Go module, testify's included (gopackages.py: at the workdir root).
    go_module: bool = False
    # The source file's text from the request's code (PHP: the opening tag added where missing).
    source_text: Callable[[str], str] | None = None
    # What the run starts, found in the source (``{entry}``; Scala: its object); None: the program
    # names none, and the build fails saying so (``ENTRY_NOT_FOUND``).
    entry: Callable[[str], str | None] | None = None
    # The source file's name for the code, where it is not ``source`` (JUnit: its public class's
    # file); None: the code is empty and no file is written (the request's files hold the tests).
    source_name: Callable[[str], str | None] | None = None
    # Without its jars the language cannot run at all (JUnit's launcher): not offered then.
    jars_required: bool = False

    def source_for(self, code: str) -> str | None:
        """The workdir file the request's ``code`` goes to (None: none)."""
        return self.source_name(code) if self.source_name is not None else self.source

    def source_bytes(self, code: str) -> bytes:
        """What the language's source file holds for ``code``."""
        return (self.source_text(code) if self.source_text else code).encode()

    @property
    def compiled(self) -> bool:
        """Whether the language has a build step."""
        return bool(self.compile)


LANGUAGES: tuple[Language, ...] = (
    Language(
        name="cpp",
        source="main.cpp",
        tools={"cxx": "g++"},
        # SandboxFusion's link flags, those of them that link here (see OPTIONAL_LINK_FLAGS).
        compile=("{cxx}", "-std=c++17", "main.cpp", THREAD_STACK, "-o", "test", LINK_FLAGS),
        run=("./test",),
        artifacts=("test",),
        version_tool="cxx",
        optional_link_flags=OPTIONAL_LINK_FLAGS,
        main_stack=True,
        thread_stack=True,
    ),
    Language(
        name="c",
        source="main.c",
        tools={"cc": "gcc"},
        compile=("{cc}", "-std=gnu17", "main.c", THREAD_STACK, "-o", "test", "-lm", LINK_FLAGS),
        run=("./test",),
        artifacts=("test",),
        version_tool="cc",
        optional_link_flags=OPTIONAL_LINK_FLAGS,
        main_stack=True,
        thread_stack=True,
    ),
    Language(
        name="java",
        source="Main.java",
        tools={"javac": "javac", "java": "java"},
        compile=("{javac}", *_JAVAC_FLAGS, "-encoding", "UTF-8", "-cp", "{jars}", "Main.java"),
        run=("{java}", *_JVM_LIMITS, "-cp", "{jars}", "-ea", "Main"),
        artifacts=("*.class",),
        # One malloc arena: glibc's default of one per thread reserves 64 MB of address space each.
        env={"MALLOC_ARENA_MAX": "1"},
        version_tool="javac",
        version_args=("-version",),
        jars=("javatuples",),
    ),
    Language(
        name="go",
        source="main.go",
        tools={"go": "go"},
        compile=("{go}", "build", "-o", "out", "main.go"),
        run=("./out",),
        artifacts=("out",),
        env=_GO_ENV,
        version_tool="go",
        version_args=("version",),
        go_module=True,
    ),
    Language(
        # SandboxFusion's ``go test <file>_test.go``: building the test is part of the run (a
        # compile error is the run's failure, as there); a failed test exits 1.
        name="go_test",
        source="main_test.go",
        tools={"go": "go"},
        run=("{go}", "test", "main_test.go"),
        env=_GO_ENV,
        version_tool="go",
        version_args=("version",),
        go_module=True,
    ),
    Language(
        name="rust",
        source="main.rs",
        tools={"rustc": "rustc"},
        compile=("{rustc}", "main.rs", "-o", "test"),
        run=("./test",),
        artifacts=("test",),
        version_tool="rustc",
        # Rust sizes its threads' stacks itself (2 MiB), whatever the limit.
        main_stack=True,
    ),
    Language(
        name="nodejs",
        source="main.js",
        tools={"node": "node"},
        run=("{node}", "main.js"),
        # ROLL's code reward names it by its fence, ``javascript`` (SandboxFusion refuses that name).
        aliases=("js", "javascript"),
        version_tool="node",
        node_packages=True,
    ),
    Language(
        name="perl",
        source="main.pl",
        tools={"perl": "perl"},
        run=("{perl}", "main.pl"),
        version_tool="perl",
        version_args=("-e", "print qq(perl $^V)"),
    ),
    Language(
        # SandboxFusion's ``php -f``, its code given the opening tag where it lacks one.
        name="php",
        source="main.php",
        tools={"php": "php"},
        # Sessions saved in its own /tmp: the image's /var/lib/php/sessions is out of its reach
        # (isolation.restrict_writes), and session_start() failed there.
        run=("{php}", "-d", "session.save_path=/tmp", "-f", "main.php"),
        version_tool="php",
        source_text=_php_tagged,
    ),
    Language(
        name="ruby",
        source="main.rb",
        tools={"ruby": "ruby"},
        run=("{ruby}", "main.rb"),
        version_tool="ruby",
    ),
    Language(
        # SandboxFusion's ``dmd <file> -unittest -of=test && ./test``: the unittest blocks run before
        # main (MultiPL-E's D tests are such blocks and an empty main). LDC's dmd-compatible driver
        # (Debian has no dmd), with the same flags.
        name="D_ut",
        source="main.d",
        tools={"ldmd2": "ldmd2"},
        # ``./main.d``: druntime prints a failed unittest's short form ("main.d(2): [unittest] ...")
        # on stdout only where the file's path starts with the module's name; SandboxFusion
        # compiles an absolute path, and its stdout stays empty (the assertion goes to stderr).
        compile=("{ldmd2}", "./main.d", "-unittest", "-of=test"),
        run=("./test",),
        artifacts=("test", "test.o"),
        version_tool="ldmd2",
    ),
    Language(
        # SandboxFusion's (after VerilogEval's harness): the test bench is module ``tb``, built by
        # Icarus Verilog as SystemVerilog 2012 with its warnings, run by ``vvp -n`` (``$stop``
        # ends the run rather than waiting at an interactive prompt).
        name="verilog",
        source="main.sv",
        tools={"iverilog": "iverilog", "vvp": "vvp"},
        compile=(
            "{iverilog}",
            "-Wall",
            "-Winfloop",
            "-Wno-timescale",
            "-g2012",
            "-s",
            "tb",
            "-o",
            "test.vvp",
            "main.sv",
        ),
        run=("{vvp}", "-n", "test.vvp"),
        artifacts=("test.vvp",),
        version_tool="iverilog",
        version_args=("-V",),
    ),
    Language(
        # SandboxFusion's: the code in its public class's file (``Main.java`` where it has none), every
        # .java of the workdir compiled against the launcher's jar, and the launcher run on the
        # class path, finding the tests there (``--scan-class-path``); a failed test exits 1.
        name="junit",
        source="Main.java",
        source_name=_java_source_name,
        tools={"javac": "javac", "java": "java"},
        compile=("{javac}", *_JAVAC_FLAGS, "-encoding", "UTF-8", "-cp", "{jars}", JAVA_FILES),
        run=("{java}", *_JVM_LIMITS, "-jar", "{junit}", "--class-path", "{jars}", "--scan-class-path"),
        artifacts=("*.class",),
        env={"MALLOC_ARENA_MAX": "1"},
        version_tool="javac",
        version_args=("-version",),
        jars=("junit",),
        jars_required=True,
    ),
    Language(
        # SandboxFusion's ``scalac <file>.scala`` then ``scala <object>``, the object found in the
        # code by its pattern (``_scala_object``); the JVM limited as Java's (``-J`` passes them).
        name="scala",
        source="main.scala",
        tools={"scalac": "scalac", "scala": "scala"},
        compile=("{scalac}", *_JAVAC_FLAGS, "-encoding", "UTF-8", "main.scala"),
        run=("{scala}", *(f"-J{flag}" for flag in _JVM_LIMITS), "{entry}"),
        artifacts=("*.class",),
        env={"MALLOC_ARENA_MAX": "1"},
        version_tool="scalac",
        version_args=("-version",),
        entry=_scala_object,
    ),
    Language(
        name="lua",
        source="main.lua",
        tools={"lua": "lua"},
        run=("{lua}", "main.lua"),
        version_tool="lua",
        version_args=("-v",),
    ),
    Language(
        name="R",
        source="main.R",
        tools={"Rscript": "Rscript"},
        run=("{Rscript}", "main.R"),
        version_tool="Rscript",
    ),
    Language(
        name="typescript",
        source="main.ts",
        tools={"esbuild": "esbuild", "node": "node"},
        # tsx's semantics: types stripped, not checked; CommonJS, as tsx runs a .ts file outside
        # an ESM package (so `require` works). Bundled, the program's own modules with it (each
        # file stripped alone left `import './lib'` to find no lib.js), packages left to require.
        compile=(
            "{esbuild}",
            "main.ts",
            "--bundle",
            "--packages=external",
            "--format=cjs",
            "--platform=node",
            "--log-level=warning",
            "--outfile=main.js",
        ),
        run=("{node}", "main.js"),
        artifacts=("main.js",),
        aliases=("ts",),
        reports_compile=False,
        version_tool="esbuild",
        node_packages=True,
    ),
)


@dataclass(frozen=True)
class Toolchain:
    """A language this host can run: its binaries resolved, its version known."""

    language: Language
    binaries: Mapping[str, str]  # template field -> absolute path of the real binary
    version: str  # first line of the version tool's answer
    fingerprint: str  # identifies the exact toolchain (compile cache key)
    env: Mapping[str, str]  # the language's environment plus what detection found (GOCACHE)
    readable: tuple[str, ...]  # directories actions must be able to read
    # The JVM's own default heap here (``java`` without -Xmx: a quarter of the memory it sees), in
    # MB; 0 where unknown or not a JVM language.
    default_heap_mb: int = 0
    link_flags: tuple[str, ...] = ()  # the optional link flags that link here (at ``{link_flags}``)
    thread_stack: str = ""  # thread_stack.c, where actions can read it (at ``{thread_stack}``)
    class_path: tuple[str, ...] = ()  # jars found, in order, for the class path after ``.``
    libraries: Mapping[str, str] = field(default_factory=dict)  # jar or npm package -> its path
    node_modules: str = ""  # the npm packages' directory, for Node's programs (nodepackages.py)
    go_modcache: str = ""  # the Go module cache, complete, for Go's builds (gopackages.py)
    # What of the language's optional flags and jars this host lacks, and why.
    missing_libraries: Mapping[str, str] = field(default_factory=dict)
    # Template field -> the word argv names it by: its name where an action's PATH finds that very
    # binary by it, as a shell running ``lua main.lua`` does (``command_words``); else its path.
    commands: Mapping[str, str] = field(default_factory=dict)

    def heap_mb(self, memory_mb: int) -> int:
        """The JVM heap of a program limited to ``memory_mb``: what fits the limit (see
        ``jvm_heap_mb``), never more than ``java`` takes by itself. (A heap of three quarters of
        the host let an 8 GB array through where ``java Main`` fails with OutOfMemoryError.)"""
        fits = jvm_heap_mb(memory_mb)
        return min(fits, self.default_heap_mb) if self.default_heap_mb > 0 else fits

    def argv(
        self, template: tuple[str, ...], values: Mapping[str, str], java_files: tuple[str, ...] = ()
    ) -> list[str]:
        """``template`` with the binaries, the jars found (by name) and ``values`` filled in
        (``{link_flags}``: the link flags found, none or several arguments; ``{java_files}``:
        ``java_files``)."""
        fields = {**values, **self.libraries, **self.binaries, **self.commands}
        argv: list[str] = []
        for part in template:
            if part == LINK_FLAGS:
                argv.extend(self.link_flags)
            elif part == JAVA_FILES:
                argv.extend(java_files)
            elif part == THREAD_STACK:
                argv.extend([self.thread_stack] if self.thread_stack else [])
            else:
                argv.append(part.format_map(fields))
        return argv

    def jars(self, request_jars: list[str]) -> str:
        """The class path: ``.``, the jars found here, then the request's own (SandboxFusion's
        ``.:javatuples-1.2.jar:<the request's jars>``)."""
        return ":".join([".", *self.class_path, *request_jars])

    def describe(self) -> dict[str, object]:
        """JSON view for ``/v1/health``."""
        return {
            "compiled": self.language.compiled,
            "version": self.version,
            "binaries": dict(self.binaries),
            "aliases": list(self.language.aliases),
            "link_flags": list(self.link_flags),
            "libraries": dict(self.libraries),
            "missing_libraries": dict(self.missing_libraries),
        }

    def label(self) -> str:
        """The version, and what the toolchain lacks (the start-up line)."""
        lacks = ", ".join(sorted(self.missing_libraries))
        return f"{self.version}; without {lacks}" if lacks else self.version


@dataclass(frozen=True)
class Detection:
    """What ``detect`` found: the languages this host runs, and why each other one is missing."""

    found: Mapping[str, Toolchain]
    missing: Mapping[str, str]  # language -> what is missing, naming the binary

    def lookup(self, name: str) -> Toolchain | None:
        """The toolchain of a language (by its name or an alias), when this host has it."""
        for toolchain in self.found.values():
            if name == toolchain.language.name or name in toolchain.language.aliases:
                return toolchain
        return None

    def readable(self) -> list[str]:
        """Every directory the sandbox must let actions read."""
        return sorted({path for toolchain in self.found.values() for path in toolchain.readable})

    def go_modcache(self) -> str:
        """The complete Go module cache Go's builds are given ("" when none is)."""
        return next((tc.go_modcache for tc in self.found.values() if tc.go_modcache), "")

    def node_modules(self) -> str:
        """The npm packages' directory Node's programs are given ("" when none is)."""
        return next((tc.node_modules for tc in self.found.values() if tc.node_modules), "")

    def summary(self) -> str:
        """One line for the start-up log."""
        found = ", ".join(f"{name} ({tc.label()})" for name, tc in sorted(self.found.items())) or "none"
        missing = "; ".join(f"{name}: {why}" for name, why in sorted(self.missing.items()))
        return f"languages found: {found}" + (f"; not offered: {missing}" if missing else "")


def known_name(name: str) -> str | None:
    """The language a /run_code name stands for (itself or the language it is an alias of)."""
    for language in LANGUAGES:
        if name == language.name or name in language.aliases:
            return language.name
    return None


def compiles(name: str) -> bool:
    """Whether /run_code's ``compile_timeout`` applies to a language name: it builds before it runs
    (Python, bash and unknown names do not)."""
    return name in _COMPILED


_COMPILED = frozenset(name for lang in LANGUAGES if lang.compiled for name in (lang.name, *lang.aliases))


def _probe(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """First non-empty line a toolchain prints for ``argv`` (``java -version`` writes to stderr)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=30, env=dict(env) if env else None, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc.__class__.__name__})"
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if line.strip():
            return line.strip()
    return "unknown"


# The system part of an action's PATH (``action_path`` puts the agent's Python first).
ACTION_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def action_path() -> str:
    """An action's ``PATH``: the agent's Python's directory, then the system's."""
    return f"{os.path.dirname(sys.executable)}:{ACTION_SYSTEM_PATH}"


# Compiling the whole standard library on a cold cache: about a minute on two busy cores.
GO_STD_BUILD_TIMEOUT_S = 900


# What each warming of Go's build cache came to, by toolchain and settings: go and go_test share the
# cache and detect runs them side by side, so the second waits for the first and takes its answer.
_GO_WARMED: dict[tuple[str, ...], str | None] = {}
_GO_WARM_LOCK = threading.Lock()


def _warm_go_cache(go: str, env: Mapping[str, str]) -> str | None:
    """``_warm_go_build``, once per toolchain and settings in this process."""
    key = (go, *sorted(f"{k}={v}" for k, v in env.items()))
    with _GO_WARM_LOCK:
        if key not in _GO_WARMED:
            _GO_WARMED[key] = _warm_go_build(go, env)
        return _GO_WARMED[key]


def _warm_go_build(go: str, env: Mapping[str, str]) -> str | None:
    """Compile the standard library (and the module's packages, testify's, where the module cache
    is given: ``GOMODCACHE``) into the build cache that actions read (and cannot write), and the
    vet facts ``go test`` computes for a test's imports.

    A cold or partial cache (a fresh host, or one whose cache only other builds filled) would fail
    every action that imports a package not yet in it (``package bufio is not in std``), and each
    ``go test`` importing testify would compile it and vet its imports again: 2.4 s a test in the
    sandbox image (Go 1.19), 0.3 s once vetted here. Done here as the agent, with the actions' own
    settings (so the cache keys are theirs), in the module as actions build in it: a minute when
    cold, half a second when warm. A cache the agent cannot write was filled by whoever made it so
    (the sandbox image runs this as root) and is left alone. Returns why Go cannot be offered, or
    None.
    """
    cache = env["GOCACHE"]
    if not os.access(cache, os.W_OK):
        return None
    build_env = {
        "PATH": f"{os.path.dirname(go)}:{ACTION_SYSTEM_PATH}",
        "HOME": os.environ.get("HOME", "/"),
        **env,
    }
    modcache = env.get("GOMODCACHE", "")
    packages = ["std", *(gopackages.PACKAGES if modcache else ())]
    steps = [
        [go, "build", *packages],
        [go, "test", "-count=1", "-run", "^$", gopackages.WARM_TEST],
    ]
    with tempfile.TemporaryDirectory(prefix="tangram-go-warm-") as module:
        gopackages.place_at(module, modcache)
        gopackages.write_warm_test(module, with_module=bool(modcache))
        for argv in steps:
            what = f"`go {' '.join(argv[1:])}` (to fill the build cache {cache})"
            try:
                done = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=GO_STD_BUILD_TIMEOUT_S,
                    env=build_env,
                    cwd=module,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return f"{what} failed: {exc}"
            if done.returncode != 0:
                why = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return f"{what} failed: {why}"
    return None


def _real_rustc(path: str) -> str:
    """A rustup proxy's toolchain ``rustc`` (the proxy needs RUSTUP_HOME and reads its settings:
    actions run the toolchain's own binary)."""
    if os.path.basename(os.path.realpath(path)) not in ("rustup", "rustup-init"):
        return os.path.realpath(path)
    sysroot = _probe([path, "--print", "sysroot"])
    real = os.path.join(sysroot, "bin", "rustc")
    return real if os.access(real, os.X_OK) else os.path.realpath(path)


_RESOLVERS: dict[str, Callable[[str], str]] = {"rustc": _real_rustc}


def _install_root(binary: str) -> str:
    """The installation a binary belongs to (``/usr/local/go`` for ``/usr/local/go/bin/go``)."""
    parent = os.path.dirname(binary)
    return os.path.dirname(parent) if os.path.basename(parent) == "bin" else parent


def _fingerprint(binaries: Mapping[str, str], version: str, extra: Mapping[str, str] | None = None) -> str:
    """The toolchain's identity: version, binaries and ``extra`` files (jars) by path, size and
    mtime."""
    digest = hashlib.sha256(version.encode())
    files = {**binaries, **{f"file:{key}": path for key, path in (extra or {}).items()}}
    for key in sorted(files):
        info = os.stat(files[key])
        digest.update(f"{key}={files[key]}:{info.st_size}:{info.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def _link_flags(compiler: str, source: str, flags: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Which of ``flags`` link with ``compiler`` here (SandboxFusion's probe): an empty ``main``
    linked, in a temporary directory, with all of them at once, and only when that fails with each
    alone. Returns the flags that link, in their order, and why each other one does not."""
    deadline = time.monotonic() + LINK_PROBE_TIMEOUT_S
    env = {"PATH": f"{os.path.dirname(compiler)}:{ACTION_SYSTEM_PATH}", "LC_ALL": "C"}
    with tempfile.TemporaryDirectory(prefix="tangram-link-probe-") as tmp:
        with open(os.path.join(tmp, source), "w", encoding="utf-8") as out:
            out.write("int main(void) { return 0; }\n")

        def links(chosen: tuple[str, ...]) -> str | None:
            """None when ``chosen`` links, else why not."""
            left = deadline - time.monotonic()
            if left <= 0:
                return f"not probed: the probes took over {LINK_PROBE_TIMEOUT_S:g} s"
            try:
                done = subprocess.run(
                    [compiler, source, "-o", "probe", *chosen],
                    capture_output=True,
                    text=True,
                    timeout=left,
                    env=env,
                    cwd=tmp,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                return f"the probe failed ({exc.__class__.__name__})"
            if done.returncode == 0:
                return None
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            first = lines[0] if lines else "no output"
            return f"does not link with {os.path.basename(compiler)} here: {first}"

        if not flags or links(flags) is None:
            return flags, {}
        found: list[str] = []
        missing: dict[str, str] = {}
        for flag in flags:
            why = links((flag,))
            if why is None:
                found.append(flag)
            else:
                missing[flag] = why
        return tuple(found), missing


def _find_jar(name: str) -> tuple[str | None, str]:
    """The real file of a jar of ``jars`` (``JARS``), or None and why it is missing.

    Its environment variable names the jar; otherwise Debian's unversioned file first (say
    ``/usr/share/java/javatuples.jar``), then any versioned one its pattern matches."""
    known = JARS.get(name)
    if known is None:
        return None, f"no such library known: {name!r}"
    override = os.environ.get(known.env, "")
    if override:
        candidates = [override]
    else:
        found = glob.glob(known.pattern)
        unversioned = os.path.basename(known.pattern).replace("*", "")
        candidates = sorted(found, key=lambda p: (os.path.basename(p) != unversioned, p))
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if not os.path.isfile(real) or not os.access(real, os.R_OK):
            continue
        if ":" in real:  # it could not be a class path entry
            continue
        return real, ""
    where = f"{override} ({known.env})" if override else known.pattern
    return None, f"no readable jar at {where}; Debian's {known.package} installs it"


def _detect_one(language: Language, path: str) -> Toolchain | str:
    binaries: dict[str, str] = {}
    for key, name in language.tools.items():
        found = shutil.which(name, path=path)
        if found is None:
            return f"{name!r} not found on PATH"
        binaries[key] = _RESOLVERS.get(name, os.path.realpath)(found)
    version = _probe([binaries[language.version_tool], *language.version_args])
    env = dict(language.env)
    readable = {_install_root(b) for b in binaries.values()}
    link_flags: tuple[str, ...] = ()
    missing: dict[str, str] = {}
    libraries: dict[str, str] = {}
    go_modcache = ""
    if language.go_module:
        go_modcache, modules, absent = gopackages.find()
        libraries.update(modules)
        missing.update(absent)
        env.update(gopackages.go_env(go_modcache))
        if go_modcache:
            readable.add(go_modcache)
        # The build cache holds the standard library (and the module's packages), compiled:
        # read-only for actions (go build works with a cache it cannot write), so no action can
        # plant an entry another would use.
        cache = _probe([binaries["go"], "env", "GOCACHE"])
        if os.path.isabs(cache):
            os.makedirs(cache, exist_ok=True)
            env["GOCACHE"] = cache
            readable.add(cache)
            failed = _warm_go_cache(binaries["go"], env)
            if failed:
                return failed
    if language.optional_link_flags:
        compiler = binaries[language.version_tool]
        link_flags, unlinked = _link_flags(compiler, language.source, language.optional_link_flags)
        missing.update(unlinked)
    for jar in language.jars:
        jar_path, why = _find_jar(jar)
        if jar_path is None and language.jars_required:
            return f"{jar}: {why}"
        if jar_path is None:
            missing[jar] = why
        else:
            libraries[jar] = jar_path
            readable.add(os.path.dirname(jar_path))
    node_modules = ""
    if language.node_packages:
        # Not in the compile's key: TypeScript's bundle leaves packages to Node's require.
        node_modules, packages, absent = nodepackages.find()
        libraries.update(packages)
        missing.update(absent)
        if node_modules:
            readable.add(node_modules)
    # What the build takes besides the request's files is in the compile cache's key too.
    built_with = {name: libraries[name] for name in language.jars if name in libraries}
    if go_modcache:  # the module's requirements, which the build resolves imports by
        built_with.update({f: os.path.join(gopackages.MODULE_DIR, f) for f in gopackages.MODULE_FILES})
    thread_stack = ""
    if language.thread_stack:
        real = os.path.realpath(THREAD_STACK_SOURCE)
        hidden = [d for d in PRIVATE_TMP_POINTS if real.startswith(d + "/")]
        if hidden:
            # Installed where each action has a tmpfs of its own, empty: every build would fail.
            missing["thread_stack.c"] = (
                f"{real} is out of actions' sight (each has a {hidden[0]} of its own): a program's "
                "main stack stays 8 MB"
            )
        else:
            thread_stack = built_with["thread_stack"] = THREAD_STACK_SOURCE
            readable.add(os.path.dirname(THREAD_STACK_SOURCE))
    return Toolchain(
        language=language,
        binaries=binaries,
        commands=command_words(language.tools, binaries, action_path()),
        version=version,
        fingerprint=_fingerprint(binaries, version, built_with),
        env=env,
        readable=tuple(sorted(readable)),
        default_heap_mb=_default_heap_mb(binaries["java"], env) if "java" in binaries else 0,
        link_flags=link_flags,
        thread_stack=thread_stack,
        class_path=tuple(libraries[jar] for jar in language.jars if jar in libraries),
        libraries=libraries,
        missing_libraries=missing,
        node_modules=node_modules,
        go_modcache=go_modcache,
    )


def command_words(tools: Mapping[str, str], binaries: Mapping[str, str], path: str) -> dict[str, str]:
    """The word each binary is named by in an action's argv: its name (``tools``) where ``path``
    finds that very binary by it, else its absolute path. A shell running ``lua main.lua`` gives
    the program ``lua`` as its ``argv[0]``, which programs show: Lua's errors begin with it
    (``lua: main.lua:1: boom``; with the path it was ``/usr/bin/lua5.2: ...``), gcc's own
    messages (``g++: fatal error: ...``), Node's ``process.argv0``. The child execs a bare name
    by that same ``PATH`` (``child._run_action``)."""
    words: dict[str, str] = {}
    for key, real in binaries.items():
        name = tools.get(key, "")
        found = shutil.which(name, path=path) if name and "/" not in name else None
        words[key] = name if found is not None and os.path.realpath(found) == real else real
    return words


def _default_heap_mb(java: str, env: Mapping[str, str]) -> int:
    """The heap ``java`` picks by itself on this host (its ergonomics: a share of the memory it
    sees, the container's limit where there is one), with the collector and arenas actions run
    with; 0 when it cannot be read."""
    flags = [f for f in _JVM_LIMITS if not f.startswith("-Xmx")]
    try:
        done = subprocess.run(
            [java, *flags, "-XX:+PrintFlagsFinal", "-version"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "MaxHeapSize" and parts[3].isdigit():
            return int(parts[3]) >> 20
    return 0


def detect(path: str | None = None, languages: tuple[Language, ...] = LANGUAGES) -> Detection:
    """Which ``languages`` this host can run, looking up binaries on ``path`` (default: ``PATH``).

    The version probes run side by side (a JVM takes a moment to start).
    """
    search = path if path is not None else os.environ.get("PATH", os.defpath)
    found: dict[str, Toolchain] = {}
    missing: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(languages) or 1) as pool:
        results = list(pool.map(lambda lang: _detect_one(lang, search), languages))
    for language, result in zip(languages, results, strict=True):
        if isinstance(result, Toolchain):
            found[language.name] = result
        else:
            missing[language.name] = result
    return Detection(found=found, missing=missing)


def artifact_names(language: Language, names: list[str]) -> list[str]:
    """Which of a workdir's top-level ``names`` are the compile's artifacts."""
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in language.artifacts))


def jvm_heap_mb(memory_mb: int) -> int:
    """The JVM heap that fits a memory limit of ``memory_mb`` (see ``JVM_RESERVE_MB``, measured
    under an address-space limit, which counts more than the data limit a program runs under now)."""
    return max(JVM_MIN_HEAP_MB, min(memory_mb - JVM_RESERVE_MB, int(memory_mb * JVM_MAX_HEAP_SHARE)))


# The key of /run_code's SandboxError body that says the language, not the sandbox, failed.
LANGUAGE_UNAVAILABLE = "language_unavailable"


def unavailable_language(
    name: str, offered: list[str], missing: Mapping[str, str]
) -> tuple[int, dict[str, object]]:
    """The HTTP status and body ``/run_code`` answers for a language this host does not run.

    As SandboxFusion answers: a name it does not know at all fails its request validation (422,
    ``detail`` in FastAPI's shape); a name it knows is answered in its response shape, here
    ``SandboxError`` with a message naming what is missing, so that a client scores neither a
    wrong answer nor an API failure.
    """
    offered_text = ", ".join(sorted(set(offered)))
    if name not in SANDBOXFUSION_LANGUAGES and known_name(name) is None:
        expected = ", ".join(repr(n) for n in SANDBOXFUSION_LANGUAGES)
        message = f"language: unknown language {name!r}; this host offers {offered_text}"
        detail = {
            "type": "literal_error",
            "loc": ["body", "language"],
            "msg": f"Input should be {expected}",
            "input": name,
        }
        # ``detail`` as SandboxFusion's request validation words it; the rest as our refusals.
        return 422, {"detail": [detail], "error": message, "status": "SandboxError", "message": message}
    canonical = known_name(name) or name
    why = missing.get(canonical, "no runner for it in this agent")
    return 200, {
        "status": "SandboxError",
        "message": f"language {name!r} is not available on this host ({why}); it offers {offered_text}",
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": os.environ.get("MY_POD_NAME") or os.environ.get("POD_NAME"),
        "files": {},
        # An extra key, as the others this agent adds: the request's language, not the sandbox,
        # failed (a dispatcher must neither retry it nor count it against the host).
        LANGUAGE_UNAVAILABLE: canonical,
    }


def main() -> int:
    """``python -m arl_tangram.sandbox.languages``: what an agent started here would offer. Run by
    ``make install`` so that the build caches an agent fills on its first start (Go's standard
    library) are filled once, at install, rather than in the first test's agent."""
    print(f"sandbox: {detect().summary()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
