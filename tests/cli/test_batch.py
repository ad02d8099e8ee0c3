"""Many jobs at once: ``map_jobs`` / ``imap_unordered_jobs`` (``pool.map`` and
``pool.imap_unordered``) and ``execpool batch`` (JSONL in, JSONL out, resume)."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from execpool import ExecPool, PythonJob, ShellJob
from execpool.cli.batch import default_output_path
from execpool.pool.mapping import MAP_REORDER_WINDOW, imap_unordered_jobs, map_jobs, run_tagged
from tests.support.helpers import REPO, alive, all_dead, wait_for

EXAMPLES = os.path.join(REPO, "examples", "jobs.jsonl")
HAS_WARM = "warm" in {f.name for f in dataclasses.fields(PythonJob)}


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:
        yield p


class CountingSubmit:
    """Wraps ``pool.submit`` to see what a map does: how many jobs are in
    flight at most, and how many were submitted."""

    def __init__(self, pool: ExecPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.submitted = 0

    def __call__(self, job, **kwargs):
        assert kwargs.get("on_event") is None, "a map never asks for live output"
        with self.lock:
            self.in_flight += 1
            self.submitted += 1
            self.peak = max(self.peak, self.in_flight)
        future = self.pool.submit(job, **kwargs)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future) -> None:
        with self.lock:
            self.in_flight -= 1


# -- map_jobs / imap_unordered_jobs -------------------------------------------------------


def test_map_yields_results_in_input_order_even_when_later_jobs_finish_first(pool):
    jobs = [ShellJob(f"sleep {0.04 * (5 - i)}; echo {i}") for i in range(6)]
    results = list(map_jobs(pool.submit, jobs, 6))
    assert [r.output for r in results] == [f"{i}\n" for i in range(6)]
    assert all(r.ok for r in results)


@pytest.mark.slow
def test_imap_unordered_yields_each_index_once_as_jobs_finish(pool):
    jobs = [ShellJob("sleep 1; echo slow")] + [ShellJob(f"echo {i}") for i in range(1, 8)]
    pairs = list(imap_unordered_jobs(pool.submit, jobs, 8))
    assert sorted(i for i, _ in pairs) == list(range(8))
    assert pairs[-1][0] == 0, "the slow first job must come last, not hold the others back"
    assert all(r.output == ("slow\n" if i == 0 else f"{i}\n") for i, r in pairs)


@pytest.mark.parametrize("mapper", [map_jobs, imap_unordered_jobs])
def test_in_flight_is_bounded_and_an_endless_input_is_pulled_lazily(pool, mapper):
    pulled = itertools.count()
    counting = CountingSubmit(pool)

    def endless():
        for i in itertools.count():
            next(pulled)
            yield ShellJob(f"sleep 0.0{i % 3}; echo {i}")

    results = mapper(counting, endless(), 3)
    taken = list(itertools.islice(results, 12))
    results.close()
    assert len(taken) == 12
    assert counting.peak <= 3
    # map may hold a reorder window of MAP_REORDER_WINDOW * max_in_flight; either way a
    # handful of jobs beyond those yielded, never the (endless) input.
    assert next(pulled) <= 12 + MAP_REORDER_WINDOW * 3 + 1
    assert counting.in_flight == 0 or wait_for(lambda: counting.in_flight == 0, 2.0)


def test_map_holds_a_bounded_window_behind_a_stalled_first_job(pool, tmp_path):
    gate = tmp_path / "gate"
    counting = CountingSubmit(pool)
    jobs = [ShellJob(f"while [ ! -e {gate} ]; do sleep 0.01; done; echo first", timeout=30)]
    jobs += [ShellJob(f"echo {i}") for i in range(1, 40)]
    results = map_jobs(counting, jobs, 2)
    first: list = []
    waiter = threading.Thread(target=lambda: first.append(next(results)))
    waiter.start()
    window = MAP_REORDER_WINDOW * 2
    assert wait_for(lambda: counting.submitted == window, 5.0)
    time.sleep(0.3)
    assert counting.submitted == window, "a stalled head job must stop the intake, not buffer everything"
    assert first == []
    gate.touch()
    waiter.join(10)
    assert first[0].output == "first\n"
    assert [r.output for r in results] == [f"{i}\n" for i in range(1, 40)]


@pytest.mark.parametrize("mapper", [map_jobs, imap_unordered_jobs])
def test_stopping_early_cancels_every_running_job_and_kills_its_tree(pool, tmp_path, mapper):
    jobs = [ShellJob("echo quick")] + [
        ShellJob(f"echo $$ > {tmp_path}/pid{i}; sleep 60 & echo $! >> {tmp_path}/pid{i}; wait", timeout=120)
        for i in range(4)
    ]
    results = mapper(pool.submit, jobs, 5)
    first = next(results)
    assert (first[1] if isinstance(first, tuple) else first).output == "quick\n"
    assert wait_for(lambda: all(len((tmp_path / f"pid{i}").read_text().split()) == 2
                                for i in range(4) if (tmp_path / f"pid{i}").exists())
                    and len(list(tmp_path.iterdir())) == 4, 5.0)
    pids = [int(p) for i in range(4) for p in (tmp_path / f"pid{i}").read_text().split()]
    t0 = time.monotonic()
    results.close()
    assert time.monotonic() - t0 < 1.5
    assert all_dead(pids, 2.0), [p for p in pids if alive(p)]
    assert pool.run(ShellJob("echo still healthy")).output == "still healthy\n"


def test_an_exception_in_the_consumer_cancels_in_flight_jobs(pool, tmp_path):
    jobs = [ShellJob("echo go")] + [ShellJob(f"echo $$ > {tmp_path}/p{i}; exec sleep 60") for i in range(3)]

    def consume():
        for result in map_jobs(pool.submit, jobs, 4):
            # Written, not only created: the shell makes the file before echo fills it.
            wait_for(lambda: all(path.read_text().endswith("\n") for path in tmp_path.iterdir())
                     and len(list(tmp_path.iterdir())) == 3, 5.0)
            raise RuntimeError("harness bug " + result.output)

    with pytest.raises(RuntimeError, match="harness bug go"):
        consume()
    pids = [int((tmp_path / f"p{i}").read_text()) for i in range(3)]
    assert all_dead(pids, 2.0)


def test_a_bad_job_is_raised_in_its_place_after_the_jobs_before_it(pool):
    jobs = [ShellJob("echo 0"), ShellJob("echo 1"), "echo 2", ShellJob("echo 3")]
    results = map_jobs(pool.submit, jobs, 4)
    assert next(results).output == "0\n"
    assert next(results).output == "1\n"
    with pytest.raises(TypeError, match="PythonJob, ShellJob or CodeJob"):
        next(results)


def test_an_exception_from_the_input_comes_after_the_running_jobs_finish(pool):
    def jobs():
        yield ShellJob("sleep 0.1; echo a")
        yield ShellJob("echo b")
        raise OSError("the input file went away")

    seen = []
    with pytest.raises(OSError, match="went away"):
        for index, result in imap_unordered_jobs(pool.submit, jobs(), 4):
            seen.append((index, result.output))
    assert sorted(seen) == [(0, "a\n"), (1, "b\n")]


def test_max_in_flight_is_checked_when_called_not_when_iterated(pool):
    for bad, error in ((0, ValueError), (-2, ValueError), (True, TypeError), (2.5, TypeError)):
        with pytest.raises(error):
            map_jobs(pool.submit, [], bad)
        with pytest.raises(error):
            imap_unordered_jobs(pool.submit, [], bad)
    assert list(map_jobs(pool.submit, [], 1)) == []


def test_no_thread_per_job(pool):
    before = threading.active_count()
    peak = before
    for _ in map_jobs(pool.submit, (ShellJob("sleep 0.2") for _ in range(24)), 24):
        peak = max(peak, threading.active_count())
    assert peak == before


def test_run_tagged_reports_tags_and_runs_the_idle_hook_before_waiting(pool):
    idle = []
    items = [(("line", i), ShellJob(f"sleep 0.0{i}; echo {i}")) for i in range(4)]
    got = dict(run_tagged(pool.submit, items, 2, on_idle=lambda: idle.append(1)))
    assert {tag: r.output for tag, r in got.items()} == {("line", i): f"{i}\n" for i in range(4)}
    assert idle


def test_pool_map_and_imap_unordered(pool):
    if not hasattr(pool, "map"):
        pytest.skip("ExecPool.map is not there yet")
    jobs = [PythonJob(f"print({i} * 2)") for i in range(5)]
    assert [r.output for r in pool.map(jobs, max_in_flight=2)] == [f"{i * 2}\n" for i in range(5)]
    pairs = sorted(pool.imap_unordered(iter(jobs)), key=lambda p: p[0])
    assert [r.output for _, r in pairs] == [f"{i * 2}\n" for i in range(5)]


# -- execpool batch -------------------------------------------------------------------------


def batch(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execpool", "batch", *args], capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def start_batch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "execpool", "batch", "--no-progress", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def write_jsonl(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


def records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def by_id(path) -> dict:
    recs = records(path)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(map(json.dumps, ids))), f"an id was written twice: {ids}"
    return {r["id"]: r for r in recs}


def line_count(path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_examples_file_gives_every_kind_of_record(tmp_path):
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    done = batch(EXAMPLES, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t0 < 10
    recs = by_id(out)
    with open(EXAMPLES, encoding="utf-8") as f:
        assert set(recs) == {json.loads(line)["id"] for line in f}
    for rec in recs.values():
        assert set(rec) >= {"id", "status", "exit_code", "output", "output_chars", "duration_s"}
    assert recs["hello"]["status"] == "ok" and recs["hello"]["output"].startswith("hello from")
    assert recs["fails"]["status"] == "error" and recs["fails"]["exit_code"] == 1
    assert "ZeroDivisionError" in recs["fails"]["output"]
    assert recs["exit-3"]["status"] == "error" and recs["exit-3"]["exit_code"] == 3
    assert recs["timeout"]["status"] == "timeout" and recs["timeout"]["exit_code"] is None
    assert recs["timeout"]["output"] == "waiting for an answer that never comes\n"
    assert recs["timeout"]["error"] == "Execution timed out after 1 seconds."
    flood = recs["flood"]
    assert flood["status"] == "ok" and flood["output_chars"] == 20_000_000 and len(flood["output"]) == 100_000
    assert "日本語" in recs["unicode"]["output"] and "\ufffd" in recs["unicode"]["output"]
    assert recs["shell"]["output"] == "apple\nfig\npear\n1+2+3+4+5 = 15\n"
    assert recs["stdin"]["output"] == "ONE\nTWO\n"
    assert recs["env"]["output"] == "GREETING=bonjour\n"
    daemon = int(re.search(r"daemon (\d+)", recs["daemon"]["output"]).group(1))
    assert all_dead([daemon], 3.0), "the escaped daemon outlived its job"
    assert re.search(r"11 records in [\d.]+ s: 8 ok, 2 error, 1 timeout -> ", done.stderr)


@pytest.mark.slow
def test_invalid_lines_become_invalid_records_with_the_reason(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "good", "python": "print('fine')"},
        "this is not json",
        "[1, 2]",
        {"python": "print(1)"},
        {"id": True, "python": "1"},
        {"id": "", "python": "1"},
        {"id": "both", "python": "1", "shell": "true"},
        {"id": "neither", "timeout": 3},
        {"id": "typed", "python": 42},
        {"id": "empty", "python": "   "},
        {"id": "negative", "shell": "true", "timeout": -1},
        {"id": "nul", "shell": "echo \u0000"},
        {"id": "badenv", "shell": "true", "env": {"A": 1}},
        {"id": "nocwd", "shell": "true", "cwd": str(tmp_path / "missing")},
        {"id": "typo", "shell": "true", "timout": 3},
        "",
        {"id": 7, "shell": "echo seven"},
    ])
    with open(src, "ab") as f:
        f.write(b'{"id": "latin1", "shell": "echo \xe9"}\n')
    done = batch(src, "--no-progress")
    assert done.returncode == 0, done.stderr
    recs = records(default_output_path(src))
    assert len(recs) == 17, "one record per non-blank line"
    reasons = {r["line"]: (r["id"], r["status"], r["error"]) for r in recs}
    expected = {
        2: (None, "bad JSON"), 3: (None, "JSON object, not array"), 4: (None, 'missing "id"'),
        5: (None, '"id" must be a string or an integer, not boolean'), 6: (None, "must not be empty"),
        7: ("both", "not both"), 8: ("neither", 'missing "python", "shell" or "code"'),
        9: ("typed", '"python" must be a string, not number'),
        11: ("negative", "positive"), 12: ("nul", "NUL"), 13: ("badenv", "env"),
        14: ("nocwd", "not an existing directory"), 15: ("typo", 'unknown field "timout"'),
        18: (None, "not valid UTF-8"),
    }
    for line, (ident, fragment) in expected.items():
        got_id, status, error = reasons[line]
        assert (got_id, status) == (ident, "invalid"), (line, reasons[line])
        assert fragment in error, (line, error)
    assert reasons[1][1] == "ok" and reasons[17] == (7, "ok", None)
    # No code is a job whose Result says so, as the library's does -- not a line that is no job.
    assert reasons[10] == ("empty", "error", "No code provided.")
    # Resume treats invalid lines as done too: nothing runs twice.
    again = batch(src, "--no-progress")
    assert again.returncode == 0 and "nothing to run" in again.stderr
    assert len(records(default_output_path(src))) == 17


@pytest.mark.slow
def test_huge_numbers_odd_ids_and_deep_nesting_are_invalid_records_and_resume(tmp_path):
    """No line can stop the batch, and what it writes reads back on resume
    whatever the interpreter's int-to-text limit (PYTHONINTMAXSTRDIGITS)."""
    huge = "9" * 5000
    id_640 = int("7" * 640)  # the most digits an id may have: every Python converts that many
    src = write_jsonl(tmp_path / "in.jsonl", [
        f'{{"id": {huge}, "shell": "true"}}',
        f'{{"id": "big-timeout", "shell": "true", "timeout": {huge}}}',
        f'{{"id": "big-env", "shell": "true", "env": {{"A": [1, -{huge}]}}}}',
        '{"id": "nan", "shell": "true", "timeout": NaN}',
        '{"id": Infinity, "shell": "true"}',
        {"id": 1.5, "shell": "true"},
        {"id": {"a": [1]}, "shell": "true"},
        '{"id": "deep", "shell": "true", "env": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "[" * 100_000,
        {"id": id_640, "shell": "echo 640 digits"},
        {"id": "L" * 1_000_000, "shell": "echo long id"},
    ])
    done = batch(src, "--no-progress", "--workers", "1")
    assert done.returncode == 0, done.stderr
    recs = {r["line"]: r for r in records(default_output_path(src))}
    assert sorted(recs) == list(range(1, 12)), "one record per line"
    expected = {
        1: (None, "integer of 5000 digits"), 2: (None, "integer of 5000 digits"),
        3: (None, "integer of 5000 digits"), 4: ("nan", '"timeout" must be a positive, finite number'),
        5: (None, "not number"), 6: (None, "not number"), 7: (None, "not object"),
        8: (None, "nested too deeply"), 9: (None, "nested too deeply"),
    }
    for line, (ident, fragment) in expected.items():
        assert (recs[line]["id"], recs[line]["status"]) == (ident, "invalid"), recs[line]
        assert fragment in recs[line]["error"], recs[line]
    assert (recs[10]["id"], recs[10]["output"]) == (id_640, "640 digits\n")
    assert (recs[11]["id"], recs[11]["output"]) == ("L" * 1_000_000, "long id\n")
    # The same records where Python would convert any int, and the strictest
    # limit Python allows still reads every record back.
    unlimited = tmp_path / "unlimited.jsonl"
    done = batch(src, "--no-progress", "--workers", "1", "-o", str(unlimited),
                 env=dict(os.environ, PYTHONINTMAXSTRDIGITS="0"))
    assert done.returncode == 0, done.stderr
    same = lambda r: (r["line"], r["id"], r["status"], r["output"], r["error"])  # noqa: E731
    assert sorted(map(same, records(unlimited)), key=lambda t: t[0]) == [same(recs[n]) for n in sorted(recs)]
    strict = dict(os.environ, PYTHONINTMAXSTRDIGITS="640")
    again = batch(src, "--no-progress", env=strict)
    assert again.returncode == 0 and "nothing to run" in again.stderr, again.stderr
    assert len(records(default_output_path(src))) == 11


