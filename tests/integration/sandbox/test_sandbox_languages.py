"""SandboxFusion-style ``/run_code`` cases for every language beyond Python, against a real agent.

Written from SandboxFusion's documented behaviour (its runner semantics and response shape): a
compiled language reports ``compile_result``; a failed or timed-out compile ends the action with
``status: Failed`` and no ``run_result``; a run that exits non-zero is ``Finished`` with its return
code and ``status: Failed``; a run past ``run_timeout`` is ``TimeLimitExceeded``. TypeScript runs as
``tsx`` runs it (types stripped, not checked): no ``compile_result``, a syntax error fails the run.

Each language is skipped only when this host lacks its toolchain, and the skip names the binary.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from sandbox_agent_harness import (
    COMPILE_TIMEOUT_S,
    Agent,
    need,
    processes_of,
    start_agent,
    stop_agent,
)
from sandbox_agent_harness import (
    run_language as run,
)

from arl_tangram.sandbox import languages
from arl_tangram.sandbox.config import Limits

# Output past what a pipe buffers (64 KiB) many times over, under the default output cap.
LARGE_LINES = 50_000  # "line <n>\n" for n < 50000: 438,890 bytes


@dataclass(frozen=True)
class Programs:
    """One language's programs for the cases (each reads "a b" on stdin where it says so)."""

    sum_stdin: str  # prints a + b
    wrong: str  # prints a + b + 1
    runtime_error: str  # fails at run time (non-zero exit)
    compile_error: str  # does not compile (TypeScript: does not parse)
    loop: str  # never ends
    large: str  # prints "line 0" .. "line {LARGE_LINES - 1}"
    with_header: str = ""  # uses the value from the request file "util.h" (C and C++ only)


