"""Per-job limits and the environment a tool sees."""

from __future__ import annotations

import os

import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob
from tests.support.helpers import all_dead, pids_in


def test_caller_secrets_never_reach_a_tool_or_a_worker(monkeypatch):
    monkeypatch.setenv("EXECPOOL_TEST_SECRET", "hunter2")
    with ExecPool(workers=1) as pool:
        result = pool.run(ShellJob("env"))
        assert "hunter2" not in result.output and "EXECPOOL_TEST_SECRET" not in result.output
        for pid in pool.worker_pids:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"hunter2" not in f.read()


def test_environment_is_the_allow_list_plus_what_the_job_passes(monkeypatch):
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("EXTRA_ALLOWED", "yes")
    with ExecPool(workers=1, env_allowlist=("PATH", "LANG", "EXTRA_ALLOWED"), env={"POOL_WIDE": "1"}) as pool:
        code = "import os, json; print(json.dumps(sorted(os.environ)))"
        names = eval(pool.run(PythonJob(code, env={"JOB_ONLY": "2"})).output)
        assert {"PATH", "LANG", "EXTRA_ALLOWED", "POOL_WIDE", "JOB_ONLY"} <= set(names)
        assert set(names) - {"PATH", "LANG", "EXTRA_ALLOWED", "POOL_WIDE", "JOB_ONLY"} <= {
            "EXECPOOL_JOB", "LC_CTYPE"}  # the job marker; LC_CTYPE is set by Python's locale coercion
        assert pool.run(ShellJob("echo $JOB_ONLY", env={"JOB_ONLY": "x y"})).text == "x y\n"


def test_file_size_limit_stops_a_disk_fill(tmp_path):
    with ExecPool(workers=1) as pool:
        limits = Limits(file_size=1 << 20)
        result = pool.run(ShellJob("head -c 5000000 /dev/zero > big; echo rc=$?", cwd=str(tmp_path), limits=limits))
        assert "File size limit exceeded" in result.output or "rc=1" in result.output
        assert (tmp_path / "big").stat().st_size <= 1 << 20
        assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


def test_address_space_limit_makes_a_memory_bomb_fail():
    with ExecPool(workers=1, limits=Limits(address_space=512 << 20)) as pool:
        result = pool.run(PythonJob("x = bytearray(2 << 30)\nprint('allocated')"))
        assert result.exit_code == 1 and "MemoryError" in result.output
        assert pool.run(PythonJob("print('healthy')")).text == "healthy\n"


def test_open_files_limit():
    with ExecPool(workers=1) as pool:
        code = "import os\nfds = []\ntry:\n    while True: fds.append(os.open(os.devnull, os.O_RDONLY))\nexcept OSError as e:\n    print(len(fds) < 64, e.errno)"
        result = pool.run(PythonJob(code, limits=Limits(open_files=64)))
        assert result.output == "True 24\n"


@pytest.mark.slow
def test_cpu_seconds_limit_kills_a_busy_loop():
    with ExecPool(workers=1) as pool:
        result = pool.run(PythonJob("while True: pass", limits=Limits(cpu_seconds=1), timeout=30))
        assert result.exit_code in (-9, -24)  # SIGKILL at the hard limit, SIGXCPU at the soft one
        assert not result.timed_out


def test_per_job_limits_override_the_pool_default():
    with ExecPool(workers=1, limits=Limits(open_files=32)) as pool:
        probe = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
        assert pool.run(PythonJob(probe)).text == "32\n"
        assert pool.run(PythonJob(probe, limits=Limits(open_files=100))).text == "100\n"


def test_default_limits_are_applied():
    with ExecPool(workers=1) as pool:
        probe = ("import resource as r\nprint(r.getrlimit(r.RLIMIT_AS)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], "
                 "r.getrlimit(r.RLIMIT_NOFILE)[0])")
        default = Limits()
        assert pool.run(PythonJob(probe)).text == f"{default.address_space} {default.file_size} {default.open_files}\n"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs procfs")
def test_tools_run_in_their_own_session():
    with ExecPool(workers=1) as pool:
        out = pool.run(ShellJob("ps -o pid=,pgid=,sid= -p $$")).output.split()
        assert out[0] == out[1] == out[2]


NET_PROBE = ("import socket\nprint(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))\n"
             "s = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', 9)) != 0)")


@pytest.mark.parametrize("warm", [False, True])
def test_network_false_gives_a_namespace_with_nothing_but_loopback(pool, warm):
    result = pool.run(PythonJob(NET_PROBE, network=False, warm=warm))
    if result.error and "Operation not permitted" in result.error:
        pytest.skip("this user may not create network namespaces")
    assert result.text == "['lo']\nTrue\n"
    with_network = pool.run(PythonJob(NET_PROBE, warm=warm)).output.splitlines()[0]
    assert with_network != "['lo']"


def test_network_must_be_a_bool():
    with pytest.raises(TypeError):
        ShellJob("true", network="no")


def test_non_dumpable_caller(tmp_path):
    """Runs in a child process: the flag applies to the whole caller."""
    import subprocess
    import sys
    import textwrap

    owner = textwrap.dedent("""
        import ctypes, sys
        from execpool import ExecPool, ShellJob
        libc = ctypes.CDLL(None)
        before = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
        with ExecPool(workers=1, non_dumpable=True) as pool:
            after = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
            assert pool.run(ShellJob("echo ok")).text.strip() == "ok"
        print(before, after)
    """)
    done = subprocess.run([sys.executable, "-c", owner], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1", "0"], done.stderr
    with pytest.raises(TypeError):
        ExecPool(workers=1, non_dumpable="yes")


def test_without_cgroups_the_worker_counts_and_keeps_the_process_cap():
    storm = ("for i in $(seq 200); do sleep 30 >/dev/null 2>&1 & echo \"PIDS $!\"; sleep 0.005; done; "
             "wait")
    with ExecPool(workers=1, cgroups=False) as pool:
        result = pool.run(ShellJob(storm, limits=Limits(processes=30), timeout=20))
        assert result.text == "Execution error: the job went over its process limit (30) and was killed"
        pids = pids_in(result.output)
        assert 10 <= len(pids) < 200  # transient forks count too, so the cap may bite before 30 sleeps
        assert all_dead(pids)
        # A job inside its cap runs to its end.
        assert pool.run(ShellJob("sleep 0.2 & sleep 0.2 & wait; echo fine",
                                 limits=Limits(processes=30))).text == "fine\n"
        result = pool.run(ShellJob("true", limits=Limits(memory=1 << 30)))
        assert result.text.startswith("Execution error: cannot start the tool: Limits(memory=...) needs a cgroup")
    with pytest.raises(TypeError):
        ExecPool(workers=1, cgroups="no")