#: Runs the CLI, then prints its peak RSS in KiB: VmHWM, which belongs to the
#: process's memory since its exec -- not ru_maxrss, which counts the RSS of
#: the process that forked it (this test run's, however big that has grown).
PEAK_RSS_PROBE = ("import sys\nfrom execpool.cli.main import main\ncode = main(sys.argv[1:])\n"
                  "peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
                  "print(peak[0])\nsys.exit(code)")


@pytest.mark.slow
def test_an_overlong_line_is_an_invalid_record_read_past_in_bounded_memory(tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        f.write('{"id": "before", "shell": "echo before"}\n')
        f.write('{"id": "huge", "shell": "#')
        for _ in range(100):
            f.write("x" * 1_000_000)
        f.write('"}\n')
        f.write('{"id": "after", "shell": "echo after"}\n')
    out = tmp_path / "out.jsonl"
    probe = PEAK_RSS_PROBE
    command = [sys.executable, "-c", probe, "batch", str(src), "-o", str(out), "--workers", "1", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stdout.split()[-1]) / 1024
    assert peak_mb < 100, f"peak RSS {peak_mb:.0f} MB for one 100 MB line"
    recs = {r["line"]: r for r in records(out)}
    assert (recs[1]["id"], recs[1]["output"]) == ("before", "before\n")
    assert (recs[2]["id"], recs[2]["status"]) == (None, "invalid")
    assert recs[2]["error"].startswith("line is longer than "), recs[2]["error"]
    assert (recs[3]["id"], recs[3]["output"]) == ("after", "after\n")
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to run" in again.stderr, again.stderr


def test_a_line_of_exactly_the_longest_length_is_read(tmp_path, monkeypatch):
    from execpool.cli import jobs_file as batchlines
    monkeypatch.setattr(batchlines, "MAX_LINE_BYTES", 10)
    lines = io.BytesIO(b"0123456789\n01234567890\n\n0123456789")
    assert list(batchlines.input_lines(lines)) == [(1, b"0123456789\n"), (2, None), (4, b"0123456789")]


@pytest.mark.slow
def test_empty_cwd_is_an_invalid_record_not_the_callers_directory(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "here", "shell": "pwd", "cwd": ""}])
    done = batch(src, "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    [rec] = records(default_output_path(src))
    assert rec["status"] == "invalid" and rec["output"] == "", rec
    assert rec["error"].startswith('"cwd" must not be empty'), rec["error"]


def test_duplicate_ids_are_refused_before_anything_runs(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "shell": f"touch {tmp_path}/ran"}, {"id": "b", "shell": "true"},
        {"id": "a", "shell": "true"}, {"id": 1, "shell": "true"}, {"id": "1", "shell": "true"},
    ])
    done = batch(src)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("execpool: error:")
    assert '"a" on lines 1 and 3' in done.stderr and "unique" in done.stderr
    assert not os.path.exists(default_output_path(src)), "refused up front: no output file"
    assert not (tmp_path / "ran").exists()