SCALA_MAIN = "object Main { def main(args: Array[String]): Unit = {\n  %s\n} }\n"
SCALA_SUM = 'val Array(a, b) = io.StdIn.readLine().trim.split("\\\\s+").map(_.toLong); println(a + b%s)'
SCALA_LARGE = (
    'val b = new StringBuilder; for (i <- 0 until %d) b.append("line ").append(i).append("\\n"); print(b)'
)
PROGRAMS: dict[str, Programs] = {
    "cpp": Programs(
        sum_stdin='#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<"\\n";}\n',
        wrong='#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b+1<<"\\n";}\n',
        runtime_error='#include <stdexcept>\nint main(){ throw std::runtime_error("boom"); }\n',
        compile_error="int main() { return undeclared_name; }\n",
        loop="int main(){ volatile long x = 0; for(;;) x++; }\n",
        large=f'#include <cstdio>\nint main(){{for(int i=0;i<{LARGE_LINES};i++) printf("line %d\\n", i);}}\n',
        with_header='#include <iostream>\n#include "util.h"\nint main(){ std::cout << VALUE << "\\n"; }\n',
    ),
    "c": Programs(
        sum_stdin=(
            '#include <stdio.h>\nint main(void){long a,b; scanf("%ld%ld",&a,&b); printf("%ld\\n",a+b);}\n'
        ),
        wrong=(
            '#include <stdio.h>\nint main(void){long a,b; scanf("%ld%ld",&a,&b); printf("%ld\\n",a+b+1);}\n'
        ),
        runtime_error="#include <stdlib.h>\nint main(void){ abort(); }\n",
        compile_error="int main(void) { return undeclared_name; }\n",
        loop="int main(void){ volatile long x = 0; for(;;) x++; }\n",
        large=(
            f"#include <stdio.h>\n"
            f'int main(void){{for(int i=0;i<{LARGE_LINES};i++) printf("line %d\\n",i);}}\n'
        ),
        with_header='#include <stdio.h>\n#include "util.h"\nint main(void){ printf("%d\\n", VALUE); }\n',
    ),
    "java": Programs(
        sum_stdin=(
            "import java.util.*;\npublic class Main { public static void main(String[] x) {\n"
            "  Scanner s = new Scanner(System.in); long a = s.nextLong(), b = s.nextLong();\n"
            "  System.out.println(a + b); } }\n"
        ),
        wrong=(
            "import java.util.*;\npublic class Main { public static void main(String[] x) {\n"
            "  Scanner s = new Scanner(System.in); long a = s.nextLong(), b = s.nextLong();\n"
            "  System.out.println(a + b + 1); } }\n"
        ),
        runtime_error=(
            "public class Main { public static void main(String[] x) {\n"
            "  int[] a = new int[1]; System.out.println(a[5]); } }\n"
        ),
        compile_error="public class Main { public static void main(String[] x) { int y = ; } }\n",
        loop="public class Main { public static void main(String[] x) { while (true) {} } }\n",
        large=(
            "public class Main { public static void main(String[] x) {\n"
            "  StringBuilder b = new StringBuilder();\n"
            f'  for (int i = 0; i < {LARGE_LINES}; i++) b.append("line ").append(i).append("\\n");\n'
            "  System.out.print(b); } }\n"
        ),
    ),
    "go": Programs(
        sum_stdin=(
            'package main\nimport "fmt"\nfunc main(){ var a, b int64; fmt.Scan(&a, &b); fmt.Println(a+b) }\n'
        ),
        wrong=(
            "package main\n"
            'import "fmt"\nfunc main(){ var a, b int64; fmt.Scan(&a, &b); fmt.Println(a+b+1) }\n'
        ),
        runtime_error='package main\nfunc main(){ var m map[string]int; m["x"] = 1 }\n',
        compile_error="package main\nfunc main(){ x := 1 }\n",
        loop="package main\nfunc main(){ for { } }\n",
        large=(
            'package main\nimport ("bufio"; "fmt"; "os")\nfunc main(){\n'
            "  w := bufio.NewWriter(os.Stdout); defer w.Flush()\n"
            f'  for i := 0; i < {LARGE_LINES}; i++ {{ fmt.Fprintf(w, "line %d\\n", i) }} }}\n'
        ),
    ),
    "rust": Programs(
        sum_stdin=(
            "use std::io::Read;\nfn main(){ let mut s = String::new();\n"
            "  std::io::stdin().read_to_string(&mut s).unwrap();\n"
            "  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
            '  println!("{}", v[0] + v[1]); }\n'
        ),
        wrong=(
            "use std::io::Read;\nfn main(){ let mut s = String::new();\n"
            "  std::io::stdin().read_to_string(&mut s).unwrap();\n"
            "  let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
            '  println!("{}", v[0] + v[1] + 1); }\n'
        ),
        runtime_error=(
            "fn main(){ let v: Vec<i32> = Vec::new(); let i = std::env::args().count() + 4;\n"
            '  println!("{}", v[i]); }\n'
        ),
        compile_error='fn main(){ let x: i32 = "text"; }\n',
        loop="fn main(){ let mut x: u64 = 0; loop { x = std::hint::black_box(x + 1); } }\n",
        large=(
            "use std::io::Write;\nfn main(){ let out = std::io::stdout(); let mut w = out.lock();\n"
            f'  for i in 0..{LARGE_LINES} {{ writeln!(w, "line {{}}", i).unwrap(); }} }}\n'
        ),
    ),
    "nodejs": Programs(
        sum_stdin=(
            'const [a, b] = require("fs").readFileSync(0, "utf8").trim().split(/\\s+/).map(Number);\n'
            "console.log(a + b);\n"
        ),
        wrong=(
            'const [a, b] = require("fs").readFileSync(0, "utf8").trim().split(/\\s+/).map(Number);\n'
            "console.log(a + b + 1);\n"
        ),
        runtime_error="null.property;\n",
        compile_error="function (\n",  # interpreted: a syntax error fails the run
        loop="for (;;) {}\n",
        large=(
            f'const out = [];\nfor (let i = 0; i < {LARGE_LINES}; i++) out.push("line " + i);\n'
            'console.log(out.join("\\n"));\n'
        ),
    ),
    "perl": Programs(
        sum_stdin='my ($a, $b) = split " ", <STDIN>;\nprint $a + $b, "\\n";\n',
        wrong='my ($a, $b) = split " ", <STDIN>;\nprint $a + $b + 1, "\\n";\n',
        runtime_error='die "boom\\n";\n',
        compile_error="sub f { \n",  # interpreted: a syntax error fails the run
        loop="1 while 1;\n",
        large=f'print "line $_\\n" for 0 .. {LARGE_LINES - 1};\n',
    ),
    # No opening tag: SandboxFusion adds it (and so do we), as on the other PHP programs below.
    "php": Programs(
        sum_stdin=(
            "$v = preg_split('/\\s+/', trim(file_get_contents('php://stdin')));\n"
            'echo $v[0] + $v[1], "\\n";\n'
        ),
        wrong=(
            "<?php\n$v = preg_split('/\\s+/', trim(file_get_contents('php://stdin')));\n"
            'echo $v[0] + $v[1] + 1, "\\n";\n'
        ),
        runtime_error='<?php\nthrow new Exception("boom");\n',
        compile_error="<?php\nfunction (\n",  # interpreted: a parse error fails the run
        loop="<?php\nwhile (true) {}\n",
        large=f'<?php\nfor ($i = 0; $i < {LARGE_LINES}; $i++) echo "line $i\\n";\n',
    ),
    "ruby": Programs(
        sum_stdin="a, b = STDIN.read.split.map(&:to_i)\nputs a + b\n",
        wrong="a, b = STDIN.read.split.map(&:to_i)\nputs a + b + 1\n",
        runtime_error='raise "boom"\n',
        compile_error="def f(\n",
        loop="loop { }\n",
        large=f'{LARGE_LINES}.times {{ |i| puts "line #{{i}}" }}\n',
    ),
    # D_ut's programs are plain D: the unittest blocks (none here) run before main.
    "D_ut": Programs(
        sum_stdin='import std.stdio;\nvoid main() { long a, b; readf(" %d %d", a, b); writeln(a + b); }\n',
        wrong='import std.stdio;\nvoid main() { long a, b; readf(" %d %d", a, b); writeln(a + b + 1); }\n',
        runtime_error="void main() { int[] a; a[5] = 1; }\n",
        compile_error="void main() { int x = undeclared_name; }\n",
        loop="void main() { while (true) {} }\n",
        large=f'import std.stdio;\nvoid main() {{ foreach (i; 0 .. {LARGE_LINES}) writeln("line ", i); }}\n',
    ),
    "scala": Programs(
        sum_stdin=SCALA_MAIN % (SCALA_SUM % ""),
        wrong=SCALA_MAIN % (SCALA_SUM % " + 1"),
        runtime_error=SCALA_MAIN % "val a = Array(1); println(a(5))",
        compile_error=SCALA_MAIN % 'val x: Int = "text"',
        loop=SCALA_MAIN % "while (true) {}",
        large=SCALA_MAIN % (SCALA_LARGE % LARGE_LINES),
    ),
    "lua": Programs(
        sum_stdin='local a, b = io.read("*n", "*n")\nprint(math.floor(a + b))\n',
        wrong='local a, b = io.read("*n", "*n")\nprint(math.floor(a + b + 1))\n',
        runtime_error='error("boom")\n',
        compile_error="function (\n",
        loop="while true do end\n",
        large=f'for i = 0, {LARGE_LINES - 1} do io.write("line ", i, "\\n") end\n',
    ),
    "R": Programs(
        sum_stdin='x <- scan(file("stdin"), quiet = TRUE)\ncat(x[1] + x[2], "\\n", sep = "")\n',
        wrong='x <- scan(file("stdin"), quiet = TRUE)\ncat(x[1] + x[2] + 1, "\\n", sep = "")\n',
        runtime_error='stop("boom")\n',
        compile_error="f <- function( {\n",
        loop="repeat {}\n",
        large=f'cat(sprintf("line %d\\n", 0:{LARGE_LINES - 1}), sep = "")\n',
    ),
    "typescript": Programs(
        sum_stdin=(
            "const parts: number[] = require('fs').readFileSync(0, 'utf8').split(/\\s+/).map(Number);\n"
            "const add = (a: number, b: number): number => a + b;\n"
            "console.log(add(parts[0], parts[1]));\n"
        ),
        wrong=(
            "const parts: number[] = require('fs').readFileSync(0, 'utf8').split(/\\s+/).map(Number);\n"
            "const add = (a: number, b: number): number => a + b + 1;\n"
            "console.log(add(parts[0], parts[1]));\n"
        ),
        runtime_error="const thing: any = null;\nconsole.log(thing.property);\n",
        compile_error="const x: number = ;\n",
        loop="while (true) {}\n",
        large=(
            f"const out: string[] = [];\nfor (let i = 0; i < {LARGE_LINES}; i++) out.push(`line ${{i}}`);\n"
            'console.log(out.join("\\n"));\n'
        ),
    ),
}
LANGUAGES = sorted(PROGRAMS)
# Languages SandboxFusion builds in a compile step it reports as ``compile_result``.
REPORTS_COMPILE = {"cpp", "c", "java", "go", "rust", "D_ut", "scala"}
# A first build can be slow on a busy two-core machine (javac, rustc, a Go build of new packages).


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent for the module (real process, real HTTP on loopback)."""
    root: Path = tmp_path_factory.mktemp("languages") / "work"
    running = start_agent(root)
    yield running
    stop_agent(running)
    assert not root.exists(), "the agent must remove its workdir root on shutdown"
    assert processes_of(running.uids) == []


@pytest.fixture(scope="module")
def found(agent: Agent) -> dict[str, Any]:
    """``/v1/health``'s languages: what the agent found, and what is missing for the rest."""
    body: dict[str, Any] = requests.get(agent.url + "/v1/health", timeout=10).json()["languages"]
    return body


