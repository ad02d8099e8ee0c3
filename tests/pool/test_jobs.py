"""SPEC §2 (Python and shell jobs) and §6 (bad input) through the pool."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest

from execpool import ExecPool, Limits, PoolClosedError, PythonJob, ShellJob
from tests.support import hostile
from tests.support.helpers import alive, all_dead, pids_in


def reference_output(argv, cwd=None):
    """What the SPEC says a job's output is: communicate() with these settings."""
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          encoding="utf-8", errors="replace", cwd=cwd).stdout


@pytest.mark.parametrize("command", [
    "echo out; echo err >&2; echo out2",
    "printf 'crlf\\r\\nlone\\rend'",
    "printf '\\xff\\xfe\\xc3\\xa9\\xe2\\x82'",
    "printf 'no newline at end'",
])
def test_shell_output_decodes_like_communicate(pool, command):
    assert pool.run(ShellJob(command)).output == reference_output(["bash", "-c", command])


def test_python_output_decodes_like_communicate(pool, tmp_path):
    script = tmp_path / "garbage.py"
    script.write_text(hostile.BINARY_GARBAGE)
    expected = reference_output([sys.executable, "-u", str(script)])
    assert pool.run(PythonJob(hostile.BINARY_GARBAGE)).output == expected


@pytest.mark.slow
def test_result_strings(pool):
    assert pool.run(ShellJob("echo hi")).text == "hi\n"
    assert pool.run(ShellJob("true")).text == "(no output)"
    assert pool.run(ShellJob("echo '   '")).text == "(no output)"
    assert pool.run(ShellJob("echo bad; exit 5")).text == "Exit code 5:\nbad\n"
    assert pool.run(PythonJob("raise SystemExit(2)")).text == "Exit code 2:\n"
    assert pool.run(ShellJob("sleep 10", timeout=0.2)).text == "Execution timed out after 0.2 seconds."
    assert pool.run(ShellJob("sleep 10", timeout=1)).text == "Execution timed out after 1 seconds."
    assert pool.run(PythonJob("")).text == "No code provided."
    assert pool.run(PythonJob("  \n\t")).text == "No code provided."
    assert pool.run(ShellJob("")).text == "No command provided."


def test_segfault_exit_code_names_the_signal(pool):
    result = pool.run(PythonJob(hostile.SEGFAULT))
    assert result.exit_code == -11 and result.signal_name == "SIGSEGV"
    assert result.text.startswith("Exit code -11:\nbefore\n")


def test_python_job_file_lives_in_the_working_directory(pool, tmp_path):
    code = "import os, sys\nprint(os.path.dirname(__file__)); print(sys.path[0]); print(os.getcwd()); print(sys.executable)"
    lines = pool.run(PythonJob(code, cwd=str(tmp_path))).output.splitlines()
    assert lines[:3] == [str(tmp_path)] * 3
    assert lines[3] == sys.executable
    assert os.listdir(tmp_path) == []  # the job's script is gone, nothing else was written


def test_cwd_keeps_what_the_job_writes_and_no_cwd_is_private_and_removed(pool, tmp_path):
    pool.run(ShellJob("echo data > kept.txt", cwd=str(tmp_path)))
    assert (tmp_path / "kept.txt").read_text() == "data\n"
    first = pool.run(ShellJob("pwd; ls -A")).output.splitlines()
    second = pool.run(ShellJob("pwd")).output.splitlines()
    assert first[0] != second[0] and first[1:] == []
    assert not os.path.exists(first[0]) and not os.path.exists(second[0])


def test_missing_cwd_is_a_value_error(pool, tmp_path):
    with pytest.raises(ValueError, match="not an existing directory"):
        pool.run(ShellJob("true", cwd=str(tmp_path / "missing")))


def test_empty_cwd_is_a_value_error_naming_it():
    """os.path.abspath("") is the caller's own directory: an empty cwd would
    silently run the job there instead of where the caller meant."""
    for kind in (PythonJob, ShellJob):
        with pytest.raises(ValueError, match="^cwd must not be empty"):
            kind("pwd", cwd="")


