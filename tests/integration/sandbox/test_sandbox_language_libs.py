"""The libraries SandboxFusion's runners give C++, Java, Perl, Node and pytest programs, against a real agent.

SandboxFusion links C++ with each of ``-lcrypto -lssl -lpthread`` that links on its host (HumanEval-X
and MultiPL-E's ``string_to_md5`` call OpenSSL's ``MD5``), and puts ``javatuples-1.2.jar`` on the
class path of ``javac`` and ``java`` (every MultiPL-E HumanEval-Java prompt starts with
``import org.javatuples.*;``). Our C gets the same link flags. Without the jar, Java still runs and
``/v1/health`` says javatuples is missing.

A case is skipped only when this host lacks the language's toolchain, and the skip names it.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from sandbox_agent_harness import (
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

ABC_MD5 = "900150983cd24fb0d6963f7d28e17f72"

CPP_MD5 = r"""#include <openssl/md5.h>
#include <cstdio>
#include <cstring>
int main() {
    const char *text = "abc";
    unsigned char digest[MD5_DIGEST_LENGTH];
    MD5((const unsigned char *)text, strlen(text), digest);
    for (int i = 0; i < MD5_DIGEST_LENGTH; i++) printf("%02x", digest[i]);
    printf("\n");
}
"""
C_MD5 = (
    CPP_MD5.replace("<cstdio>", "<stdio.h>")
    .replace("<cstring>", "<string.h>")
    .replace("int main()", "int main(void)")
)
JAVA_TUPLES = """import org.javatuples.Pair;
public class Main {
    public static void main(String[] args) {
        System.out.println(Pair.with(1, 2).getValue1());
    }
}
"""
# A MultiPL-E HumanEval-Java prompt's imports, as every one starts.
JAVA_TUPLES_WILDCARD = """import java.util.*;
import java.lang.reflect.*;
import org.javatuples.*;
import java.security.*;
import java.math.*;
import java.io.*;
import java.util.stream.*;
class Problem {
    public static Pair<Long, Long> evenOdd(long n) { return Pair.with(n / 2, n - n / 2); }
}
public class Main {
    public static void main(String[] args) {
        assert(Problem.evenOdd(5L).equals((Pair.with(2L, 3L))));
        System.out.println(Problem.evenOdd(5L));
    }
}
"""
JAVA_PLAIN = """import java.util.*;
public class Main {
    public static void main(String[] args) {
        List<Integer> xs = new ArrayList<>(List.of(3, 1, 2));
        Collections.sort(xs);
        System.out.println(xs);
    }
}
"""


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent for the module (real process, real HTTP on loopback)."""
    root: Path = tmp_path_factory.mktemp("language-libs") / "work"
    running = start_agent(root)
    yield running
    stop_agent(running)
    assert processes_of(running.uids) == []


def health_languages(agent: Agent) -> dict[str, Any]:
    body: dict[str, Any] = requests.get(agent.url + "/v1/health", timeout=10).json()["languages"]
    return body


@pytest.fixture(scope="module")
def found(agent: Agent) -> dict[str, Any]:
    return health_languages(agent)


@pytest.mark.parametrize("language,code", [("cpp", CPP_MD5), ("c", C_MD5)])
def test_openssl_md5_links(agent: Agent, found: dict[str, Any], language: str, code: str) -> None:
    """HumanEval-X's ``string_to_md5``: OpenSSL's MD5 links, as under SandboxFusion's g++."""
    need(found, language)
    body = run(agent, language, code)
    assert body["status"] == "Success", str(body)
    assert body["compile_result"]["return_code"] == 0, body["compile_result"]
    assert body["run_result"]["stdout"] == ABC_MD5 + "\n"
    assert "-lcrypto" in found["found"][language]["link_flags"], found["found"][language]


@pytest.mark.parametrize("code,expected", [(JAVA_TUPLES, "2\n"), (JAVA_TUPLES_WILDCARD, "[2, 3]\n")])
def test_java_has_javatuples(agent: Agent, found: dict[str, Any], code: str, expected: str) -> None:
    need(found, "java")
    body = run(agent, "java", code)
    assert body["status"] == "Success", str(body)
    assert body["compile_result"]["return_code"] == 0, body["compile_result"]
    assert body["run_result"]["stdout"] == expected
    java = found["found"]["java"]
    assert java["libraries"].get("javatuples"), java
    assert "javatuples" not in java["missing_libraries"], java


