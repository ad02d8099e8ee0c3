"""The languages over HTTP (shared/SERVE.md §3 and §7): ``/run_code`` with
``compile_result`` filled as SandboxFusion fills it (with its own client
package too), ``/v1/run`` and ``/v1/batch`` with a language, a program
against its tests compiled once, ``/v1/languages`` and the compile cache's
metrics. Each server is the real ``execpool serve`` on a loopback port,
with its default sandbox (strict)."""

from __future__ import annotations

import base64
import json
import time

import pytest

from tests.support.helpers import language_cases, toolchains, wait_for
from tests.support.programs import CRASH_EXIT, PROGRAMS, TEST_RUNNERS, slow_to_compile
from tests.support.servers import Server, b64, metric

RUNS_HERE = {name for name, row in toolchains().items() if row.runs}


@pytest.fixture(scope="module")
def server():
    s = Server("--workers", "2", "--max-in-flight", "8")
    yield s
    assert s.stop() == 0


def run_code(server, **body):
    answer = server.client.post("/run_code", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_run_code_compiles_and_runs_with_compile_result_filled(server):
    answer = run_code(server, code=PROGRAMS["cpp"], language="cpp", stdin="wörld", run_timeout=10,
                      compile_timeout=60)
    assert answer["status"] == "Success", answer
    compiled, ran = answer["compile_result"], answer["run_result"]
    assert (compiled["status"], compiled["return_code"]) == ("Finished", 0) and compiled["execution_time"] > 0
    assert (ran["status"], ran["return_code"], ran["stdout"]) == ("Finished", 0, "héllo wörld ✓\n")
    crashed = run_code(server, code=PROGRAMS["cpp"], language="cpp", stdin="crash")
    assert crashed["status"] == "Failed" and crashed["run_result"]["return_code"] == -6
    assert crashed["compile_result"] == compiled  # the same compile, from the cache


def test_a_compile_error_fills_compile_result_and_runs_nothing(server):
    answer = run_code(server, code="int main() { undeclared(); }", language="cpp")
    assert answer["status"] == "Failed" and answer["run_result"] is None, answer
    compiled = answer["compile_result"]
    assert compiled["status"] == "Finished" and compiled["return_code"] == 1
    assert "undeclared" in compiled["stderr"] and compiled["stdout"] == ""


def test_a_compile_timeout_is_time_limit_exceeded(server):
    answer = run_code(server, code=slow_to_compile(1000), language="cpp", compile_timeout=0.3)
    assert answer["status"] == "Failed" and answer["run_result"] is None, answer
    assert answer["compile_result"]["status"] == "TimeLimitExceeded"
    assert answer["compile_result"]["return_code"] is None


def test_a_compile_timeout_over_the_server_s_limit_is_refused(server):
    answer = run_code(server, code="int main(){}", language="cpp", compile_timeout=10 ** 6)
    assert answer["status"] == "SandboxError" and "compile_timeout" in answer["message"]
    assert "over this server's limit" in answer["message"]


def test_a_run_timeout_of_a_compiled_program(server):
    answer = run_code(server, code=PROGRAMS["c"], language="c", stdin="hang", run_timeout=0.5)
    assert answer["status"] == "Failed"
    assert answer["compile_result"]["status"] == "Finished"
    assert answer["run_result"]["status"] == "TimeLimitExceeded" and answer["run_result"]["return_code"] is None


def test_files_in_and_out_of_a_compiled_program(server):
    code = ('#include <stdio.h>\n#include "twice.h"\nint main(void){ FILE *f = fopen("out.txt", "w"); '
            'fprintf(f, "%d", TWICE(21)); return 0; }\n')
    answer = run_code(server, code=code, language="c", files={"twice.h": b64(b"#define TWICE(x) (2 * (x))\n")},
                      fetch_files=["out.txt"])
    assert answer["status"] == "Success", answer
    assert base64.b64decode(answer["files"]["out.txt"]) == b"42"


@pytest.mark.parametrize("language, message", [
    ("cobol", 'language "cobol" is not in the languages table; known: python, pytest, '),
    ("julia", "language 'julia' does not run here: needs Julia, which Debian 12 does not package"),
])
def test_a_language_that_does_not_run_is_a_sandbox_error_saying_why(server, language, message):
    answer = run_code(server, code="x", language=language)
    assert answer["status"] == "SandboxError" and message in answer["message"], answer


@pytest.mark.slow
def test_v1_languages_lists_the_table(server):
    def listed():
        return server.client.get("/v1/languages").json()

    # The server checks each language as it starts: wait until it knows all.
    assert wait_for(lambda: not any(entry["checking"] for entry in listed()), 120, interval=0.1)
    by_name = {entry["name"]: entry for entry in listed()}
    assert {"cpp", "java", "python", "bash", "javascript", "c"} <= set(by_name)
    assert set(by_name["cpp"]) == {"name", "runs", "toolchain", "compiles", "why_not", "checking"}
    assert by_name["cpp"]["runs"] and by_name["cpp"]["compiles"] and by_name["cpp"]["toolchain"].startswith("g++ ")
    assert not by_name["julia"]["runs"] and by_name["julia"]["why_not"]
    assert not by_name["python"]["compiles"]


@pytest.mark.slow
def test_v1_run_takes_a_language_and_records_the_compile(server):
    record = server.client.post("/v1/run", json={"language": "java", "code": PROGRAMS["java"], "stdin": "x",
                                                 "timeout": 30}).json()
    assert record["status"] == "ok" and record["output"] == "héllo x ✓\n", record
    assert record["compile_status"] == "ok" and record["compile_duration_s"] > 0
    python = server.client.post("/v1/run", json={"python": "print(1)"}).json()
    assert python["compile_status"] is python["compile_output"] is python["compile_duration_s"] is None
    broken = server.client.post("/v1/run", json={"language": "java", "code": "class Main {"}).json()
    assert broken["status"] == "error" and broken["compile_status"] == "error"
    assert broken["error"].startswith("Compilation failed (exit code 1):") and "error" in broken["compile_output"]


def test_v1_run_refuses_a_language_without_code(server):
    answer = server.client.post("/v1/run", json={"language": "cpp", "shell": "echo"})
    assert answer.status_code == 400 and answer.json()["detail"] == '"language" goes with "code", not "shell"'


def test_a_program_against_its_tests_compiles_once(server):
    misses = metric(server, 'execpool_compile_cache_total{result="miss"}')
    hits = metric(server, 'execpool_compile_cache_total{result="hit"}')
    code = PROGRAMS["rust"] + f"// {time.time_ns()}\n"
    tests = [{"stdin": f"t{n}", "expected": f"héllo t{n} ✓"} for n in range(6)] + [{"stdin": "exit", "expected": ""}]
    answer = server.client.post("/v1/batch", json={"code": code, "language": "rust", "tests": tests, "timeout": 30})
    records = [json.loads(line) for line in answer.text.splitlines()]
    assert len(records) == 7
    assert sum(r["passed"] for r in records) == 6 and all(r["compile_status"] == "ok" for r in records)
    assert metric(server, 'execpool_compile_cache_total{result="miss"}') - misses == 1
    assert metric(server, 'execpool_compile_cache_total{result="hit"}') - hits == 6
    assert metric(server, "execpool_compile_seconds_count") >= 1


#: The names SandboxFusion's client package takes (its RunCodeRequest's
#: Literal): "c" and "javascript" are execpool's own.
CLIENT_NAMES = set(PROGRAMS) - {"c", "javascript"}


def _each(names):
    return language_cases(sorted(names))


@pytest.mark.parametrize("language", _each(CLIENT_NAMES))
def test_every_language_through_the_sandbox_fusion_client(server, language):
    from sandbox_fusion import RunCodeRequest, RunStatus
    from sandbox_fusion import run_code as sf_run_code

    def call(stdin):
        # The client's default compile_timeout is 10 s: scalac took that
        # long here with two test suites sharing the two CPUs.
        return sf_run_code(RunCodeRequest(code=PROGRAMS[language], language=language, stdin=stdin, run_timeout=30,
                                          compile_timeout=120),
                           endpoint=server.url, max_attempts=1, client_timeout=120)

    hello = call("wörld")
    assert hello.status == RunStatus.Success and hello.run_result.stdout == "héllo wörld ✓\n", hello
    crashed = call("crash")
    assert crashed.status == RunStatus.Failed and crashed.run_result.return_code == CRASH_EXIT[language], crashed
    assert "boom" in crashed.run_result.stderr + crashed.run_result.stdout


#: pytest is the pool's Python with pytest: its tests as a test runner's.
RUNNERS = dict(TEST_RUNNERS, pytest=("def test_sum():\n    assert 1 + 1 == WANT\n", "1 passed", "1 failed"))


@pytest.mark.slow
@pytest.mark.parametrize("language", _each(RUNNERS))
def test_every_test_runner_through_the_sandbox_fusion_client(server, language):
    """verl and SandboxFusion's datasets send a test file as the program:
    the runner's verdict is the exit code, its report the output."""
    from sandbox_fusion import RunCodeRequest, RunStatus
    from sandbox_fusion import run_code as sf_run_code

    code, passed, failed = RUNNERS[language]

    def call(want):
        return sf_run_code(RunCodeRequest(code=code.replace("WANT", want), language=language, run_timeout=60,
                                          compile_timeout=120), endpoint=server.url, max_attempts=1,
                           client_timeout=200)

    good, bad = call("2"), call("3")
    assert good.status == RunStatus.Success and passed in good.run_result.stdout + good.run_result.stderr, good
    assert bad.status == RunStatus.Failed and failed in bad.run_result.stdout + bad.run_result.stderr, bad
    assert bad.run_result.return_code != 0 and bad.run_result.status == "Finished"


@pytest.mark.parametrize("language", _each(set(PROGRAMS) | set(TEST_RUNNERS)))
def test_every_language_against_its_tests_in_one_batch(server, language):
    if language in TEST_RUNNERS:  # a test runner's tests are in its program: stdin is not read
        code = TEST_RUNNERS[language][0].replace("WANT", "2")
        tests = [{"stdin": "", "expected": "unused"}]
    else:
        code = PROGRAMS[language]
        tests = [{"stdin": "wörld", "expected": "héllo wörld ✓"}, {"stdin": "exit", "expected": ""}]
    answer = server.client.post("/v1/batch", json={"code": code, "language": language, "tests": tests,
                                                   "timeout": 60}, timeout=180)
    records = sorted((json.loads(line) for line in answer.text.splitlines()), key=lambda r: r["id"])
    if language in TEST_RUNNERS:
        assert records[0]["status"] == "ok", records
        return
    assert [(r["passed"], r["status"], r["exit_code"]) for r in records] == [(True, "ok", 0), (False, "error", 3)]


def test_v1_stream_runs_a_language_live(server):
    events = []
    with server.client.stream("POST", "/v1/stream", json={"language": "cpp", "code": PROGRAMS["cpp"],
                                                          "stdin": "live"}) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    outputs = "".join(e["text"] for e in events if e.get("type") == "tool_output")
    record = events[-1]
    assert outputs == "héllo live ✓\n" and record["status"] == "ok" and record["compile_status"] == "ok"


@pytest.mark.slow
def test_the_sandbox_fusion_client_runs_compiled_languages(server):
    from sandbox_fusion import RunCodeRequest, RunStatus
    from sandbox_fusion import run_code as sf_run_code

    def call(**kwargs):
        return sf_run_code(RunCodeRequest(**kwargs), endpoint=server.url, max_attempts=1, client_timeout=60)

    for language in sorted({"cpp", "java", "rust", "nodejs"} & RUNS_HERE):
        done = call(code=PROGRAMS[language], language=language, stdin="sf")
        assert done.status == RunStatus.Success and done.run_result.stdout == "héllo sf ✓\n", (language, done)
    broken = call(code="int main() {", language="cpp")
    assert broken.status == RunStatus.Failed and broken.run_result is None
    assert broken.compile_result.return_code == 1
