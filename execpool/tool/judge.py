"""The judge of function-style samples (``execpool eval``): the program a
batch of HumanEval-style or assert-style samples runs as, so that no
sample's code shares a process with the code that checks it, nor with
another sample.

Runs as a tool: a warm PythonJob (``execpool/eval/harness.py``
``judge_job``) imports it and calls ``main(N)``; the N samples' specs --
each its source, its tests and a nonce -- come as JSON on its stdin.

::

    the leader (the job's process)      a judge per sample          its sample
    ------------------------------      ------------------          ----------
    forks N judges before it reads  --> own process group; with     stdin, stdout,
    stdin (none holds a test);          N > 1 its own directory     stderr: /dev/null;
    non-dumpable; reads the specs;      and Landlock layer      --> gets its source;
    sends each judge its own, with      (execpool/sandbox/          runs it; says
    its clock; prints each verdict      rulesets.py); forks its     "ready" with the
    line as it comes, or kills a        sample, turns non-          names it defines;
    judge and its sample at its         dumpable, gets its spec,    answers calls:
    time limit (Time Limit              runs the tests: each call   plain data by value,
    Exceeded) or says how it died  <--  is a message to the    <--> anything else as
                                        sample; sends the verdicts  a handle
                                        up; kills its sample

Why a process for the sample: in one interpreter a sample can end it
early with exit code 0 (``sys.exit``, ``os._exit``, ``raise SystemExit``),
replace ``check`` or builtins, walk the stack up to the test's frame and
read the expected values, or print whatever line a harness looks for.
Here the tests and the nonce live only in the judges and the leader,
which the sample cannot read (they are non-dumpable, and under the
sandbox no tool holds a capability), and whose stdout it has no
descriptor of; the caller accepts a sample only on the line bearing its
nonce, printed only after its tests ran to their end. The calls between
a judge and its sample, and the verdicts of the tests that make them,
are execpool/tool/sample_calls.py.

Why a judge per sample, and a layer per judge: samples judged side by
side must not reach each other. Each pair has its own directory (the
sample's working directory, HOME and TMPDIR) and a Landlock layer that
reads the system but nothing of the job's writable places, and scopes
signals and abstract sockets to the pair -- so a sample may stop or kill
its own judge (its verdict says so), never a neighbour or the leader;
and each has its own time limit, kept by the leader.
"""

import ctypes
import json
import os
import select
import signal
import site
import struct
import sys
import tempfile
import time
import traceback
from typing import List

# Imported here, so that a pool preloading the judge has them in every
# warm job: how a batch's samples are kept apart.
from execpool.sandbox.enter import confine_again
from execpool.sandbox.rulesets import apart_grants, apart_ruleset
from execpool.tool.sample_calls import (
    MAX_MESSAGE_BYTES,
    Judge,
    SampleSide,
    read_exactly,
    receive,
    send,
    status_fields,
    verdicts,
    write_all,
)

#: The line the caller looks for: MARKER, the nonce, the verdicts.
MARKER = "\nEXECPOOL-JUDGE "

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38


def _send_json(fd, value):
    data = json.dumps(value).encode()
    write_all(fd, struct.pack("<Q", len(data)) + data)


def _null_stdio(fds=(0, 1, 2)):
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        os.dup2(null, fd)
    os.close(null)


class _Seat:
    """The leader's view of one sample's judge: its pid (and process
    group), the pipe its spec goes down, the pipe its verdicts come up,
    and its clock."""

    def __init__(self, pid, spec_w, said_r):
        self.pid = pid
        self.spec_w = spec_w
        self.said_r = said_r
        self.said = bytearray()
        self.started = 0.0
        self.deadline = 0.0
        self.spec = None


