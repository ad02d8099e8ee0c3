"""Every public input, fuzzed (SPEC §6).

The Python API answers bad input with a precise ``ValueError`` or
``TypeError`` (and takes good input); the tool layer never raises and
answers bad input with one line; nothing a session id says reaches outside
the sandbox root; and after every case the pool still runs a simple job.

One pool serves the whole module; example counts are modest so the file
runs in well under a minute. Each oracle below restates the contract
independently of execpool's own checks. Cases that found bugs are pinned
with ``@example`` so they fail every run, not only when hypothesis draws
them.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import threading
from collections.abc import Mapping
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from execpool import ExecPool, Limits, PythonJob, ShellJob
from execpool import tools as tool_layer
from execpool.shared.checks import MAX_SECONDS as MAX_TIMEOUT_S
from execpool.shared.jobs import MAX_SHELL_COMMAND_BYTES

FUZZ = settings(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
FEW = settings(FUZZ, max_examples=12)

#: Any code point, lone surrogates and NUL included.
ANY_CHAR = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr), st.just("\x00"))
HOSTILE_TEXT = st.text(alphabet=ANY_CHAR, max_size=60)
#: Text a program can receive: no NUL, no lone surrogate.
CLEAN_TEXT = st.text(alphabet=st.characters(exclude_characters="\x00"), max_size=300)
NOT_TEXT = st.one_of(st.none(), st.binary(max_size=8), st.integers(), st.floats(), st.booleans(),
                     st.lists(st.integers(), max_size=2))
ANY_NUMBER = st.one_of(st.none(), st.floats(), st.integers(), st.booleans(), st.fractions(),
                       st.text(max_size=4), st.just(10 ** 400), st.just(-(10 ** 400)))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:
        yield p


def healthy(pool: ExecPool) -> None:
    assert pool.run(ShellJob("echo ok", timeout=30)).text == "ok\n"


def newlines(text: str) -> str:
    """Universal newlines, as communicate(text=True) reads them."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def text_error(value: object):
    """What the contract says about a string handed to a program."""
    if not isinstance(value, str):
        return TypeError
    if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return ValueError
    return None