def test_a_long_duplicate_id_is_shown_shortened(tmp_path):
    long_id = "d" * 100_000
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": long_id, "shell": "true"}] * 2)
    done = batch(src)
    assert done.returncode == 2 and "on lines 1 and 2" in done.stderr
    assert len(done.stderr) < 500, done.stderr[:500]


@pytest.mark.slow
def test_resume_runs_only_the_lines_without_a_record(tmp_path):
    log = tmp_path / "executions.log"
    job = lambda i: {"id": f"job{i}", "shell": f"echo job{i} >> {log}; echo out{i}"}  # noqa: E731
    src = write_jsonl(tmp_path / "in.jsonl", [job(i) for i in range(3)])
    assert batch(src).returncode == 0
    write_jsonl(src, [job(i) for i in range(6)])
    done = batch(src)
    assert done.returncode == 0
    assert "3 already done, skipped" in done.stderr
    recs = by_id(default_output_path(src))
    assert sorted(recs) == [f"job{i}" for i in range(6)]
    assert all(recs[f"job{i}"]["output"] == f"out{i}\n" for i in range(6))
    assert sorted(log.read_text().split()) == [f"job{i}" for i in range(6)], "every job ran exactly once"


@pytest.mark.slow
def test_a_torn_last_line_is_cut_off_and_its_job_runs_again(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "shell": f"echo {i}"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    good = [json.dumps({"id": i, "status": "ok", "exit_code": 0, "output": f"{i}\n", "output_chars": 2,
                        "duration_s": 0.01}) for i in (0, 1)]
    torn = '{"id": 2, "status": "ok", "exit_code": 0, "outp'
    out.write_text("\n".join(good) + "\n" + torn)
    done = batch(src, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "torn" in done.stderr
    recs = by_id(out)
    assert sorted(recs) == [0, 1, 2, 3] and recs[2]["output"] == "2\n"
    assert out.read_text().startswith("\n".join(good) + "\n"), "records before the tear are kept as they were"

    # A complete last line that is not a record (power loss can leave zeros) is torn too.
    with open(out, "ab") as f:
        f.write(b"\x00\x00\x00\x00\n")
    write_jsonl(src, [{"id": i, "shell": f"echo {i}"} for i in range(5)])
    assert batch(src, "-o", str(out)).returncode == 0
    assert sorted(by_id(out)) == [0, 1, 2, 3, 4]


def _record(ident, status: str, output: str = "") -> str:
    return json.dumps({"id": ident, "status": status, "exit_code": 0 if status == "ok" else None,
                       "output": output, "output_chars": len(output), "duration_s": 0.01, "line": 1,
                       "error": None if status == "ok" else "Execution error: worker process 1 ..."})


@pytest.mark.slow
def test_a_rerun_retries_infra_records_and_each_id_stays_once(tmp_path):
    """An infra record is execpool's failure, not the job's: a rerun runs
    the job again and its new record replaces the old one."""
    log = tmp_path / "executions.log"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "shell": f"echo {i} >> {log}; echo out{i}"}
                                              for i in range(4)])
    out = tmp_path / "out.jsonl"
    kept = [_record(0, "ok", "out0\n"), _record(2, "error", "")]
    out.write_text("\n".join([kept[0], _record(1, "infra"), kept[1], _record(3, "infra")]) + "\n"
                   + '{"id": 9, "torn')
    done = batch(src, "-o", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "2 record(s)" in done.stderr and "status infra" in done.stderr
    recs = by_id(out)
    assert sorted(recs) == [0, 1, 2, 3]
    assert recs[1]["status"] == recs[3]["status"] == "ok" and recs[3]["output"] == "out3\n"
    assert sorted(log.read_text().split()) == ["1", "3"], "only the infra records ran again"
    assert out.read_text().startswith("\n".join(kept) + "\n"), "the other records are kept as they were"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".retry")]


