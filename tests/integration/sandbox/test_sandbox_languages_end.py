"""A program in a language beyond Python ends in the sandbox as it ends outside: each program below
runs through a real agent (``/run_code``) and as a plain user runs it in a fresh directory (``g++
main.cpp -o test && ./test``, ``javac Main.java && java -ea Main``, ``go build``, ``rustc``, ``node
main.js``, ``bash .tangram-main.sh``, ``perl main.pl``, ``php -f main.php``, ``ruby main.rb``,
``lua main.lua``, ``Rscript main.R``, ``ldmd2 main.d -unittest -of=test && ./test``, ``scalac
main.scala && scala Main``, with the very toolchains the agent found), and the two must give the
same verdict, return code and stdout (and stderr where it names no path or pid). None of the
expected values is written here: the reference is the toolchain itself.

The programs are the ways a run's end was found to differ, and representative ordinary ones:
bash run as ``bash -c`` (``$0``, its error messages, its last command exec'd in its place so that
a signal death was not bash's 128+n, scripts over 128 KiB refused), a memory limit enforced on the
address space (a Go binary, Node, and the compilers of Go, Rust and Java failed under 512 MB where
their programs use a few MB) and a JVM heap larger than ``java`` takes by itself (an 8 GB array
succeeded where ``java Main`` fails with OutOfMemoryError); then signals, exit statuses beyond a
byte, buffered output lost or kept at exit, panics and uncaught exceptions, Node's exit codes.

Each language is skipped only where this host lacks its toolchain, and the skip names the binary.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from sandbox_agent_harness import Agent, start_agent, stop_agent

from arl_tangram.sandbox.executor import BASH_FILE
from arl_tangram.sandbox.languages import LANGUAGES

COMPILE_TIMEOUT_S = 120  # a first build can be slow on a busy two-core machine
RUN_TIMEOUT_S = 30
SOURCES = {lang.name: lang.source for lang in LANGUAGES} | {"bash": BASH_FILE}
ENVS = {lang.name: dict(lang.env) for lang in LANGUAGES}
KNOWN = {lang.name: lang for lang in LANGUAGES}


@dataclass(frozen=True)
class Case:
    language: str
    code: str
    stdin: str | None = None
    memory_mb: int | None = None  # the request's memory_limit_MB (outside: no limit)
    same_stderr: bool = False  # stderr names no path or pid: it must match too


C = "#include <stdio.h>\n#include <stdlib.h>\n#include <signal.h>\n#include <unistd.h>\n"
CPP = "#include <iostream>\n#include <stdexcept>\n#include <cstdlib>\n"
GO_HELLO = 'package main\nimport "fmt"\nfunc main(){ fmt.Println("hello") }\n'
RUST_HELLO = (
    "use std::collections::HashMap;\n"
    'fn main(){ let mut m = HashMap::new(); m.insert(1, 2); println!("{}", m.len()); }\n'
)
JAVA_HELLO = (
    "import java.util.*;\npublic class Main { public static void main(String[] a) {\n"
    "  List<Integer> l = new ArrayList<>(); l.add(1); System.out.println(l.size()); } }\n"
)
NOISY_SCRIPT = "x=0\n" + "x=$((x+1))\n" * 15_000 + "echo $x\n"  # about 165 KB

CASES: dict[str, Case] = {
    # bash runs from a file, as ``bash <file>``.
    "bash: $0 and BASH_SOURCE name the script": Case("bash", 'echo "$0" "${BASH_SOURCE[0]}"\n'),
    "bash: an error names the script": Case("bash", "echo a\nnosuchcommand_q\n", same_stderr=True),
    "bash: a syntax error names the script": Case("bash", "echo first\nif then fi\n", same_stderr=True),
    "bash: the last command killed by a signal": Case("bash", "echo hi\nsh -c 'kill -SEGV $$'\n"),
    "bash: a script over 128 KiB": Case("bash", NOISY_SCRIPT),
    "bash: the script reads itself": Case("bash", 'head -c 12 "$0"; echo\n'),
    "bash: kill -9 $$": Case("bash", "echo before; kill -9 $$; echo after\n"),
    "bash: stdin read to its end": Case("bash", "wc -c\n", stdin="l1\nl2\nl3\n"),
    # A memory limit holds what a program writes, not the address space its runtime reserves; the
    # compile is not the program (a judge limits the program).
    "go: hello world and its build under 256 MB": Case("go", GO_HELLO, memory_mb=256),
    "nodejs: hello world under 256 MB": Case("nodejs", "console.log('hello');\n", memory_mb=256),
    "typescript: hello world under 256 MB": Case(
        "typescript", "const x: number = 1; console.log(x);\n", memory_mb=256
    ),
    "rust: hello world and its build under 256 MB": Case("rust", RUST_HELLO, memory_mb=256),
    "java: hello world and its build under 256 MB": Case("java", JAVA_HELLO, memory_mb=256),
    # Signals and statuses (these matched already: kept as the representative cases).
    "c: abort after a flushed line": Case(
        "c", C + 'int main(void){ puts("before"); fflush(stdout); abort(); }\n'
    ),
    "c: kill(getpid(), SIGTERM)": Case(
        "c", C + "int main(void){ kill(getpid(), SIGTERM); sleep(1); return 0; }\n"
    ),
    "c: return 256": Case("c", C + "int main(void){ return 256; }\n"),
    "c: return -1": Case("c", C + "int main(void){ return -1; }\n"),
    "c: buffered printf then _exit": Case("c", C + 'int main(void){ printf("lost"); _exit(0); }\n'),
    "c: buffered printf then exit": Case("c", C + 'int main(void){ printf("kept"); exit(0); }\n'),
    "c: raise(SIGPIPE)": Case("c", C + "int main(void){ raise(SIGPIPE); return 0; }\n"),
    "c: a system() child kills its parent": Case(
        "c", C + 'int main(void){ system("kill -9 $PPID"); sleep(1); puts("survived"); return 0; }\n'
    ),
    "cpp: an uncaught exception": Case(
        "cpp", CPP + 'int main(){ throw std::runtime_error("boom"); }\n', same_stderr=True
    ),
    "cpp: std::exit(3) with buffered cout": Case(
        "cpp", CPP + 'int main(){ std::cout << "x"; std::exit(3); }\n'
    ),
    "java: an uncaught exception": Case(
        "java",
        'public class Main { public static void main(String[] a){ throw new RuntimeException("boom"); } }\n',
    ),
    "java: System.exit(-1)": Case(
        "java", "public class Main { public static void main(String[] a){ System.exit(-1); } }\n"
    ),
    "java: a shutdown hook halts with 0 after System.exit(1)": Case(
        "java",
        "public class Main { public static void main(String[] a){\n"
        "  Runtime.getRuntime().addShutdownHook(new Thread(() -> Runtime.getRuntime().halt(0)));\n"
        "  System.exit(1); } }\n",
    ),
    "go: a panic": Case("go", 'package main\nfunc main(){ panic("boom") }\n'),
    "go: os.Exit(-1) after a deferred print": Case(
        "go",
        'package main\nimport ("fmt"; "os")\nfunc main(){ defer fmt.Println("deferred"); os.Exit(-1) }\n',
    ),
    "go: a deadlock": Case("go", "package main\nfunc main(){ c := make(chan int); <-c }\n"),
    "rust: a panic": Case("rust", 'fn main(){ panic!("boom"); }\n'),
    "rust: process::exit(3) after print!": Case(
        "rust", 'fn main(){ print!("buffered"); std::process::exit(3); }\n'
    ),
    "rust: process::abort": Case("rust", 'fn main(){ println!("x"); std::process::abort(); }\n'),
    "nodejs: process.exitCode": Case("nodejs", "process.exitCode = 4;\nconsole.log('end');\n"),
    "nodejs: process.exit with a timer pending": Case(
        "nodejs", "setTimeout(() => console.log('late'), 100);\nprocess.exit(0);\n"
    ),
    "nodejs: an unhandled rejection": Case("nodejs", "Promise.reject(new Error('no'));\n"),
    "nodejs: SIGTERM to itself": Case(
        "nodejs", "process.kill(process.pid, 'SIGTERM');\nsetTimeout(() => console.log('survived'), 1000);\n"
    ),
    "typescript: a type error still runs": Case(
        "typescript", "let y: number = 'no' as any;\nconsole.log(y);\n"
    ),
    "perl: die": Case("perl", 'print "x";\ndie "boom\\n";\n', same_stderr=True),
    "php: an uncaught exception": Case("php", '<?php\necho "x";\nthrow new Exception("boom");\n'),
    "php: exit(3) after output": Case("php", 'echo "a";\nexit(3);\n'),
    "php: exit with a message": Case("php", '<?php exit("bye\\n");', same_stderr=True),
    "php: a fatal error": Case("php", "<?php\nundefined_function();\n"),
    "ruby: an exception": Case("ruby", 'puts "x"\nraise "boom"\n'),
    "ruby: exit! after a buffered print": Case("ruby", 'print "buffered"\nexit!(5)\n', same_stderr=True),
    "ruby: abort": Case("ruby", 'abort("bye")\n', same_stderr=True),
    "ruby: a signal to itself": Case("ruby", "Process.kill('TERM', Process.pid)\nsleep 1\nputs 'survived'\n"),
    "D_ut: a failed unittest": Case(
        "D_ut", 'unittest { assert(1 + 1 == 3); }\nvoid main() { import std.stdio; writeln("main"); }\n'
    ),
    "D_ut: unittests pass, then main": Case(
        "D_ut", 'unittest { assert(1 + 1 == 2); }\nvoid main() { import std.stdio; writeln("main"); }\n'
    ),
    "D_ut: an uncaught exception": Case("D_ut", 'void main() { throw new Exception("boom"); }\n'),
    "scala: an uncaught exception": Case(
        "scala",
        'object Main { def main(args: Array[String]): Unit = { print("x"); throw new Exception("boom") } }\n',
    ),
    "scala: sys.exit(3)": Case(
        "scala", "object Main { def main(args: Array[String]): Unit = sys.exit(3) }\n"
    ),
    "scala: a failed assert, MultiPL-E's way": Case(
        "scala",
        "import scala.math._\nobject Problem {\n  def add(x : Long, y : Long) : Long = x + y\n"
        "  def main(args: Array[String]) = {\n    assert(add((2l), (3l)) == (6l));\n  }\n}\n",
    ),
    "lua: error": Case("lua", 'io.write("x")\nerror("boom")\n'),
    "lua: os.exit(false)": Case("lua", 'print("a")\nos.exit(false)\n', same_stderr=True),
    "lua: os.exit(7) with buffered output": Case(
        "lua", 'io.write("buffered")\nos.exit(7)\n', same_stderr=True
    ),
    "R: stop": Case("R", 'cat("x\\n")\nstop("boom")\n', same_stderr=True),
    "R: quit with a status from a function": Case(
        "R", "f <- function() quit(save = 'no', status = 4)\nf()\n"
    ),
    "R: a warning is not an error": Case("R", 'warning("careful")\ncat("done\\n")\n', same_stderr=True),
}


def _default_signals() -> None:
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _plain_commands(language: str, bins: dict[str, str], code: str) -> tuple[list[str] | None, list[str]]:
    """How a plain user builds and runs the source file (the agent's toolchain binaries)."""
    if language == "c":
        return [bins["cc"], "-std=gnu17", "main.c", "-o", "test", "-lm", "-lpthread"], ["./test"]
    if language == "cpp":
        return [bins["cxx"], "-std=c++17", "main.cpp", "-o", "test", "-lpthread"], ["./test"]
    if language == "java":
        return [bins["javac"], "-encoding", "UTF-8", "-cp", ".", "Main.java"], [
            bins["java"],
            "-cp",
            ".",
            "-ea",
            "Main",
        ]
    if language == "go":
        return [bins["go"], "build", "-o", "out", "main.go"], ["./out"]
    if language == "rust":
        return [bins["rustc"], "main.rs", "-o", "test"], ["./test"]
    if language == "typescript":
        esbuild = [bins["esbuild"], "main.ts", "--format=cjs", "--platform=node", "--outfile=main.js"]
        return esbuild, [bins["node"], "main.js"]
    if language == "nodejs":
        return None, [bins["node"], "main.js"]
    if language == "perl":
        return None, [bins["perl"], "main.pl"]
    if language == "php":
        return None, [bins["php"], "-f", "main.php"]
    if language == "ruby":
        return None, [bins["ruby"], "main.rb"]
    if language == "D_ut":
        # SandboxFusion compiles the source by its absolute path: a failed unittest's short form
        # then stays off stdout (druntime prints it there only for a path starting "main").
        return [bins["ldmd2"], "./main.d", "-unittest", "-of=test"], ["./test"]
    if language == "scala":
        entry = KNOWN["scala"].entry
        assert entry is not None
        return [bins["scalac"], "main.scala"], [bins["scala"], str(entry(code))]
    if language == "lua":
        return None, [bins["lua"], "main.lua"]
    if language == "R":
        return None, [bins["Rscript"], "main.R"]
    return None, ["/bin/bash", BASH_FILE]


def _plain_env(language: str) -> dict[str, str]:
    """A plain user's environment, with the language's own variables."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": os.environ.get("HOME", "/")}
    env.update(ENVS.get(language, {}))
    return env


def outside(case: Case, bins: dict[str, str], workdir: Path) -> dict[str, Any]:
    """The plain run: build (if the language builds), then run, in a fresh directory."""
    # The source as SandboxFusion writes it (PHP: with its opening tag).
    language = KNOWN.get(case.language)
    source = language.source_bytes(case.code) if language else case.code.encode()
    (workdir / SOURCES[case.language]).write_bytes(source)
    env = _plain_env(case.language)
    build, command = _plain_commands(case.language, bins, case.code)
    if build is not None:
        built = subprocess.run(build, cwd=workdir, env=env, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        assert built.returncode == 0, f"the plain build failed: {built.stderr.decode(errors='replace')}"
    done = subprocess.run(
        command,
        cwd=workdir,
        env=env,
        input=case.stdin.encode() if case.stdin else None,
        stdin=None if case.stdin else subprocess.DEVNULL,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
        preexec_fn=_default_signals,  # not this test run's (a background job ignores SIGINT)
        start_new_session=True,
    )
    return {
        "status": "Success" if done.returncode == 0 else "Failed",
        "return_code": done.returncode,
        "signal": -done.returncode if done.returncode < 0 else None,
        "stdout": done.stdout.decode("utf-8", "replace"),
        "stderr": done.stderr.decode("utf-8", "replace"),
    }


def inside(agent: Agent, case: Case) -> dict[str, Any]:
    body: dict[str, Any] = {
        "code": case.code,
        "language": case.language,
        "compile_timeout": COMPILE_TIMEOUT_S,
        "run_timeout": RUN_TIMEOUT_S,
    }
    if case.stdin:
        body["stdin"] = case.stdin
    if case.memory_mb is not None:
        body["memory_limit_MB"] = case.memory_mb
    resp = agent.post("/run_code", body, timeout=COMPILE_TIMEOUT_S + RUN_TIMEOUT_S + 30)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    running = start_agent(tmp_path_factory.mktemp("languages-end") / "work")
    yield running
    stop_agent(running)


@pytest.fixture(scope="module")
def toolchains(agent: Agent) -> dict[str, Any]:
    """``/v1/health``'s languages (found, with their binaries; missing, naming the binary)."""
    found: dict[str, Any] = requests.get(agent.url + "/v1/health", timeout=10).json()["languages"]
    return found


def _binaries(toolchains: dict[str, Any], language: str) -> dict[str, str]:
    if language == "bash":
        if shutil.which("bash") is None:
            pytest.skip("bash: 'bash' not found on PATH")
        return {}
    if language not in toolchains["found"]:
        pytest.skip(f"{language}: {toolchains['missing'].get(language, 'not detected')}")
    bins: dict[str, str] = dict(toolchains["found"][language]["binaries"])
    return bins


@pytest.mark.parametrize("name", list(CASES))
def test_a_program_ends_as_outside(
    agent: Agent, toolchains: dict[str, Any], name: str, tmp_path: Path
) -> None:
    case = CASES[name]
    bins = _binaries(toolchains, case.language)
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The plain run beside the agent's (each compiles once).
        plain = pool.submit(outside, case, bins, tmp_path)
        body = inside(agent, case)
        want = plain.result()
    compiled = body["compile_result"]
    assert compiled is None or (compiled["status"], compiled["return_code"]) == ("Finished", 0), (name, body)
    run = body["run_result"]
    assert run is not None, (name, body)
    got = {
        "status": body["status"],
        "return_code": run["return_code"],
        "signal": run["signal"],
        "stdout": run["stdout"],
        "stderr": run["stderr"] if case.same_stderr else want["stderr"],
    }
    assert run["status"] == "Finished", (name, body)
    assert got == want, (name, body, want)


@pytest.mark.parametrize(
    ("language", "tool", "code"),
    [
        ("lua", "lua", 'io.write("x")\nerror("boom")\n'),  # "lua: main.lua:2: boom"
        ("lua", "lua", "print(arg[-1])\n"),
        ("nodejs", "node", "console.log(process.argv0)\n"),
    ],
)
def test_a_program_is_named_as_a_shell_names_it(
    agent: Agent, toolchains: dict[str, Any], tmp_path: Path, language: str, tool: str, code: str
) -> None:
    """SandboxFusion runs ``lua main.lua`` through a shell, which gives the program the name it
    was typed by as its ``argv[0]``; the agent gave the binary's real path, so every uncaught Lua
    error began ``/usr/bin/lua5.2: main.lua:2: boom`` where there it begins ``lua: ...``, and
    Node's ``process.argv0`` was the path. (The other cases here run the agent's binaries by
    path on both sides, which hid it.)"""
    bins = _binaries(toolchains, language)
    env = _plain_env(language)
    found = shutil.which(tool, path=env["PATH"])
    if found is None or os.path.realpath(found) != bins[tool]:
        pytest.skip(f"a shell's {tool!r} is not the agent's {bins[tool]}")
    (tmp_path / SOURCES[language]).write_text(code)
    command = f"{tool} {SOURCES[language]}"
    done = subprocess.run(
        ["/bin/sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, timeout=RUN_TIMEOUT_S
    )
    run = inside(agent, Case(language, code))["run_result"]
    got = (run["return_code"], run["stdout"], run["stderr"])
    assert got == (done.returncode, done.stdout.decode(), done.stderr.decode()), (command, run)


def test_a_bash_error_after_a_signal_death_says_it_as_bash_does(
    agent: Agent, toolchains: dict[str, Any]
) -> None:
    """bash reports a command killed by a signal with its pid; apart from the pid, as outside."""
    case = CASES["bash: the last command killed by a signal"]
    body = inside(agent, case)
    pidless = re.sub(r"line (\d+): +\d+ ", r"line \1: PID ", body["run_result"]["stderr"])
    want = f"{BASH_FILE}: line 2: PID Segmentation fault      sh -c 'kill -SEGV $$'\n"
    assert pidless == want, body


def test_the_jvm_heap_is_what_java_takes_by_itself(
    agent: Agent, toolchains: dict[str, Any], tmp_path: Path
) -> None:
    """Without a memory limit, a Java program's heap is ``java``'s own default (a share of the
    memory it sees), not the most that fits the host: a program that outside fails with
    OutOfMemoryError fails inside too. (The collector differs, outside the JVM may pick G1 on more
    cores: its maximum differs by a survivor space, so the check allows a tenth.)"""
    code = (
        "public class Main { public static void main(String[] a){\n"
        "  System.out.println(Runtime.getRuntime().maxMemory()); } }\n"
    )
    case = Case("java", code)
    want = int(outside(case, _binaries(toolchains, "java"), tmp_path)["stdout"])
    got = int(inside(agent, case)["run_result"]["stdout"])
    assert 0.9 * want <= got <= want * 1.01, (got, want)


def test_a_memory_limit_still_holds_what_a_program_writes(agent: Agent, toolchains: dict[str, Any]) -> None:
    """The limit is on what a program writes: 512 MB written under a 256 MB limit fail as running
    out of memory, in a compiled language and in one whose runtime reserves much more."""
    _binaries(toolchains, "c")
    code = (
        C + "#include <string.h>\n"
        'int main(void){ char *p = malloc(512u << 20); if (!p) { perror("malloc"); return 1; }\n'
        '  memset(p, 1, 512u << 20); puts("wrote"); return 0; }\n'
    )
    body = inside(agent, Case("c", code, memory_mb=256))
    assert body["status"] == "Failed" and body["run_result"]["stdout"] == "", body
    assert body["run_result"]["memory_limit_exceeded"] is True, body
    _binaries(toolchains, "go")
    go = (
        'package main\nimport "fmt"\n'
        "func main(){ b := make([]byte, 512<<20); for i := range b { b[i] = 1 }; fmt.Println(len(b)) }\n"
    )
    body = inside(agent, Case("go", go, memory_mb=256))
    assert body["status"] == "Failed" and body["run_result"]["stdout"] == "", body
    assert body["run_result"]["memory_limit_exceeded"] is True, body


def test_an_exec_program_may_not_map_more_than_any_request_may_ask(
    agent: Agent, toolchains: dict[str, Any]
) -> None:
    """What RLIMIT_DATA does not count (shared mappings) is held by the address-space ceiling,
    the most any request may ask for (here the host's memory): a shared mapping of twice that is
    refused."""
    _binaries(toolchains, "c")
    code = (
        C + "#include <sys/mman.h>\n"
        "int main(void){ size_t n = (size_t)sysconf(_SC_PHYS_PAGES) * sysconf(_SC_PAGESIZE) * 2;\n"
        "  void *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);\n"
        '  puts(p == MAP_FAILED ? "refused" : "mapped"); return 0; }\n'
    )
    body = inside(agent, Case("c", code, memory_mb=256))
    assert body["run_result"]["stdout"] == "refused\n", body
