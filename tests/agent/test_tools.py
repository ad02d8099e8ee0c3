"""SPEC §4 (the tool layer), §2's model-facing strings and §6's bad input,
through a real pool: schemas, execute_tool, truncation, the missing-path
hint, session directories and the /mnt/data shim inside real tools."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob, tools
from execpool.agent.tools import (
    MAX_OUTPUT_CHARS,
    PYTHON_TOOL,
    TERMINAL_TOOL,
    bash_exec,
    env_int,
    execute_tool,
    get_sandbox_workdir,
    missing_path_hint,
    python_exec,
    truncate,
)
from tests.support.helpers import wait_for

MNT_NOTICE = "/mnt/data does not exist in this sandbox"
HINT_WORDS = ("working directory is writable", "relative path")


@pytest.fixture(scope="module")
def tool_pool():
    with ExecPool(workers=2) as pool:
        yield pool


@pytest.fixture(autouse=True)
def sandbox(tmp_path, monkeypatch):
    """Every test's sandbox root is its own temporary directory, never ~."""
    root = tmp_path / "sandbox"
    monkeypatch.setenv("EXECPOOL_SANDBOX_ROOT", str(root))
    return root


def run_tool(kind, source, pool, **kwargs):
    return (python_exec if kind == "python" else bash_exec)(source, pool=pool, **kwargs)


def assert_hint_names(text, full_path):
    base = "." if full_path == "/mnt/data" else os.path.basename(full_path)
    for words in HINT_WORDS:
        assert words in text
    assert f"'{base}', not '{full_path}'" in text


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("schema, name, field", [(PYTHON_TOOL, "python", "code"),
                                                 (TERMINAL_TOOL, "terminal", "command")])
def test_schemas_are_openai_function_tools(schema, name, field):
    assert json.loads(json.dumps(schema)) == schema
    assert schema["type"] == "function"
    function = schema["function"]
    assert set(function) == {"name", "description", "parameters"}
    assert function["name"] == name
    params = function["parameters"]
    assert params["type"] == "object"
    assert params["required"] == [field]
    assert params["properties"][field]["type"] == "string"
    assert "relative paths" in function["description"]
    assert "/mnt/data" in function["description"]


# --------------------------------------------------------------------------- execute_tool


def test_execute_tool_takes_a_dict_or_a_json_string(tool_pool):
    assert execute_tool("python", {"code": "print(6 * 7)"}, pool=tool_pool) == "42\n"
    assert execute_tool("python", json.dumps({"code": "print('é')"}), pool=tool_pool) == "é\n"
    assert execute_tool("terminal", '{"command": "echo hi; exit 2"}', pool=tool_pool) == "Exit code 2:\nhi\n"
    assert execute_tool("terminal", {"command": "echo x", "ignored": 1}, pool=tool_pool) == "x\n"


@pytest.mark.parametrize("name, arguments, expected", [
    ("nope", {"code": "1"}, "Unknown tool 'nope'"),
    (None, {"code": "1"}, "Unknown tool None"),
    ("python\nnewline", {"code": "1"}, "Unknown tool"),
    ("x" * 10_000, {}, "Unknown tool"),
    ("python", '{"code": ', "not valid JSON"),
    ("python", "print(1)", "not valid JSON"),
    ("python", b"\xff", "not valid JSON"),
    ("python", "[1, 2]", "expected a JSON object"),
    ("python", '"print(1)"', "expected a JSON object"),
    ("python", 42, "expected a JSON object"),
    ("python", "{}", "missing the required string argument 'code'"),
    ("python", "", "missing the required string argument 'code'"),
    ("python", None, "missing the required string argument 'code'"),
    ("terminal", {"code": "ls"}, "missing the required string argument 'command'"),
    ("python", {"code": 1}, "'code' must be a string, got int"),
    ("terminal", '{"command": null}', "'command' must be a string, got NoneType"),
    ("terminal", {"command": ["ls"]}, "'command' must be a string, got list"),
])
def test_execute_tool_bad_calls_get_one_line_messages(tool_pool, name, arguments, expected):
    message = execute_tool(name, arguments, pool=tool_pool)
    assert expected in message
    assert "\n" not in message and len(message) < 300