def test_java_without_javatuples_is_java_as_before(tmp_path: Path, found: dict[str, Any]) -> None:
    """A host without the jar: plain Java runs, a javatuples import fails to compile, and
    ``/v1/health`` says what is missing."""
    need(found, "java")
    missing_jar = tmp_path / "absent" / "javatuples-1.2.jar"
    running = start_agent(tmp_path / "work", env={"TANGRAM_JAVATUPLES_JAR": str(missing_jar)})
    try:
        java = health_languages(running)["found"]["java"]
        assert "javatuples" in java["missing_libraries"], java
        assert "absent" in java["missing_libraries"]["javatuples"]
        assert "javatuples" not in java["libraries"], java
        plain = run(running, "java", JAVA_PLAIN)
        assert plain["status"] == "Success", plain
        assert plain["run_result"]["stdout"] == "[1, 2, 3]\n"
        tuples = run(running, "java", JAVA_TUPLES)
        assert tuples["status"] == "Failed", tuples
        assert "org.javatuples" in tuples["compile_result"]["stderr"]
        assert tuples["run_result"] is None
    finally:
        stop_agent(running)
    assert processes_of(running.uids) == []


def test_java_plain_program_with_javatuples_present(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "java")
    body = run(agent, "java", JAVA_PLAIN)
    assert body["status"] == "Success", str(body)
    assert body["run_result"]["stdout"] == "[1, 2, 3]\n"


def _java_only() -> tuple[languages.Language, ...]:
    return tuple(lang for lang in languages.LANGUAGES if lang.name == "java")