@pytest.mark.slow
def test_no_retry_infra_keeps_infra_records(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "shell": f"echo {i}"} for i in range(2)])
    out = tmp_path / "out.jsonl"
    before = _record(0, "infra") + "\n"
    out.write_text(before)
    done = batch(src, "-o", str(out), "--no-progress", "--no-retry-infra")
    assert done.returncode == 0, done.stderr
    recs = by_id(out)
    assert recs[0]["status"] == "infra" and recs[1]["status"] == "ok"
    assert out.read_text().startswith(before)


@pytest.mark.slow
def test_a_job_whose_worker_is_killed_gets_an_infra_record_that_a_rerun_retries(tmp_path):
    """End to end: the worker under a job is SIGKILLed (the job kills its
    own worker, $PPID); the record says infra; the rerun runs it again."""
    marker = tmp_path / "killed-once"
    command = f"if [ ! -e {marker} ]; then touch {marker}; kill -9 $PPID; sleep 5; fi; echo second try"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "victim", "shell": command}, {"id": "ok", "shell": "echo ok"}])
    out = tmp_path / "out.jsonl"
    assert batch(src, "-o", str(out), "--no-progress", "--workers", "1", "--max-in-flight", "1").returncode == 0
    first = by_id(out)
    assert first["victim"]["status"] == "infra", first["victim"]
    assert first["ok"]["status"] == "ok"
    done = batch(src, "-o", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    second = by_id(out)
    assert second["victim"]["status"] == "ok" and second["victim"]["output"] == "second try\n"
    assert second["ok"] == first["ok"]


def test_a_damaged_line_in_the_middle_is_refused_not_repaired(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "shell": "true"}, {"id": "b", "shell": "true"}])
    out = tmp_path / "out.jsonl"
    damaged = 'garbage\n{"id": "a", "status": "ok", "exit_code": 0, "output": "", "output_chars": 0}\n'
    out.write_text(damaged)
    done = batch(src, "-o", str(out))
    assert done.returncode == 2 and "line 1" in done.stderr and done.stderr.count("\n") == 1
    assert out.read_text() == damaged