def test_execute_tool_defaults_and_forwarding(tool_pool, sandbox):
    seen = []

    class Recording(ExecPool):
        def run(self, job, **kwargs):
            seen.append(job)
            return super().run(job, **kwargs)

    with Recording(workers=1) as pool:
        assert execute_tool("python", {"code": "print(1)"}, pool=pool) == "1\n"
        assert execute_tool("terminal", {"command": "pwd"}, pool=pool, session_id="s1", timeout=7) == \
            str(sandbox / "s1") + "\n"
    python_job, shell_job = seen
    assert isinstance(python_job, PythonJob) and python_job.timeout == tools.DEFAULT_TIMEOUT_S == 300
    assert python_job.cwd == str(sandbox / "default")
    assert python_job.env["PYTHONPATH"] == tools.SHIM_DIR
    assert python_job.max_output_chars == MAX_OUTPUT_CHARS
    assert isinstance(shell_job, ShellJob) and shell_job.timeout == 7 and shell_job.env is None
    assert execute_tool("terminal", {"command": "sleep 5"}, pool=tool_pool, timeout=0.2) == \
        "Execution timed out after 0.2 seconds."


# --------------------------------------------------------------------------- result strings


@pytest.mark.parametrize("kind, source, expected", [
    ("python", "print('hi')", "hi\n"),
    ("python", "pass", "(no output)"),
    ("python", "print('   ')", "(no output)"),
    ("python", "import sys; print('bad'); sys.exit(3)", "Exit code 3:\nbad\n"),
    ("python", "raise SystemExit(2)", "Exit code 2:\n"),
    ("python", "", "No code provided."),
    ("python", "  \n\t", "No code provided."),
    ("terminal", "echo out; echo err >&2", "out\nerr\n"),
    ("terminal", "true", "(no output)"),
    ("terminal", "echo bad; exit 5", "Exit code 5:\nbad\n"),
    ("terminal", "", "No command provided."),
])
def test_exact_result_strings(tool_pool, kind, source, expected):
    assert run_tool(kind, source, tool_pool) == expected


@pytest.mark.parametrize("kind, source", [("python", "import time; time.sleep(5)"),
                                          pytest.param("terminal", "sleep 5", marks=pytest.mark.slow)])
def test_timeout_string(tool_pool, kind, source):
    assert run_tool(kind, source, tool_pool, timeout=0.3) == "Execution timed out after 0.3 seconds."


@pytest.mark.parametrize("call, expected", [
    (lambda pool: python_exec("print(1)", timeout=-1, pool=pool), "timeout"),
    (lambda pool: python_exec("print(1)", timeout=float("nan"), pool=pool), "timeout"),
    (lambda pool: python_exec("print(1)", timeout=10**9, pool=pool), "timeout"),
    (lambda pool: python_exec("print(1)\x00", pool=pool), "NUL"),
    (lambda pool: python_exec(None, pool=pool), "code must be str"),
    (lambda pool: bash_exec(b"ls", pool=pool), "command must be str"),
    (lambda pool: bash_exec("echo " + "x" * 200_000, pool=pool), "KiB"),
    (lambda pool: python_exec("print(1)", session_id="../up", pool=pool), "session_id"),
    (lambda pool: python_exec("print(1)", session_id=7, pool=pool), "session_id"),
    (lambda pool: python_exec("print(1)", pool="not a pool"), "pool must be"),
    (lambda pool: python_exec("print(1)", output_callback=5, pool=pool), "output_callback"),
    (lambda pool: python_exec("print(1)", cancel_event=5, output_callback=print, pool=pool), "cancel_event"),
    (lambda pool: execute_tool("python", {"code": "1"}, timeout="soon", pool=pool), "timeout"),
])
def test_bad_input_is_an_execution_error_and_the_pool_stays_healthy(tool_pool, call, expected):
    text = call(tool_pool)
    assert text.startswith("Execution error: ") and expected in text
    assert "\n" not in text
    assert python_exec("print('still fine')", pool=tool_pool) == "still fine\n"


