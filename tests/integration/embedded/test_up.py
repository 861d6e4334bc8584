"""``tangram up`` as a user runs it: a directory of the same YAML a cluster takes, actions through
its gateway (SandboxFusion's /run_code and /run_jupyter, the native API with sessions, reward
endpoints) with the right verdicts, bad specs refused by name, and Ctrl-C stopping every process it
started."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import sandbox_fusion
import yaml
from up_harness import Up, leftovers, pool_doc, tangram_up, wait_until

from arl_tangram.client import TangramClient
from arl_tangram.rewards.builtin import BuiltinScorer, write_model
from arl_tangram.workloads.humaneval import local_verdict, programs

POOL = "default/py"


def service_doc(name: str, uri: str) -> dict[str, Any]:
    return {
        "apiVersion": "tangram.arl.dev/v1alpha1",
        "kind": "RewardModelService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": name, "uri": uri},
            "server": {"runtime": "builtin"},
            "gpu": {"memory": "64Mi"},
            "batching": {"maxWaitMillis": 1},
        },
    }


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("rm") / "rm.npz", buckets=1024, dim=16, seed=3)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[Up]:
    specs = tmp_path_factory.mktemp("specs")
    (specs / "pool.yaml").write_text(yaml.safe_dump(pool_doc()))
    # Several documents in one file, as kubectl takes them: a served service, one that is not (its
    # weights would have to be downloaded), and an ActionBatch (not a spec tangram up runs).
    docs = [
        service_doc("rm", f"file://{model}"),
        service_doc("hub-rm", "hf://Skywork/Skywork-Reward-V2-Qwen3-0.6B"),
        {"apiVersion": "tangram.arl.dev/v1alpha1", "kind": "ActionBatch", "metadata": {"name": "b"}},
    ]
    (specs / "services.yaml").write_text(yaml.safe_dump_all(docs))
    with tangram_up(specs) as running:
        wait_until(lambda: running.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")
        yield running


def test_it_says_what_it_serves_and_what_not(up: Up) -> None:
    out = up.output()
    assert "RewardModelService default/hub-rm: not served" in out and "hf://" in out
    assert "ActionBatch skipped" in out
    assert up.url.startswith("http://127.0.0.1:")


def test_humaneval_programs_get_their_own_verdicts_through_run_code(up: Up) -> None:
    for prog in programs(8):
        want = local_verdict(prog)
        resp = requests.post(up.url + "/run_code", json={"code": prog.code, "language": "python"}, timeout=60)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["run_result"]["return_code"] == want, (prog.action_id, body)
        assert body["status"] == ("Success" if want == 0 else "Failed")


def test_a_notebook_through_sandboxfusions_client(up: Up) -> None:
    """SandboxFusion's own client, its endpoint naming the pool in the path (it appends the route)."""
    notebook = sandbox_fusion.RunJupyterRequest(cells=["x = 6 * 7", "x", "1 / 0", "print(x)"])
    endpoint = up.url + "/pools/default/py"
    answer = sandbox_fusion.run_jupyter(notebook, endpoint=endpoint, max_attempts=1, client_timeout=120)
    assert answer.status == "Success"
    assert answer.cells[1].display[0]["text/plain"] == "42"
    assert answer.cells[2].error[0]["ename"] == "ZeroDivisionError"
    assert answer.cells[3].stdout == "42\n"


def test_native_actions_and_a_session_through_the_client(up: Up) -> None:
    with TangramClient(up.url, namespace="default", pool="py", token="") as client:
        result = client.run_code("print(6 * 7)")
        assert result.ok and result.stdout == "42\n" and result.host is not None
        failed = client.run_code("import sys; sys.exit(3)")
        assert not failed.ok and failed.exit_code == 3 and failed.reason == "NonZeroExit"
        with client.session() as session:
            assert session.run_code("open('state.txt', 'w').write('kept')").ok
            again = session.run_code("print(open('state.txt').read())")
            assert again.ok and again.stdout == "kept\n"