def assert_built(language: str, body: dict[str, Any]) -> None:
    """A successful build, reported as SandboxFusion reports it (or not at all where it does not)."""
    if language in REPORTS_COMPILE:
        compiled = body["compile_result"]
        assert compiled is not None, body
        assert compiled["status"] == "Finished", compiled
        assert compiled["return_code"] == 0, compiled
        assert set(compiled) >= {"status", "execution_time", "return_code", "stdout", "stderr"}
    else:
        assert body["compile_result"] is None


@pytest.mark.parametrize("language", LANGUAGES)
def test_correct_answer_reads_stdin(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].sum_stdin, stdin="20 22\n")
    assert body["status"] == "Success", body
    assert_built(language, body)
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] == 0
    assert body["run_result"]["stdout"] == "42\n"


@pytest.mark.parametrize("language", LANGUAGES)
def test_wrong_answer_is_a_success_with_other_output(
    agent: Agent, found: dict[str, Any], language: str
) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].wrong, stdin="20 22\n")
    # As in SandboxFusion: the sandbox reports the run; comparing answers is the client's part.
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "43\n"


@pytest.mark.parametrize("language", LANGUAGES)
def test_runtime_error_is_failed_and_finished(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].runtime_error)
    assert body["status"] == "Failed", body
    assert_built(language, body)
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] != 0
    if language != "c":  # abort() says nothing; the others' runtimes name the error
        assert body["run_result"]["stderr"] != ""


