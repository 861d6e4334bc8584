"""A program's main stack may grow to its memory limit, as under SandboxFusion, and its threads keep
the 8 MB they have outside: real agents (both fork loops for Python), real compilers.

SandboxFusion sets RLIMIT_STACK to the request's memory limit. A memoised recursion 200,000 deep in
Python, or a recursion a million deep in C or C++, passes there and overflowed the 8 MB stack a
process has by default here. glibc sizes threads' stacks by the same limit, so under SandboxFusion
a program's threads fail to start; here they start as outside (a Python action's are sized when the
zygote starts, a C or C++ program's by ``sandbox/thread_stack.c``, linked into each).
"""

from __future__ import annotations

import resource
import shutil
from typing import Any

import pytest
from sandbox_agent_harness import Agent

PY_DEEP = """
import sys, threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
sys.setrecursionlimit(10**7)
@lru_cache(None)
def depth(n):
    return 0 if n == 0 else depth(n - 1) + 1
print(depth(200000))
with ThreadPoolExecutor(8) as pool:
    print(sum(pool.map(lambda x: x * x, range(100))))
t = threading.Thread(target=lambda: print("thread"))
t.start(); t.join()
"""

CPP_DEEP = r"""#include <cstdio>
#include <thread>
#include <vector>
int depth(int n) {
    volatile char frame[64];
    frame[0] = (char)n;
    return n ? depth(n - 1) + (frame[0] & 0) + 1 : 0;
}
int main() {
    std::vector<std::thread> pool;
    for (int i = 0; i < 8; i++) pool.emplace_back([] {});
    for (auto &t : pool) t.join();
    std::printf("threads\n%d\n", depth(1000000));
}
"""

C_DEEP = r"""#include <pthread.h>
#include <stdio.h>
static void *nothing(void *arg) { return arg; }
static int depth(int n) {
    volatile char frame[64];
    frame[0] = (char)n;
    return n ? depth(n - 1) + (frame[0] & 0) + 1 : 0;
}
int main(void) {
    pthread_t t[8];
    for (int i = 0; i < 8; i++) if (pthread_create(&t[i], NULL, nothing, NULL) != 0) return 3;
    for (int i = 0; i < 8; i++) pthread_join(t[i], NULL);
    printf("threads\n%d\n", depth(1000000));
    return 0;
}
"""

CPP_RUNAWAY = r"""#include <cstdio>
int down(int n) { volatile char frame[256]; frame[0] = (char)n; return down(n + 1) + frame[0]; }
int main() { std::printf("%d\n", down(0)); }
"""


def run_code(agent: Agent, language: str, code: str, memory_mb: int = 1024) -> dict[str, Any]:
    body: dict[str, Any] = agent.post(
        "/run_code",
        {
            "code": code,
            "language": language,
            "memory_limit_MB": memory_mb,
            "run_timeout": 20,
            "compile_timeout": 120,
        },
    ).json()
    return body


def test_python_recursion_as_deep_as_sandboxfusion_allows_and_threads_as_outside(loop_agent: Agent) -> None:
    body = run_code(loop_agent, "python", PY_DEEP)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "200000\n328350\nthread\n"


@pytest.mark.parametrize(("language", "code"), [("cpp", CPP_DEEP), ("c", C_DEEP)])
def test_native_recursion_a_million_deep_with_threads(loop_agent: Agent, language: str, code: str) -> None:
    if shutil.which({"cpp": "g++", "c": "gcc"}[language]) is None:
        pytest.skip(f"no {language} compiler here")
    body = run_code(loop_agent, language, code)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "threads\n1000000\n"


def test_runaway_recursion_still_ends_at_the_memory_limit(loop_agent: Agent) -> None:
    """The stack is bounded by the memory limit: a recursion without end dies of it (a segmentation
    fault, as outside), and soon."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler here")
    body = run_code(loop_agent, "cpp", CPP_RUNAWAY, memory_mb=256)
    assert body["status"] == "Failed", body
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["return_code"] == -11, body


SUBPROCESS_THREAD = (
    "import subprocess, sys\n"
    "done = subprocess.run([sys.executable, '-c', 'import threading; t = threading.Thread(target=print); "
    "t.start(); t.join()'])\n"
    "print(done.returncode)\n"
)


def test_no_memory_limit_asked_is_the_stack_a_process_has_outside(loop_agent: Agent) -> None:
    """SandboxFusion sets RLIMIT_STACK only for a positive memory_limit_MB (and the native API is as
    outside): then the stack is the 8 MB a process starts with, so what a program executes starts
    its threads (a stack the size of the pool's memory made them fail)."""
    body = run_code(loop_agent, "python", SUBPROCESS_THREAD, memory_mb=-1)
    assert (body["status"], body["run_result"]["stdout"]) == ("Success", "\n0\n"), body
    body = loop_agent.execute(SUBPROCESS_THREAD)
    assert (body["status"], body["stdout"]) == ("ok", "\n0\n"), body
    limit = "import resource; print(resource.getrlimit(resource.RLIMIT_STACK)[0] >> 20)"
    assert loop_agent.execute(limit)["stdout"] == f"{resource.getrlimit(resource.RLIMIT_STACK)[0] >> 20}\n"
    assert run_code(loop_agent, "python", limit, memory_mb=512)["run_result"]["stdout"] == "512\n"


C_RAISES_ITS_STACK = r"""#include <pthread.h>
#include <stdio.h>
#include <sys/resource.h>
static void *nothing(void *arg) { return arg; }
/* The first constructor a program may declare: ours must have run before it. */
__attribute__((constructor(101))) static void early(void) {
    pthread_t t;
    int made = pthread_create(&t, NULL, nothing, NULL);
    printf("constructor thread %d\n", made);
    if (made == 0) pthread_join(t, NULL);
}
int main(void) {
    struct rlimit rl;
    getrlimit(RLIMIT_STACK, &rl);
    rl.rlim_cur = rl.rlim_max;  /* the hard limit is SandboxFusion's: the program may raise to it */
    printf("raised %d\n", setrlimit(RLIMIT_STACK, &rl));
    return 0;
}
"""


def test_a_c_programs_constructors_and_its_hard_stack_limit_are_as_outside(loop_agent: Agent) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    body = run_code(loop_agent, "c", C_RAISES_ITS_STACK)
    assert body["status"] == "Success", body
    assert body["run_result"]["stdout"] == "constructor thread 0\nraised 0\n", body
