"""A sample's functions called from the process of its judge: both ends
of the calls, the wire between them, and the tests that make them, with
the verdicts they give (execpool/tool/judge.py says why the sample has a
process of its own, and how a batch's judges are kept apart).

Runs in tool processes, beside untrusted code: ``SampleSide`` in the
sample's process, where the sample's code runs; ``Judge`` and the tests in
its judge's, which the sample reaches only through this wire -- plain data
by value (exact builtin types: a subclass is cast to its base), anything
else as a ``Handle`` that calls back into the sample's process and equals
only itself, so an object whose ``__eq__`` always says True compares as
what it is.
"""

import builtins
import importlib
import io
import os
import pickle
import resource
import signal
import struct
import sys
import time
import traceback
from typing import Any, Dict, Tuple

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


#: The sample's source, in its own directory, as tracebacks read it back.
SAMPLE_FILE = "sample.py"


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


def send(fd, obj, pickler=pickle.Pickler):
    buffer = io.BytesIO()
    pickler(buffer, protocol=4).dump(obj)
    data = buffer.getvalue()
    write_all(fd, struct.pack("<Q", len(data)) + data)


def receive(fd, unpickler=pickle.Unpickler):
    size = struct.unpack("<Q", read_exactly(fd, 8))[0]
    if size > MAX_MESSAGE_BYTES:
        raise SampleGone(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    return unpickler(io.BytesIO(read_exactly(fd, size))).load()


def read_exactly(fd, size):
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


class SampleSide:
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
            send(self.replies, message, _ToJudge)
        except Exception:  # noqa: BLE001 - a value that plain() let through but pickle refuses
            failed = ("raised", "TypeError", "the value could not be sent to the judge", "")
            send(self.replies, failed if cost is None else (*failed, cost), _ToJudge)

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
                target, args, kwargs = receive(self.calls, self.unpickler)
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


class Judge:
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
            send(self.calls, (target, args, kwargs), _ToSample)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"a test passed the sample what cannot be sent to it: {exc}") from None
        except OSError:
            raise SampleGone("its process ended") from None
        try:
            reply = receive(self.replies, self.unpickler)
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
                **status_fields(status)}
    if isinstance(exc, AssertionError):
        return {**test, "verdict": "Wrong Answer", "message": _cut(str(exc)) or "an assertion failed"}
    return {**test, "verdict": "Wrong Answer", "message": f"{type(exc).__name__}: {_cut(str(exc))}"}


def status_fields(status):
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


def verdicts(judge, spec):
    """A failure before any test (or None), and each test's verdict."""
    try:
        hello = receive(judge.replies, judge.unpickler)
    except Exception as exc:  # noqa: BLE001 - the sample's bytes: whatever fails to read them is its failure
        return {"verdict": "Runtime Error", "message": f"the sample ended before its tests ran ({exc})",
                **status_fields(judge.ended())}, []
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


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
