"""RayPool and ``execpool batch --ray`` on a real Ray cluster: the session's
local one (tests/ray/conftest.py, ``ray_address``) and, for the loss of a node,
a two-node ``ray.cluster_utils.Cluster`` on this machine. Nothing of Ray is
mocked: jobs run in actors' ExecPools, actors are killed with ``ray.kill``,
drivers with SIGKILL, nodes by removing them -- and then no tool, escaped
daemon included, may live on."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from execpool import CodeJob, ExecPool, PythonJob, ShellJob, Status
from execpool.ray import RayPool
from tests.support.helpers import REPO, all_dead, collect, joined_output, pids_in, remember, wait_for
from tests.support.leftovers import nothing_left_behind

pytestmark = pytest.mark.ray


#: The job's shell, and a daemon in a session of its own with an empty
#: environment, orphaned at once; then the job keeps running.
ESCAPE = ("echo \"PIDS $$\"; setsid sh -c 'env -i /bin/sleep 300 </dev/null >/dev/null 2>&1 & echo \"PIDS $!\"'; "
          "sleep 300")

#: The Ray worker process that runs a tool's actor: above the tool are its
#: worker, the pool's lifeline, then the actor.
ACTOR_OF = "$(ps -o ppid= -p $(ps -o ppid= -p $PPID))"

JOBS = [ShellJob("echo hi; exit 3"), ShellJob("sleep 5", timeout=0.3), PythonJob("print(sum(range(10)))"),
        PythonJob("raise SystemExit(7)"), ShellJob("printf 'caf\\xc3\\xa9 \\xff\\n'"), PythonJob("   ")]


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request, ray_address):
    """The cluster is up before the module's processes and
    threads are counted (descriptors: see ``nothing_left_behind``)."""
    with RayPool(workers=1) as pool:  # Ray's own driver threads start on first use
        pool.run(ShellJob("true"))
    yield from nothing_left_behind(request, descriptors=False)


@pytest.fixture(scope="module")
def pool(ray_address):
    with RayPool(workers=2, per_node=2) as p:
        yield p


def _fields(result) -> tuple:
    return result.status, result.exit_code, result.output, result.text, result.timed_out


def test_results_are_those_of_execpool(pool):
    with ExecPool(workers=2) as local:
        expected = [_fields(local.run(job)) for job in JOBS]
    assert [_fields(r) for r in pool.map(JOBS)] == expected
    assert sorted((i, _fields(r)) for i, r in pool.imap_unordered(JOBS, max_in_flight=2)) == list(enumerate(expected))
    assert [_fields(pool.submit(job).result()) for job in JOBS] == expected
    stats = pool.stats()
    assert stats.jobs[("shell", "timeout")] >= 3 and stats.in_flight == 0


@pytest.mark.slow
def test_a_code_job_compiles_and_runs_on_an_actor(pool):
    program = '#include <cstdio>\nint main() { int a, b; std::scanf("%d %d", &a, &b); std::printf("%d\\n", a + b); }\n'
    results = [pool.submit(CodeJob("cpp", program, stdin=f"{n} 1", timeout=30)).result() for n in range(3)]
    assert [(r.status, r.output, r.compile_status) for r in results] == [(Status.OK, f"{n + 1}\n", Status.OK)
                                                                        for n in range(3)]
    assert results[-1].compile_cached  # the actors' pools kept it


@pytest.mark.slow
def test_misuse_raises_as_with_execpool(pool):
    with pytest.raises(TypeError):
        pool.submit("echo hi")
    with pytest.raises(ValueError):
        pool.run(ShellJob("pwd", cwd="/no/such/directory"))
    with pytest.raises(ValueError):
        RayPool(workers=0)


@pytest.mark.slow
def test_a_stream_carries_the_same_events_and_heartbeats(pool):
    job = PythonJob("import time\nfor i in range(3):\n    print(i)\n    time.sleep(0.3)")
    events, result = collect(pool.stream(job, tool_name="python", tool_call_id="c1", heartbeat_interval_s=0.1))
    assert joined_output(events) == "0\n1\n2\n" == result.output
    assert {e["type"] for e in events} == {"tool_output", "heartbeat"}
    assert all(e == {"type": "tool_output", "tool_name": "python", "tool_call_id": "c1", "text": e["text"]}
               for e in events if e["type"] == "tool_output")
    flood = pool.stream(PythonJob("for i in range(20000):\n    print(i)"), heartbeat_interval_s=10)
    events, result = collect(flood)
    assert joined_output(events) == result.output == "".join(f"{i}\n" for i in range(20000))


@pytest.mark.slow
def test_astream_is_the_same_for_asyncio(pool):
    async def consume():
        stream = pool.astream(ShellJob("echo a; sleep 0.2; echo b"), heartbeat_interval_s=0.05)
        events = [event async for event in stream]
        return events, stream.result

    events, result = asyncio.run(consume())
    assert joined_output(events) == "a\nb\n" and result.status is Status.OK
    assert any(e["type"] == "heartbeat" for e in events)


@pytest.mark.slow
def test_closing_a_stream_kills_the_tree_on_its_node(pool, doomed):
    stream = pool.stream(ShellJob(ESCAPE, timeout=None), heartbeat_interval_s=0.1)
    text = ""
    while text.count("PIDS") < 2:
        text += next(stream).get("text", "")
    pids = pids_in(text)
    remember(doomed, pids)
    started = time.monotonic()
    stream.close()
    assert time.monotonic() - started < 1.0
    assert all_dead(pids, timeout=3.0), [p for p in pids if psutil.pid_exists(p)]
    cancel = pool.submit(ShellJob("sleep 30"))
    assert cancel.cancel() and cancel.result().status is Status.CANCELLED


@pytest.mark.slow
def test_tools_see_no_ray_variable_and_run_at_the_pools_niceness(pool, ray_address):
    probe = ShellJob("env | grep -c '^RAY_' ; nice")
    assert pool.run(probe).output == "0\n0\n"  # the Ray worker itself runs at 15, with RAY_* set
    with RayPool(workers=1, niceness=7) as niced:
        assert niced.run(probe).output == "0\n7\n"


def _actor_running(pool, pid: int):
    for actor in list(pool._running):
        if ray_get(actor.node.remote())[1] == pid:
            return actor
    raise AssertionError(f"no actor of the pool runs as process {pid}")


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=30)


@pytest.mark.slow
def test_ray_kill_of_an_actor_leaves_no_tool_alive_and_its_jobs_run_elsewhere(ray_address, doomed):
    import ray

    with RayPool(workers=1, per_node=2) as pool:
        texts: list = []
        streamed = pool.submit(ShellJob(f'echo "ACTOR {ACTOR_OF}"; ' + ESCAPE, timeout=None),
                               on_event=lambda event: texts.append(event.text))
        assert wait_for(lambda: "".join(texts).count("PIDS") == 2, 20.0), texts
        text = "".join(texts)
        pids = pids_in(text)
        remember(doomed, pids)
        actor = _actor_running(pool, int(text.split("ACTOR")[1].split()[0]))
        # A job that streamed nothing is run again on the other actor.
        quiet = [pool.submit(PythonJob("import time; time.sleep(1.5); print('done')")) for _ in range(2)]
        ray.kill(actor, no_restart=True)
        assert all_dead(pids, timeout=5.0), [p for p in pids if psutil.pid_exists(p)]
        lost = streamed.result(timeout=30)
        assert lost.status is Status.INFRA and "actor" in lost.text, lost
        assert [f.result(timeout=30).output for f in quiet] == ["done\n", "done\n"]
        assert pool.actors == 1


#: A driver of the module's cluster, in a process of its own: a RayPool
#: with a job that left a daemon; says its pids, then waits to be killed.
DRIVER = textwrap.dedent("""
    import sys, threading
    import ray
    from execpool import ShellJob
    from execpool.ray import RayPool
    ray.init(address=sys.argv[1], log_to_driver=False)
    pool = RayPool(workers=1)
    texts, said = [], threading.Event()

    def seen(event):
        texts.append(event.text)
        if "".join(texts).count("PIDS") >= 2:
            said.set()

    pool.submit(ShellJob(sys.argv[2], timeout=None), on_event=seen)
    said.wait(60)
    print(" ".join("".join(texts).split()), flush=True)
    sys.stdin.read()