def interval_error(value: object, maximum: float = math.inf):
    """A positive, finite number of seconds (not a bool); None is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return TypeError
    try:
        as_float = float(value)
    except OverflowError:  # an int too big for a float is absurd, not mistyped
        return ValueError
    if math.isnan(as_float) or not 0 < as_float < math.inf or value > maximum:
        return ValueError
    return None


def raises_as(expected, build):
    """Build; check it raised exactly ``expected`` (None: did not raise)."""
    if expected is None:
        return build()
    with pytest.raises(expected):
        build()
    return None


# --- code and command strings ----------------------------------------------------------------


@FUZZ
@given(source=st.one_of(HOSTILE_TEXT, CLEAN_TEXT, NOT_TEXT), warm=st.booleans())
def test_python_code_is_validated_then_runs_to_a_result(pool, source, warm):
    job = raises_as(text_error(source), lambda: PythonJob(source, timeout=20, warm=warm))
    if job is not None:
        result = pool.run(job)
        assert result.error is None, result.error
        if not source.strip():
            assert result.text == "No code provided."
        else:
            # Arbitrary text is a syntax error (1) or, rarely, a valid program.
            assert result.exit_code in (0, 1) and not result.timed_out, result.text[:300]
    healthy(pool)


@FUZZ
@given(command=st.one_of(HOSTILE_TEXT, NOT_TEXT, st.text(min_size=1, max_size=3).map(lambda s: s * 50_000)))
def test_shell_command_is_validated_without_running_it(command):
    # Random text is never run as a shell command here (it could mean
    # anything); its content travels as data in the next test.
    expected = text_error(command)
    if expected is None and len(command.encode("utf-8")) > MAX_SHELL_COMMAND_BYTES:
        expected = ValueError
    raises_as(expected, lambda: ShellJob(command))


@FUZZ
@given(text=CLEAN_TEXT.filter(lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)))
def test_any_text_survives_the_trip_through_a_tool(pool, text):
    expected = newlines(text)
    shell = pool.run(ShellJob("printf '%s' " + shlex.quote(text), timeout=20))
    assert shell.exit_code == 0 and shell.output == expected
    python = pool.run(PythonJob(f"import sys\nsys.stdout.write({text!r})", timeout=20))
    assert python.exit_code == 0 and python.output == expected
    assert python.output_chars == len(expected)


@FEW
@given(data=st.binary(max_size=3000), split=st.integers(0, 3000), warm=st.booleans())
def test_any_bytes_decode_like_communicate_across_a_read_boundary(pool, data, split, warm):
    # Two writes with a pause between them: the worker sees two reads, split
    # anywhere -- inside a UTF-8 sequence or between \r and \n.
    code = (f"import os, time\ndata = {data!r}\nos.write(1, data[:{split}])\ntime.sleep(0.02)\n"
            f"os.write(1, data[{split}:])\n")
    result = pool.run(PythonJob(code, timeout=20, warm=warm))
    assert result.output == newlines(data.decode("utf-8", "replace"))


@pytest.mark.slow
def test_huge_python_source_runs_and_huge_shell_command_is_refused(pool):
    code = "x = 'é'\n" * (10 * 1024 * 1024 // 9) + "print(len(x))"
    assert len(code.encode()) > 10 * 1024 * 1024
    assert pool.run(PythonJob(code, timeout=60)).text == "1\n"
    with pytest.raises(ValueError, match="KiB"):
        ShellJob("#" * (MAX_SHELL_COMMAND_BYTES + 1))
    healthy(pool)


# --- timeouts and stream arguments ---------------------------------------------------------------


@FUZZ
@given(timeout=ANY_NUMBER)
@example(timeout=10 ** 400)
@example(timeout=-(10 ** 400))
@example(timeout=5e-324)
@example(timeout=Fraction(1, 3))
def test_timeout_is_validated_and_a_valid_one_is_honoured(pool, timeout):
    expected = None if timeout is None else interval_error(timeout, MAX_TIMEOUT_S)
    job = raises_as(expected, lambda: ShellJob("sleep 0.05; echo done", timeout=timeout))
    if job is not None:
        result = pool.run(job)
        if result.timed_out:
            assert result.text == f"Execution timed out after {timeout} seconds."
        else:
            assert result.text == "done\n"
    healthy(pool)


@FUZZ
@given(heartbeat=ANY_NUMBER, tool_name=st.one_of(HOSTILE_TEXT, NOT_TEXT),
       cancel_event=st.one_of(st.none(), st.just("set"), st.integers(), st.builds(threading.Event)))
@example(heartbeat=10 ** 400, tool_name="x", cancel_event=None)
@example(heartbeat=1e10, tool_name="x", cancel_event=None)
@example(heartbeat=MAX_TIMEOUT_S + 1, tool_name="x", cancel_event=threading.Event())
def test_stream_arguments_are_validated(pool, heartbeat, tool_name, cancel_event):
    # Intervals beyond a week are refused as absurd (and no wait could take them).
    expected = interval_error(heartbeat, MAX_TIMEOUT_S)
    bad_event = cancel_event is not None and not hasattr(cancel_event, "is_set")
    if expected is None and bad_event:
        expected = TypeError
    job = ShellJob("echo streamed", timeout=20)
    stream = raises_as(expected, lambda: pool.stream(job, tool_name=tool_name, heartbeat_interval_s=heartbeat,
                                                      cancel_event=cancel_event))
    if stream is not None:
        events = []
        try:
            while True:
                events.append(next(stream))
        except StopIteration as stop:
            assert stop.value.text == "streamed\n"
        outputs = [e for e in events if e["type"] == "tool_output"]
        assert outputs and all(e["tool_name"] == str(tool_name) for e in outputs)
    raises_as(TypeError if bad_event else None, lambda: pool.run(job, cancel_event=cancel_event))
    healthy(pool)


# --- environment, cwd, stdin, flags ---------------------------------------------------------------


def env_error(env: object):
    """In the order the contract checks a mapping: each key, then its value."""
    if env is None:
        return None
    if not isinstance(env, Mapping):
        return TypeError
    for key, value in env.items():
        error = text_error(key) or text_error(value)
        if error is None and (not key or "=" in key):
            error = ValueError
        if error is not None:
            return error
    return None


MEANINGFUL = ("LC_", "LANG", "PYTHON", "LD_", "PATH", "HOME", "BASH", "ENV", "EXECPOOL", "IFS", "PS4", "SHELLOPTS")


@FUZZ
@given(env=st.one_of(st.dictionaries(HOSTILE_TEXT, HOSTILE_TEXT, max_size=3),
                     st.dictionaries(st.text(alphabet=st.characters(exclude_characters="\x00="), min_size=1,
                                             max_size=12), CLEAN_TEXT, max_size=3),
                     st.dictionaries(st.one_of(st.integers(), st.binary(max_size=4)), st.text(max_size=3),
                                     min_size=1, max_size=2),
                     st.dictionaries(st.text(min_size=1, max_size=3), st.one_of(st.integers(), st.none()),
                                     min_size=1, max_size=2),
                     st.lists(st.text(max_size=3), max_size=2), st.text(max_size=4), st.integers()))
def test_env_is_validated_and_a_valid_one_reaches_the_tool(pool, env):
    job = raises_as(env_error(env), lambda: PythonJob("pass", env=env))
    if job is not None and env and not any(key.upper().startswith(MEANINGFUL) for key in env):
        keys = sorted(env)
        code = f"import json, os\nprint(json.dumps([os.environ.get(k) for k in {keys!r}]))"
        result = pool.run(PythonJob(code, env=env, timeout=20))
        assert json.loads(result.output) == [env[k] for k in keys]
    healthy(pool)


@FUZZ
@given(cwd=st.one_of(HOSTILE_TEXT.map(lambda s: "/" + s), NOT_TEXT,
                     st.sampled_from(["/", "/tmp", "/etc/hostname", "/nonexistent/dir", "/proc", "/.."])))
def test_cwd_is_validated_and_a_valid_one_is_used(pool, cwd):
    expected = None
    if cwd is not None and (not isinstance(cwd, (str, os.PathLike))):
        expected = TypeError
    elif isinstance(cwd, str) and text_error(cwd):
        expected = ValueError
    job = raises_as(expected, lambda: ShellJob("pwd -P", cwd=cwd, timeout=20))
    if job is not None and cwd is not None:
        if not os.path.isdir(cwd):
            with pytest.raises(ValueError, match="not an existing directory"):
                pool.run(job)
        else:
            assert pool.run(job).text == os.path.realpath(cwd) + "\n"
    healthy(pool)


def test_relative_cwd_is_the_callers(pool, tmp_path, monkeypatch):
    """A relative ``cwd`` names a directory relative to the caller, where it
    was checked to exist, not relative to the worker (which runs in /)."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert pool.run(ShellJob("pwd -P", cwd="sub")).text == str((tmp_path / "sub").resolve()) + "\n"
    assert pool.run(ShellJob("pwd -P", cwd=".")).text == str(tmp_path.resolve()) + "\n"