@pytest.mark.slow
def test_records_are_written_as_each_job_ends(tmp_path):
    gate = tmp_path / "gate"
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "waits", "shell": f"while [ ! -e {gate} ]; do sleep 0.01; done; echo released", "timeout": 30},
        {"id": "quick", "shell": "echo quick"},
    ])
    out = tmp_path / "out.jsonl"
    proc = start_batch(src, "-o", str(out))
    try:
        assert wait_for(lambda: line_count(out) == 1, 15.0)
        assert records(out)[0]["id"] == "quick"
        assert proc.poll() is None
        # A second run on the same OUT meanwhile is refused, not interleaved.
        clash = batch(src, "-o", str(out))
        assert clash.returncode == 2 and "another execpool batch" in clash.stderr
        gate.touch()
        assert proc.wait(15) == 0
    finally:
        proc.kill()
        proc.communicate()
    assert by_id(out)["waits"]["output"] == "released\n"


def _slow_jobs(tmp_path, n: int) -> str:
    log = tmp_path / "executions.log"
    return write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"j{i:03d}", "shell": f"sleep 0.1; echo j{i:03d} >> {log}; echo {i}"} for i in range(n)
    ])


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_writes_every_id_exactly_once(tmp_path):
    src = _slow_jobs(tmp_path, 60)
    out = tmp_path / "out.jsonl"
    proc = start_batch(src, "-o", str(out), "--max-in-flight", "4", "--workers", "2")
    try:
        assert wait_for(lambda: line_count(out) >= 10, 20.0)
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        proc.wait(5)
    finally:
        proc.kill()
        proc.communicate()
    assert 10 <= line_count(out) < 60
    assert all_dead(family, 5.0), "workers and tools must die with the batch"
    done = batch(src, "-o", str(out))
    assert done.returncode == 0, done.stderr
    recs = by_id(out)
    assert sorted(recs) == [f"j{i:03d}" for i in range(60)]
    assert all(r["status"] == "ok" and r["output"] == f"{int(k[1:])}\n" for k, r in recs.items())
    runs = (tmp_path / "executions.log").read_text().split()
    assert len(runs) <= 60 + 4, "only the jobs in flight at the kill may have run twice"