def test_a_changed_jar_changes_the_compile_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jar's identity is in the toolchain's fingerprint (a key of the compile cache): a jar
    replaced in place builds again rather than serving classes compiled against the old one."""
    if shutil.which("javac") is None or shutil.which("java") is None:
        pytest.skip("java: 'javac' or 'java' not found on PATH")
    jar = tmp_path / "javatuples-1.2.jar"
    jar.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip
    monkeypatch.setenv("TANGRAM_JAVATUPLES_JAR", str(jar))
    first = languages.detect(languages=_java_only()).found["java"]
    assert str(jar) in first.class_path
    jar.write_bytes(b"PK\x05\x06" + bytes(18) + b"changed")
    second = languages.detect(languages=_java_only()).found["java"]
    assert first.fingerprint != second.fingerprint
    # The jar's directory is readable to actions (here under a private /tmp).
    assert str(tmp_path) in second.readable


def test_link_flags_are_in_the_compile_argv() -> None:
    """The flags found are in the compile's argv (the compile cache's key holds the argv)."""
    if shutil.which("g++") is None:
        pytest.skip("cpp: 'g++' not found on PATH")
    cpp = [lang for lang in languages.LANGUAGES if lang.name == "cpp"]
    toolchain = languages.detect(languages=tuple(cpp)).found["cpp"]
    argv = toolchain.argv(toolchain.language.compile, {})
    assert "-lcrypto" in argv and "-lssl" in argv, argv
    assert argv[-len(toolchain.link_flags) :] == list(toolchain.link_flags)


PERL_DEEP = """use strict; use warnings;
use Test::Deep;
use Data::Compare;
print eq_deeply([1, {a => 2}], [1, {a => 2}]) ? "deep\\n" : "not deep\\n";
print Compare([1, 2], [1, 2]) ? "same\\n" : "differ\\n";
"""


def test_perl_has_the_modules_sandboxfusions_image_adds(agent: Agent, found: dict[str, Any]) -> None:
    """Every MultiPL-E Perl test starts with `use Test::Deep;`, and SandboxFusion's image installs
    Test::Deep and Data::Compare: without them each such problem failed (hack/system-deps.sh and
    the sandbox image install Debian's libtest-deep-perl and libdata-compare-perl)."""
    need(found, "perl")
    body = run(agent, "perl", PERL_DEEP)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "deep\nsame\n"


MOCKER_TEST = """
import os


def test_the_mocker_fixture(mocker):
    mocker.patch("os.getcwd", return_value="/mocked")
    assert os.getcwd() == "/mocked"


def test_a_spy(mocker):
    spy = mocker.spy(os.path, "join")
    os.path.join("a", "b")
    spy.assert_called_once_with("a", "b")
"""


def test_pytest_has_the_mocker_fixture_of_sandboxfusions_image(agent: Agent) -> None:
    """SandboxFusion's Python image has pytest-mock: a test that takes ``mocker`` errored here with
    "fixture 'mocker' not found" and passes there (the sandbox image and ``make install`` add it)."""
    body = run(agent, "pytest", MOCKER_TEST)
    assert body["status"] == "Success", body
    assert "2 passed" in body["run_result"]["stdout"], body


@pytest.mark.parametrize(("under", "linked"), [("/tmp", False), ("/dev/shm", False), ("/var/tmp", True)])
def test_thread_stack_c_is_linked_where_actions_can_read_it(
    monkeypatch: pytest.MonkeyPatch, under: str, linked: bool
) -> None:
    """Each action has a /tmp and a /dev/shm of its own, empty: a thread_stack.c there would fail
    every C and C++ build, so it is left out (and the main stack stays 8 MB). Elsewhere, /var/tmp
    included (covered for actions, but the agent's own paths are bound back), it is linked."""
    if shutil.which("gcc") is None:
        pytest.skip("c: 'gcc' not found on PATH")
    source = Path(under) / f"tangram-test-{os.getpid()}" / "thread_stack.c"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(Path(languages.THREAD_STACK_SOURCE).read_bytes())
    monkeypatch.setattr(languages, "THREAD_STACK_SOURCE", str(source))
    c = languages.detect(languages=tuple(x for x in languages.LANGUAGES if x.name == "c")).found["c"]
    assert bool(c.thread_stack) is linked, c.missing_libraries
    argv = c.argv(c.language.compile, {})
    assert (languages.THREAD_STACK_SOURCE in argv) is linked, argv
    assert ("thread_stack.c" in c.missing_libraries) is not linked
    shutil.rmtree(source.parent)


# HumanEval-X's JavaScript string_to_md5 requires js-md5; lodash and seedrandom are the others a
# program reaches for. seedrandom('hello') is the same sequence on every host.
NODE_PACKAGES = """const md5 = require('js-md5');
const _ = require('lodash');
const seedrandom = require('seedrandom');
const rand = require('random-seed').create('x');
const { Command } = require('commander');
console.log(md5('abc'));
console.log(JSON.stringify(_.chunk([1, 2, 3, 4, 5], 2)));
console.log(seedrandom('hello')());
console.log(typeof rand.random(), typeof new Command().parse);
"""
NODE_PACKAGES_OUT = f"{ABC_MD5}\n[[1,2],[3,4],[5]]\n0.5463663768140734\nnumber function\n"
TS_IMPORTS = """import _ from 'lodash';
import md5 from 'js-md5';
const xs: number[] = _.uniq([3, 1, 3, 2]);
console.log(xs.join(','), md5('abc'));
"""


def test_node_finds_sandboxfusions_npm_packages(agent: Agent, found: dict[str, Any]) -> None:
    """SandboxFusion links its runtime's node_modules into each Node program's directory; a program
    requiring js-md5 or lodash failed here with `Cannot find module`."""
    need(found, "nodejs")
    body = run(agent, "nodejs", NODE_PACKAGES)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == NODE_PACKAGES_OUT
    node = found["found"]["nodejs"]
    assert set(node["libraries"]) >= {"lodash", "js-md5", "seedrandom", "random-seed", "commander"}, node
    assert node["missing_libraries"] == {}, node


def test_typescript_imports_the_npm_packages(agent: Agent, found: dict[str, Any]) -> None:
    """ES `import` (which Node's NODE_PATH does not serve) finds them too: a TypeScript program's."""
    need(found, "typescript")
    body = run(agent, "typescript", TS_IMPORTS)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == f"3,1,2 {ABC_MD5}\n"


def test_a_program_cannot_take_the_packages_from_the_next(agent: Agent, found: dict[str, Any]) -> None:
    """The link sits in the workdir root, which no action may write: a program that tries to remove
    or replace it fails, and the next program still finds lodash."""
    need(found, "nodejs")
    if not requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["per_action_uid"]:
        pytest.skip("the agent runs actions under its own uid here (not root): they share its rights")
    hostile = """const fs = require('fs');
for (const attempt of [
  () => fs.unlinkSync('../node_modules'),
  () => fs.symlinkSync('/nonexistent', '../node_modules'),
  () => fs.renameSync('../node_modules', 'stolen'),
]) {
  try { attempt(); console.log('done'); } catch (e) { console.log(e.code); }
}
"""
    body = run(agent, "nodejs", hostile)
    outcomes = body["run_result"]["stdout"].split()
    assert len(outcomes) == 3 and "done" not in outcomes, body
    after = run(agent, "nodejs", "console.log(require('lodash').sum([1, 2, 3]))")
    assert after["run_result"]["stdout"] == "6\n", after


def test_node_without_the_packages_is_node_as_before(tmp_path: Path, found: dict[str, Any]) -> None:
    """A host without them: plain Node runs, a `require('lodash')` fails as Node fails it, and
    ``/v1/health`` names each package missing and where it looked."""
    need(found, "nodejs")
    absent = tmp_path / "absent" / "node_modules"
    running = start_agent(tmp_path / "work", env={"TANGRAM_NODE_MODULES": str(absent)})
    try:
        node = health_languages(running)["found"]["nodejs"]
        assert set(node["missing_libraries"]) >= {"lodash", "js-md5"}, node
        assert str(absent) in node["missing_libraries"]["lodash"]
        plain = run(running, "nodejs", "console.log([3, 1, 2].sort().join(','))")
        assert plain["status"] == "Success", plain
        assert plain["run_result"]["stdout"] == "1,2,3\n"
        lodash = run(running, "nodejs", "require('lodash')")
        assert lodash["status"] == "Failed", lodash
        assert "Cannot find module 'lodash'" in lodash["run_result"]["stderr"]
        assert not os.path.lexists(running.root / "node_modules")
    finally:
        stop_agent(running)
    assert processes_of(running.uids) == []


# HumanEval-X's Go problems run as `go_test`, every test importing testify's assert.
GO_TESTIFY_TEST = """package main

import (
    "testing"
    "github.com/stretchr/testify/assert"
)

func Add(x int, y int) int {
    return x + y
}

func TestAdd(t *testing.T) {
    assert := assert.New(t)
    assert.Equal(5, Add(2, 3))
    assert.Equal(%s, Add(5, 7))
}
"""
GO_TESTIFY_MAIN = """package main

import (
    "fmt"
    "github.com/stretchr/testify/assert"
)

func main() {
    fmt.Println(assert.ObjectsAreEqual([]int{1, 2}, []int{1, 2}))
}
"""


def test_go_test_with_testify_passes_and_fails_as_under_go_test(agent: Agent, found: dict[str, Any]) -> None:
    """`go_test` was refused here as a language this host does not run; HumanEval-X's Go tests
    import testify, which SandboxFusion's module provides."""
    need(found, "go_test")
    passed = run(agent, "go_test", GO_TESTIFY_TEST % "12")
    assert passed["status"] == "Success", passed
    assert passed["run_result"]["stdout"].startswith("ok  \tcommand-line-arguments"), passed
    assert passed["compile_result"] is None
    failed = run(agent, "go_test", GO_TESTIFY_TEST % "13")
    assert failed["status"] == "Failed", failed
    assert failed["run_result"]["return_code"] == 1, failed
    assert (
        "Not equal" in failed["run_result"]["stdout"]
        and "--- FAIL: TestAdd" in failed["run_result"]["stdout"]
    )
    go = found["found"]["go_test"]
    assert "github.com/stretchr/testify" in go["libraries"], go
    assert go["missing_libraries"] == {}, go


def test_go_programs_build_in_sandboxfusions_module(agent: Agent, found: dict[str, Any]) -> None:
    """A plain `go` program may import testify too (SandboxFusion builds it in the module)."""
    need(found, "go")
    body = run(agent, "go", GO_TESTIFY_MAIN)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "true\n"


def test_a_requests_own_go_mod_wins(agent: Agent, found: dict[str, Any]) -> None:
    """As under SandboxFusion (the request's files are written over the module's): a go.mod of the
    request's makes the workdir its own module, whose packages the program imports by its path."""
    need(found, "go")
    files = {
        "go.mod": "module mine\n\ngo 1.19\n",
        "util/util.go": "package util\n\nfunc Twice(x int) int { return 2 * x }\n",
    }
    code = 'package main\n\nimport (\n    "fmt"\n    "mine/util"\n)\n\nfunc main() { fmt.Println(util.Twice(21)) }\n'  # noqa: E501
    encoded = {name: base64.b64encode(text.encode()).decode() for name, text in files.items()}
    body = run(agent, "go", code, files=encoded)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "42\n"


def test_a_program_cannot_change_the_module_of_the_next(agent: Agent, found: dict[str, Any]) -> None:
    """go.mod and go.sum sit in the workdir root, which no action may write."""
    need(found, "go")
    if not requests.get(agent.url + "/v1/health", timeout=10).json()["isolation"]["per_action_uid"]:
        pytest.skip("the agent runs actions under its own uid here (not root): they share its rights")
    hostile = """import os
for attempt in (lambda: open('../go.mod', 'a').write('replace x => ./y\\n'), lambda: os.unlink('../go.sum'),
                lambda: os.rename('../go.mod', 'stolen')):
    try:
        attempt()
        print('done')
    except OSError as exc:
        print(type(exc).__name__)
"""
    body = run(agent, "python", hostile)
    assert "done" not in body["run_result"]["stdout"], body
    assert len(body["run_result"]["stdout"].split()) == 3, body
    after = run(agent, "go", GO_TESTIFY_MAIN)
    assert after["run_result"]["stdout"] == "true\n", after


def test_go_without_the_module_cache_is_go_as_before(tmp_path: Path, found: dict[str, Any]) -> None:
    """A host without the cache: no go.mod is written, a program importing only the standard
    library builds as before, a testify import fails to, and ``/v1/health`` names each module."""
    need(found, "go")
    absent = tmp_path / "absent" / "mod"
    running = start_agent(tmp_path / "work", env={"TANGRAM_GOMODCACHE": str(absent)})
    try:
        go = health_languages(running)["found"]["go_test"]
        assert "github.com/stretchr/testify" in go["missing_libraries"], go
        assert str(absent) in go["missing_libraries"]["github.com/stretchr/testify"]
        assert not os.path.lexists(running.root / "go.mod")
        plain = run(running, "go", 'package main\nimport "fmt"\nfunc main() { fmt.Println(6 * 7) }\n')
        assert plain["status"] == "Success", plain
        assert plain["run_result"]["stdout"] == "42\n"
        testify = run(running, "go", GO_TESTIFY_MAIN)
        assert testify["status"] == "Failed", testify
        assert "github.com/stretchr/testify" in testify["compile_result"]["stderr"]
    finally:
        stop_agent(running)
    assert processes_of(running.uids) == []


def test_go_test_build_errors_and_timeouts_are_the_runs(agent: Agent, found: dict[str, Any]) -> None:
    """`go test` builds as it runs (SandboxFusion has no compile step for it): a test that does not
    build fails the run, and one that never ends is out of time, with 1024 MB as verl sends."""
    need(found, "go_test")
    broken = run(agent, "go_test", GO_TESTIFY_TEST.replace("return x + y", "return x +") % "12")
    assert broken["status"] == "Failed", broken
    assert broken["compile_result"] is None
    assert broken["run_result"]["return_code"] != 0
    assert "main_test.go" in broken["run_result"]["stdout"] + broken["run_result"]["stderr"], broken
    endless = 'package main\nimport "testing"\nfunc TestLoop(t *testing.T) { for { } }\n'
    slow = run(agent, "go_test", endless, run_timeout=3, memory_limit_MB=1024)
    assert slow["status"] == "Failed", slow
    assert slow["run_result"]["status"] == "TimeLimitExceeded", slow


# MultiPL-E's Ruby tests: test/unit (a gem Ruby carries), which runs at exit and exits 1 on a failure.
RUBY_TEST_UNIT = """def add(x, y)
  x + y
end
require 'test/unit'
class TestHumanEval < Test::Unit::TestCase
  def test_add
    candidate = method(:add)
    assert_equal(%s, candidate.call(5, 7))
  end
end
"""


def test_ruby_test_unit_passes_and_fails_as_multipl_e_expects(agent: Agent, found: dict[str, Any]) -> None:
    need(found, "ruby")
    passed = run(agent, "ruby", RUBY_TEST_UNIT % "12")
    assert passed["status"] == "Success", passed
    assert "1 tests, 1 assertions, 0 failures" in passed["run_result"]["stdout"], passed
    failed = run(agent, "ruby", RUBY_TEST_UNIT % "13")
    assert failed["status"] == "Failed", failed
    assert failed["run_result"]["return_code"] == 1


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ('echo 6 * 7, "\\n";', "42\n"),  # no tag: added, else PHP would print the code itself
        ('\n\n  <?php\necho 6 * 7, "\\n";', "42\n"),  # white space before the tag is dropped
        ("<?php\necho 6 * 7;\n?>\nafter\n", "42after\n"),  # text after the closing tag is printed
    ],
)
def test_php_gets_its_opening_tag_as_under_sandboxfusion(
    agent: Agent, found: dict[str, Any], code: str, expected: str
) -> None:
    need(found, "php")
    body = run(agent, "php", code)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == expected