@FUZZ
@given(stdin=st.one_of(HOSTILE_TEXT, CLEAN_TEXT, NOT_TEXT))
def test_stdin_is_validated_and_a_valid_one_is_read(pool, stdin):
    expected = None
    if stdin is not None:
        expected = TypeError if not isinstance(stdin, str) else (
            ValueError if any(0xD800 <= ord(c) <= 0xDFFF for c in stdin) else None)
    job = raises_as(expected, lambda: ShellJob("cat", stdin=stdin, timeout=20))
    if job is not None:
        # NUL is fine on stdin; cat passes every byte through.
        assert pool.run(job).output == newlines(stdin or "")
    healthy(pool)


@FUZZ
@given(keep_background=NOT_TEXT, warm=NOT_TEXT, network=NOT_TEXT, max_output_chars=ANY_NUMBER)
def test_flags_and_sizes_are_type_checked(keep_background, warm, network, max_output_chars):
    for name, value in (("keep_background", keep_background), ("warm", warm), ("network", network)):
        expected = None if isinstance(value, bool) else TypeError
        raises_as(expected, lambda: PythonJob("pass", **{name: value}))
    if max_output_chars is None:
        expected = None
    elif isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int):
        expected = TypeError
    else:
        expected = None if max_output_chars > 0 else ValueError
    raises_as(expected, lambda: PythonJob("pass", max_output_chars=max_output_chars))


# --- limits ----------------------------------------------------------------------------------------

RLIMIT_FIELDS = ("address_space", "cpu_seconds", "file_size", "open_files")
#: rlimits are 64-bit: a larger value can never be applied.
RLIM_MAX = 2 ** 63 - 1
#: Values a tool certainly starts under (smaller ones may make it fail to start, which is the caller's choice).
SANE_MINIMUM = {"address_space": 1 << 30, "cpu_seconds": 5, "file_size": 1 << 20, "open_files": 64}


def limit_error(value: object):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return TypeError
    return ValueError if value <= 0 or value > RLIM_MAX else None