@pytest.mark.slow
def test_ctrl_c_cancels_running_jobs_writes_nothing_partial_and_says_how_to_resume(tmp_path):
    src = _slow_jobs(tmp_path, 60)
    out = tmp_path / "out.jsonl"
    proc = start_batch(src, "-o", str(out), "--max-in-flight", "4")
    try:
        assert wait_for(lambda: line_count(out) >= 8, 20.0)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Run the same command again to resume." in stderr
    written = records(out)
    assert 8 <= len(written) < 60
    assert {r["status"] for r in written} == {"ok"}, "cancelled jobs leave no record"
    done = batch(src, "-o", str(out))
    assert done.returncode == 0
    assert sorted(by_id(out)) == [f"j{i:03d}" for i in range(60)]


@pytest.mark.slow
def test_sigterm_is_an_interrupt_too(tmp_path):
    started = tmp_path / "started"
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "long", "shell": f"touch {started}; sleep 30"}])
    proc = start_batch(src)
    try:
        assert wait_for(started.exists, 15.0)
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "resume" in stderr
    assert records(default_output_path(src)) == []


@pytest.mark.slow
def test_output_to_stdout_and_the_progress_bar(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "shell": f"echo {i}"} for i in range(3)])
    done = batch(src, "-o", "-")
    assert done.returncode == 0
    assert sorted(json.loads(line)["id"] for line in done.stdout.splitlines()) == [0, 1, 2]
    assert "it/s" not in done.stderr and "job/s" not in done.stderr, "no bar when stderr is not a terminal"
    assert "-> stdout" in done.stderr
    assert not os.path.exists(default_output_path(src))
    forced = batch(src, "-o", "-", "--progress")
    assert "ok=3" in forced.stderr and "3/3" in forced.stderr