def _seat(index, apart, leaders):
    """Fork the judge of sample ``index`` (before the leader read any
    test); ``leaders``: the descriptors the leader holds of the judges
    forked before, which this one must not keep."""
    spec_r, spec_w = os.pipe()
    said_r, said_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (*leaders, spec_w, said_r):
                os.close(fd)
            _null_stdio((0,))  # the job's stdin is the leader's to read
            os.setpgid(0, 0)
            _sample_judge(index, apart, spec_r, said_w)
        except BaseException:  # noqa: BLE001 - the judge's own failure: the leader says Internal Error
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    try:
        os.setpgid(pid, pid)  # both sides, so that a kill at the deadline finds the group
    except OSError:
        pass
    os.close(spec_r)
    os.close(said_w)
    return _Seat(pid, spec_w, said_r)


def _sample_judge(index, apart, spec_r, said_w):
    """One sample's judge: its directory and its layer where samples share
    the job, its sample forked, then the spec, the tests, the verdicts
    sent up to the leader."""
    own = None
    failure = None
    if apart is not None:
        own = os.path.abspath(f"sample-{index}")
        try:
            os.mkdir(own, 0o700)
            if isinstance(apart, OSError):
                raise apart
            _keep_apart(own, apart)
        except OSError as exc:
            failure = {"verdict": "Internal Error", "message": f"the sample cannot be kept apart here: {exc}"}
    calls_read, calls_write = os.pipe()
    replies_read, replies_write = os.pipe()
    pid = -1 if failure else os.fork()
    if pid == 0:
        os.close(calls_write)
        os.close(replies_read)
        os.close(spec_r)
        os.close(said_w)
        _null_stdio()
        sys.stdin = open(os.devnull, encoding="utf-8")
        if own is not None:
            os.chdir(own)
            os.environ.update(HOME=own, TMPDIR=own)
            tempfile.tempdir = None
        SampleSide(calls_read, replies_write).run(receive(calls_read))
        os._exit(0)
    os.close(calls_read)
    os.close(replies_write)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    raw = read_exactly(spec_r, struct.unpack("<Q", read_exactly(spec_r, 8))[0])
    os.close(spec_r)
    spec = json.loads(raw)
    if failure is None:
        try:
            send(calls_write, spec["program"])
        except OSError:
            pass  # the sample is gone already: its greeting says so
        judge = Judge(pid, calls_write, replies_read)
        failure, tests = verdicts(judge, spec)
        ended = time.monotonic()
        judge.ended()
    else:
        tests, ended = [], time.monotonic()
    _send_json(said_w, {"failure": failure, "tests": tests, "ended": ended})
    os.close(said_w)


def _keep_apart(own, grants):
    """Enter a Landlock layer of this sample's own (execpool/sandbox/
    rulesets.py): its directory, the system read-only, nothing of the
    job's writable places, no signal out of it."""
    layer = apart_ruleset(grants, own)
    try:
        confine_again(layer)
    finally:
        os.close(layer)
        for fd, _ in grants:
            os.close(fd)


def _apart_grants():
    """What every sample of a batch may read (opened once, by the
    leader), or the OSError that says they cannot be kept apart here."""
    try:
        return apart_grants([os.getcwd(), tempfile.gettempdir(), os.environ.get("HOME") or os.getcwd(),
                             "/dev/shm"])
    except OSError as exc:
        return exc


def _leader(seats, specs):
    """Send each judge its spec, then print each sample's verdict line as
    its judge ends -- or when its time is up, having killed that judge and
    its sample: one sample's wait is never another's."""
    for seat, spec in zip(seats, specs, strict=True):
        seat.spec = spec
        seat.started = time.monotonic()
        seat.deadline = seat.started + float(spec["timeout"])
        try:
            _send_json(seat.spec_w, spec)
        except OSError:
            pass  # that judge died already: its end says how
        os.close(seat.spec_w)
    waiting = {seat.said_r: seat for seat in seats}
    while waiting:
        timeout = max(0.0, min(s.deadline for s in waiting.values()) - time.monotonic())
        ready, _, _ = select.select(list(waiting), [], [], timeout)
        for fd in ready:
            _take(waiting, waiting[fd])
        now = time.monotonic()
        for seat in [s for s in waiting.values() if s.deadline <= now]:
            # Woken late (a loaded machine): what the judge said is read
            # first, and counts if its tests ended in time.
            while seat.said_r in waiting and select.select([seat.said_r], [], [], 0)[0]:
                _take(waiting, seat)
            if seat.said_r in waiting:
                del waiting[seat.said_r]
                _kill_group(seat.pid)
                _report(seat, _said(seat), out_of_time=True)