def test_a_failed_php_or_r_check_fails_the_run(agent: Agent, found: dict[str, Any]) -> None:
    """MultiPL-E's PHP tests throw on a mismatch, its R tests quit with status 1."""
    need(found, "php")
    need(found, "R")
    php = run(
        agent, "php", 'function f() { return 1; }\nif (f() !== 2) { throw new Exception("Test failed!"); }\n'
    )
    assert php["status"] == "Failed" and "Test failed!" in php["run_result"]["stderr"], php
    r = run(agent, "R", "f <- function() 1\nif(!identical(f(), 2)) { quit('no', 1) }\n")
    assert r["status"] == "Failed" and r["run_result"]["return_code"] == 1, r
    ok = run(agent, "R", "f <- function() 2\nif(!identical(f(), 2)) { quit('no', 1) }\ncat('ok\\n')\n")
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "ok\n", ok


# MultiPL-E's Lua tests, as every one is shaped: luaunit, and the exit status it returns.
LUA_LUAUNIT = """function add(x, y)
    return x + y
end
lu = require('luaunit')

function test_humaneval()
local candidate = add
    lu.assertEquals(candidate(5, 7), %s)
end

os.exit(lu.LuaUnit.run())
"""


def test_lua_has_luaunit_as_sandboxfusions_image_does(agent: Agent, found: dict[str, Any]) -> None:
    """SandboxFusion's image installs luaunit (luarocks); Debian's lua-unit is the same 3.4."""
    need(found, "lua")
    passed = run(agent, "lua", LUA_LUAUNIT % "12")
    assert passed["status"] == "Success", passed
    assert "1 success" in passed["run_result"]["stdout"], passed
    failed = run(agent, "lua", LUA_LUAUNIT % "13")
    assert failed["status"] == "Failed", failed
    assert failed["run_result"]["return_code"] == 1
    assert "expected: 13, actual: 12" in failed["run_result"]["stdout"], failed


