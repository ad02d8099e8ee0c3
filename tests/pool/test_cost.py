"""What a job cost (issue 16): CPU time, memory and processes in every Result.

Each figure is checked against something the job measured of itself or a
count it cannot dodge, so that made-up numbers fail: a child that burns CPU
prints what its own ``getrusage`` says and the job must report at least
that; a grandchild touches 200 MB; the processes a job leaves behind are
counted exactly; a warm job's memory is compared with a worker that was made
to hold hundreds of megabytes just before. Shell, cold Python and warm
Python jobs each, and jobs ended by a timeout or a cancel too.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import threading

import psutil
import pytest

from execpool import ExecPool, JobOutput, Limits, PythonJob, ShellJob, Status
from execpool.shared.kernel.cgroups import Cgroups, JobGroup
from execpool.tool.spare_wire import read_report, taken
from tests.support.helpers import SPAWN_PARAMS, proc_kib, wait_for

MiB = 1 << 20
PY = shlex.quote(sys.executable)
KINDS = ("shell", "python", "warm")

#: Burns 0.3 s of user CPU, then prints what its own rusage says it used.
BURN_CHILD = ("import resource\ndef used():\n    return resource.getrusage(resource.RUSAGE_SELF).ru_utime\n"
              "x = 0\nwhile used() < 0.3:\n    for i in range(100_000):\n        x += i\nprint(used())\n")

#: Touches 200 MiB, page by page, so that all of it is resident at once.
TOUCH_200 = "b = bytearray(200 * 2**20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n"
TOUCH_100 = TOUCH_200.replace("200", "100")

#: Prints the CPU time its code used so far every 20 ms of it, until it is
#: killed: the last line is a lower bound of what it used. From its first
#: line, not from its process's start: a warm job's process was a spare
#: before, and that is not the job's.
BURN_UNTIL_KILLED = ("import time\nstart = time.process_time()\nmark = 0.0\nwhile True:\n"
                     "    for i in range(20_000):\n        pass\n"
                     "    used = time.process_time() - start\n"
                     "    if used >= mark:\n        print(used, flush=True)\n        mark = used + 0.02\n")


def run_in_child(code: str) -> str:
    """Python code that runs ``code`` in a child interpreter and waits for it."""
    return f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {code!r}], check=True)\n"


def job_of(kind: str, python_code: str, **kwargs):
    """``python_code`` as a shell job (bash starting Python as a child: the
    ``; true`` keeps bash from exec'ing it), a cold or a warm Python job."""
    if kind == "shell":
        return ShellJob(f"{PY} -c {shlex.quote(python_code)}; true", **kwargs)
    return PythonJob(python_code, warm=kind == "warm", **kwargs)


@pytest.fixture(scope="module", params=SPAWN_PARAMS)
def pool(request):
    with ExecPool(workers=2, spawn_method=request.param) as p:
        yield p


def assert_plausible(result) -> None:
    """No job uses more CPU than its wall time on every CPU of the machine."""
    assert result.cpu_user_s >= 0 and result.cpu_system_s >= 0
    assert result.cpu_s <= result.duration_s * os.cpu_count() + 0.05, result


@pytest.mark.parametrize("kind", KINDS)
def test_cpu_burnt_in_a_child_is_counted(pool, kind):
    result = pool.run(job_of(kind, run_in_child(BURN_CHILD), timeout=60))
    assert result.status is Status.OK, result.text
    child_says = float(result.output.split()[-1])
    assert child_says >= 0.3
    assert result.cpu_user_s >= child_says, (result.cpu_user_s, child_says)
    assert_plausible(result)


@pytest.mark.parametrize("kind", KINDS)
def test_memory_touched_in_a_grandchild_is_counted(pool, kind):
    result = pool.run(job_of(kind, run_in_child(run_in_child(TOUCH_200)), timeout=60))
    assert result.status is Status.OK, result.text
    # The grandchild's own interpreter comes on top of the 200 MiB.
    assert 200 * MiB <= result.max_rss_bytes < 200 * MiB + 128 * MiB, result.max_rss_bytes
    assert result.peak_memory_bytes is None  # no memory cgroup without Limits(memory=...)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_job_that_sleeps_reports_almost_no_cpu(pool, kind):
    result = pool.run(job_of(kind, "import time\ntime.sleep(1)\n", timeout=60))
    assert result.status is Status.OK and result.duration_s >= 1
    # An interpreter's start costs a few tens of milliseconds; sleeping, nothing.
    assert 0 < result.cpu_s < 0.25, result


@pytest.mark.parametrize("kind", ["shell_exits", "shell_killed", "python", "warm"])
def test_ten_processes_a_job_forks_and_leaves_are_counted_exactly(pool, kind):
    """The leader and ten children it does not wait for: ``sleep``s that
    outlive the shell and end on their own, ``sleep``s killed when the job
    ends, children that exit at once and are reaped by the worker as the
    orphans of a Python job (cold, warm)."""
    jobs = {
        "shell_exits": ShellJob("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 0.2 & done"),
        "shell_killed": ShellJob("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 30 >/dev/null 2>&1 & done"),
        "python": PythonJob("import os\nfor _ in range(10):\n    if os.fork() == 0:\n        os._exit(0)\n"),
        "warm": PythonJob("import os\nfor _ in range(10):\n    if os.fork() == 0:\n        os._exit(0)\n", warm=True),
    }
    result = pool.run(jobs[kind])
    assert result.status is Status.OK, result.text
    assert result.processes == 11


@pytest.mark.parametrize("job", [ShellJob("echo hi"), PythonJob("pass"), PythonJob("pass", warm=True)],
                         ids=["shell", "python", "warm"])
def test_a_job_of_one_process_counts_one(pool, job):
    """Nothing else is counted: not the warm job's spare's life before the
    job, not the template it came from."""
    result = pool.run(job)
    assert result.status is Status.OK and result.processes == 1
    assert result.max_rss_bytes > 0
    assert_plausible(result)


@pytest.mark.slow
def test_a_job_does_not_report_the_workers_memory():
    """The worker is made to hold a 160 MB output (its peak goes past 300
    MB); the jobs after it -- warm and cold, allocating 100 MB or nothing --
    report their own memory, not the worker's, and not each other's."""
    with ExecPool(workers=1) as pool:
        assert pool.run(PythonJob("pass", warm=True)).ok  # the template starts now, not later
        worker = pool.worker_pids[0]
        flood = PythonJob("import sys\nfor _ in range(160):\n    sys.stdout.write('x' * 1_000_000)\n",
                          max_output_chars=160_000_000, timeout=120)
        assert pool.run(flood).output_chars == 160_000_000
        assert proc_kib(f"/proc/{worker}/status", "VmHWM") > 300 * MiB  # the worker did hold it
        for warm in (True, False):
            big = pool.run(PythonJob(TOUCH_100, warm=warm))
            small = pool.run(PythonJob("pass", warm=warm))
            assert 100 * MiB <= big.max_rss_bytes < 100 * MiB + 64 * MiB, (warm, big.max_rss_bytes)
            assert small.max_rss_bytes < 64 * MiB, (warm, small.max_rss_bytes)


def _last_number(text: str) -> float:
    """The last complete line's number (the kill may cut the one after it)."""
    return float(text[: text.rindex("\n")].split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_job_killed_at_its_timeout_still_reports_what_it_used(pool, kind):
    result = pool.run(job_of(kind, BURN_UNTIL_KILLED, timeout=1))
    assert result.status is Status.TIMEOUT
    used = _last_number(result.output)
    assert result.cpu_s >= used > 0, (result.cpu_s, used)
    assert result.processes >= 1 and result.max_rss_bytes > 0
    assert_plausible(result)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_job_still_reports_what_it_used(pool, kind):
    cancel = threading.Event()
    seen: list[str] = []

    def on_event(event) -> None:
        if isinstance(event, JobOutput):
            seen.append(event.text)
            if "\n" in "".join(seen) and _last_number("".join(seen)) >= 0.1:
                cancel.set()

    future = pool.submit(job_of(kind, BURN_UNTIL_KILLED, timeout=60), on_event=on_event, cancel_event=cancel)
    result = future.result(timeout=60)
    assert result.status is Status.CANCELLED
    assert result.cpu_s >= 0.1 and result.processes >= 1 and result.max_rss_bytes > 0
    assert_plausible(result)


def test_a_job_whose_worker_died_has_no_figures():
    """Nobody measured it: None, not zeros."""
    with ExecPool(workers=1) as pool:
        worker = psutil.Process(pool.worker_pids[0])
        future = pool.submit(ShellJob("sleep 30"))
        assert wait_for(lambda: any(p.name() == "sleep" for p in worker.children(recursive=True)), 10)
        worker.kill()
        result = future.result(timeout=30)
    assert result.status is Status.INFRA
    assert (result.cpu_user_s, result.cpu_system_s, result.max_rss_bytes, result.processes) == (None,) * 4
    assert result.cpu_s is None


_TIER = Cgroups.detect("probe-cost")
MEMORY_CGROUP = _TIER is not None and "memory" in _TIER.bases
if _TIER is not None:
    _TIER.close()


@pytest.mark.skipif(not MEMORY_CGROUP, reason="no memory cgroup controller execpool may use here")
def test_a_job_with_a_memory_cgroup_reports_its_peak(pool):
    capped = pool.run(PythonJob(run_in_child(TOUCH_100), limits=Limits(memory=512 * MiB)))
    assert capped.status is Status.OK, capped.text
    assert 100 * MiB <= capped.peak_memory_bytes <= 512 * MiB
    assert capped.max_rss_bytes >= 100 * MiB


def test_cgroup_figures_are_read_from_v1_and_v2_groups(tmp_path):
    """The files a v2 group has (also without controllers: cpu.stat) and a v1
    memory group has; execpool makes v2 job groups only where controllers
    are delegated to it, so this machine may not show them live."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.stat").write_text("usage_usec 1750000\nuser_usec 1250000\nsystem_usec 500000\nnr_periods 0\n")
    (v2 / "memory.peak").write_text("123456789\n")
    group = JobGroup([str(v2)], 2)
    assert group.cpu_seconds() == (1.25, 0.5) and group.peak_memory() == 123456789
    pids, memory = tmp_path / "pids", tmp_path / "memory"
    pids.mkdir()
    memory.mkdir()
    (memory / "memory.max_usage_in_bytes").write_text("4096\n")
    assert JobGroup([str(pids), str(memory)], 1).peak_memory() == 4096
    assert JobGroup([str(pids)], 1).peak_memory() is None
    assert JobGroup([str(pids)], 1).cpu_seconds() is None


def test_a_spares_report_keeps_its_spent_cpu_apart_from_a_failure():
    """What a spare writes on its ready pipe when it takes a job: the CPU it
    had spent (taken off the job's figures), then any start failure."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    report = taken()
    took, spent, failure = read_report(report)
    assert took and failure == b"" and spent[0] >= before.ru_utime and spent[1] >= before.ru_stime
    assert read_report(report + b"warm spare: no such directory") == (True, spent, b"warm spare: no such directory")
    assert read_report(b"")[0] is False  # a spare that died parked said nothing


def execpool(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execpool", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


COST_KEYS = ("cpu_user_s", "cpu_system_s", "max_rss_bytes", "peak_memory_bytes", "processes")


@pytest.mark.slow
def test_run_json_prints_one_record_with_the_cost():
    done = execpool("run", "--json", "--python", run_in_child(BURN_CHILD) + "raise SystemExit(3)")
    assert done.returncode == 3
    record = json.loads(done.stdout)  # one line: the output is in it, not streamed
    child_says = float(record["output"].split()[-1])
    assert record["status"] == "error" and record["exit_code"] == 3
    assert record["cpu_user_s"] >= child_says >= 0.3
    assert record["processes"] >= 1 and record["max_rss_bytes"] > 0 and record["peak_memory_bytes"] is None
    assert "id" not in record and "line" not in record


@pytest.mark.slow
def test_batch_records_carry_the_cost(tmp_path):
    jobs = tmp_path / "in.jsonl"
    lines = [{"id": "burn", "python": run_in_child(BURN_CHILD)},
             {"id": "forks", "shell": "for i in 1 2 3; do sleep 30 >/dev/null 2>&1 & done"},
             {"id": "late", "shell": f"{PY} -c {shlex.quote(BURN_UNTIL_KILLED)}", "timeout": 1},
             {"id": "bad", "python": 5}]
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = execpool("batch", str(jobs), "--no-progress")
    assert done.returncode == 0, done.stderr
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "in.out.jsonl").read_text().splitlines())}
    burn, forks, late, bad = (records[key] for key in ("burn", "forks", "late", "bad"))
    assert burn["cpu_user_s"] >= float(burn["output"].split()[-1]) >= 0.3
    assert forks["processes"] == 4
    assert late["status"] == "timeout" and late["cpu_user_s"] + late["cpu_system_s"] >= _last_number(late["output"])
    assert all(bad[key] is None for key in COST_KEYS) and bad["status"] == "invalid"
