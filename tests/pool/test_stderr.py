"""``separate_stderr=True``: a job's stdout and stderr kept apart, each decoded
and bounded as the merged output is (SPEC §2), for shell, cold and warm
Python jobs, under both spawn methods -- and the default left as it was."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess

import pytest

from execpool import TOOL_OUTPUT_STREAM_MAX_CHARS, JobOutput, Limits, OutputCapped, PythonJob, ShellJob, Status
from execpool.shared import worker_wire
from tests.support.helpers import all_dead, collect, pids_in, wait_for, worker_records

BASH = shutil.which("bash")
WARMTH = pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])

#: Shell commands whose two streams must come out as ``communicate()`` gives
#: them from two pipes.
APART = {
    "interleaved": "for i in 1 2 3; do echo out $i; echo err $i >&2; done",
    "invalid utf-8 on stderr": "printf 'ok\\n'; printf '\\xff\\xfe bad \\xc3\\n' >&2",
    "universal newlines on stderr": "printf 'a\\r\\nb\\rc' >&2; printf 'x\\r\\n'",
    "a carriage return last on stderr": "printf 'end\\r' >&2",
    # Half a character on stderr, a whole line on stdout, then the other
    # half: each stream is decoded on its own.
    "a character split around stdout": "printf '\\xe6\\x97' >&2; echo plain; printf '\\xa5\\n' >&2",
    "only stderr, failing": "echo nothing here >&2; exit 4",
    "neither": "true",
}


def communicate(command: str, merged: bool = False) -> tuple[str, str, int, int]:
    """What SPEC §2 names as the reference: stdout, stderr (merged into
    stdout when asked), exit code, and the raw bytes of both."""
    stderr = subprocess.STDOUT if merged else subprocess.PIPE
    raw = subprocess.run([BASH, "-c", command], stdout=subprocess.PIPE, stderr=stderr, check=False)
    with subprocess.Popen([BASH, "-c", command], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          encoding="utf-8", errors="replace") as proc:
        out, err = proc.communicate(timeout=30)
    return out, err or "", proc.returncode, len(raw.stdout) + len(raw.stderr or b"")


def run(pool, job, timeout: float = 60):
    """The job's Result and the live events it produced on the way."""
    events = []
    result = pool.submit(job, on_event=events.append).result(timeout=timeout)
    return result, events


def live(events: list, stream: str) -> str:
    return "".join(e.text for e in events if isinstance(e, JobOutput) and e.stream == stream)


@pytest.mark.parametrize("name", sorted(APART))
def test_shell_streams_come_apart_as_communicate_gives_them(pool, name):
    out, err, code, raw = communicate(APART[name])
    result, events = run(pool, ShellJob(APART[name], separate_stderr=True))
    assert (result.output, result.stderr, result.exit_code) == (out, err, code)
    assert (result.output_chars, result.stderr_chars, result.output_bytes) == (len(out), len(err), raw)
    assert (live(events, "stdout"), live(events, "stderr")) == (out, err)
    assert result.text == ((out if out.strip() else "(no output)") if code == 0 else f"Exit code {code}:\n{out}")


@pytest.mark.parametrize("name", sorted(APART))
def test_the_default_still_merges_both_streams_into_output(pool, name):
    out, _, code, raw = communicate(APART[name], merged=True)
    result, events = run(pool, ShellJob(APART[name]))
    assert (result.output, result.output_chars, result.exit_code, result.output_bytes) == (out, len(out), code, raw)
    assert (result.stderr, result.stderr_chars) == ("", 0)
    assert {e.stream for e in events} <= {"stdout"} and live(events, "stdout") == out


@WARMTH
def test_python_prints_come_apart_unflushed_and_a_traceback_goes_to_stderr(pool, warm):
    code = ("import sys\nfor i in range(3):\n    print('out', i)\n    print('err', i, file=sys.stderr)\n"
            "sys.stdout.write('no newline')\nraise ValueError('boom')")
    result, events = run(pool, PythonJob(code, separate_stderr=True, warm=warm))
    assert result.output == "out 0\nout 1\nout 2\nno newline"
    assert result.stderr.startswith("err 0\nerr 1\nerr 2\nTraceback (most recent call last):\n")
    assert result.stderr.endswith("ValueError: boom\n")
    assert (result.status, result.exit_code) == (Status.ERROR, 1)
    assert result.text == "Exit code 1:\nout 0\nout 1\nout 2\nno newline"
    assert (live(events, "stdout"), live(events, "stderr")) == (result.output, result.stderr)


