"""``execpool serve`` over real HTTP on a loopback port (shared/SERVE.md):
each server here is the real command in a process of its own, talked to
with httpx -- and with SandboxFusion's own client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from execpool.formats.request import HTTP_JOB, RUN_CODE
from execpool.tool.spare_wire import TEMPLATE_NAME
from tests.support.helpers import REPO, Gates, all_dead, pids_in, wait_for
from tests.support.servers import DEADLINE_S, Server, b64, runs_a_job


@pytest.fixture(scope="module")
def server():
    s = Server("--workers", "2", "--max-in-flight", "4", "--heartbeat", "0.05")
    yield s
    assert s.stop() == 0



# -- health, OpenAPI --------------------------------------------------------------------------


def test_health_ping_and_openapi(server):
    c = server.client
    assert c.get("/healthz").json() == {"status": "ok"}
    ready = c.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["workers"] == 2
    assert c.get("/v1/ping").json() == "pong"
    document = c.get("/openapi.json").json()
    assert {"/v1/run", "/v1/stream", "/v1/batch", "/run_code", "/metrics"} <= set(document["paths"])
    # Generated from the declaration that parses the bodies: what it describes is what is taken.
    schemas = document["components"]["schemas"]
    assert set(schemas["Job"]["properties"]) == set(HTTP_JOB.keys) and schemas["Job"]["additionalProperties"] is False
    assert set(schemas["RunCodeRequest"]["properties"]) == set(RUN_CODE.keys)
    for key in set(HTTP_JOB.keys) - {"fetch_files"}:  # a list of paths is a list
        refused = c.post("/v1/run", json={"shell": "true", key: ["not", "this type"]})
        assert refused.status_code == 400 and json.dumps(key) in refused.json()["detail"], (key, refused.text)


# -- execpool's dialect ----------------------------------------------------------------------


def test_run_answers_the_batch_record(server):
    c = server.client
    ok = c.post("/v1/run", json={"id": "a", "python": "print('hi')"}).json()
    assert (ok["id"], ok["status"], ok["exit_code"], ok["output"]) == ("a", "ok", 0, "hi\n")
    failed = c.post("/v1/run", json={"shell": "echo out; echo err >&2; exit 3"}).json()
    assert (failed["status"], failed["exit_code"], failed["output"]) == ("error", 3, "out\nerr\n")
    slow = c.post("/v1/run", json={"shell": "echo before; sleep 10", "timeout": 0.3}).json()
    assert slow["status"] == "timeout" and slow["output"] == "before\n"
    assert slow["error"] == "Execution timed out after 0.3 seconds."
    fed = c.post("/v1/run", json={"python": "print(input()[::-1])", "stdin": "abc\n", "env": {"X": "1"}}).json()
    assert fed["output"] == "cba\n"


def test_files_go_in_and_come_back_and_paths_out_of_the_job_are_refused(server):
    c = server.client
    answer = c.post("/v1/run", json={
        "shell": "cat in/data.txt; mkdir out; tr a-z A-Z < in/data.txt > out/up.txt",
        "files": {"in/data.txt": b64(b"hello\n")}, "fetch_files": ["out/up.txt", "missing.txt"]}).json()
    assert answer["output"] == "hello\n"
    assert answer["files"] == {"out/up.txt": b64(b"HELLO\n")}
    for bad in ({"files": {"../x": b64(b"x")}}, {"files": {"/etc/x": b64(b"x")}}, {"fetch_files": ["a/../../b"]},
                {"files": {"x": "not base64!"}}):
        refused = c.post("/v1/run", json={"shell": "touch ran", **bad})
        assert refused.status_code == 400, refused.text
        assert "files" in refused.json()["detail"]


def test_a_symlink_the_job_plants_is_not_followed_when_fetching(server, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("SECRET")
    answer = server.client.post("/v1/run", json={"shell": f"ln -s {secret} leak; echo done",
                                                 "fetch_files": ["leak"]}).json()
    assert answer["output"] == "done\n" and answer["files"] == {}


@pytest.mark.parametrize("body, field", [
    ({"python": 5}, '"python"'), ({"python": "x", "shell": "y"}, "give one of"), ({"shell": "true", "timeout": -1}, "timeout"),
    ({"shell": "true", "timeout": "1"}, "timeout"), ({"shell": "true", "bogus": 1}, '"bogus"'),
    ({"shell": "true", "env": {"A": 1}}, "env"), ({"shell": "true", "id": [1]}, '"id"'),
    ({"shell": "true", "timeout": 10 ** 6}, "limit"), ([1, 2], "object"),
])
def test_bad_bodies_get_400_naming_the_field(server, body, field):
    answer = server.client.post("/v1/run", json=body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["detail"]


def test_no_code_is_answered_as_the_library_answers_it_in_each_dialect(server):
    """One rule: a job with no code runs to a Result that says so. execpool's
    routes give that Result's record; /run_code gives what SandboxFusion
    makes of an empty program (an empty file, run: it succeeds)."""
    for body, text in (({"shell": "  "}, "No command provided."), ({"python": ""}, "No code provided.")):
        answer = server.client.post("/v1/run", json=body)
        assert answer.status_code == 200, answer.text
        assert (answer.json()["status"], answer.json()["error"]) == ("error", text)
    answer = server.client.post("/run_code", json={"code": "", "language": "python"}).json()
    assert answer["status"] == "Success" and answer["run_result"]["return_code"] == 0


@pytest.mark.slow
def test_not_json_and_too_large_bodies(server):
    c = server.client
    assert c.post("/v1/run", content=b"{not json").status_code == 400
    huge = c.post("/v1/run", content=b"x" * (65 << 20))
    assert huge.status_code == 413


def test_stream_shows_output_before_the_job_ends(server):
    events, result, heartbeats = [], None, 0
    # The job is sandboxed: no file of the test's is in its view to wait for.
    with Gates() as gates, server.client.stream("POST", "/v1/stream", json={
            "python": gates.python() + "print('first', flush=True)\nwait()\nprint('second')", "id": 7}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith(": keep-alive"):
                heartbeats += 1
                if "first\n" in "".join(e["text"] for e in events):
                    gates.open()  # the job ends only after its first line, then a keep-alive, came
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                payload = json.loads(line[len("data: "):])
                if name == "result":
                    result = payload
                    break
                events.append(payload)
    assert "".join(e["text"] for e in events) == "first\nsecond\n"
    assert all(e["type"] == "tool_output" for e in events)
    assert heartbeats >= 1
    assert result["id"] == 7 and result["status"] == "ok" and result["output"] == "first\nsecond\n"


def test_a_stream_whose_client_goes_away_kills_the_whole_tree(server):
    command = "for i in 1 2 3; do sleep 300 & echo \"PIDS $!\"; done; echo \"PIDS $$\"; wait"
    text = ""
    with server.client.stream("POST", "/v1/stream", json={"shell": command, "timeout": 600}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                text += json.loads(line[6:])["text"]
            if text.count("PIDS") == 4:
                break
    pids = pids_in(text)
    assert len(pids) == 4
    assert all_dead(pids, timeout=5.0), "the tree outlived its client"


def test_batch_streams_records_and_invalid_lines_do_not_fail_it(server):
    lines = [json.dumps({"id": 1, "shell": "echo one"}), "", "not json", json.dumps({"id": 2, "python": "exit(4)"}),
             json.dumps({"id": 3, "shell": "echo three"})]
    answer = server.client.post("/v1/batch", content="\n".join(lines).encode())
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    records = [json.loads(line) for line in answer.text.splitlines()]
    by_id = {r["id"]: r for r in records if r["status"] != "invalid"}
    assert by_id[1]["output"] == "one\n" and by_id[2]["exit_code"] == 4 and by_id[3]["status"] == "ok"
    assert [by_id[i]["line"] for i in (1, 2, 3)] == [1, 4, 5], "records name their input line"
    invalid = [r for r in records if r["status"] == "invalid"]
    assert len(invalid) == 1 and invalid[0]["line"] == 3 and "JSON" in invalid[0]["error"]


def test_batch_of_tests_says_which_passed(server):
    body = {"code": "import sys\nn = int(input())\nprint(n * 2)\nprint('noise', file=sys.stderr)",
            "tests": [{"stdin": "2\n", "expected": "4"}, {"stdin": "5\n", "expected": "11\n"},
                      {"stdin": "x\n", "expected": "0"}]}
    answer = server.client.post("/v1/batch", content=json.dumps(body, indent=2).encode())  # pretty printed
    records = sorted((json.loads(line) for line in answer.text.splitlines()), key=lambda r: r["id"])
    assert [r["passed"] for r in records] == [True, False, False]
    assert records[0]["stderr"] == "noise\n" and records[2]["status"] == "error"


# -- SandboxFusion's dialect -------------------------------------------------------------------


def run_code(server, **body):
    answer = server.client.post("/run_code", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_run_code_answers_sandbox_fusions_model(server):
    ok = run_code(server, code="import sys\nprint('out')\nprint('err', file=sys.stderr)", language="python")
    assert set(ok) == {"status", "message", "compile_result", "run_result", "executor_pod_name", "files"}
    assert ok["status"] == "Success" and ok["compile_result"] is None
    run = ok["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "out\n", "err\n")
    assert run["execution_time"] > 0
    failed = run_code(server, code="echo x; exit 3", language="bash")
    assert failed["status"] == "Failed" and failed["run_result"]["return_code"] == 3
    killed = run_code(server, code="kill -9 $$", language="bash")
    assert killed["status"] == "Failed" and killed["run_result"]["return_code"] == -9
    slow = run_code(server, code="print('before', flush=True)\nimport time\ntime.sleep(30)", run_timeout=0.5)
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    assert slow["run_result"]["return_code"] is None and slow["run_result"]["stdout"] == "before\n"
    fed = run_code(server, code="print(input() + '!')", language="python", stdin="hey")
    assert fed["run_result"]["stdout"] == "hey!\n"


#: Burns ~0.3 s of CPU in a child process, then prints what it used.
BURN_IN_CHILD = ("import subprocess, sys\n"
                 "burn = 'import resource, time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end:"
                 "\\n    pass\\nu = resource.getrusage(resource.RUSAGE_SELF)\\nprint(u.ru_utime + u.ru_stime)'\n"
                 "subprocess.run([sys.executable, '-c', burn])\n")


@pytest.mark.slow
def test_run_code_fills_cpu_time_and_records_carry_what_the_job_cost(server):
    """Issue 16: SandboxFusion's ``cpu_time`` (the whole tree's CPU), and
    the five cost fields in execpool's records."""
    burnt = run_code(server, code=BURN_IN_CHILD, language="python")["run_result"]
    used = float(burnt["stdout"])
    assert used >= 0.29 and burnt["cpu_time"] >= used, burnt
    assert burnt["cpu_time"] <= burnt["execution_time"] * (os.cpu_count() or 1) + 0.05
    slept = run_code(server, code="sleep 1", language="bash")["run_result"]
    assert slept["execution_time"] >= 1.0 and slept["cpu_time"] < 0.25, slept
    record = server.client.post("/v1/run", json={"python": BURN_IN_CHILD}).json()
    assert record["cpu_user_s"] + record["cpu_system_s"] >= float(record["output"]) and record["processes"] >= 1
    # Its memory cgroup (--memory-mb, where the machine has one) says its peak.
    assert record["max_rss_bytes"] > 0 and (record["peak_memory_bytes"] or 1 << 20) >= 1 << 20
    assert "execpool_job_cpu_seconds_total" in server.client.get("/metrics").text