@pytest.mark.parametrize("language", LANGUAGES)
def test_compile_error_is_reported_as_sandboxfusion_does(
    agent: Agent, found: dict[str, Any], language: str
) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].compile_error)
    assert body["status"] == "Failed", body
    if language in REPORTS_COMPILE:
        compiled = body["compile_result"]
        assert compiled["status"] == "Finished"
        assert compiled["return_code"] != 0
        assert compiled["stderr"] != "", "the compiler's message is what a model reads back"
        assert body["run_result"] is None, "a failed compile ends the action: nothing ran"
    else:
        # Interpreted (or, for TypeScript, transpiled as it runs): the run fails.
        assert body["compile_result"] is None
        assert body["run_result"]["status"] == "Finished"
        assert body["run_result"]["return_code"] != 0
        assert body["run_result"]["stderr"] != ""


@pytest.mark.parametrize("language", LANGUAGES)
def test_run_timeout(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].loop, run_timeout=1)
    assert body["status"] == "Failed", body
    assert_built(language, body)
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["return_code"] is None
    assert body["outcome"] == "timeout"


@pytest.mark.parametrize("language", LANGUAGES)
def test_large_output_comes_back_whole(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    body = run(agent, language, PROGRAMS[language].large)
    assert body["status"] == "Success", body
    expected = "".join(f"line {i}\n" for i in range(LARGE_LINES))
    assert body["run_result"]["stdout_truncated"] is False
    assert body["run_result"]["stdout"] == expected


@pytest.mark.parametrize("language", sorted(REPORTS_COMPILE))
def test_compile_timeout_ends_the_action(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    # No compiler here starts, reads its input and writes a binary in 1 ms; the source is new to
    # the cache (a kept build is never served past a compile timeout shorter than it took).
    code = PROGRAMS[language].sum_stdin + ("\n// timeout case\n" if language != "go" else "\n// t\n")
    body = run(agent, language, code, compile_timeout=0.001)
    assert body["status"] == "Failed", body
    assert body["compile_result"]["status"] == "TimeLimitExceeded"
    assert body["compile_result"]["return_code"] is None
    assert body["run_result"] is None


@pytest.mark.parametrize("language", sorted(REPORTS_COMPILE))
def test_second_identical_build_is_a_cache_hit(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    code = PROGRAMS[language].sum_stdin + "\n// cache case\n"
    first = run(agent, language, code, stdin="1 2\n")
    second = run(agent, language, code, stdin="3 4\n")
    assert first["compile_result"]["cached"] is False
    assert second["compile_result"]["cached"] is True
    # The kept build runs as its own did, on this request's input.
    assert (first["run_result"]["stdout"], second["run_result"]["stdout"]) == ("3\n", "7\n")


@pytest.mark.parametrize("language", ["cpp", "c"])
def test_a_changed_header_is_a_cache_miss(agent: Agent, found: dict[str, Any], language: str) -> None:
    need(found, language)
    code = PROGRAMS[language].with_header

    def header(value: int) -> dict[str, str]:
        return {"util.h": base64.b64encode(f"#define VALUE {value}\n".encode()).decode()}

    one = run(agent, language, code, files=header(1))
    again = run(agent, language, code, files=header(1))
    two = run(agent, language, code, files=header(2))
    assert [one["compile_result"]["cached"], again["compile_result"]["cached"]] == [False, True]
    assert two["compile_result"]["cached"] is False
    assert [b["run_result"]["stdout"] for b in (one, again, two)] == ["1\n", "1\n", "2\n"]


def test_a_failed_build_is_kept_and_reported_again(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "cpp")
    code = "int main() { return not_declared_here; }\n"
    first = run(agent, "cpp", code)
    second = run(agent, "cpp", code)
    assert (first["compile_result"]["cached"], second["compile_result"]["cached"]) == (False, True)
    assert second["compile_result"]["stderr"] == first["compile_result"]["stderr"]
    assert "not_declared_here" in second["compile_result"]["stderr"]
    assert second["run_result"] is None


def test_a_build_whose_compiler_was_killed_is_not_kept(agent: Agent, found: dict[str, Any]) -> None:
    """The kernel's OOM killer, on a host another action filled, kills the largest process: in a
    C++ build that is ``cc1plus``, not the ``g++`` driver, which outlives it and fails the build
    (return code 1, "Killed signal terminated program cc1plus"), no signal of its own. That
    failure was kept as the source's, every later identical request's verdict a compile error.
    Here the test kills ``cc1plus`` as the OOM killer does (SIGKILL, from outside the action)."""
    need(found, "cpp")
    # Heavy headers, so the compiler proper runs long enough to be found.
    code = (
        "#include <regex>\n#include <iostream>\n"
        'int main(){ std::cout << std::regex_match("ab", std::regex("a+b")) << "\\n"; }\n'
    )
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run, agent, "cpp", code)
        killed = False
        while not killed and not pending.done():
            for pid in processes_of(agent.uids):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "cc1plus":
                        os.kill(pid, signal.SIGKILL)
                        killed = True
            time.sleep(0.005)  # a poll interval while the compile runs, not synchronisation
        first = pending.result()
    if not killed:
        pytest.skip("the compile ended before its compiler could be found")
    assert first["status"] == "Failed" and first["run_result"] is None, first
    assert "signal terminated program" in first["compile_result"]["stderr"], first
    again = run(agent, "cpp", code)
    assert again["compile_result"]["cached"] is False, again
    assert again["status"] == "Success" and again["run_result"]["stdout"] == "1\n", again


def test_a_compile_error_that_is_not_utf8_is_answered_as_sandboxfusion_answers_it(
    agent: Agent, found: dict[str, Any]
) -> None:
    """The compiler echoes a source line holding a Latin-1 byte: SandboxFusion decodes the
    compile's stderr strictly too (``[DecodeError]`` and the decoder's message in its place),
    where the agent returned it with U+FFFD; a build kept in the compile cache answers the same."""
    need(found, "cpp")
    header = b"int bad = \xe9;\n"
    files = {"bad.h": base64.b64encode(header).decode()}
    code = '#include "bad.h"\nint main() { return 0; }\n'
    first = run(agent, "cpp", code, files=files)
    second = run(agent, "cpp", code, files=files)
    for body in (first, second):
        stderr = body["compile_result"]["stderr"]
        assert stderr.startswith("[DecodeError] 'utf-8' codec can't decode byte 0xe9"), body
        assert (body["status"], body["run_result"]) == ("Failed", None), body
    assert (first["compile_result"]["cached"], second["compile_result"]["cached"]) == (False, True)


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("go", "package notmain\n\nfunc F() {}\n"),  # builds an archive, not a program
        ("rust", '#![crate_type = "lib"]\npub fn f() {}\n'),  # builds a library
    ],
)
def test_a_build_that_is_no_program_fails_as_the_programs_own(
    agent: Agent, found: dict[str, Any], language: str, code: str
) -> None:
    """The build succeeds but what it made cannot be run: the program's fault, answered as a shell
    running it answers (126, Failed), not as the sandbox's (SandboxError, which clients retry or
    drop instead of scoring)."""
    need(found, language)
    body = run(agent, language, code)
    assert body["compile_result"]["return_code"] == 0, body
    assert body["status"] == "Failed", body
    assert body["run_result"]["return_code"] == 126, body
    assert "cannot execute" in body["run_result"]["stderr"], body