# VerilogEval's shape: the design, and a test bench `tb` that counts mismatches and says how many.
VERILOG_DESIGN = """module top_module(input [7:0] a, input [7:0] b, output [8:0] sum);
    assign sum = a + b%s;
endmodule
"""
VERILOG_TB = """
module tb;
    reg [7:0] a, b;
    wire [8:0] sum;
    integer mismatches = 0, i;
    top_module dut(.a(a), .b(b), .sum(sum));
    initial begin
        for (i = 0; i < 20; i = i + 1) begin
            a = i * 7; b = i * 13; #1;
            if (sum !== a + b) mismatches = mismatches + 1;
        end
        $display("Mismatches: %0d in 20 samples", mismatches);
        $finish;
    end
endmodule
"""


def test_verilog_builds_the_test_bench_and_runs_it_as_verilogeval_does(
    agent: Agent, found: dict[str, Any]
) -> None:
    """SandboxFusion's verilog: `iverilog -g2012 -s tb` reported as the compile, `vvp -n` the run."""
    need(found, "verilog")
    right = run(agent, "verilog", VERILOG_DESIGN % "" + VERILOG_TB)
    assert right["status"] == "Success", right
    assert right["compile_result"]["return_code"] == 0
    assert right["run_result"]["stdout"].strip().splitlines()[-1] == "Mismatches: 0 in 20 samples", right
    wrong = run(agent, "verilog", VERILOG_DESIGN % " + 1" + VERILOG_TB)
    assert wrong["status"] == "Success", wrong  # the bench ran; the mismatches are the client's to read
    assert "Mismatches: 20 in 20 samples" in wrong["run_result"]["stdout"], wrong
    broken = run(agent, "verilog", "module tb; initial begin $display(undeclared); end endmodule\n")
    assert broken["status"] == "Failed" and broken["run_result"] is None, broken
    assert "undeclared" in broken["compile_result"]["stderr"], broken
    endless = run(agent, "verilog", "module tb; reg c = 0; always #1 c = ~c; endmodule\n", run_timeout=2)
    assert endless["run_result"]["status"] == "TimeLimitExceeded", endless
    again = run(agent, "verilog", VERILOG_DESIGN % "" + VERILOG_TB)
    assert again["compile_result"]["cached"] is True, again