def test_a_closed_pool_is_an_execution_error():
    pool = ExecPool(workers=1)
    pool.close()
    assert python_exec("print(1)", pool=pool) == "Execution error: this ExecPool is closed"
    assert execute_tool("terminal", {"command": "ls"}, pool=pool).startswith("Execution error: ")


def test_huge_code_runs(tool_pool):
    code = "#" + "x" * 10_000_000 + "\nprint('ok')"
    assert python_exec(code, pool=tool_pool) == "ok\n"


# --------------------------------------------------------------------------- truncation


def test_truncate_under_at_and_over_the_limit():
    assert truncate("abc", limit=5) == "abc"
    assert truncate("abcde", limit=5) == "abcde"
    assert truncate("") == ""
    text = "0123456789" * 3
    cut = truncate(text, limit=7)
    assert cut.startswith("0123456") and not cut.startswith("01234567")
    notice = cut[7:]
    assert "truncated" in notice
    assert "30 chars total" in notice
    assert "persist in the working directory" in notice
    assert "shown" not in cut.lower()


def test_truncate_defaults_to_max_output_chars(monkeypatch):
    text = "y" * (tools.MAX_OUTPUT_CHARS + 1)
    assert truncate(text).startswith("y" * tools.MAX_OUTPUT_CHARS + "\n")
    assert truncate(text[:-1]) == text[:-1]
    monkeypatch.setattr(tools, "MAX_OUTPUT_CHARS", 10)
    assert truncate("z" * 11).startswith("z" * 10 + "\n") and "11 chars total" in truncate("z" * 11)


@pytest.mark.parametrize("limit, error", [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError)])
def test_truncate_rejects_bad_limits(limit, error):
    with pytest.raises(error):
        truncate("text", limit=limit)


def test_tool_output_is_truncated_once_with_the_true_total(tool_pool, monkeypatch):
    monkeypatch.setattr(tools, "MAX_OUTPUT_CHARS", 1000)
    text = python_exec("print('a' * 5000)", pool=tool_pool)
    assert text.startswith("a" * 1000 + "\n... [output truncated")
    assert "5001 chars total" in text and text.count("truncated") == 1
    assert python_exec("print('b' * 998)", pool=tool_pool) == "b" * 998 + "\n"
    assert bash_exec("head -c 1001 /dev/zero | tr '\\0' c; exit 4", pool=tool_pool).startswith(
        "Exit code 4:\n" + "c" * 1000 + "\n... [output truncated: 1001 chars total")


@pytest.mark.parametrize("raw, expected", [
    (None, 9), ("", 9), ("abc", 9), ("0", 9), ("-5", 9), ("1.5", 9), ("1e3", 9), ("7", 7), (" 42 ", 42),
])
def test_env_int(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("EXECPOOL_TEST_INT", raising=False)
    else:
        monkeypatch.setenv("EXECPOOL_TEST_INT", raw)
    assert env_int("EXECPOOL_TEST_INT", 9) == expected


@pytest.mark.parametrize("raw, expected", [("1234", 1234), ("-1", 16_000), ("lots", 16_000), (None, 16_000)])
def test_max_output_chars_comes_from_the_environment_at_import(raw, expected):
    env = {k: v for k, v in os.environ.items() if k != "EXECPOOL_TOOL_RESULT_MAX_CHARS"}
    if raw is not None:
        env["EXECPOOL_TOOL_RESULT_MAX_CHARS"] = raw
    out = subprocess.run([sys.executable, "-c", "import execpool.tools as t; print(t.MAX_OUTPUT_CHARS)"],
                         env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(tools.__file__))).stdout
    assert int(out) == expected


# --------------------------------------------------------------------------- missing-path hint


