"""``execpool eval``'s batches (docs/batch/evaluation.md, "Batches"): several
function- or assert-style samples judged in one job, each beside a judge
of its own, in a directory and a Landlock layer of its own, against its
own time limit -- and none of them able to reach another: read its
files, signal it, or hold back its verdict."""

from __future__ import annotations

import json

import pytest

from execpool import ExecPool
from execpool.eval import EvalOptions, evaluate, load_problems
from execpool.eval.harness import JudgeTask, judge, judge_job
from execpool.eval.problems import parse_sample
from execpool.eval.run import judge_samples
from execpool.shared.result import Result, Status

#: A problem whose test passes a sample that reports having reached
#: nothing of its neighbours'.
PROBE = {"task_id": "probe", "entry_point": "probe", "prompt": "def probe():\n    \"\"\"What it reached.\"\"\"\n",
         "test": "def check(candidate):\n    assert candidate() == []\n"}

#: Leaves a secret in every place it may write, then stays alive a while
#: so that its neighbours look while it runs.
WRITER = ("    import os, tempfile, time\n"
          "    for where in {os.getcwd(), tempfile.gettempdir(), os.environ.get('HOME', '.')}:\n"
          "        with open(os.path.join(where, 'secret.txt'), 'w') as f:\n"
          "            f.write('the writer was here')\n"
          "    time.sleep(1.5)\n"
          "    return []\n")

#: Looks for that secret (which its own source does not hold) wherever a
#: path could lead -- the writer's source holds it too -- and lists where
#: it was found.
READER = ("    import os, tempfile, time\n"
          "    time.sleep(0.5)\n"
          "    found, secret = [], 'writer' + ' was here'\n"
          "    places = {os.getcwd(), os.path.dirname(os.getcwd()), tempfile.gettempdir(), '/tmp', '/home',\n"
          "              os.environ.get('HOME', '.')}\n"
          "    places |= {f'/proc/{pid}/cwd' for pid in os.listdir('/proc') if pid.isdigit()}\n"
          "    for place in places:\n"
          "        try:\n"
          "            walked = list(os.walk(place))\n"
          "        except OSError:\n"
          "            continue\n"
          "        for root, _, names in walked:\n"
          "            for name in names:\n"
          "                try:\n"
          "                    if secret in open(os.path.join(root, name)).read():\n"
          "                        found.append(os.path.join(root, name))\n"
          "                except (OSError, UnicodeDecodeError):\n"
          "                    pass\n"
          "    return found\n")

#: Signals every process it can see but itself and its own judge, and
#: lists the ones it reached.
KILLER = ("    import os, signal, time\n"
          "    time.sleep(0.5)\n"
          "    reached = []\n"
          "    for pid in (int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
          "        if pid in (os.getpid(), os.getppid()):\n"
          "            continue\n"
          "        try:\n"
          "            os.kill(pid, signal.SIGSTOP)\n"
          "            reached.append(pid)\n"
          "        except OSError:\n"
          "            pass\n"
          "    return reached\n")

#: The control: the reader's search finds what the same sample wrote.
CONTROL = WRITER.replace("    time.sleep(1.5)\n    return []\n", "") + READER


@pytest.fixture(scope="module")
def sandboxed():
    with ExecPool(workers=2, sandbox="strict") as pool:
        yield pool


def one_batch(pool, completions, timeout=5.0):
    """``completions`` of PROBE judged in one job, through the scheduler:
    a batch as large as the samples, one job at a time."""
    options = EvalOptions(timeout=timeout, batch=len(completions))
    return evaluate(pool, [{"task_id": "probe", "completion": c} for c in completions], load_problems([PROBE]),
                    options=options, max_in_flight=1).records


@pytest.mark.slow
def test_samples_in_one_job_cannot_read_each_others_files_or_signal_each_other(sandboxed):
    records = one_batch(sandboxed, [WRITER, READER, KILLER, WRITER, CONTROL])
    said = [(r["verdict"], (r["first_failure"] or {}).get("actual")) for r in records]
    assert said[:4] == [("Accepted", None)] * 4, said
    assert said[4][0] == "Wrong Answer" and "secret.txt" in said[4][1], said