def test_huge_integers_are_refused_by_field_name():
    # Python refuses to print an int of more than 4300 digits, so an error
    # message that repeats the value would become an error about printing it.
    for huge in (10**5000, -10**5000):
        with pytest.raises(ValueError, match="^timeout .*integer of 16610 bits"):
            PythonJob("1", timeout=huge)
        with pytest.raises(ValueError, match="^memory.*integer of 16610 bits"):
            Limits(memory=huge)
        with pytest.raises(ValueError, match="^max_output_chars .*integer of 16610 bits"):
            ShellJob("true", max_output_chars=-abs(huge))
    with pytest.raises(ValueError, match=r"^timeout=<an integer of 101 bits> is over"):
        PythonJob("1", timeout=2**100)


def test_timeout_none_waits_for_a_background_grandchild(pool):
    result = pool.run(ShellJob("(sleep 0.3; echo late) & echo early", timeout=None))
    assert result.output == "early\nlate\n" and result.exit_code == 0


def test_timeout_kills_a_grandchild_that_holds_stdout(pool, tmp_path):
    command = "(sleep 1; echo written > after.txt; echo never) & echo \"PIDS $!\""
    started = time.monotonic()
    result = pool.run(ShellJob(command, timeout=0.3, cwd=str(tmp_path)))
    assert result.timed_out and time.monotonic() - started < 1.0
    assert all_dead(pids_in(result.output), timeout=0.5)
    assert "never" not in result.output and not (tmp_path / "after.txt").exists()


def test_cancel_from_another_thread_after_the_leader_exited(pool):
    cancel = threading.Event()
    seen = []
    stream = pool.stream(ShellJob(hostile.GRANDCHILD_HOLDS_STDOUT, timeout=None), cancel_event=cancel)
    seen.append(next(stream)["text"])
    set_at = time.monotonic()
    threading.Thread(target=cancel.set).start()
    result = None
    try:
        while True:
            next(stream)
    except StopIteration as stop:
        result = stop.value
    assert time.monotonic() - set_at < 0.5
    assert result.text == "Execution cancelled."
    assert all_dead(pids_in(seen[0]), timeout=0.5)


def test_run_honours_cancel_event(pool):
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    started = time.monotonic()
    result = pool.run(ShellJob("sleep 30"), cancel_event=cancel)
    assert result.cancelled and time.monotonic() - started < 0.6


@pytest.mark.parametrize("tool", [
    ShellJob(hostile.QUIET_BACKGROUND),
    PythonJob(hostile.SETSID_DAEMON),
    PythonJob(hostile.NEW_PGID),
    ShellJob("nohup sleep 100 >/dev/null 2>&1 & disown; echo \"PIDS $!\""),
], ids=["background", "setsid-double-fork", "new-pgid", "nohup-disown"])
def test_nothing_outlives_its_job(pool, tool):
    result = pool.run(tool)
    pids = pids_in(result.output)
    assert pids, result.output
    assert all_dead(pids, timeout=1.0)


def test_daemon_that_clears_its_environment_dies_when_the_worker_is_idle(pool):
    code = "setsid env -i /bin/sh -c 'sleep 100' >/dev/null 2>&1 & echo \"PIDS $!\""
    with ExecPool(workers=1) as single:
        result = single.run(ShellJob(code))
        assert all_dead(pids_in(result.output), timeout=1.0)


def test_keep_background_lives_until_the_pool_closes(tmp_path):
    with ExecPool(workers=1) as own:
        result = own.run(ShellJob(hostile.QUIET_BACKGROUND, keep_background=True))
        pids = pids_in(result.output)
        assert pids and all(alive(p) for p in pids)
        assert own.run(ShellJob("echo next")).text == "next\n"
        assert all(alive(p) for p in pids)
    assert all_dead(pids, timeout=2.0)


def test_tool_stdin_is_devnull(pool):
    result = pool.run(ShellJob("cat; echo done", timeout=5))
    assert result.text == "done\n"


def test_spawn_failure_is_an_execution_error_and_the_pool_goes_on(tmp_path):
    interpreter = tmp_path / "python"
    interpreter.write_text("#!/bin/sh\nexec %s \"$@\"\n" % sys.executable)
    interpreter.chmod(0o755)
    with ExecPool(workers=1, python=str(interpreter)) as own:
        assert own.run(PythonJob("print(1)")).text == "1\n"
        interpreter.unlink()
        result = own.run(PythonJob("print(1)"))
        assert result.text.startswith("Execution error: cannot start the tool: ")
        assert "No such file" in result.text
        assert own.run(ShellJob("echo alive")).text == "alive\n"