def test_run_code_files_languages_and_bad_requests(server):
    answer = run_code(server, code="cat a.txt > b.txt; echo done", language="bash",
                      files={"a.txt": b64(b"payload"), "skip.txt": None}, fetch_files=["b.txt"])
    assert answer["files"] == {"b.txt": b64(b"payload")}
    other = run_code(server, code="IDENTIFICATION DIVISION.", language="cobol")
    assert other["status"] == "SandboxError" and "python" in other["message"] and "cpp" in other["message"]
    bad = run_code(server, code="print(1)", files={"../../etc/x": b64(b"x")})
    assert bad["status"] == "SandboxError" and "files" in bad["message"]
    default_language = run_code(server, code="print(40 + 2)")
    assert default_language["run_result"]["stdout"] == "42\n"


def test_the_sandbox_fusion_client_runs_against_the_server(server):
    from sandbox_fusion import RunCodeRequest, RunStatus
    from sandbox_fusion import run_code as sf_run_code

    def call(**kwargs):
        return sf_run_code(RunCodeRequest(**kwargs), endpoint=server.url, max_attempts=1, client_timeout=30)

    python = call(code="print(sum(range(10)))", language="python")
    assert python.status == RunStatus.Success and python.run_result.stdout == "45\n"
    bash = call(code="echo $((6 * 7)); echo oops >&2", language="bash")
    assert bash.run_result.stdout == "42\n" and bash.run_result.stderr == "oops\n"
    stdin = call(code="import sys; print(sys.stdin.read().upper())", language="python", stdin="quiet")
    assert stdin.run_result.stdout == "QUIET\n"
    files = call(code="cp in.bin out.bin", language="bash", files={"in.bin": b64(b"\x00\x01")},
                 fetch_files=["out.bin"])
    assert files.files == {"out.bin": b64(b"\x00\x01")}
    timeout = call(code="while True: pass", language="python", run_timeout=0.5)
    assert timeout.status == RunStatus.Failed and timeout.run_result.status.value == "TimeLimitExceeded"
    failed = call(code="exit 5", language="bash")
    assert failed.status == RunStatus.Failed and failed.run_result.return_code == 5