@FUZZ
@given(field=st.sampled_from(RLIMIT_FIELDS),
       value=st.one_of(ANY_NUMBER, st.integers(1, 1 << 40), st.integers(RLIM_MAX - 2, RLIM_MAX + 2)))
@example(field="address_space", value=2 ** 64)
@example(field="file_size", value=RLIM_MAX + 1)
def test_limits_are_validated_and_sane_ones_apply(pool, field, value):
    limits = raises_as(limit_error(value), lambda: Limits(**{field: value}))
    if limits is not None:
        result = pool.run(ShellJob("echo ok", limits=limits, timeout=20))
        if value is None or value >= SANE_MINIMUM[field]:
            assert result.text == "ok\n"
        else:
            assert isinstance(result.text, str)  # too tight to start is a Result, never an exception
    healthy(pool)


@pytest.mark.parametrize("field", ["processes", "memory"])
def test_cgroup_caps_too_large_to_apply_are_refused_up_front(field):
    """pids.max and memory limits are 64-bit as well; a cap the kernel cannot
    take is a ValueError, not an ``Execution error`` at the first job."""
    with pytest.raises(ValueError):
        Limits(**{field: 2 ** 64})


# --- the tool layer ---------------------------------------------------------------------------------

SAFE_SOURCES = {"python": ["print('fuzz')", ""], "terminal": ["echo fuzz", ""]}
ARG_VALUES = st.one_of(st.sampled_from(["print('fuzz')", "echo fuzz", ""]), NOT_TEXT, st.just({"nested": 1}))


def tool_arguments():
    """Well-formed, malformed and mistyped tool-call arguments. A string that
    is a program is only ever one of SAFE_SOURCES (fuzzed text is never run
    as a shell command)."""
    keys = st.sampled_from(["code", "command", "other", ""])
    objects = st.dictionaries(keys, ARG_VALUES, max_size=3)
    json_objects = st.dictionaries(keys, st.one_of(st.sampled_from(["print('fuzz')", "echo fuzz", ""]), JSON),
                                   max_size=3)
    deep = st.builds(str.__mul__, st.just("["), st.just(100_000))  # json.loads: RecursionError
    return st.one_of(st.none(), objects, json_objects.map(json.dumps), HOSTILE_TEXT, st.binary(max_size=20), JSON,
                     JSON.map(json.dumps), st.just('{"code": "print(1)"'), deep, st.just('{"code": "\\ud800"}'))


def expected_source(name: object, arguments: object):
    """The program a valid call runs, or None for an invalid call."""
    if not isinstance(name, str) or name not in SAFE_SOURCES:
        return None
    if isinstance(arguments, (str, bytes)):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    if arguments is None:
        arguments = {}
    field = "code" if name == "python" else "command"
    if not isinstance(arguments, Mapping) or not isinstance(arguments.get(field), str):
        return None
    source = arguments[field]
    try:
        source.encode("utf-8")
    except UnicodeEncodeError:
        return None  # a lone surrogate is no text: the tool answers in one line
    return source


@FUZZ
@given(name=st.one_of(st.sampled_from(["python", "terminal"]), HOSTILE_TEXT, NOT_TEXT),
       arguments=tool_arguments(),
       timeout=st.one_of(st.none(), st.just(20), ANY_NUMBER),
       session_id=st.one_of(st.none(), st.just("fuzz-session"), HOSTILE_TEXT, NOT_TEXT))
@example(name="terminal", arguments='{"command": "echo fuzz"}', timeout=None, session_id="fuzz-session")
@example(name="python", arguments={"code": "print('fuzz')"}, timeout=20, session_id=None)
@example(name="python", arguments={"code": "print('fuzz')"}, timeout=20, session_id="../escape")
@example(name="terminal", arguments='{"command": 7}', timeout=None, session_id=None)
@example(name="python", arguments="[" * 100_000, timeout=None, session_id=None)
@example(name="python", arguments='{"code": "\\ud800"}', timeout=None, session_id=None)  # found under load
@example(name="python", arguments={"code": "echo fuzz"}, timeout=None, session_id=None)  # found in a whole run
def test_execute_tool_never_raises_and_answers_bad_calls_in_one_line(pool, tmp_path, monkeypatch, name, arguments,
                                                                     timeout, session_id):
    monkeypatch.setenv(tool_layer.SANDBOX_ROOT_ENV, str(tmp_path / "root"))
    answer = tool_layer.execute_tool(name, arguments, timeout=timeout, session_id=session_id, pool=pool)
    assert isinstance(answer, str) and answer
    source = expected_source(name, arguments)
    session_ok = session_id is None or (isinstance(session_id, str) and _valid_session(session_id))
    timeout_ok = timeout is None or interval_error(timeout, MAX_TIMEOUT_S) is None
    if source is None or (source and not (session_ok and timeout_ok)):
        assert "\n" not in answer, answer
    elif source in SAFE_SOURCES[name] and source:
        # Only a short timeout can stop these one-liners.
        assert answer in ("fuzz\n", f"Execution timed out after {timeout} seconds."), answer
    elif source.strip():
        # The other tool's one-liner (``echo fuzz`` as Python): its syntax error.
        assert answer.startswith("Exit code ") or answer == f"Execution timed out after {timeout} seconds.", answer
    else:
        assert answer in ("No code provided.", "No command provided.") or "\n" not in answer
    _nothing_outside(tmp_path, tmp_path / "root")
    healthy(pool)