def test_bounded_result_keeps_head_length_and_error_lines(pool):
    code = ("import sys\nsys.stdout.write('x' * 3_000_000 + '\\n')\n"
            "open('/mnt/data/input.csv')")
    result = pool.run(PythonJob(code, max_output_chars=1000))
    assert len(result.output) == 1000 and result.output_chars > 3_000_000 and result.truncated
    assert any("FileNotFoundError" in line and "/mnt/data/input.csv" in line for line in result.error_lines)
    assert result.text.startswith("Exit code 1:\n" + "x" * 1000)
    assert "truncated" in result.text and str(result.output_chars) in result.text


# -- SPEC §6: bad input -------------------------------------------------------


@pytest.mark.parametrize("kwargs, error", [
    (dict(timeout=-1), ValueError),
    (dict(timeout=0), ValueError),
    (dict(timeout=math.nan), ValueError),
    (dict(timeout=math.inf), ValueError),
    (dict(timeout=1e12), ValueError),
    (dict(timeout="10"), TypeError),
    (dict(timeout=True), TypeError),
    (dict(env={"A": 1}), TypeError),
    (dict(env={"A=B": "x"}), ValueError),
    (dict(env={"": "x"}), ValueError),
    (dict(env={"A": "x\x00y"}), ValueError),
    (dict(env=["A"]), TypeError),
    (dict(cwd=b"/tmp"), TypeError),
    (dict(limits={"open_files": 3}), TypeError),
    (dict(max_output_chars=0), ValueError),
])
def test_bad_job_arguments(kwargs, error):
    with pytest.raises(error):
        PythonJob("print(1)", **kwargs)


@pytest.mark.parametrize("source, error", [
    (None, TypeError), (b"print(1)", TypeError), ("print(1)\x00", ValueError), ("x = '\ud800'", ValueError),
])
def test_bad_sources(source, error):
    with pytest.raises(error):
        PythonJob(source)
    with pytest.raises(error):
        ShellJob(source)


def test_bad_limits():
    with pytest.raises(ValueError):
        Limits(open_files=-1)
    with pytest.raises(TypeError):
        Limits(cpu_seconds=1.5)


@pytest.mark.slow
def test_huge_inputs(pool):
    big = "x = 1\n" * (10 * 1024 * 1024 // 6) + "print('big ok')"
    assert pool.run(PythonJob(big, timeout=60)).text == "big ok\n"
    with pytest.raises(ValueError, match="128 KiB"):
        ShellJob("echo " + "y" * 200_000)
    assert pool.run(ShellJob("echo still healthy")).text == "still healthy\n"


def test_wrong_job_type_and_closed_pool():
    own = ExecPool(workers=1)
    with pytest.raises(TypeError):
        own.run("echo hi")
    assert own.run(ShellJob("echo fine")).text == "fine\n"
    own.close()
    for call in (lambda: own.run(ShellJob("true")), lambda: own.stream(ShellJob("true"))):
        with pytest.raises(PoolClosedError, match="closed"):
            call()
    assert issubclass(PoolClosedError, ValueError) and issubclass(PoolClosedError, RuntimeError)


@pytest.mark.parametrize("kwargs, error", [
    (dict(workers=0), ValueError), (dict(workers="2"), TypeError),
    (dict(python="/nonexistent/python"), ValueError), (dict(limits=3), TypeError),
])
def test_bad_pool_arguments(kwargs, error):
    with pytest.raises(error):
        ExecPool(**kwargs)


def test_private_directory_is_removed_with_what_the_job_wrote(pool):
    result = pool.run(ShellJob("mkdir -p a/b && echo x > a/b/f && echo y > g && pwd"))
    workdir = result.output.strip()
    assert workdir and not os.path.exists(workdir)


def test_private_directory_replaced_by_a_symlink_is_removed_and_not_followed(pool, tmp_path):
    (tmp_path / "keep").write_text("mine")
    result = pool.run(ShellJob(f'd=$(pwd); cd /; rmdir "$d" && ln -s {tmp_path} "$d" && echo "$d"'))
    workdir = result.output.strip()
    assert workdir and not os.path.lexists(workdir)
    assert (tmp_path / "keep").read_text() == "mine"