@WARMTH
def test_the_default_python_job_still_merges_in_order(pool, warm):
    code = "import sys\nfor i in range(3):\n    print('out', i)\n    print('err', i, file=sys.stderr)"
    result, events = run(pool, PythonJob(code, warm=warm))
    assert result.output == "out 0\nerr 0\nout 1\nerr 1\nout 2\nerr 2\n"
    assert (result.stderr, result.stderr_chars, result.output_bytes) == ("", 0, len(result.output))
    assert {e.stream for e in events} == {"stdout"}


@WARMTH
def test_live_output_of_both_streams_arrives_while_the_tool_runs(pool, warm, tmp_path):
    gate = tmp_path / "gate"
    code = (f"import os, sys, time\nprint('to out')\nprint('to err', file=sys.stderr)\n"
            f"while not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nprint('after', file=sys.stderr)")
    events = []
    future = pool.submit(PythonJob(code, cwd=str(tmp_path), separate_stderr=True, warm=warm),
                         on_event=events.append)
    assert wait_for(lambda: live(events, "stdout") == "to out\n" and live(events, "stderr") == "to err\n",
                    timeout=30)
    assert not future.done()  # it is provably still waiting on us
    gate.touch()
    result = future.result(timeout=30)
    assert (result.output, result.stderr) == ("to out\n", "to err\nafter\n")
    assert all(isinstance(e, JobOutput) and e.stream in ("stdout", "stderr") for e in events)
    assert (live(events, "stdout"), live(events, "stderr")) == (result.output, result.stderr)


@WARMTH
def test_a_stderr_flood_is_bounded_and_counted_whole(pool, warm):
    code = "import sys\nfor _ in range(300):\n    sys.stderr.write('é' * 1000)\nprint('done')"
    result, _ = run(pool, PythonJob(code, max_output_chars=1000, separate_stderr=True, warm=warm))
    assert (result.stderr, result.stderr_chars) == ("é" * 1000, 300_000)
    assert (result.output, result.output_chars) == ("done\n", 5)
    assert result.output_bytes == 2 * 300_000 + 5
    assert not result.truncated and result.text == "done\n"


def test_a_shell_flood_on_stderr_past_the_head(pool):
    job = ShellJob("head -c 5000000 /dev/zero | tr '\\0' e >&2; echo ok", max_output_chars=100,
                   separate_stderr=True)
    result, _ = run(pool, job)
    assert (result.stderr, result.stderr_chars) == ("e" * 100, 5_000_000)
    assert (result.output, result.output_bytes, result.status) == ("ok\n", 5_000_003, Status.OK)


def test_the_live_cap_counts_both_streams_together(pool):
    command = "head -c 300000 /dev/zero | tr '\\0' o; head -c 300000 /dev/zero | tr '\\0' e >&2"
    result, events = run(pool, ShellJob(command, separate_stderr=True))
    outputs = [e for e in events if isinstance(e, JobOutput)]
    assert sum(len(e.text) for e in outputs) == TOOL_OUTPUT_STREAM_MAX_CHARS
    assert events[-1] == OutputCapped(TOOL_OUTPUT_STREAM_MAX_CHARS) and len(outputs) == len(events) - 1
    # Which pipe the worker reads first is its own business; the two add up.
    assert set(live(events, "stdout")) == {"o"} and set(live(events, "stderr")) == {"e"}
    assert (result.output_chars, result.stderr_chars, result.output_bytes) == (300_000, 300_000, 600_000)