@pytest.mark.slow
@pytest.mark.skipif(not HAS_WARM, reason="PythonJob(warm=True) is not there yet")
def test_warm_flag_runs_python_jobs_warm_with_the_same_records(tmp_path):
    programs = {
        "argv": "import sys, os\nprint(__name__, sys.argv == [__file__], os.getcwd() == sys.path[0])",
        "raises": "def f():\n    raise KeyError('k')\nf()",
        "exits": "import sys\nprint('bye')\nsys.exit(4)",
        "unicode": "print('日本語 ✓')",
    }
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": k, "python": v} for k, v in programs.items()])
    assert batch(src, "-o", str(tmp_path / "cold.jsonl")).returncode == 0
    assert batch(src, "-o", str(tmp_path / "warm.jsonl"), "--warm").returncode == 0
    cold, warm = by_id(tmp_path / "cold.jsonl"), by_id(tmp_path / "warm.jsonl")
    norm = lambda r: (r["status"], r["exit_code"], re.sub(r"/\S*/\.execpool-[\w-]+\.py", "JOB.py", r["output"]))  # noqa: E731
    assert {k: norm(r) for k, r in warm.items()} == {k: norm(r) for k, r in cold.items()}
    assert warm["argv"]["output"] == "__main__ True True\n"


@pytest.mark.slow
def test_memory_stays_bounded_for_a_big_input(tmp_path):
    """60 000 lines of 4 KB (240 MB) must stream through, never be held."""
    src = tmp_path / "big.jsonl"
    pad = "#" * 4000
    with open(src, "w") as f:
        for i in range(60_000):
            # python and shell both: invalid, so nothing runs and the test stays fast.
            f.write(f'{{"id": {i}, "python": "{pad}", "shell": "true"}}\n')
    out = tmp_path / "out.jsonl"
    probe = PEAK_RSS_PROBE
    done = subprocess.run([sys.executable, "-c", probe, "batch", str(src), "-o", str(out), "--workers", "1",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stdout.split()[-1]) / 1024
    assert line_count(out) == 60_000
    assert peak_mb < 120, f"peak RSS {peak_mb:.0f} MB for a 240 MB input"


@pytest.mark.parametrize("args", [
    [], ["/nonexistent.jsonl"], [REPO], [EXAMPLES, "--workers", "0"], [EXAMPLES, "--max-in-flight", "x"],
    [EXAMPLES, "--timeout", "-1"], [EXAMPLES, "-o", EXAMPLES], [EXAMPLES, "--progress", "--no-progress"],
    [EXAMPLES, "--timeout", "1e9"], [EXAMPLES, "--timeout", "nan"], [EXAMPLES, "--preload", "not a module"],
    [EXAMPLES, "--max-output-chars", "0"],
])
def test_bad_batch_arguments_get_a_one_line_error(args):
    done = batch(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("execpool: error:")


@pytest.mark.slow
@pytest.mark.parametrize("flags, named", [(["--timeout", "1e9"], "--timeout"),
                                          (["--preload", "no_such_module_here"], "no_such_module_here")])
def test_a_bad_flag_writes_nothing_and_a_rerun_with_a_good_one_runs_every_line(tmp_path, flags, named):
    """A flag the job rules refuse (a timeout past their bound) once gave
    every line an invalid record, and the rerun then found them all done;
    a preload that does not import is found only as the pool starts. Both
    stop the command before OUT is touched."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(src, [{"id": 1, "shell": "echo one"}, {"id": 2, "python": "print(2)"}])
    refused = batch(src, "-o", out, "--no-progress", *flags)
    assert refused.returncode == 2 and named in refused.stderr, refused.stderr
    assert not out.exists()
    again = batch(src, "-o", out, "--no-progress", "--timeout", "30")
    assert again.returncode == 0, again.stderr
    assert {(r["id"], r["status"]) for r in records(out)} == {(1, "ok"), (2, "ok")}


def test_default_output_path():
    assert default_output_path("runs/evals.jsonl") == "runs/evals.out.jsonl"
    assert default_output_path("jobs.txt") == "jobs.txt.out.jsonl"