@pytest.mark.parametrize("line, path", [
    ("FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/x.csv'", "/mnt/data/x.csv"),
    ("bash: line 1: /mnt/data/x: No such file or directory", "/mnt/data/x"),
    ("cat: /mnt/data/x: No such file or directory", "/mnt/data/x"),
    ("ls: cannot access '/mnt/data/x': No such file or directory", "/mnt/data/x"),
    ("cat: '/mnt/data/my file.csv': No such file or directory", "/mnt/data/my file.csv"),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/mnt/data/my data.csv'", "/mnt/data/my data.csv"),
    ("bash: line 1: /home/sandbox/run me.sh: No such file or directory", "/home/sandbox/run me.sh"),
    ("FileNotFoundError: [Errno 2] No such file or directory: \"/mnt/data/it's.csv\"", "/mnt/data/it's.csv"),
    ("python3: can't open file '/workspace/main.py': [Errno 2] No such file or directory", "/workspace/main.py"),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'a.txt' -> '/tmp/outputs/b.txt'",
     "/tmp/outputs/b.txt"),
    ("FileNotFoundError: /mnt/outputs/model.pkl not found.", "/mnt/outputs/model.pkl"),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/data/input.csv'", "/data/input.csv"),
    ("ls: cannot access '/mnt/data': No such file or directory", "/mnt/data"),
])
def test_hint_for_a_missing_absolute_path(line, path):
    output = f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{line}\n"
    hint = missing_path_hint(output)
    assert_hint_names(hint, path)
    assert "\n" not in hint


def test_hint_for_a_habit_prefix_without_an_isolatable_path():
    hint = missing_path_hint("FileNotFoundError: cannot read file:/mnt/data/x.csv")
    for words in HINT_WORDS:
        assert words in hint
    assert "/mnt/data" in hint


@pytest.mark.parametrize("output, workdir", [
    ("", None),
    ("all good\n", None),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'x.csv'", None),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'mnt/data/x.csv'", None),
    ("ls: cannot access 'data/x': No such file or directory", None),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/workspace/proj/x.csv'", "/workspace/proj"),
    ("cat: /workspace/proj/sub/x: No such file or directory", "/workspace/proj"),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/srv/box/s1/x.csv'", "/srv/box/s1"),
    ('  File "/mnt/data/script.py", line 3, in <module>\n'
     "FileNotFoundError: [Errno 2] No such file or directory: 'input.csv'", None),
    ("saving to /mnt/data/out.csv\nFileNotFoundError: [Errno 2] No such file or directory: 'in.csv'", None),
    ("/workspace is where I work\nbash: line 1: nothere: No such file or directory", None),
])
def test_no_hint(output, workdir):
    assert missing_path_hint(output, workdir) == ""


def test_hint_default_workdir_is_the_sandbox_root(sandbox):
    inside = f"FileNotFoundError: [Errno 2] No such file or directory: '{sandbox}/s2/x.csv'"
    assert missing_path_hint(inside) == ""
    assert missing_path_hint(inside, str(sandbox / "s1")) != ""


def test_hint_is_computed_on_the_full_output_and_appended_after_truncation(tool_pool):
    text = python_exec("print('x' * 100_000)\nopen('/mnt/data/x.csv')", pool=tool_pool)
    assert text.startswith("Exit code 1:\n" + "x" * 16_000 + "\n... [output truncated: ")
    total = int(re.search(r"(\d+) chars total", text).group(1))
    assert total > 100_000
    assert text.index("truncated") < text.index("[hint]")
    assert text.endswith("'x.csv', not '/mnt/data/x.csv'.")
    assert_hint_names(text, "/mnt/data/x.csv")
    shell = bash_exec("head -c 100000 /dev/zero | tr '\\0' y; echo; cat /mnt/outputs/r.txt", pool=tool_pool)
    assert shell.index("truncated") < shell.index("[hint]")
    assert_hint_names(shell, "/mnt/outputs/r.txt")


def test_hint_not_added_when_the_habit_path_is_only_printed(tool_pool):
    text = python_exec("print('would save to /mnt/data/out.csv')\nopen('missing.csv')", pool=tool_pool)
    assert "No such file or directory: 'missing.csv'" in text and "[hint]" not in text


# --------------------------------------------------------------------------- streaming