def test_scala_runs_the_object_sandboxfusion_finds_or_says_it_found_none(
    agent: Agent, found: dict[str, Any]
) -> None:
    """`scala <object>`, the object found by SandboxFusion's pattern; a program with none fails with
    its message before any compile (SandboxFusion says SandboxError there: see _no_entry)."""
    need(found, "scala")
    named = run(
        agent, "scala", 'object Solution extends App {\n  println("from " + getClass.getSimpleName)\n}\n'
    )
    assert named["status"] == "Success", named
    assert named["run_result"]["stdout"] == "from Solution$\n"
    none = run(agent, "scala", "class Lonely { def f = 1 }\n")
    assert none["status"] == "Failed", none
    assert none["compile_result"]["stderr"] == "Object name not found.", none
    assert none["compile_result"]["return_code"] == 1 and none["run_result"] is None


JUNIT_TEST = """import org.junit.jupiter.api.Test;
import static org.junit.jupiter.api.Assertions.assertEquals;

public class SolutionTest {
    @Test
    void adds() { assertEquals(5, Solution.add(2, 3)); }
    @Test
    void addsAgain() { assertEquals(%s, Solution.add(5, 7)); }
}
"""
JUNIT_SOLUTION = "public class Solution { public static int add(int a, int b) { return a + b; } }\n"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_junit_runs_the_tests_it_finds_as_sandboxfusion_does(agent: Agent, found: dict[str, Any]) -> None:
    """The code goes to its public class's file, every .java is compiled against the launcher, and
    the launcher runs what it finds on the class path; a failed test fails the run."""
    need(found, "junit")
    files = {"Solution.java": _b64(JUNIT_SOLUTION)}
    passed = run(agent, "junit", JUNIT_TEST % "12", files=files)
    assert passed["status"] == "Success", passed
    assert "2 tests successful" in passed["run_result"]["stdout"], passed
    assert passed["compile_result"]["return_code"] == 0
    failed = run(agent, "junit", JUNIT_TEST % "13", files=files)
    assert failed["status"] == "Failed", failed
    assert failed["run_result"]["return_code"] == 1
    assert "1 tests failed" in failed["run_result"]["stdout"], failed
    # No code: the request's files are the tests (SandboxFusion writes no file then).
    only_files = run(agent, "junit", "", files={**files, "SolutionTest.java": _b64(JUNIT_TEST % "12")})
    assert only_files["status"] == "Success", only_files
    assert "2 tests successful" in only_files["run_result"]["stdout"], only_files
    junit = found["found"]["junit"]
    assert junit["libraries"].get("junit"), junit


def test_junit_is_not_offered_without_its_launcher(tmp_path: Path, found: dict[str, Any]) -> None:
    need(found, "junit")
    running = start_agent(tmp_path / "work", env={"TANGRAM_JUNIT_JAR": str(tmp_path / "absent.jar")})
    try:
        languages_found = health_languages(running)
        assert "junit" not in languages_found["found"]
        assert "absent.jar" in languages_found["missing"]["junit"], languages_found["missing"]
        body = run(running, "junit", JUNIT_TEST % "12")
        assert body["status"] == "SandboxError" and "junit" in body["message"], body
        assert "java" in languages_found["found"]  # Java itself runs on
    finally:
        stop_agent(running)