def test_reward_endpoints_score_with_the_declared_model(up: Up, model: Path) -> None:
    scorer = BuiltinScorer.from_file(model)
    scorer.restore()
    body = {"query": ["q: sky? a: blue", "q: sky? a: green"], "prompts": ["q: sky? a:"] * 2}
    resp = requests.post(up.url + "/get_reward?service=rm", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["rewards"] == [float(x) for x in scorer.score(body["query"])]
    missing = requests.post(up.url + "/get_reward?service=hub-rm", json=body, timeout=60)
    assert missing.status_code == 404 and "hub-rm" in missing.text
    # Declared, so the answer says why it is not served (it said no such service existed).
    assert "not served by tangram up" in missing.text and "hf://" in missing.text, missing.text


def _up_refuses(tmp_path: Path, doc: dict[str, Any] | None) -> str:
    path = tmp_path / "bad.yaml"
    if doc is not None:
        path.write_text(yaml.safe_dump(doc))
    done = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "up", "-f", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    return done.stderr


def test_bad_specs_are_refused_by_name(tmp_path: Path) -> None:
    assert "no such file" in _up_refuses(tmp_path, None)
    half_core = pool_doc()
    half_core["spec"]["template"]["resources"]["cpu"] = "1500m"
    assert "spec.template.resources.cpu" in _up_refuses(tmp_path, half_core)
    typo = pool_doc()
    typo["spec"]["scaling"]["maxHost"] = 2
    assert "maxHost" in _up_refuses(tmp_path, typo)


def test_ctrl_c_stops_every_process_it_started(tmp_path: Path) -> None:
    (tmp_path / "pool.yaml").write_text(yaml.safe_dump(pool_doc()))
    with tangram_up(tmp_path / "pool.yaml") as running:
        wait_until(lambda: running.pools()[POOL]["status"]["hostsReady"] == 1, 60, "the pool's host")
        # An action still running and a session still open when Ctrl-C comes.
        session = requests.post(running.url + "/v1/sessions", json={"pool": "py"}, timeout=30).json()
        assert "id" in session, session
        ended: list[str] = []

        def sleep_long() -> None:
            code = "import time; time.sleep(120)"
            body: dict[str, Any] = {"code": code, "language": "python", "run_timeout": 50}
            try:
                resp = requests.post(running.url + "/run_code", json=body, timeout=180)
                ended.append(f"{resp.status_code} {resp.text}")
            except requests.RequestException as exc:
                ended.append(repr(exc))

        sleeper = threading.Thread(target=sleep_long, daemon=True)
        sleeper.start()
        wait_until(lambda: running.pools()[POOL]["status"]["coresBusy"] == 1, 30, "the action to run")
        hosts = running.hosts(POOL)
        pids = [h["pid"] for h in hosts]
        uids = [range(*h["uids"]) for h in hosts]
        assert pids
        # Granted is not yet forked: wait for the action's own process, under the host's uids.
        wait_until(lambda: leftovers([], uids), 30, "the action's process under the host's uids")
        running.proc.send_signal(signal.SIGINT)
        assert running.proc.wait(timeout=60) == 0, running.output()
        assert leftovers(pids, uids) == []
        sleeper.join(timeout=30)
        # Answered, saying to send it again: its connection was dropped without an answer (a
        # trainer's client read that as a network fault, or as nothing it could act on).
        assert ended and ended[0].startswith("504 "), ended  # /run_code's platform failure
        assert "SandboxError" in ended[0] and "send it again" in ended[0], ended
        assert "stopping" in running.output()
        # Each agent stopped by itself, its action killed first: it was not killed after the grace.
        assert "did not stop" not in running.output(), running.output()


def test_tenant_weights_are_read_as_the_operator_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TANGRAM_TENANT_WEIGHTS``, the operator's variable, sets the scheduler's weights here too,
    and a wrong one stops the start with the operator's own message. It was ignored: every tenant
    weighed 1 with no word of it."""
    monkeypatch.setenv("TANGRAM_TENANT_WEIGHTS", "team-a=3,team-b=zero")
    refused = _up_refuses(tmp_path, pool_doc(minHosts=0))
    assert "TANGRAM_TENANT_WEIGHTS: 'team-b=zero' is not TENANT=WEIGHT with a positive number" in refused
    monkeypatch.setenv("TANGRAM_TENANT_WEIGHTS", "team-a=3, team-b=1.5")
    with tangram_up(tmp_path / "bad.yaml") as running:
        assert "tenant weights (TANGRAM_TENANT_WEIGHTS): team-a=3, team-b=1.5" in running.output()


def test_a_damaged_model_stops_the_start_with_one_line(tmp_path: Path) -> None:
    """A RewardModelService whose model file is no model: the reward runtime refuses it at its
    start, and ``tangram up`` stops with that reason in one line, nothing left running. It ended
    in a RuntimeError traceback."""
    damaged = tmp_path / "rm.npz"
    damaged.write_bytes(b"not a model")
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(service_doc("rm", f"file://{damaged}")))
    done = subprocess.run(
        [sys.executable, "-m", "arl_tangram", "up", "-f", str(tmp_path / "rm.yaml"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tangram up: the reward runtime exited 2: "), done.stderr
    assert f"{damaged} is not a built-in scorer model" in last, done.stderr