@pytest.mark.slow
def test_samples_are_kept_apart_without_the_sandbox_too():
    with ExecPool(workers=1) as bare:
        records = one_batch(bare, [WRITER, READER, KILLER])
    said = [(r["verdict"], (r["first_failure"] or {}).get("actual")) for r in records]
    assert said == [("Accepted", None)] * 3, said


@pytest.mark.slow
def test_each_sample_of_a_batch_has_its_own_time_limit(sandboxed):
    """A sample that never ends is out of time at its own limit; its
    neighbours are judged in their own time, not kept waiting for it."""
    sleeper = "    import time\n    time.sleep(60)\n"
    spinner = "    while True:\n        pass\n"
    quick = "    return []\n"
    records = one_batch(sandboxed, [sleeper, quick, spinner, quick], timeout=2.0)
    assert [r["verdict"] for r in records] == ["Time Limit Exceeded", "Accepted", "Time Limit Exceeded", "Accepted"]
    assert all(r["time_s"] < 2.0 for r in (records[1], records[3])), [r["time_s"] for r in records]
    assert all(r["time_s"] >= 2.0 for r in (records[0], records[2])), [r["time_s"] for r in records]


@pytest.mark.slow
def test_a_slow_sample_frees_its_batchs_other_seats(sandboxed):
    """The scheduler counts verdict lines as they arrive: with room for one
    batch of two, a slow sample's batch-mate leaves a seat, and the next
    samples are judged while the slow one still runs."""
    slow = {"task_id": "probe", "completion": "    import time\n    time.sleep(6)\n    return []\n"}
    quick = {"task_id": "probe", "completion": "    return []\n"}
    samples = [(n, parse_sample(s, f"samples[{n}]")) for n, s in enumerate([slow, quick, quick, quick])]
    order = [tag for tag, _ in judge_samples(sandboxed.submit, samples, load_problems([PROBE]),
                                             EvalOptions(timeout=10, batch=2), max_in_flight=1)]
    assert set(order[:2]) == {2, 3}, order  # the slow one's batch-mate comes with it, at its job's end


def test_a_batch_that_says_nothing_of_a_sample_is_judged_again_alone():
    """A batch's judging that failed (no verdict line for the sample) is
    never the sample's verdict: it runs again in a job of its own."""
    sample = parse_sample({"task_id": "probe", "completion": "    return []\n"}, "s")
    steps = judge(sample, load_problems([PROBE])["probe"], EvalOptions(batch=4))
    (first,) = next(steps)
    assert isinstance(first, JudgeTask) and not first.alone
    (again,) = steps.send([Result(status=Status.OK, output="")])
    assert isinstance(again, JudgeTask) and again.alone and again.spec == first.spec
    job = judge_job([again], EvalOptions())
    assert job.code.rstrip().endswith("main(1)") and len(json.loads(job.stdin)) == 1


def test_batch_is_a_whole_number_of_at_least_one():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch"):
            EvalOptions(batch=bad)


#: A leader with one judge that says its verdict at once, then takes its
#: time to end (as a judge killing and reaping its sample does): the
#: verdict came within the sample's time, so it is the sample's.
LATE_ENDING_JUDGE = r'''
import json, os, struct, sys, time
from execpool.tool import judge

spec_r, spec_w = os.pipe()
said_r, said_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(spec_w); os.close(said_r)
    size = struct.unpack("<Q", os.read(spec_r, 8))[0]
    os.read(spec_r, size)
    judge._send_json(said_w, {"failure": None, "tests": [{"verdict": "Accepted"}], "ended": time.monotonic()})
    time.sleep(30)
    os._exit(0)
os.close(spec_r); os.close(said_w)
judge._leader([judge._Seat(pid, spec_w, said_r)], [{"nonce": "ab" * 16, "timeout": 0.5}])
'''


def test_a_verdict_said_in_time_counts_though_its_judge_ends_after_the_limit():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LATE_ENDING_JUDGE], capture_output=True, text=True, timeout=60)
    line = done.stdout.strip().split(" ", 2)
    assert line[0] == "EXECPOOL-JUDGE" and line[1] == "ab" * 16, done.stdout + done.stderr
    said = json.loads(line[2])
    assert said["tests"] == [{"verdict": "Accepted"}] and said["failure"] is None, said