def test_concurrent_identical_builds_compile_once(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "cpp")
    code = PROGRAMS["cpp"].sum_stdin + "\n// concurrent case\n"
    with ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda i: run(agent, "cpp", code, stdin=f"{i} 1\n"), range(4)))
    assert sorted(b["run_result"]["stdout"] for b in bodies) == ["1\n", "2\n", "3\n", "4\n"]
    assert [b["compile_result"]["cached"] for b in bodies].count(False) == 1


def test_the_compile_runs_in_the_actions_sandbox(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "cpp")
    isolation = requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]
    if not isolation["per_action_uid"]:
        pytest.skip("the agent runs without a uid per action (not root with CAP_SETUID)")
    # The compiler runs as the action's uid: it cannot read what the action could not.
    body = run(agent, "cpp", '#include "/etc/shadow"\nint main(){}\n')
    assert body["status"] == "Failed"
    assert "Permission denied" in body["compile_result"]["stderr"]
    # The request's memory limit is its program's, not its compiler's (a judge's is too): the
    # compile gets at least the pool's default, and a program limited to 16 MB still builds.
    tight = run(agent, "cpp", PROGRAMS["cpp"].sum_stdin + "\n// tight\n", memory_limit_MB=16, stdin="2 3")
    assert tight["compile_result"]["return_code"] == 0, tight
    assert (tight["status"], tight["run_result"]["stdout"]) == ("Success", "5\n"), tight