@FEW
@given(name=st.sampled_from(["python", "terminal"]), cancel_event=st.one_of(st.integers(), st.text(max_size=2)),
       output_callback=st.one_of(st.integers(), st.text(max_size=2)))
def test_execute_tool_with_mistyped_keywords_never_raises(pool, tmp_path, monkeypatch, name, cancel_event,
                                                          output_callback):
    monkeypatch.setenv(tool_layer.SANDBOX_ROOT_ENV, str(tmp_path / "root"))
    arguments = {"code": "print(1)", "command": "echo 1"}
    for kwargs in ({"cancel_event": cancel_event}, {"output_callback": output_callback}):
        answer = tool_layer.execute_tool(name, arguments, pool=pool, **kwargs)
        assert answer.startswith("Execution error: ") and "\n" not in answer, answer
    healthy(pool)


# --- session directories ---------------------------------------------------------------------------

TRAVERSALS = ["..", "../x", "/abs", "a/b", "\x00", "", "x" * 10_000, ".", "./x", "a\\b", "~", "$HOME",
              "a\nb", " ", "..\x00", "%2e%2e", "\u2025", "..\\..", "x/../../y", "/", "//", "a\x00b"]


def _valid_session(session_id: str) -> bool:
    return (0 < len(session_id) <= tool_layer.MAX_SESSION_ID_CHARS and session_id not in (".", "..")
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in session_id))


def _nothing_outside(top, root) -> None:
    """Everything below ``top`` is ``root`` or a direct child directory of it."""
    for dirpath, dirnames, filenames in os.walk(top):
        for entry in dirnames + filenames:
            path = os.path.join(dirpath, entry)
            assert path == str(root) or os.path.dirname(path) == str(root), f"created outside the root: {path!r}"


@FUZZ
@given(session_id=st.one_of(st.sampled_from(TRAVERSALS), HOSTILE_TEXT, NOT_TEXT,
                            st.text(alphabet="._-/aZ09", max_size=12)))
@example(session_id="...")
def test_session_ids_never_reach_outside_the_sandbox_root(tmp_path, monkeypatch, session_id):
    root = tmp_path / "root"
    monkeypatch.setenv(tool_layer.SANDBOX_ROOT_ENV, str(root))
    if session_id is None:
        expected = None
    elif not isinstance(session_id, str):
        expected = TypeError
    else:
        expected = None if _valid_session(session_id) else ValueError
    path = raises_as(expected, lambda: tool_layer.get_sandbox_workdir(session_id))
    if path is not None:
        assert os.path.dirname(path) == str(root) and os.path.isdir(path)
        assert os.path.basename(path) == (session_id or tool_layer.DEFAULT_SESSION)
    _nothing_outside(tmp_path, root)


def test_a_raypool_refuses_bad_options_before_it_starts_anything():
    """Its options are checked -- its own, and every option of the pools its
    actors make -- before Ray is started or joined, so a mistake costs no
    cluster. (RayPool itself runs in tests/ray/test_ray.py, on a real cluster.)"""
    import ray

    from execpool.ray import RayPool

    for options, error, named in (({"per_node": 0}, ValueError, "per_node"), ({"retries": -1}, ValueError, "retries"),
                                  ({"workers": "two"}, TypeError, "workers"),
                                  ({"no_such_option": 1}, TypeError, "no_such_option")):
        with pytest.raises(error, match=named):
            RayPool(**options)
    assert not ray.is_initialized()