def test_metrics_count_what_ran(server):
    server.client.post("/v1/run", json={"shell": "echo metrics"})
    text = server.client.get("/metrics").text
    for name in ("execpool_jobs_total", "execpool_job_duration_seconds_bucket", "execpool_queue_wait_seconds_count",
                 "execpool_jobs_in_flight", "execpool_queue_depth", "execpool_worker_restarts_total",
                 "execpool_output_bytes_total"):
        assert name in text, name
    assert 'execpool_jobs_total{kind="shell",route="v1_run",status="ok"}' in text


# -- auth, binding -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_token_guards_every_route_but_health_and_a_401_runs_nothing(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    marker = tmp_path / "ran"
    # The jobs leave a mark outside their directories, which the sandbox forbids.
    s = Server("--workers", "1", "--token-file", str(token_file), "--sandbox", "off")
    try:
        body = {"shell": f"touch {marker}"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            assert s.client.post("/v1/run", json=body, headers=headers).status_code == 401
            assert s.client.post("/run_code", json={"code": f"touch {marker}", "language": "bash"},
                                 headers=headers).status_code == 401
            assert s.client.get("/metrics", headers=headers).status_code == 401
        assert s.client.get("/healthz").status_code == 200 and s.client.get("/v1/ping").json() == "pong"
        # The page and the icon a browser asks for beside it need no token (the page's runs do).
        assert s.client.get("/").status_code == 200 and s.client.get("/favicon.ico").status_code == 204
        metrics = s.client.get("/metrics", headers={"Authorization": "Bearer s3cret-token"}).text
        assert 'execpool_rejected_total{reason="auth"} 9.0' in metrics
        ok = s.client.post("/v1/run", json={"shell": "echo in"}, headers={"Authorization": "Bearer s3cret-token"})
        assert ok.json()["output"] == "in\n"
        assert not marker.exists(), "a request without the token ran"
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_binding_beyond_loopback_without_a_token_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "EXECPOOL_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "execpool", "serve", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert done.returncode == 2 and "token" in done.stderr


# -- load ----------------------------------------------------------------------------------------


def _gated(gate) -> dict:
    return {"python": f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nprint('ok')",
            "timeout": 60}


@pytest.mark.slow
def test_overload_is_answered_promptly_503_or_504_and_a_gone_client_never_runs(tmp_path):
    gate, marker = tmp_path / "gate", tmp_path / "ran"
    # The jobs leave a mark outside their directories, which the sandbox forbids.
    s = Server("--workers", "1", "--max-in-flight", "1", "--max-queue", "1", "--queue-timeout", "1",
               "--sandbox", "off")
    pool = ThreadPoolExecutor(4)
    try:
        running = pool.submit(s.client.post, "/v1/run", json=_gated(gate))
        assert wait_for(lambda: s.client.get("/readyz").json()["in_flight"] == 1, DEADLINE_S)
        queued = pool.submit(s.client.post, "/v1/run", json={"shell": "echo queued"})
        assert wait_for(lambda: s.client.get("/readyz").json()["queue_depth"] == 1, DEADLINE_S)
        full = s.client.post("/v1/run", json={"shell": f"touch {marker}"})
        assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
        assert s.client.post("/run_code", json={"code": f"touch {marker}", "language": "bash"}).status_code == 504
        assert s.client.get("/readyz").status_code == 503, "a full queue is not ready"
        assert queued.result(DEADLINE_S).status_code == 503, "the queued request timed out in the queue"
        # A waiting client that goes away: it leaves the queue and never runs.
        with httpx.Client(base_url=s.url, timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/run", json={"shell": f"touch {marker}"})
        gate.touch()
        assert running.result(DEADLINE_S).json()["output"] == "ok\n"
        assert s.client.post("/v1/run", json={"shell": "echo after"}).json()["output"] == "after\n"
        assert not marker.exists(), "a request that was refused, or whose client left, ran"
        metrics = s.client.get("/metrics").text
        assert 'execpool_rejected_total{reason="queue_full"}' in metrics
    finally:
        gate.touch()
        pool.shutdown()
        assert s.stop() == 0


@pytest.mark.slow
def test_500_concurrent_requests_against_a_small_queue_each_get_an_answer(tmp_path):
    s = Server("--workers", "2", "--max-in-flight", "2", "--max-queue", "8", "--queue-timeout", "2")
    try:
        async def all_at_once():
            # One client with a connection per request: all 500 are in
            # flight together (a client apiece would load the CA
            # certificates 500 times and swell this test process).
            limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=s.url, timeout=60, limits=limits) as client:
                async def one(i):
                    if i % 2:
                        return i, await client.post("/run_code", json={"code": f"print({i})", "language": "python"})
                    return i, await client.post("/v1/run", json={"python": f"print({i})"})

                return await asyncio.gather(*(one(i) for i in range(500)))

        answers = asyncio.run(all_at_once())
        kinds = {"ok": 0, "503": 0, "504": 0}
        for i, answer in answers:
            if answer.status_code == 200:
                out = answer.json()["run_result"]["stdout"] if i % 2 else answer.json()["output"]
                assert out == f"{i}\n"
                kinds["ok"] += 1
            else:
                assert answer.status_code == (504 if i % 2 else 503), answer.text
                kinds[str(answer.status_code)] += 1
        assert sum(kinds.values()) == 500 and kinds["ok"] > 0, kinds
        assert wait_for(lambda: s.client.get("/readyz").json()["in_flight"] == 0, DEADLINE_S)
        assert wait_for(lambda: not [p for p in s.descendants() if runs_a_job(p)], DEADLINE_S), "a tool was left"
    finally:
        assert s.stop() == 0



@pytest.mark.slow
def test_sigterm_lets_running_jobs_finish_within_the_grace_then_kills_the_rest(tmp_path):
    gate = tmp_path / "gate"
    # The jobs leave their pids outside their directories, which the sandbox forbids.
    s = Server("--workers", "2", "--grace", "2", "--sandbox", "off")
    answers = {}
    try:
        def post(name, body, route="/v1/run"):
            try:
                answers[name] = s.client.post(route, json=body)
            except httpx.HTTPError as exc:
                answers[name] = exc

        quick = threading.Thread(target=post, args=("quick", _gated(gate)))
        stuck = threading.Thread(target=post, args=("stuck", {
            "shell": f"sleep 300 & echo $! > {tmp_path / 'pid'}; wait", "timeout": 600}))
        stuck_sf = threading.Thread(target=post, args=("stuck_sf", {
            "code": f"sleep 300 & echo $! > {tmp_path / 'pid2'}; wait", "language": "bash", "run_timeout": 600},
            "/run_code"))
        threads = [quick, stuck, stuck_sf]
        for thread in threads:
            thread.start()
        pid_files = [tmp_path / "pid", tmp_path / "pid2"]
        assert wait_for(lambda: all(f.exists() and f.read_text().strip() for f in pid_files), DEADLINE_S)
        sleepers = [int(f.read_text()) for f in pid_files]
        assert wait_for(lambda: s.client.get("/readyz").json()["in_flight"] == 3, DEADLINE_S)
        below = s.descendants()
        s.proc.send_signal(signal.SIGTERM)
        gate.touch()  # the quick job can finish within the grace; the stuck one cannot
        assert s.proc.wait(DEADLINE_S) == 0
        for thread in threads:
            thread.join(DEADLINE_S)
        assert answers["quick"].json()["output"] == "ok\n"
        # Cut short by the shutdown, still answered: its cancelled record (was a 500).
        stuck_record = answers["stuck"].json()
        assert stuck_record["status"] == "cancelled" and "cancelled" in stuck_record["error"], stuck_record
        # SandboxFusion's clients get what they retry, not a run that looks killed.
        assert answers["stuck_sf"].status_code == 504, answers["stuck_sf"].text
        assert all_dead(sleepers + [p.pid for p in below], timeout=5.0)
    finally:
        gate.touch()
        s.stop()


def test_files_that_cannot_be_written_or_fetched_are_answered_not_500(server):
    """Regressions (red team): a path that is both a file and a directory, a
    name over 255 bytes, or a fetched directory gave 500s, hung a batch and
    leaked a descriptor per request."""
    c = server.client
    for files in ({"a": b64(b""), "a/b": b64(b"")}, {"x" * 300: b64(b"")}, {"/".join(["d"] * 40): b64(b"")}):
        answer = c.post("/v1/run", json={"shell": "true", "files": files})
        assert answer.status_code == 400 and "files" in answer.json()["detail"], answer.text
        sf = c.post("/run_code", json={"code": "true", "language": "bash", "files": files})
        assert sf.status_code == 200 and sf.json()["status"] == "SandboxError", sf.text
    lines = [json.dumps({"id": 1, "shell": "echo one"}),
             json.dumps({"id": 2, "shell": "true", "files": {"a": b64(b""), "a/b": b64(b"")}}),
             json.dumps({"id": 3, "shell": "echo three"})]
    records = [json.loads(line) for line in c.post("/v1/batch", content="\n".join(lines).encode()).text.splitlines()]
    assert sorted((r["id"], r["status"]) for r in records) == [(1, "ok"), (2, "invalid"), (3, "ok")]
    fds = len(os.listdir(f"/proc/{server.proc.pid}/fd"))
    for _ in range(20):
        fetched = c.post("/v1/run", json={"shell": "mkdir d", "fetch_files": ["d"]}).json()
        assert fetched["files"] == {}
    assert len(os.listdir(f"/proc/{server.proc.pid}/fd")) <= fds + 2, "a fetched directory leaked descriptors"


@pytest.mark.slow
def test_a_disk_budget_below_the_default_disk_bound_starts_with_the_bound_given():
    """The server's first job (which asks whether a memory cap can be a
    cgroup here) took Limits()'s 1 GiB disk bound, not --disk-mb's: with
    a budget under 1 GiB the server did not start."""
    s = Server("--workers", "1", "--disk-mb", "64", "--disk-budget-mb", "128")
    try:
        answer = s.client.post("/v1/run", json={"shell": "echo fits"}).json()
        assert answer["output"] == "fits\n", answer
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_jobs_run_warm_by_default_with_the_interpreter_given(tmp_path):
    """``--python``: the service's jobs run with a runtime of their own,
    warm by default and with ``--cold``; the server keeps its own."""
    runtime = tmp_path / "runtime"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(runtime)], check=True, timeout=120)
    probe = "import sys\nprint(sys.prefix, 'psutil' in sys.modules)"
    for start in ((), ("--cold",)):
        s = Server("--workers", "1", "--python", str(runtime / "bin" / "python"), *start)
        try:
            answer = s.client.post("/run_code", json={"code": probe, "language": "python"}).json()
            assert answer["run_result"]["stdout"] == f"{runtime} False\n", (start, answer)
            # Warm by default: the worker started a template; --cold never does.
            templates = [p for p in s.descendants() if _name(p) == TEMPLATE_NAME]
            assert bool(templates) == (not start), start
        finally:
            assert s.stop() == 0


def _name(proc: psutil.Process) -> str:
    """A process's name, or "" once it is gone (a tool may end between the
    listing and the read: NoSuchProcess failed a whole run)."""
    try:
        return proc.name()
    except psutil.Error:
        return ""
