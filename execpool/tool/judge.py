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
nonce, printed only after its tests ran to their end. Values come back
as plain data (exact builtin types: a subclass is cast to its base,
anything else is a handle compared by identity), so an object whose
``__eq__`` always says True compares as what it is.

Why a judge per sample, and a layer per judge: samples judged side by
side must not reach each other. Each pair has its own directory (the
sample's working directory, HOME and TMPDIR) and a Landlock layer that
reads the system but nothing of the job's writable places, and scopes
signals and abstract sockets to the pair -- so a sample may stop or kill
its own judge (its verdict says so), never a neighbour or the leader;
and each has its own time limit, kept by the leader.
"""

import builtins
import ctypes
import importlib
import io
import json
import os
import pickle
import resource
import select
import signal
import site
import struct
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Tuple

# Imported here, so that a pool preloading the judge has them in every
# warm job: how a batch's samples are kept apart.
from execpool.sandbox.enter import confine_again
from execpool.sandbox.rulesets import apart_grants, apart_ruleset

#: The line the caller looks for: MARKER, the nonce, the verdicts.
MARKER = "\nEXECPOOL-JUDGE "

#: The largest message either side reads (a sample returning a huge value
#: fails its test rather than filling the judge's memory).
MAX_MESSAGE_BYTES = 64 << 20

#: Characters of a value, a message or a traceback kept in a verdict.
SHOWN = 2000

#: Types that cross between the two processes by value, as themselves.
PLAIN: Tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes)
CONTAINERS: Tuple[type, ...] = (list, tuple, set, frozenset, dict)

#: How deep a value may nest before its inner part becomes a handle.
MAX_DEPTH = 200

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38


class Handle:
    """A value of the sample's that is not plain data, on the judge's side:
    it can be passed back to the sample, called (in the sample's process),
    and equals only itself."""

    __slots__ = ("ident", "kind", "judge")

    def __init__(self, ident, kind, judge):
        self.ident = ident
        self.kind = kind
        self.judge = judge

    def __call__(self, *args, **kwargs):
        return self.judge.call(self, args, kwargs)

    def __repr__(self):
        return f"<{self.kind} of the sample>"


class SampleError(Exception):
    """What the sample's code raised in a call, re-raised in the judge."""

    def __init__(self, kind, message, trace):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.trace = trace


class ProblemError(Exception):
    """The problem's own code (a prompt, a setup) does not run: nothing of
    the sample's is judged."""


class SampleGone(Exception):
    """The sample's process ended (or spoke out of turn) during a call."""


# -- the wire: a length-prefixed pickle each way ------------------------------------------


def _send(fd, obj, pickler=pickle.Pickler):
    buffer = io.BytesIO()
    pickler(buffer, protocol=4).dump(obj)
    data = buffer.getvalue()
    _write_all(fd, struct.pack("<Q", len(data)) + data)


def _receive(fd, unpickler=pickle.Unpickler):
    size = struct.unpack("<Q", _read_exactly(fd, 8))[0]
    if size > MAX_MESSAGE_BYTES:
        raise SampleGone(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    return unpickler(io.BytesIO(_read_exactly(fd, size))).load()


def _read_exactly(fd, size):
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise SampleGone("its process ended")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class _FromSample(pickle.Unpickler):
    """Plain data only: no class, no function, no reduce but ``complex``;
    a handle comes as a persistent id."""

    def __init__(self, buffer, judge):
        super().__init__(buffer)
        self.judge = judge

    def find_class(self, module, name):
        if (module, name) == ("builtins", "complex"):
            return complex
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 2 or type(pid[0]) is not int
                or type(pid[1]) is not str):
            raise pickle.UnpicklingError("a malformed handle")
        return Handle(pid[0], pid[1][:100], self.judge)


class _ToSample(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.ident if type(obj) is Handle else None


# -- the sample's side ---------------------------------------------------------------------


class _Ref:
    """A value of the sample's that goes to the judge as a handle."""

    def __init__(self, ident, kind):
        self.ident = ident
        self.kind = kind


class _ToJudge(pickle.Pickler):
    def persistent_id(self, obj):
        return (obj.ident, obj.kind) if type(obj) is _Ref else None


class _FromJudge(pickle.Unpickler):
    def __init__(self, buffer, objects):
        super().__init__(buffer)
        self.objects = objects

    def persistent_load(self, pid):
        return self.objects[pid]


class _SampleSide:
    def __init__(self, calls, replies):
        self.calls = calls
        self.replies = replies
        self.objects = {}

    def plain(self, value: Any, depth=0, seen=None):
        """``value`` as exact builtin types, a handle for anything else."""
        kind = type(value)
        if kind in PLAIN:
            return value
        for base in PLAIN[1:]:
            if isinstance(value, base) and depth < MAX_DEPTH:
                return base(value)
        if isinstance(value, CONTAINERS) and depth < MAX_DEPTH:
            seen = set() if seen is None else seen
            if id(value) in seen:
                return self.ref(value)
            seen.add(id(value))
            try:
                if isinstance(value, dict):
                    return {self.plain(k, depth + 1, seen): self.plain(v, depth + 1, seen)
                            for k, v in dict.items(value)}
                members: Any = value  # one of CONTAINERS: iterable
                items = [self.plain(item, depth + 1, seen) for item in members]
                for base in CONTAINERS:
                    if isinstance(value, base):
                        return base(items)
            finally:
                seen.discard(id(value))
        return self.ref(value)

    def ref(self, value):
        ident = len(self.objects)
        self.objects[ident] = value
        return _Ref(ident, type(value).__name__)

    def unpickler(self, buffer):
        return _FromJudge(buffer, self.objects)

    def reply(self, message, cost=None):
        """``message``, and for a call what it cost (CPU seconds, the
        process's peak resident bytes): as the sample's process says it."""
        if cost is not None:
            message = (*message, cost)
        try:
            _send(self.replies, message, _ToJudge)
        except Exception:  # noqa: BLE001 - a value that plain() let through but pickle refuses
            failed = ("raised", "TypeError", "the value could not be sent to the judge", "")
            _send(self.replies, failed if cost is None else (*failed, cost), _ToJudge)

    def run(self, source):
        namespace: Dict[str, Any] = {"__name__": "__sample__", "__builtins__": builtins}
        try:  # where a traceback's lines are read from
            with open(SAMPLE_FILE, "w", encoding="utf-8") as f:
                f.write(source)
        except OSError:
            pass
        try:
            code = compile(source, "sample.py", "exec")
        except (SyntaxError, ValueError) as exc:
            self.reply(("compile", type(exc).__name__, _cut(str(exc))))
            return
        try:
            exec(code, namespace)
        except BaseException as exc:  # noqa: BLE001 - the sample's own failure, reported as such
            self.reply(("failed", type(exc).__name__, _cut(str(exc)), _trace(exc)))
            return
        functions = sorted(name for name, value in namespace.items()
                           if callable(value) and not name.startswith("__") and not isinstance(value, type(os)))
        modules = sorted((name, value.__name__) for name, value in namespace.items()
                         if isinstance(value, type(os)) and isinstance(getattr(value, "__name__", None), str))
        self.reply(("ready", functions, modules))
        while True:
            try:
                target, args, kwargs = _receive(self.calls, self.unpickler)
            except SampleGone:
                return
            before = _cpu()
            try:
                function = namespace[target] if isinstance(target, str) else target
                value = self.plain(function(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - sys.exit() in a call is the call's outcome
                self.reply(("raised", type(exc).__name__, _cut(str(exc)), _trace(exc)), _cost(before))
                continue
            self.reply(("value", value), _cost(before))


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cost(before):
    return (_cpu() - before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _trace(exc):
    """The traceback from the sample's first frame on (the judge's own is
    the first, which calls it)."""
    first = exc.__traceback__
    return _cut("".join(traceback.format_exception(type(exc), exc, first.tb_next if first else None)))


def _cut(text):
    return text if len(text) <= SHOWN else text[:SHOWN] + "..."


# -- the judge's side ----------------------------------------------------------------------


class _Remote:
    """One of the sample's functions, called from the tests."""

    def __init__(self, judge, name):
        self.judge = judge
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        return self.judge.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<the sample's {self.__name__}>"


class _Judge:
    def __init__(self, pid, calls, replies):
        self.pid = pid
        self.calls = calls
        self.replies = replies
        self.last_call = None
        self.status = None  # how the sample's process ended, once it is reaped
        self.spent = [0.0, 0]  # the current test's calls: CPU seconds, peak resident bytes

    def unpickler(self, buffer):
        return _FromSample(buffer, self)

    def call(self, target, args, kwargs):
        shown = ", ".join([*map(_shown, args), *(f"{k}={_shown(v)}" for k, v in kwargs.items())])
        self.last_call = {"input": f"{target}({shown})", "actual": None}
        try:
            _send(self.calls, (target, args, kwargs), _ToSample)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"a test passed the sample what cannot be sent to it: {exc}") from None
        except OSError:
            raise SampleGone("its process ended") from None
        try:
            reply = _receive(self.replies, self.unpickler)
        except Exception as exc:  # noqa: BLE001 - the sample's bytes, as for its greeting
            raise SampleGone(f"it sent what is not a reply ({exc})") from None
        if type(reply) is tuple and len(reply) == 3 and reply[0] == "value":
            self.count(reply[2])
            value = reply[1]
            self.last_call["actual"] = _shown(value)
            return value
        if type(reply) is tuple and len(reply) == 5 and reply[0] == "raised":
            self.count(reply[4])
            raise SampleError(*(str(part) for part in reply[1:4]))
        raise SampleGone("it sent what is not a reply")

    def count(self, cost):
        """Add a call's cost to the test's, where it is two numbers."""
        if (type(cost) is tuple and len(cost) == 2 and type(cost[0]) in (int, float) and type(cost[1]) is int
                and cost[0] >= 0 and cost[1] >= 0):
            self.spent[0] += cost[0]
            self.spent[1] = max(self.spent[1], cost[1])

    def costs(self, started):
        """The test's time, and its calls' CPU and peak memory."""
        return {"time_s": round(time.monotonic() - started, 6), "cpu_s": round(self.spent[0], 6),
                "memory_bytes": self.spent[1] or None}

    def ended(self):
        """How the sample's process ended, once it has (it is killed first)."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.status = os.waitpid(self.pid, 0)[1]
        return self.status


def _shown(value):
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails says so
        text = "<unprintable>"
    return _cut(text)


def _outcome(exc, judge, started, where):
    """A test's verdict from what it raised."""
    test = {**judge.costs(started), **(judge.last_call or {})}
    if where is not None:
        test["expected"] = where
    if isinstance(exc, SampleError):
        memory = exc.kind == "MemoryError"
        return {**test, "verdict": "Memory Limit Exceeded" if memory else "Runtime Error",
                "message": f"{exc.kind}: {exc.message}", "trace": exc.trace}
    if isinstance(exc, SampleGone):
        status = judge.ended()
        return {**test, "verdict": "Runtime Error", "message": f"the sample's process ended during the test: {exc}",
                **_status_fields(status)}
    if isinstance(exc, AssertionError):
        return {**test, "verdict": "Wrong Answer", "message": _cut(str(exc)) or "an assertion failed"}
    return {**test, "verdict": "Wrong Answer", "message": f"{type(exc).__name__}: {_cut(str(exc))}"}


def _status_fields(status):
    if os.WIFSIGNALED(status):
        return {"signal": signal.Signals(os.WTERMSIG(status)).name if os.WTERMSIG(status) in
                {s.value for s in signal.Signals} else str(os.WTERMSIG(status))}
    return {"exit_code": os.WEXITSTATUS(status)}


def _failing_line(exc, filename, lines):
    """The test's source line an exception came from (the expectation)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == filename and frame.lineno and frame.lineno <= len(lines):
            return lines[frame.lineno - 1].strip()
    return None


def _run_tests(judge, spec, namespace):
    tests = []
    if spec["kind"] == "function":
        units = [("test.py", spec["test"] + f"\ncheck({spec['entry_point']})\n")]
    else:
        units = [(f"test_{number}.py", line) for number, line in enumerate(spec["asserts"])]
    for filename, source in units:
        judge.last_call = None
        judge.spent = [0.0, 0]
        started = time.monotonic()
        try:
            exec(compile(source, filename, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - every way a test fails is a verdict
            tests.append(_outcome(exc, judge, started, _failing_line(exc, filename, source.splitlines())))
            if isinstance(exc, SampleGone) or not spec["all"]:
                break
            continue
        tests.append({"verdict": "Accepted", **judge.costs(started)})
    return tests


def _namespace(judge, spec, functions, modules):
    """The tests' globals: the problem's own definitions (the prompt, the
    setup), the modules the sample imported, and its functions as remote
    calls -- for function-style problems, the entry point alone."""
    namespace = {"__name__": "__test__", "__builtins__": builtins}
    try:
        exec(compile(spec.get("setup") or "", "setup.py", "exec"), namespace)
    except Exception as exc:  # noqa: BLE001 - the problem's, not the sample's: never scored
        raise ProblemError(f"the problem's own code failed: {type(exc).__name__}: {_cut(str(exc))}") from None
    for name, module in modules:
        # The standard library's only, and never a ``__main__``: importing
        # what the sample names runs that module's code here. Whatever that
        # import does (``venv.__main__`` raised SystemExit, which killed the
        # judge: an Internal Error the sample chose, never scored) leaves
        # the name undefined.
        if (name not in namespace and module.partition(".")[0] in sys.stdlib_module_names
                and "__main__" not in module.split(".")):
            try:
                namespace[name] = importlib.import_module(module)
            except BaseException:  # noqa: BLE001 - see above
                pass
    if spec["kind"] == "function":
        namespace[spec["entry_point"]] = _Remote(judge, spec["entry_point"])
        return namespace
    for name in functions:
        # Never a builtin's name: ``assert set(f(x)) == set(y)`` would call
        # the sample's ``set`` on both sides and pass whatever ``f`` says.
        if name not in namespace and not hasattr(builtins, name):
            namespace[name] = _Remote(judge, name)
    return namespace


def _verdicts(judge, spec):
    """A failure before any test (or None), and each test's verdict."""
    try:
        hello = _receive(judge.replies, judge.unpickler)
    except Exception as exc:  # noqa: BLE001 - the sample's bytes: whatever fails to read them is its failure
        return {"verdict": "Runtime Error", "message": f"the sample ended before its tests ran ({exc})",
                **_status_fields(judge.ended())}, []
    if type(hello) is tuple and len(hello) == 3 and hello[0] == "compile":
        return {"verdict": "Compilation Error", "message": f"{hello[1]}: {hello[2]}"}, []
    if type(hello) is tuple and len(hello) == 4 and hello[0] == "failed":
        verdict = "Memory Limit Exceeded" if hello[1] == "MemoryError" else "Runtime Error"
        return {"verdict": verdict, "message": f"{hello[1]}: {hello[2]}", "trace": str(hello[3])}, []
    if not (type(hello) is tuple and len(hello) == 3 and hello[0] == "ready"):
        return {"verdict": "Runtime Error", "message": "the sample sent what is not a greeting"}, []
    functions = [name for name in hello[1] if type(name) is str]
    modules = [pair for pair in hello[2] if type(pair) is tuple and len(pair) == 2
               and all(type(part) is str for part in pair)]
    try:
        namespace = _namespace(judge, spec, functions, modules)
    except ProblemError as exc:
        return {"verdict": "Internal Error", "message": str(exc)}, []
    return None, _run_tests(judge, spec, namespace)


# -- a batch: the leader, a judge per sample, each judge's sample ----------------------------------

#: The sample's source, in its own directory, as tracebacks read it back.
SAMPLE_FILE = "sample.py"


def _send_json(fd, value):
    data = json.dumps(value).encode()
    _write_all(fd, struct.pack("<Q", len(data)) + data)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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
        _SampleSide(calls_read, replies_write).run(_receive(calls_read))
        os._exit(0)
    os.close(calls_read)
    os.close(replies_write)
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    raw = _read_exactly(spec_r, struct.unpack("<Q", _read_exactly(spec_r, 8))[0])
    os.close(spec_r)
    spec = json.loads(raw)
    if failure is None:
        try:
            _send(calls_write, spec["program"])
        except OSError:
            pass  # the sample is gone already: its greeting says so
        judge = _Judge(pid, calls_write, replies_read)
        failure, tests = _verdicts(judge, spec)
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
                       **_status_fields(status)}
        said = {"failure": failure, "tests": []}
    said["cost"] = {"time_s": round(elapsed, 6), "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
                    "max_rss_bytes": usage.ru_maxrss * 1024}
    _write_all(1, (MARKER + seat.spec["nonce"] + " " + json.dumps(said) + "\n").encode())


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