""")


@pytest.mark.slow
def test_sigkill_of_the_driver_ends_its_actors_and_their_tools(ray_address, doomed):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, ray_address, ESCAPE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd=REPO, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    try:
        line = driver.stdout.readline()
        pids = pids_in(line)
        assert len(pids) == 2, line
        remember(doomed, pids)
        driver.kill()
        driver.wait()
        assert all_dead(pids, timeout=10.0), [p for p in pids if psutil.pid_exists(p)]
    finally:
        driver.kill()
        driver.wait()
        driver.stdin.close()
        driver.stdout.close()


def _batch(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execpool", "batch", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=90, env={**os.environ, "PYTHONPATH": REPO}, **kwargs)


def _records(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_batch_on_ray_writes_the_same_records_and_resumes(ray_address, tmp_path):
    lines = [{"id": "a", "shell": "echo a"}, {"id": "b", "python": "exit(3)"}, {"id": "c", "shell": "sleep 5",
             "timeout": 0.3}, {"id": "d", "python": 4}, {"id": 5, "shell": "printf é"}]
    infile = tmp_path / "in.jsonl"
    infile.write_text("".join(json.dumps(line) + "\n" for line in lines))
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert _batch([str(infile), "-o", str(local)]).returncode == 0
    done = _batch([str(infile), "-o", str(remote), "--ray", ray_address, "--progress"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "5/5" in done.stderr  # the progress bar
    keep = ("id", "status", "exit_code", "output", "line", "error")
    by_id = lambda records: sorted(({k: r[k] for k in keep} for r in records), key=lambda r: r["line"])  # noqa: E731
    assert by_id(_records(remote)) == by_id(_records(local))
    again = _batch([str(infile), "-o", str(remote), "--ray", ray_address])
    assert again.returncode == 0 and "already have a record" in again.stderr
    assert len(_records(remote)) == 5


@pytest.mark.slow
def test_eval_on_ray_gives_the_same_verdicts(ray_address, tmp_path):
    """``execpool eval --ray``: the driver keeps OUT, the actors judge, the
    judge preloaded on every node."""
    samples = os.path.join(REPO, "examples", "eval_samples.jsonl")
    problems = os.path.join(REPO, "examples", "eval_problems.jsonl")
    verdicts = {}
    for where, flags in (("local", []), ("ray", ["--ray", ray_address])):
        out = tmp_path / f"{where}.jsonl"
        done = subprocess.run([sys.executable, "-m", "execpool", "eval", samples, "--problems", problems, "-k", "1,2",
                               "-o", str(out), *flags], capture_output=True, text=True, cwd=REPO, timeout=90,
                              env={**os.environ, "PYTHONPATH": REPO})
        assert done.returncode == 0, done.stderr[-2000:]
        verdicts[where] = sorted((r["line"], r["verdict"]) for r in _records(out))
        assert json.loads(done.stdout.splitlines()[-1])["pass@2"] == pytest.approx(5 / 6)
    assert verdicts["ray"] == verdicts["local"] and len(verdicts["ray"]) == 6


@pytest.mark.slow
def test_a_lost_node_reruns_its_jobs_elsewhere_each_id_once(tmp_path, doomed):
    """A second cluster, of two nodes: the batch runs on both; the one that
    is not the head is removed while its jobs run. Its tools die, the jobs
    run again on the head's actor, and OUT has each id once, none infra."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        doomed_node = cluster.add_node(num_cpus=1)
        raylet = doomed_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        marks = tmp_path / "pids"
        marks.mkdir()
        infile = tmp_path / "in.jsonl"
        infile.write_text("".join(json.dumps({"id": i, "shell": f"echo $$ > {marks}/{i}.$$; sleep 4; echo {i}"}) + "\n"
                                  for i in range(4)))
        out = tmp_path / "out.jsonl"
        batch = subprocess.Popen([sys.executable, "-m", "execpool", "batch", str(infile), "-o", str(out),
                                  "--ray", cluster.address, "--workers", "1", "--max-in-flight", "4"],
                                 stderr=subprocess.PIPE, cwd=REPO, text=True, env={**os.environ, "PYTHONPATH": REPO})
        try:
            assert wait_for(lambda: len(os.listdir(marks)) >= 4, 60.0), os.listdir(marks)
            tools = [int(name.split(".")[1]) for name in os.listdir(marks)]
            remember(doomed, tools)
            on_node = [pid for pid in tools if raylet in {p.pid for p in _ancestors(pid)}]
            assert on_node, "no job ran on the second node"
            cluster.remove_node(doomed_node)
            assert all_dead(on_node, timeout=10.0), [p for p in on_node if psutil.pid_exists(p)]
            assert batch.wait(60) == 0, batch.stderr.read()[-2000:]
        finally:
            batch.kill()
            batch.wait()
            batch.stderr.close()
        records = _records(out)
        assert sorted(r["id"] for r in records) == [0, 1, 2, 3]
        assert {r["status"] for r in records} == {"ok"}, records
        assert all(r["output"] == f"{r['id']}\n" for r in records)
    finally:
        cluster.shutdown()


def _ancestors(pid: int) -> list:
    try:
        return psutil.Process(pid).parents()
    except psutil.Error:
        return []