def _take(waiting, seat):
    """Read what a judge sent; at its end, report."""
    chunk = os.read(seat.said_r, 1 << 16)
    if chunk and len(seat.said) + len(chunk) <= MAX_MESSAGE_BYTES:
        seat.said += chunk
        return
    del waiting[seat.said_r]
    if chunk:  # more than any verdict: a judge that went wrong
        _kill_group(seat.pid)
        seat.said.clear()
    _report(seat, _said(seat))


def _said(seat):
    """The judge's whole message, or None."""
    if len(seat.said) < 8 or struct.unpack("<Q", bytes(seat.said[:8]))[0] != len(seat.said) - 8:
        return None
    try:
        said = json.loads(bytes(seat.said[8:]))
    except ValueError:
        return None
    return said if isinstance(said, dict) else None


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _report(seat, said, out_of_time=False):
    """One sample's verdict line: what its judge said, if its tests ended
    within the sample's time (by the judge's clock, which is the
    leader's); else Time Limit Exceeded (``out_of_time``: killed at its
    deadline, having said nothing), or how the judge ended."""
    os.close(seat.said_r)
    _, status, usage = os.wait4(seat.pid, 0)
    elapsed = time.monotonic() - seat.started
    ended = said.pop("ended", None) if said is not None else None
    if said is not None and not (type(ended) is float and ended <= seat.deadline):
        said, out_of_time = None, True
    if out_of_time and said is None:
        limit = float(seat.spec["timeout"])
        said = {"failure": None, "tests": [{"verdict": "Time Limit Exceeded", "time_s": round(elapsed, 6),
                                            "message": f"Execution timed out after {limit:g} seconds."}]}
    elif said is None:
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) > 0:
            failure = {"verdict": "Internal Error", "message": "the sample's judge failed (its error is in the "
                       "job's output)"}
        else:
            failure = {"verdict": "Runtime Error", "message": "the judge was ended before its tests did",
                       **status_fields(status)}
        said = {"failure": failure, "tests": []}
    said["cost"] = {"time_s": round(elapsed, 6), "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
                    "max_rss_bytes": usage.ru_maxrss * 1024}
    write_all(1, (MARKER + seat.spec["nonce"] + " " + json.dumps(said) + "\n").encode())


def main(count=1):
    """Judge ``count`` samples, whose specs come as a JSON list on stdin:
    each in a process of its own beside a judge of its own, side by side,
    each against its own time limit; with more than one, each pair in a
    directory and a Landlock layer of its own."""
    # Nothing the sample writes may be imported here: it could plant a
    # module in the job's directory, its /tmp or the user's site-packages
    # before the tests import theirs. (The rest of sys.path is read-only in
    # the sandbox.)
    writable = tuple(os.path.join(os.path.abspath(p), "") for p in (os.getcwd(), tempfile.gettempdir(),
                                                                    site.getusersitepackages()))
    sys.path[:] = [p for p in sys.path if p and not os.path.join(os.path.abspath(p), "").startswith(writable)]
    apart = None
    if count > 1:
        # What Landlock needs of a process without capabilities (the
        # sandbox set it already; a job without one has not).
        ctypes.CDLL(None).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        apart = _apart_grants()
    seats: List[_Seat] = []
    for index in range(count):
        seats.append(_seat(index, apart, [fd for seat in seats for fd in (seat.spec_w, seat.said_r)]))
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    specs = json.loads(sys.stdin.read())
    os.close(0)
    if not isinstance(specs, list) or len(specs) != count:
        raise ValueError(f"{count} specs expected on stdin")
    _leader(seats, specs)
    os._exit(0)


if __name__ == "__main__":
    main()
