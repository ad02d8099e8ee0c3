"""``execpool run``: live output, exit codes, one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest


def execpool(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execpool", *args], capture_output=True, text=True,
                          timeout=60, **kwargs)


@pytest.mark.slow
def test_run_shell_streams_output_and_exits_with_the_tool_code():
    done = execpool("run", "--shell", "echo hello; exit 3")
    assert done.stdout == "hello\n" and done.returncode == 3


@pytest.mark.slow
def test_run_python_code_and_file(tmp_path):
    assert execpool("run", "--python", "print(6 * 7)").stdout == "42\n"
    script = tmp_path / "job.py"
    script.write_text("import os\nprint(os.path.basename(__file__).endswith('.py'))\nopen('out.txt', 'w').write('x')")
    done = execpool("run", "--cwd", str(tmp_path), str(script))
    assert done.stdout == "True\n" and done.returncode == 0
    assert (tmp_path / "out.txt").read_text() == "x"


@pytest.mark.slow
def test_timeout_exits_124():
    done = execpool("run", "--timeout", "0.3", "--shell", "echo a; sleep 30")
    assert done.returncode == 124 and done.stdout == "a\n"
    assert "Execution timed out after 0.3 seconds." in done.stderr


def test_signal_exit_is_128_plus_n():
    assert execpool("run", "--shell", "kill -KILL $$").returncode == 137


def test_output_is_live_before_the_tool_exits(tmp_path):
    gate = tmp_path / "gate"
    proc = subprocess.Popen([sys.executable, "-m", "execpool", "run", "--python",
                             f"import os, time\nprint('first')\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "first\n"
        assert proc.poll() is None
        gate.touch()
        assert proc.wait(30) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize("args", [
    ["run"], ["run", "--timeout", "abc", "--shell", "true"], ["run", "--timeout", "-1", "--shell", "true"],
    ["run", "--shell", "true", "--python", "1"], ["frobnicate"], ["run", "/nonexistent/file.py"],
    ["run", "--shell", "echo \x01\udcff"], ["run", "--timeout", "1e9", "--shell", "true"],
    ["run", "--cwd", "/nonexistent/dir", "--shell", "true"], ["serve", "--port", "70000"],
    ["serve", "--workers", "0"], ["serve", "--preload", "a-b"],
])
def test_bad_arguments_get_a_one_line_error(args):
    done = execpool(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("execpool: error:")


@pytest.mark.parametrize("args, help_command", [(["frobnicate"], "execpool --help"),
                                                 (["run", "--timeout", "abc", "--shell", "true"], "execpool run --help")])
def test_a_usage_error_names_the_help_of_the_command_it_is_about(args, help_command):
    """An unknown command said ``(see 'execpool execpool --help')``."""
    assert execpool(*args).stderr.rstrip().endswith(f"(see '{help_command}')")


def test_serve_without_its_extra_says_what_to_install():
    """The core install has no service stack; ``execpool serve`` then says
    how to get it (starlette hidden here, as a core install lacks it)."""
    code = ("import sys\nsys.modules['starlette'] = None\nfrom execpool.cli.main import main\n"
            "sys.exit(main(['serve', '--port', '0']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'execpool[serve]'" in done.stderr and "Traceback" not in done.stderr


def test_a_reader_that_goes_away_stops_the_job_without_a_traceback():
    """``execpool run ... | head`` printed a BrokenPipeError traceback and
    exited 1; now the job is stopped and the exit is 141 (128 + SIGPIPE),
    as a shell pipeline's writer would have."""
    proc = subprocess.Popen([sys.executable, "-m", "execpool", "run", "--shell", "while :; do echo line; done"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "line\n"
        proc.stdout.close()  # the reader goes away, as `head -1` does
        assert proc.wait(30) == 141
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