TIMED_OUT = {
    "shell": lambda: ShellJob("echo out; echo err >&2; exec sleep 60", timeout=1, separate_stderr=True),
    "cold python": lambda: PythonJob("import sys, time\nprint('out')\nprint('err', file=sys.stderr)\ntime.sleep(60)",
                                     timeout=1, separate_stderr=True),
    "warm python": lambda: PythonJob("import sys, time\nprint('out')\nprint('err', file=sys.stderr)\ntime.sleep(60)",
                                     timeout=1, separate_stderr=True, warm=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(TIMED_OUT))
def test_a_timeout_keeps_what_both_streams_said_so_far(pool, kind):
    result, events = run(pool, TIMED_OUT[kind]())
    assert (result.status, result.timed_out) == (Status.TIMEOUT, True)
    assert result.text == "Execution timed out after 1 seconds."
    assert (result.output, result.stderr) == ("out\n", "err\n")
    assert (live(events, "stdout"), live(events, "stderr")) == ("out\n", "err\n")


def _after_the_leader(leader: str, stream: str) -> str:
    """A background process that holds only ``stream`` open and writes to
    it once the job's leader is gone."""
    other, fd = ("1", "2") if stream == "stderr" else ("2", "1")
    return f"( while kill -0 {leader} 2>/dev/null; do sleep 0.01; done; echo late >&{fd} ) {other}>/dev/null &"


def _late_writer(kind: str, stream: str):
    """A job that prints "early" and leaves a background process writing
    "late" on ``stream`` after the job's leader exited."""
    if kind == "shell":
        return ShellJob(f"{_after_the_leader('$$', stream)}\necho early", timeout=None, separate_stderr=True)
    background = _after_the_leader("%d", stream)
    code = f"import os, subprocess\nsubprocess.Popen([{BASH!r}, '-c', {background!r} % os.getpid()])\nprint('early')"
    return PythonJob(code, timeout=None, separate_stderr=True, warm=kind == "warm python")


@pytest.mark.parametrize("stream", ["stderr", "stdout"])
@pytest.mark.parametrize("kind", ["shell", "cold python", "warm python"])
def test_without_timeout_the_job_waits_for_eof_on_both_streams(pool, kind, stream):
    """SPEC §2.3 per stream: a background process that holds one stream
    after the leader exited is waited for, and what it writes then is in
    the Result and live."""
    result, events = run(pool, _late_writer(kind, stream))
    late_in, other = (result.stderr, result.output) if stream == "stderr" else (result.output, result.stderr)
    assert "late\n" in late_in and "late" not in other
    assert "early\n" in result.output and (result.status, result.exit_code) == (Status.OK, 0)
    assert "late\n" in live(events, stream)


@pytest.mark.slow
def test_a_timeout_kills_a_grandchild_that_holds_stderr(pool):
    command = "( echo PIDS $BASHPID >&2; exec sleep 60 ) >/dev/null &\necho leader done"
    result, _ = run(pool, ShellJob(command, timeout=1, separate_stderr=True))
    assert (result.status, result.output) == (Status.TIMEOUT, "leader done\n")
    grandchild = pids_in(result.stderr)
    assert len(grandchild) == 1 and all_dead(grandchild)


SIGNALLED = {
    "python exit 3": ("import sys\nprint('o')\nprint('e', file=sys.stderr)\nsys.exit(3)", 3, None),
    "python SIGKILL": ("import os, sys\nprint('o')\nprint('e', file=sys.stderr)\nos.kill(os.getpid(), 9)", -9,
                       "SIGKILL"),
    "python SystemExit message": ("print('o')\nraise SystemExit('e')", 1, None),
}


@WARMTH
@pytest.mark.parametrize("name", sorted(SIGNALLED))
def test_exit_codes_and_signals_with_streams_apart(pool, warm, name):
    code, exit_code, signal_name = SIGNALLED[name]
    result, _ = run(pool, PythonJob(code, separate_stderr=True, warm=warm))
    assert (result.output, result.stderr) == ("o\n", "e\n")
    assert (result.status, result.exit_code, result.signal_name) == (Status.ERROR, exit_code, signal_name)
    assert result.text == f"Exit code {exit_code}:\no\n"


def test_a_shell_killed_by_a_signal_keeps_both_streams(pool):
    result, _ = run(pool, ShellJob("echo o; echo e >&2; kill -SEGV $$", separate_stderr=True))
    assert (result.output, result.stderr, result.exit_code, result.signal_name) == ("o\n", "e\n", -11, "SIGSEGV")


def test_error_lines_come_from_stderr_too(pool):
    result, _ = run(pool, ShellJob("cat /mnt/data/missing.csv", separate_stderr=True))
    assert result.output == "" and "No such file or directory" in result.stderr
    assert result.error_lines == (result.stderr.rstrip("\n"),)


@WARMTH
def test_error_lines_from_both_streams_past_the_head(pool, warm):
    code = ("import sys\nprint('FileNotFoundError: said on stdout')\nsys.stderr.write('x' * 5000 + '\\n')\n"
            "open('/mnt/data/nope.csv')")
    result, _ = run(pool, PythonJob(code, max_output_chars=100, separate_stderr=True, warm=warm))
    assert result.stderr == "x" * 100 and result.stderr_chars > 5000
    assert set(result.error_lines) == {"FileNotFoundError: said on stdout",
                                       "FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/nope.csv'"}


@WARMTH
@pytest.mark.parametrize("separate", [False, True], ids=["merged", "apart"])
def test_output_bytes_counts_raw_bytes_of_multibyte_output(pool, warm, separate):
    code = "import sys\nprint('é✓日本')\nsys.stderr.buffer.write(b'\\xff\\xf0\\x9f\\x98\\x80\\n')"
    result, _ = run(pool, PythonJob(code, max_output_chars=2, separate_stderr=separate, warm=warm))
    assert result.output_bytes == len("é✓日本\n".encode()) + 6
    if separate:
        assert (result.output, result.output_chars) == ("é✓", 5)
        assert (result.stderr, result.stderr_chars) == ("\ufffd😀", 3)
    else:
        assert (result.output, result.output_chars, result.stderr) == ("é✓", 8, "")


def test_streaming_returns_the_same_result_as_run(pool):
    job = ShellJob("echo out; printf 'err \\xff\\n' >&2; cat /mnt/data/x; exit 2", separate_stderr=True)
    plain = pool.run(job)
    _, streamed = collect(pool.stream(job, heartbeat_interval_s=0.05))
    for field in ("text", "output", "stderr", "exit_code", "output_chars", "stderr_chars", "output_bytes",
                  "error_lines"):
        assert getattr(streamed, field) == getattr(plain, field), field


def test_cancel_kills_a_job_with_streams_apart_promptly(pool):
    events = []
    future = pool.submit(ShellJob("echo started >&2; exec sleep 60", separate_stderr=True), on_event=events.append)
    assert wait_for(lambda: live(events, "stderr") == "started\n", timeout=30)
    future.cancel()
    result = future.result(timeout=5)
    assert (result.status, result.stderr, result.text) == (Status.CANCELLED, "started\n", "Execution cancelled.")


def _worker_pipes(pool) -> int:
    """The pipes the pool's workers hold: a tool's output pipes are the only
    ones that come and go with jobs."""
    count = 0
    for worker in worker_records(pool):
        for name in os.listdir(f"/proc/{worker.pid}/fd"):
            try:
                count += os.readlink(f"/proc/{worker.pid}/fd/{name}").startswith("pipe:")
            except OSError:
                continue
    return count


def test_every_pipe_of_every_ending_is_closed(pool):
    """Exit, EOF after the leader, timeout, cancel and death in exec, cold
    and warm, streams apart and merged: the workers end with the pipes they
    had before."""
    pool.run(PythonJob("pass", warm=True))
    before = _worker_pipes(pool)
    jobs = [
        ShellJob("echo o; echo e >&2", separate_stderr=True),
        ShellJob("echo o; echo e >&2"),
        _late_writer("shell", "stderr"),
        ShellJob("exec sleep 60", timeout=0.5, separate_stderr=True),
        PythonJob("import sys\nprint('e', file=sys.stderr)", separate_stderr=True, warm=True),
        PythonJob("import time\ntime.sleep(60)", timeout=0.5, separate_stderr=True, warm=True),
        ShellJob("true", limits=Limits(address_space=4096), separate_stderr=True),  # dies in its exec
    ]
    results = [future.result(timeout=60) for future in [pool.submit(job) for job in jobs]]
    assert [r.status for r in results] == [Status.OK, Status.OK, Status.OK, Status.TIMEOUT, Status.OK,
                                           Status.TIMEOUT, Status.ERROR]
    events = []
    cancelled = pool.submit(PythonJob("import sys, time\nprint('x', file=sys.stderr)\ntime.sleep(60)",
                                      separate_stderr=True, warm=True), on_event=events.append)
    assert wait_for(lambda: bool(events), timeout=30)
    cancelled.cancel()
    assert cancelled.result(timeout=5).status is Status.CANCELLED
    assert wait_for(lambda: _worker_pipes(pool) == before, timeout=5), (_worker_pipes(pool), before)


@pytest.mark.parametrize("kind", [PythonJob, ShellJob])
def test_separate_stderr_must_be_a_bool(kind):
    with pytest.raises(TypeError, match="separate_stderr must be a bool"):
        kind("print(1)", separate_stderr="yes")
    assert kind("print(1)").separate_stderr is False


def test_the_channel_refuses_output_of_a_stream_no_job_has():
    """A worker's Output names one of the two streams or it is forged."""
    assert worker_wire.decode(pickle.dumps(worker_wire.Output(1, "x", "stderr"))).stream == "stderr"
    with pytest.raises(worker_wire.ChannelError, match="stream has the wrong type"):
        worker_wire.decode(pickle.dumps(worker_wire.Output(1, "x", "stdin")))