STREAM_CASES = [
    ("python", "print('hello')\nimport sys\nprint('err', file=sys.stderr)\nsys.exit(3)", {}),
    pytest.param("python", "import time\nprint('start', flush=True)\ntime.sleep(5)", {"timeout": 0.3},
                 marks=pytest.mark.slow),
    ("python", "print('x' * 50_000)", {}),
    ("python", "print('z' * 30_000)\nopen('/mnt/data/x.csv')", {}),
    ("python", "open('/mnt/data/out.txt', 'w').write('1')\nprint(open('/mnt/data/out.txt').read())", {}),
    ("python", "pass", {}),
    ("python", "", {}),
    ("terminal", "printf 'a\\r\\nb\\rc\\xff'; echo é", {}),
    ("terminal", "ls /mnt/data/x; echo after", {}),
    pytest.param("terminal", "sleep 5", {"timeout": 0.3}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, source, kwargs", STREAM_CASES, ids=lambda c: str(c)[:25])
def test_streamed_and_plain_results_are_byte_identical(tool_pool, kind, source, kwargs):
    plain = run_tool(kind, source, tool_pool, **kwargs)
    chunks = []
    streamed = run_tool(kind, source, tool_pool, output_callback=chunks.append, **kwargs)
    assert streamed == plain
    if plain.endswith("\n") and "[" not in plain and not plain.startswith("Exit code"):
        assert "".join(chunks) == plain


@pytest.mark.parametrize("kind, source", [
    ("python", "for i in range(5): print(i, flush=True)\nopen('done.txt', 'w').write('ok')"),
    ("terminal", "for i in 1 2 3 4 5; do echo $i; done; echo ok > done.txt"),
])
def test_a_failing_output_callback_does_not_break_the_job(tool_pool, sandbox, kind, source):
    calls = []

    def broken(text):
        calls.append(text)
        raise RuntimeError("the client went away")

    text = run_tool(kind, source, tool_pool, output_callback=broken)
    assert text == run_tool(kind, source, tool_pool)
    assert len(calls) == 1  # dropped after it failed
    assert (sandbox / "default" / "done.txt").read_text().strip() == "ok"


@pytest.mark.parametrize("streaming", [False, True])
def test_cancel_event_from_another_thread(tool_pool, sandbox, streaming):
    cancel = threading.Event()
    started = sandbox / "default" / "started"
    set_at = []

    def canceller():
        assert wait_for(started.exists, timeout=10)
        set_at.append(time.monotonic())
        cancel.set()

    thread = threading.Thread(target=canceller)
    thread.start()
    code = "import time\nopen('started', 'w').close()\nprint('running', flush=True)\ntime.sleep(30)"
    kwargs = {"output_callback": lambda text: None} if streaming else {}
    text = python_exec(code, cancel_event=cancel, pool=tool_pool, **kwargs)
    done = time.monotonic()
    thread.join()
    assert text == "Execution cancelled."
    assert done - set_at[0] < 1.0


def test_a_cancel_event_set_before_the_call(tool_pool):
    cancel = threading.Event()
    cancel.set()
    start = time.monotonic()
    assert bash_exec("sleep 30", cancel_event=cancel, pool=tool_pool) == "Execution cancelled."
    assert time.monotonic() - start < 2.0


# --------------------------------------------------------------------------- sessions


def test_sessions_have_their_own_directories(tool_pool, sandbox):
    assert get_sandbox_workdir() == str(sandbox / "default")
    assert python_exec("import os; print(os.getcwd())", pool=tool_pool) == str(sandbox / "default") + "\n"
    assert python_exec("open('secret.txt', 'w').write('a')", session_id="alice", pool=tool_pool) == "(no output)"
    assert bash_exec("cat secret.txt", session_id="alice", pool=tool_pool) == "a"
    assert bash_exec("ls", session_id="bob", pool=tool_pool) == "(no output)"
    assert bash_exec("ls", pool=tool_pool) == "(no output)"
    assert python_exec("import os; print(os.getcwd())", session_id="bob", pool=tool_pool) == \
        get_sandbox_workdir("bob") + "\n"
    assert sorted(os.listdir(sandbox)) == ["alice", "bob", "default"]


def test_sandbox_root_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv("EXECPOOL_SANDBOX_ROOT")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert get_sandbox_workdir() == str(tmp_path / "home" / "execpool_sandbox" / "default")
    assert os.path.isdir(tmp_path / "home" / "execpool_sandbox" / "default")


def test_concurrent_workdir_creation_is_safe(sandbox):
    barrier = threading.Barrier(32)
    results, errors = [], []

    def create(i):
        try:
            barrier.wait()
            results.append((get_sandbox_workdir("shared"), get_sandbox_workdir(f"own-{i % 4}"),
                            get_sandbox_workdir()))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 32
    assert {r[0] for r in results} == {str(sandbox / "shared")}
    assert sorted(os.listdir(sandbox)) == ["default", "own-0", "own-1", "own-2", "own-3", "shared"]


@pytest.mark.parametrize("session_id, error", [
    ("..", ValueError), (".", ValueError), ("../etc", ValueError), ("/etc", ValueError), ("a/b", ValueError),
    ("a\\b", ValueError), ("a\x00b", ValueError), ("", ValueError), ("x" * 129, ValueError),
    ("tab\t", ValueError), ("línea", ValueError), ("ok\n", ValueError), (5, TypeError), (b"abc", TypeError),
])
def test_invalid_session_ids_are_rejected(sandbox, tmp_path, session_id, error):
    with pytest.raises(error):
        get_sandbox_workdir(session_id)
    assert not os.path.exists(sandbox) or os.listdir(sandbox) == []
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("session_id", ["abc-DEF_1.2", "x" * 128, "...", ".hidden", "default"])
def test_valid_session_ids(sandbox, session_id):
    assert get_sandbox_workdir(session_id) == str(sandbox / session_id)


# --------------------------------------------------------------------------- the shared default pool


def test_the_default_pool_is_created_once_lazily_and_shared(monkeypatch):
    monkeypatch.setattr(tools, "_default_pool", None)
    barrier = threading.Barrier(8)
    pools = []

    def get():
        barrier.wait()
        pools.append(tools._shared_pool())

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(pools) == 8 and all(p is pools[0] for p in pools)
        assert python_exec("print('default pool')") == "default pool\n"
        assert tools._default_pool is pools[0]
    finally:
        pools[0].close()


# --------------------------------------------------------------------------- the /mnt/data shim

REMAP_CODE = r"""
import io, os, pathlib
with open('/mnt/data/a.txt', 'w') as f:
    f.write('A')
print(open('/mnt/data/a.txt').read())
with io.open('/mnt/data/b.txt', 'w') as f:
    f.write('B')
print(io.open('/mnt/data/b.txt').read())
pathlib.Path('/mnt/data/c.txt').write_text('C')
print(pathlib.Path('/mnt/data/c.txt').read_text())
pathlib.Path('/mnt/data/d.bin').write_bytes(b'D')
print(pathlib.Path('/mnt/data/d.bin').read_bytes())
os.makedirs('/mnt/data/sub/deep', exist_ok=True)
os.makedirs('/mnt/data')
pathlib.Path('/mnt/data/p/q').mkdir(parents=True, exist_ok=True)
with open('/mnt/data/sub/deep/e.txt', 'a') as f:
    f.write('E')
with open(file='/mnt/data/f.txt', mode='x') as f:
    f.write('F')
os.makedirs(name='/mnt/data/kw', exist_ok=True)
print(os.path.exists('/mnt/data/c.txt'), os.path.isdir('/mnt/data'), pathlib.Path('/mnt/data/sub').is_dir())
"""


def test_mnt_data_is_remapped_to_the_working_directory(tool_pool, sandbox):
    text = python_exec(REMAP_CODE, pool=tool_pool)
    workdir = sandbox / "default"
    assert text == (f"[execpool] {MNT_NOTICE}: paths under it are mapped to the working directory "
                    f"({workdir}). Use relative paths.\nA\nB\nC\nb'D'\nTrue True True\n")
    assert text.count(MNT_NOTICE) == 1
    assert {p.name for p in workdir.iterdir()} == {"a.txt", "b.txt", "c.txt", "d.bin", "f.txt", "sub", "p", "kw"}
    assert (workdir / "sub" / "deep" / "e.txt").read_text() == "E"
    assert (workdir / "p" / "q").is_dir()
    assert not os.path.exists("/mnt/data")


def test_a_write_to_an_invented_directory_lands_in_the_working_directory(tool_pool, sandbox):
    code = ("open('/no/such/place/report.csv', 'w').write('r')\n"
            "import pathlib; pathlib.Path('/tmp/outputs/x/plot.txt').write_text('p')\nprint('saved')")
    text = python_exec(code, session_id="s", pool=tool_pool)
    assert text.count("does not exist in this sandbox") == 2
    assert "'report.csv'" in text and text.endswith("saved\n")
    assert (sandbox / "s" / "report.csv").read_text() == "r"
    assert (sandbox / "s" / "plot.txt").read_text() == "p"
    assert not os.path.exists("/no/such/place")


def test_reads_of_missing_paths_are_not_redirected(tool_pool, sandbox):
    workdir = get_sandbox_workdir()
    with open(os.path.join(workdir, "x.txt"), "w") as f:
        f.write("present")
    text = python_exec("print(open('/nowhere/x.txt').read())", pool=tool_pool)
    assert text.startswith("Exit code 1:\n")
    assert "No such file or directory: '/nowhere/x.txt'" in text
    assert_hint_names(text, "/nowhere/x.txt")
    # /mnt/data reads go to the working directory only when the file is there.
    assert python_exec("print(open('/mnt/data/x.txt').read())", pool=tool_pool).endswith("present\n")
    missing = python_exec("open('/mnt/data/absent.csv')", pool=tool_pool)
    assert "No such file or directory: '/mnt/data/absent.csv'" in missing
    assert_hint_names(missing, "/mnt/data/absent.csv")


def test_listdir_is_not_remapped_and_earns_the_hint(tool_pool, sandbox):
    os.makedirs(os.path.join(get_sandbox_workdir(), "x"))
    text = python_exec("import os\nprint(os.listdir('/mnt/data/x'))", pool=tool_pool)
    assert "No such file or directory: '/mnt/data/x'" in text
    assert text.endswith("[hint] /mnt/data/x does not exist in this sandbox. Your working directory is "
                         "writable and holds your files: use a relative path, e.g. 'x', not '/mnt/data/x'.")


def test_the_shim_is_invisible_to_other_programs(tool_pool, sandbox):
    code = ("import os, sys\nprint(__name__, os.path.dirname(__file__) == os.getcwd() == sys.path[0])\n"
            "print(sys.argv == [__file__], sys.stdout.write_through)\n"
            f"print('PYTHONPATH' in os.environ, {tools.SHIM_DIR!r} in sys.path)")
    assert python_exec(code, pool=tool_pool) == "__main__ True\nTrue True\nFalse False\n"


@pytest.mark.parametrize("code", [
    "open('missing.txt')",
    "import pathlib\npathlib.Path('missing.txt').read_text()",
    "import os\nos.stat('missing.txt')",
    "import os\nos.makedirs('')",
    "def f():\n    try:\n        open('missing.txt')\n    except OSError as e:\n"
    "        raise ValueError('wrapped') from e\nf()",
    "1 / 0",
])
def test_tracebacks_are_those_of_a_run_without_the_shim(tool_pool, sandbox, code):
    workdir = get_sandbox_workdir()
    script = os.path.join(workdir, "ref.py")
    with open(script, "w") as f:
        f.write(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    reference = subprocess.run([tool_pool.config.python, "-u", script], cwd=workdir, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT).stdout
    os.unlink(script)
    text = python_exec(code, pool=tool_pool)
    assert "sitecustomize" not in text
    assert text.startswith("Exit code 1:\n")
    normalized = re.sub(r'File "[^"]*/\.execpool-[^"]*\.py"', f'File "{script}"', text[len("Exit code 1:\n"):])
    assert normalized == reference


def test_the_pool_pythonpath_and_a_shadowed_sitecustomize_survive(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mylib.py").write_text("VALUE = 'from mylib'\n")
    (lib / "sitecustomize.py").write_text("import sys\nsys.stderr.write('site hook ran\\n')\n")
    with ExecPool(workers=1, env={"PYTHONPATH": str(lib)}) as pool:
        text = python_exec("import os, mylib\nprint(mylib.VALUE, os.environ['PYTHONPATH'])\n"
                           "open('/mnt/data/f.txt', 'w').write('f')", pool=pool)
    assert text.startswith("site hook ran\n") and f"from mylib {lib}\n" in text
    assert text.count(MNT_NOTICE) == 1
    assert os.path.exists(os.path.join(get_sandbox_workdir(), "f.txt"))


# -- a session per conversation (SPEC §8: the tool layer) ---------------------------------------

def test_python_exec_in_a_session_keeps_state_and_files_of_the_conversation(tool_pool, sandbox):
    with tools.python_session("conv-1", pool=tool_pool) as session:
        assert python_exec("import math\nr = 2", session=session) == "(no output)"
        assert python_exec("print('area'); math.pi * r * r", session=session) == "area\n12.566370614359172"
        remapped = python_exec("open('/mnt/data/kept.txt', 'w').write('x')", session=session)
        assert remapped.startswith("[execpool] " + MNT_NOTICE) and remapped.endswith("\n1")
        assert (sandbox / "conv-1" / "kept.txt").read_text() == "x"  # the conversation's directory, remapped
        assert bash_exec("cat kept.txt", pool=tool_pool, session_id="conv-1") == "x"
        error = python_exec("open('/workspace/nope.csv')", session=session)
        assert "FileNotFoundError" in error and "'nope.csv', not '/workspace/nope.csv'" in error
        assert "sitecustomize" not in error  # the shim's frames are left out, as a job's are
        assert python_exec("import time\ntime.sleep(30)", session=session, timeout=0.3) == (
            "Execution timed out after 0.3 seconds.")
        assert python_exec("r", session=session) == "2"


@pytest.mark.slow
def test_a_conversation_in_a_tool_workspace_has_a_bounded_disk_of_its_own():
    """The tool layer's session directory is bounded per file only; a
    workspace gives the conversation one bound for all it writes."""
    with ExecPool(workers=1, limits=Limits(disk=8 << 20)) as pool:
        workspace = tools.tool_workspace(pool)
        assert workspace is not None
        with workspace, tools.python_session(pool=pool, workspace=workspace) as session:
            assert python_exec("open('kept.txt', 'w').write('x')", session=session) == "1"
            assert python_exec("open('kept.txt').read()", session=session) == "'x'"
            text = python_exec("open('/tmp/big', 'wb').write(bytes(16 << 20))", session=session)
            assert "No space left on device" in text
            assert python_exec("import os; os.remove('/tmp/big') if os.path.exists('/tmp/big') else None\n"
                               "open('kept.txt').read()", session=session) == "'x'"
        assert not os.listdir(get_sandbox_workdir())  # nothing on the caller's disk


def test_a_session_call_streams_and_cancels(tool_pool):
    with tools.python_session(pool=tool_pool) as session:
        seen = []
        assert python_exec("print('a')\nprint('b')", session=session, output_callback=seen.append) == "a\nb\n"
        assert "".join(seen) == "a\nb\n"
        cancel = threading.Event()
        started = threading.Event()
        threading.Thread(target=lambda: started.wait(20) and cancel.set(), daemon=True).start()
        text = python_exec("print('go', flush=True)\nimport time\ntime.sleep(60)", session=session,
                           cancel_event=cancel, output_callback=lambda _: started.set())
        assert text == "go\nExecution cancelled." and session.alive


def test_execute_tool_binds_the_python_tool_to_the_session_only(tool_pool):
    with tools.python_session(pool=tool_pool) as session:
        assert execute_tool("python", {"code": "n = 5"}, session=session, pool=tool_pool) == "(no output)"
        assert execute_tool("python", '{"code": "n * 2"}', session=session, pool=tool_pool) == "10"
        assert execute_tool("terminal", {"command": "echo $n"}, session=session, pool=tool_pool) == "(no output)"
    shell = tool_pool.session("bash")
    try:
        assert python_exec("1", session=shell).startswith("Execution error: this tool runs python")
    finally:
        shell.close()
    assert python_exec("1", session=session).startswith("Execution error: this session was closed")
    assert python_exec("", session=session) == "No code provided."