def test_a_compile_gets_the_pools_memory_or_the_requests_whichever_is_more(
    agent: Agent, found: dict[str, Any]
) -> None:
    """The compiler runs under a memory limit of its own: the request's (its program's) or the
    pool's default (``--memory-mb``), whichever is more. A Rust program embeds, at its compile,
    ``/proc/self/limits`` as rustc saw it, and prints it."""
    need(found, "rust")
    code = 'const L: &str = include_str!("/proc/self/limits");\nfn main() { print!("{}", L); }\n'
    pool_mb = Limits().memory_mb
    for asked in (16, 2 * pool_mb):
        body = run(agent, "rust", code + f"// asked {asked}\n", memory_limit_MB=asked)
        assert body["status"] == "Success", body
        seen = next(line.split() for line in body["run_result"]["stdout"].splitlines() if "data size" in line)
        assert int(seen[3]) == max(asked, pool_mb) << 20, seen  # Max data size <soft> <hard> bytes


def test_java_runs_within_the_default_memory_limit(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "java")
    code = (
        "public class Main { public static void main(String[] x) {\n"
        "  long[] big = new long[32 * 1024 * 1024];  // 256 MB: the JVM heap follows the limit\n"
        "  big[big.length - 1] = 7; System.out.println(big[big.length - 1]); } }\n"
    )
    body = run(agent, "java", code, memory_limit_MB=1024)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "7\n"


