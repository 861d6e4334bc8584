"""An action's uid has a name, as a program's has outside a sandbox: ``getpass.getuser()``,
``pwd.getpwuid(os.getuid())``, ``grp.getgrgid(os.getgid())`` and ``id -un`` answer, where without an
entry for the uid they raised KeyError and a correct program failed (SandboxFusion's container runs as
root, whose entry exists). Every action uid has the same name, so that no output depends on which
uid an action drew; the host's own entries still resolve; and an action cannot change the files.

Real agents (both fork loops) running real programs; each action in its own mount namespace.
"""

from __future__ import annotations

import os

import pytest
import requests
from sandbox_agent_harness import Agent

from arl_tangram.sandbox.zygote_wire import ACTION_USER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a uid per action needs root")

WHO = (
    "import getpass, grp, os, pwd\n"
    "print(getpass.getuser(), pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(os.getgid()).gr_name)\n"
    "print(pwd.getpwnam('root').pw_uid, os.getuid() >= 1000)\n"
)


def _run(agent: Agent, code: str, language: str = "python") -> dict[str, object]:
    body = agent.post("/run_code", {"code": code, "language": language}).json()
    result: dict[str, object] = body["run_result"]
    assert body["status"] == "Success", body
    return result


def test_every_action_uid_resolves_to_one_name(loop_agent: Agent) -> None:
    outs = {str(_run(loop_agent, WHO)["stdout"]) for _ in range(3)}
    # Three actions, three uids drawn (a uid per action), one answer.
    assert outs == {f"{ACTION_USER} {ACTION_USER} {ACTION_USER}\n0 True\n"}


def test_shell_tools_name_the_user(loop_agent: Agent) -> None:
    out = _run(loop_agent, "id -un; id -gn; whoami", language="bash")["stdout"]
    assert out == f"{ACTION_USER}\n{ACTION_USER}\n{ACTION_USER}\n"


@pytest.mark.parametrize("persistent", [False, True])
def test_a_session_uid_resolves_too(loop_agent: Agent, persistent: bool) -> None:
    """Sessions draw uids from a range of their own (after the actions'); a persistent one keeps
    its interpreter."""
    sid = loop_agent.post("/v1/sessions", {"persistent": persistent}).json()["session_id"]
    try:
        out = loop_agent.execute("import getpass; print(getpass.getuser())", session_id=sid)
        assert out["stdout"] == f"{ACTION_USER}\n", out
    finally:
        requests.delete(f"{loop_agent.url}/v1/sessions/{sid}", timeout=10)


def test_an_action_cannot_change_who_it_is(loop_agent: Agent) -> None:
    """Neither the files it sees (bound over /etc/passwd and /etc/group, as its mount table says)
    nor the agent's copies in the workdir root, which every action's namespace binds from. A file
    of its own cannot even be renamed into the root: its workdir is a filesystem of its own
    (--workdir-mb; test_sandbox_workdir_limit tries it where workdirs are plain directories)."""
    code = (
        "import errno, os\n"
        "root = os.path.dirname(os.getcwd())\n"
        "mounts = open('/proc/self/mountinfo').read().split()\n"
        "print('/etc/passwd' in mounts, '/etc/group' in mounts)\n"
        "for path in ('/etc/passwd', '/etc/group', root + '/.passwd', root + '/.group'):\n"
        "    try:\n"
        "        open(path, 'a').write('root::0:0::/:/bin/sh\\n')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
        "open('mine', 'w').write('root::0:0::/:/bin/sh\\n')\n"
        "for path in (root + '/.passwd', root + '/.passwd.new'):\n"
        "    try:\n"
        "        os.replace('mine', path)\n"
        "        print('replaced', path)\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    out = _run(loop_agent, code)["stdout"]
    assert out == "True True\n" + "PermissionError\n" * 4 + "EXDEV\n" * 2, out
