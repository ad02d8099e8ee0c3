"""Sessions over HTTP (shared/SERVE.md §8): ``/v1/sessions`` -- create,
run, stream, delete, list -- and SandboxFusion's ``/run_jupyter`` with its
own client package. Each server is the real ``execpool serve`` on a
loopback port, with its default sandbox (strict), run as root here."""

from __future__ import annotations

import base64
import json
import secrets

import httpx
import psutil
import pytest

from tests.support.helpers import all_dead, pids_in, wait_for
from tests.support.servers import DEADLINE_S, Server, b64, metric


@pytest.fixture(scope="module")
def server():
    s = Server("--workers", "2", "--max-in-flight", "4", "--max-sessions", "3", "--heartbeat", "0.05")
    yield s
    assert s.stop() == 0


def open_session(server, **body):
    answer = server.client.post("/v1/sessions", json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def run(server, ident, code, **body):
    """A cell's answer, waited for as long as the cell may run and then the
    tests' deadline (a 120 s cell once outlasted the client's 20 s)."""
    return server.client.post(f"/v1/sessions/{ident}/run", json={"code": code, **body},
                              timeout=body.get("timeout", 0) + DEADLINE_S)


def test_a_python_session_keeps_its_state_and_files(server):
    ident = open_session(server, language="python", files={"data.csv": b64(b"a,b\n1,2\n3,4\n")})
    assert len(ident) >= 20
    first = run(server, ident, "import csv\nrows = list(csv.DictReader(open('data.csv')))\nlen(rows)").json()
    assert (first["status"], first["value"], first["alive"], first["execution_count"]) == ("ok", "2", True, 1)
    assert set(first) >= {"status", "stdout", "stderr", "value", "display", "error", "alive", "duration_s",
                          "execution_count", "cpu_user_s", "cpu_system_s", "max_rss_bytes", "peak_memory_bytes",
                          "processes"}
    assert first["max_rss_bytes"] > 0 and first["cpu_user_s"] >= 0
    second = run(server, ident, "print(sum(int(r['b']) for r in rows))\nrows[0]['a']").json()
    assert (second["stdout"], second["value"]) == ("6\n", "'1'")
    error = run(server, ident, "undefined_name").json()
    assert error["status"] == "error" and error["error"]["ename"] == "NameError"
    listed = {s["id"]: s for s in server.client.get("/v1/sessions").json()}
    assert listed[ident]["language"] == "python" and listed[ident]["alive"]
    assert server.client.delete(f"/v1/sessions/{ident}").status_code == 204
    assert run(server, ident, "1").status_code == 404
    assert ident not in {s["id"] for s in server.client.get("/v1/sessions").json()}


def test_a_bash_session_and_its_timeout(server):
    ident = open_session(server, language="bash")
    assert run(server, ident, "cd /tmp && export K=v").json()["exit_code"] == 0
    assert run(server, ident, "pwd; echo $K").json()["stdout"] == "/tmp\nv\n"
    slow = run(server, ident, "sleep 30", timeout=0.3).json()
    assert (slow["status"], slow["alive"]) == ("timeout", True)
    assert run(server, ident, "echo $K").json()["stdout"] == "v\n"
    server.client.delete(f"/v1/sessions/{ident}")


def test_a_cell_streams_its_output_then_its_record(server):
    ident = open_session(server)
    events = []
    with server.client.stream("POST", f"/v1/sessions/{ident}/stream",
                              json={"code": "import sys, time\nfor i in range(3):\n    print(i)\n    time.sleep(0.1)\n"
                                            "print('e', file=sys.stderr)\n'done'"}) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
    outputs = [e for k, e in events if k is None]
    assert "".join(e["text"] for e in outputs if e["stream"] == "stdout") == "0\n1\n2\n"
    assert "".join(e["text"] for e in outputs if e["stream"] == "stderr") == "e\n"
    kind, record = events[-1]
    assert kind == "result" and record["value"] == "'done'" and record["stdout"] == "0\n1\n2\n"
    server.client.delete(f"/v1/sessions/{ident}")


def test_unknown_and_guessed_ids_are_404_and_bad_bodies_400(server):
    ident = open_session(server)
    guessed = ident[:-2] + ("AA" if not ident.endswith("AA") else "BB")
    assert run(server, guessed, "1").status_code == 404
    assert run(server, secrets.token_urlsafe(16), "1").status_code == 404
    assert server.client.delete(f"/v1/sessions/{guessed}").status_code == 404
    bad = server.client.post("/v1/sessions", json={"language": "ruby"})
    assert bad.status_code == 400 and '"language" must be one of python, bash' in bad.json()["detail"]
    assert server.client.post("/v1/sessions", json={"idle_timeout": 10**9}).status_code == 400
    assert server.client.post(f"/v1/sessions/{ident}/run", json={"cod": "1"}).status_code == 400
    assert run(server, ident, "1", timeout=10**9).status_code == 400
    server.client.delete(f"/v1/sessions/{ident}")


def test_past_max_sessions_a_503_with_retry_after(server):
    before = {s["id"] for s in server.client.get("/v1/sessions").json()}
    opened = [open_session(server) for _ in range(3 - len(before))]
    try:
        refused = server.client.post("/v1/sessions", json={})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert metric(server, "execpool_sessions_open") == 3
    finally:
        for ident in opened:
            server.client.delete(f"/v1/sessions/{ident}")
    assert wait_for(lambda: metric(server, "execpool_sessions_open") == len(before), 5)


def test_an_idle_session_expires_and_leaves_the_list(server):
    ident = open_session(server, idle_timeout=0.3)
    assert run(server, ident, "1").json()["status"] == "ok"
    # Watched through the list: a cell would keep it alive.
    assert wait_for(lambda: ident not in {s["id"] for s in server.client.get("/v1/sessions").json()}, 10)
    assert run(server, ident, "1").status_code == 404


def test_deleting_a_session_kills_what_it_started(server, doomed):
    from tests.support.helpers import remember
    ident = open_session(server, language="bash")
    pids = pids_in(run(server, ident, "setsid sh -c 'sleep 300 >/dev/null 2>&1 & echo PIDS $!'; "
                                      "sleep 300 >/dev/null 2>&1 & echo PIDS $!").json()["stdout"])
    remember(doomed, pids)
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    assert server.client.delete(f"/v1/sessions/{ident}").status_code == 204
    assert all_dead(pids)


def test_cells_are_counted_in_the_metrics(server):
    before = metric(server, 'execpool_session_cells_total{status="ok"}')
    ident = open_session(server)
    run(server, ident, "1")
    run(server, ident, "2")
    assert metric(server, 'execpool_session_cells_total{status="ok"}') - before == 2
    server.client.delete(f"/v1/sessions/{ident}")


# -- SandboxFusion's /run_jupyter, with its own client ----------------------------------------

def test_run_jupyter_through_the_sandbox_fusion_client(server):
    from sandbox_fusion import RunJupyterRequest, RunStatus, run_jupyter

    answer = run_jupyter(RunJupyterRequest(
        cells=["a = 123", "a", "print(a)", "import sys; sys.stderr.write('stderr message')",
               "raise RuntimeError('error message')", "import pandas as pd\npd.DataFrame({'x': [a]})",
               "open('out.txt', 'w').write('made')"],
        files={"in.txt": b64(b"given")}, fetch_files=["out.txt"]), endpoint=server.url, max_attempts=1)
    assert answer.status == RunStatus.Success and answer.driver.status == "Finished", answer
    cells = answer.cells
    assert len(cells) == 7
    assert cells[0].display == [] and cells[1].display == [{"text/plain": "123"}]
    assert cells[2].stdout == "123\n" and cells[3].stderr == "stderr message"
    assert cells[4].error[0]["ename"] == "RuntimeError" and cells[4].error[0]["evalue"] == "error message"
    assert "<table" in cells[5].display[0]["text/html"]
    assert base64.b64decode(answer.files["out.txt"]) == b"made"


@pytest.mark.slow
def test_run_jupyter_past_its_total_timeout_fails_and_a_cell_timeout_interrupts(server):
    from sandbox_fusion import RunJupyterRequest, RunStatus, run_jupyter

    late = run_jupyter(RunJupyterRequest(cells=["x = 1", "import time\ntime.sleep(30)"], total_timeout=1),
                       endpoint=server.url, max_attempts=1)
    assert late.status == RunStatus.Failed and late.driver.status == "TimeLimitExceeded" and late.cells == []
    interrupted = run_jupyter(RunJupyterRequest(cells=["import time\ntime.sleep(30)", "'after'"], cell_timeout=0.3,
                                                total_timeout=20), endpoint=server.url, max_attempts=1)
    assert interrupted.status == RunStatus.Success, interrupted
    assert interrupted.cells[0].error[0]["ename"] == "KeyboardInterrupt"
    assert interrupted.cells[1].display == [{"text/plain": "'after'"}]
    bad = server.client.post("/run_jupyter", json={"cells": "print(1)"}).json()
    assert bad["status"] == "SandboxError" and '"cells" must be an array' in bad["message"]


@pytest.mark.slow
def test_sessions_opened_at_once_never_pass_max_sessions(server):
    """Each create reserves its place before it writes its files."""
    from concurrent.futures import ThreadPoolExecutor

    before = len(server.client.get("/v1/sessions").json())
    body = {"files": {f"f{n}.bin": b64(bytes(1 << 20)) for n in range(4)}}
    with ThreadPoolExecutor(16) as creating:
        answers = list(creating.map(lambda _: server.client.post("/v1/sessions", json=body), range(16)))
    opened = [a.json()["id"] for a in answers if a.status_code == 201]
    try:
        assert len(opened) == 3 - before
        assert {a.status_code for a in answers} == {201, 503}
    finally:
        for ident in opened:
            server.client.delete(f"/v1/sessions/{ident}")


@pytest.mark.slow
def test_fork_over_http(server):
    """A copy is a session of its own, with its parent's state and a copy of
    its files, in the service's sandbox (strict, its default) and without
    one; a bash session cannot be forked (409, saying why)."""
    boxed = open_session(server, language="python", files={"seed.txt": b64(b"seed")})
    run(server, boxed, "state = ['parent']\nopen('mine.txt', 'w').write('parent')")
    answer = server.client.post(f"/v1/sessions/{boxed}/fork")
    assert answer.status_code == 201, answer.text
    copy = answer.json()["id"]
    run(server, copy, "state.append('child')\nopen('mine.txt', 'w').write('child')")
    assert run(server, boxed, "state, open('mine.txt').read()").json()["value"] == "(['parent'], 'parent')"
    assert run(server, copy, "state, open('mine.txt').read(), open('seed.txt').read()").json()["value"] == (
        "(['parent', 'child'], 'child', 'seed')")
    assert server.client.post(f"/v1/sessions/{secrets.token_urlsafe(16)}/fork").status_code == 404
    for ident in (boxed, copy):
        assert server.client.delete(f"/v1/sessions/{ident}").status_code == 204
    shell = open_session(server, language="bash")
    refused = server.client.post(f"/v1/sessions/{shell}/fork")
    assert refused.status_code == 409 and "Python" in refused.json()["detail"]
    server.client.delete(f"/v1/sessions/{shell}")
    plain = Server("--workers", "1", "--sandbox", "off", "--max-sessions", "2")
    try:
        parent = open_session(plain, language="python", files={"seed.txt": b64(b"seed")})
        run(plain, parent, "state = ['parent']\nopen('mine.txt', 'w').write('parent')")
        answer = plain.client.post(f"/v1/sessions/{parent}/fork")
        assert answer.status_code == 201, answer.text
        child = answer.json()["id"]
        assert child != parent and answer.json()["language"] == "python"
        run(plain, child, "state.append('child')\nopen('mine.txt', 'w').write('child')")
        assert run(plain, parent, "state, open('mine.txt').read(), open('seed.txt').read()").json()["value"] == (
            "(['parent'], 'parent', 'seed')")
        assert run(plain, child, "state, open('mine.txt').read()").json()["value"] == "(['parent', 'child'], 'child')"
        full = plain.client.post(f"/v1/sessions/{parent}/fork")  # two open: the cap
        assert full.status_code == 503 and "Retry-After" in full.headers
        assert plain.client.delete(f"/v1/sessions/{parent}").status_code == 204
        assert run(plain, child, "len(state)").json()["value"] == "2"
        assert {s["id"] for s in plain.client.get("/v1/sessions").json()} == {child}
    finally:
        assert plain.stop() == 0


@pytest.mark.slow
def test_a_fork_whose_client_left_is_closed_and_leaves_no_place_taken(tmp_path):
    """A client that gives up during a slow fork gets no copy: the copy,
    once made, is closed, its place among --max-sessions freed (it was once
    kept, listed, until its idle timeout)."""
    plain = Server("--workers", "1", "--sandbox", "off", "--max-sessions", "4")
    try:
        parent = open_session(plain, language="python")
        run(plain, parent, "for i in range(40000):\n    open(f'f{i}', 'w').close()", timeout=120)
        with pytest.raises(httpx.TimeoutException):
            plain.client.post(f"/v1/sessions/{parent}/fork", timeout=0.3)
        assert wait_for(lambda: [s["id"] for s in plain.client.get("/v1/sessions").json()] == [parent], 60)
        for _ in range(3):  # every other place is free
            open_session(plain, language="python")
    finally:
        assert plain.stop() == 0