def test_aliases_and_request_files(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "nodejs")
    helper = base64.b64encode(b"module.exports = { twice: (x) => 2 * x };\n").decode()
    body = run(agent, "js", 'console.log(require("./helper.js").twice(21));\n', files={"helper.js": helper})
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "42\n"


def test_typescript_imports_its_own_modules_as_tsx_runs_them(agent: Agent, found: dict[str, Any]) -> None:
    """A TypeScript program of two files (``import { f } from './lib'``) runs as under ``tsx``: its
    own modules are built with it, and a package of the host (node's ``fs``) stays a require. Each
    file was stripped of its types alone, so ``./lib`` was not found."""
    need(found, "typescript")
    lib = base64.b64encode(b"export function twice(x: number): number {\n  return 2 * x;\n}\n").decode()
    code = (
        "import { twice } from './lib';\nimport * as fs from 'fs';\n"
        "console.log(twice(21), typeof fs.readFileSync);\n"
    )
    body = run(agent, "typescript", code, files={"lib.ts": lib})
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "42 function\n"


def test_go_imports_its_own_packages_by_the_modules_path(agent: Agent, found: dict[str, Any]) -> None:
    """A Go program with a package of its own imports it as SandboxFusion's module names it
    (``SeedSandbox/utils``): the agent's go.mod was at the workdir root, the workdirs' parent, and
    the build failed ("package SeedSandbox/utils is not in std"), where SandboxFusion, which copies
    go.mod beside the program, builds it."""
    need(found, "go")
    if not found["found"]["go"].get("libraries"):
        pytest.skip("SandboxFusion's Go module cache is not installed here")
    utils = base64.b64encode(b"package utils\n\nfunc Double(x int) int { return 2 * x }\n").decode()
    code = (
        'package main\n\nimport (\n\t"fmt"\n\t"SeedSandbox/utils"\n)\n\n'
        "func main() { fmt.Println(utils.Double(21)) }\n"
    )
    body = run(agent, "go", code, files={"utils/utils.go": utils})
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "42\n"


def test_php_sessions_start(agent: Agent, found: dict[str, Any]) -> None:
    """PHP saves sessions in /var/lib/php/sessions, out of an action's reach (its writes are
    confined): session_start() failed there ("Permission denied") and the id was empty. It saves
    them in the action's own /tmp."""
    need(found, "php")
    code = "<?php\nsession_start();\n$_SESSION['n'] = 1;\necho session_id() !== '' ? 'started' : 'none';\n"
    body = run(agent, "php", code)
    assert body["status"] == "Success", body
    assert (body["run_result"]["stdout"], body["run_result"]["stderr"]) == ("started", ""), body


def test_health_lists_the_languages_found(agent: Agent, found: dict[str, Any]) -> None:
    for name, entry in found["found"].items():
        assert entry["version"], name
        assert entry["binaries"], name
    # Every language the agent knows (go_test's, junit's and verilog's cases, which are tests and
    # benches rather than programs reading stdin, are in test_sandbox_language_libs.py).
    known = {language.name for language in languages.LANGUAGES}
    assert set(found["found"]) | set(found["missing"]) == known
    assert set(LANGUAGES) == known - {"go_test", "junit", "verilog"}
    for name, why in found["missing"].items():
        assert "not found on PATH" in why, (name, why)
    assert set(found["compile_cache"]) >= {"entries", "bytes", "max_bytes", "hits", "misses"}


def test_a_language_sandboxfusion_knows_but_this_host_lacks(agent: Agent) -> None:
    resp = agent.post("/run_code", {"code": "print(1)", "language": "julia"})
    # SandboxFusion's response shape, not an HTTP error a client reads as the API failing.
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "SandboxError"
    assert "julia" in body["message"]
    assert body["compile_result"] is None and body["run_result"] is None


def test_a_language_sandboxfusion_does_not_know(agent: Agent) -> None:
    resp = agent.post("/run_code", {"code": "x", "language": "cobol"})
    assert resp.status_code == 422  # SandboxFusion's request validation
    detail = resp.json()["detail"]
    assert detail[0]["loc"] == ["body", "language"]
    assert detail[0]["input"] == "cobol"


def test_native_api_reports_the_compile(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "cpp")
    resp = agent.post(
        "/v1/execute",
        {"runtime": "cpp", "code": "int main() { return broken; }\n", "compile_timeout_s": COMPILE_TIMEOUT_S},
        timeout=COMPILE_TIMEOUT_S + 60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["status"] == "failed"
    assert body["compile"]["return_code"] != 0
    assert "broken" in body["compile"]["stderr"]


def test_compile_timeout_out_of_range(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "cpp")
    # Not positive, or not finite: the request's own validation (422), as for any field's type.
    resp = agent.post("/run_code", {"code": "int main(){}", "language": "cpp", "compile_timeout": -1})
    assert resp.status_code == 422
    assert "compile_timeout" in resp.json()["message"]
    # Past the agent's ceiling: compiled with the ceiling, as SandboxFusion refuses no limit, and
    # the answer's notes say so.
    resp = agent.post("/run_code", {"code": "int main(){}", "language": "cpp", "compile_timeout": 10**7})
    assert resp.status_code == 200 and resp.json()["status"] == "Success", resp.text
    assert any(n.startswith("compile_timeout 10000000 s") for n in resp.json()["notes"]), resp.text


def test_a_session_compiles_in_its_workdir(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "c")
    session = agent.post("/v1/sessions", {}).json()["session_id"]
    try:
        first = agent.execute(
            '#include <stdio.h>\nint main(void){ FILE *f = fopen("kept.txt", "w"); fputs("x", f); }\n',
            runtime="c",
            session_id=session,
            compile_timeout_s=COMPILE_TIMEOUT_S,
        )
        assert first["status"] == "ok", first
        assert first["compile"]["cached"] is False
        second = agent.execute(
            '#include <stdio.h>\nint main(void){ FILE *f = fopen("kept.txt", "r"); putchar(fgetc(f)); }\n',
            runtime="c",
            session_id=session,
            compile_timeout_s=COMPILE_TIMEOUT_S,
        )
        assert second["stdout"] == "x"
        assert second["compile"]["cached"] is False  # a session's workdir is never built from the cache
    finally:
        requests.delete(agent.url + "/v1/sessions/" + session, timeout=10)
