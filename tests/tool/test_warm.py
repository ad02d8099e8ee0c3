"""Warm Python (``PythonJob(warm=True)``): a fork of the worker that behaves as
``python -u FILE`` would, and job stdin."""

from __future__ import annotations

import os
import re

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob, sandbox_support
from execpool.pool.config import DEFAULT_WARM_SPARES as WARM_SPARES
from execpool.tool.spare_wire import SPARE_NAME, TEMPLATE_NAME
from tests.support import hostile
from tests.support.helpers import all_dead, pids_in, wait_for

CORPUS = {
    "print": "print('hello')\nprint(1, 2, sep='-', end='!\\n')",
    "unicode": "print('é ✓ 日本')\nimport sys\nsys.stdout.write('\\u2603\\n')",
    "interleaved": "import sys\nfor i in range(3):\n    print('out', i)\n    print('err', i, file=sys.stderr)",
    "traceback": "def inner():\n    raise ValueError('boom')\n\ndef outer():\n    inner()\n\nouter()",
    "chained": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    raise KeyError('k') from e",
    "syntax_error": "print('never')\nx = (",
    "exit_int": "import sys\nprint('bye')\nsys.exit(3)",
    "exit_message": "raise SystemExit('went wrong')",
    "exit_none": "import sys\nsys.exit()",
    "os_exit": "import os\nprint('flushed', flush=True)\nos._exit(5)",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "identity": ("import os, sys\nprint(__name__, sys.argv == [__file__], sys.path[0] == os.getcwd(),\n"
                 "      os.path.dirname(__file__) == os.getcwd(), __spec__, __package__)"),
    "no_execpool_on_path": "import sys\nprint([p for p in sys.path if 'execpool' in p or p == '/'])",
    "environment": "import os, json\nprint(json.dumps(sorted(k for k in os.environ if k != 'EXECPOOL_JOB')))",
    "stdin": "import sys\ndata = sys.stdin.read()\nprint(repr(data))\nprint(input.__name__)",
    "atexit": "import atexit\natexit.register(print, 'at exit')\nprint('main')",
    "non_daemon_thread": ("import threading, time\ndef later():\n    time.sleep(0.1)\n    print('thread done')\n"
                          "threading.Thread(target=later).start()\nprint('main done')"),
    "pickle_main": ("import pickle\nclass Point:\n    pass\np = Point()\n"
                    "print(type(pickle.loads(pickle.dumps(p))).__qualname__)"),
    "segfault": hostile.SEGFAULT,
    "unbuffered_before_crash": "import sys, os\nsys.stdout.write('partial')\nos.kill(os.getpid(), 9)",
    "main_guard": "def main():\n    print('main ran')\n\nif __name__ == '__main__':\n    main()",
    "multiprocessing_fork": ("import multiprocessing as mp\nif __name__ == '__main__':\n"
                             "    with mp.get_context('fork').Pool(2) as pool:\n"
                             "        print(pool.map(abs, [-1, -2]))"),
    "multiprocessing_spawn": ("import multiprocessing as mp\ndef square(x):\n    return x * x\n"
                              "if __name__ == '__main__':\n"
                              "    with mp.get_context('spawn').Pool(2) as pool:\n"
                              "        print(pool.map(square, [2, 3]))"),
    "signal_handlers": ("import os, signal\nsignal.signal(signal.SIGUSR1, lambda *_: print('got USR1'))\n"
                        "os.kill(os.getpid(), signal.SIGUSR1)\nprint('after')"),
    "signal_dispositions": ("import signal\n"
                            "for name in ('SIGINT', 'SIGTERM', 'SIGPIPE', 'SIGCHLD', 'SIGHUP', 'SIGUSR1'):\n"
                            "    print(name, signal.getsignal(getattr(signal, name)))\n"
                            "print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))"),
    "killed_by_sigterm": "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)",
    "recursion_limit": ("import sys\nprint(sys.getrecursionlimit())\ndef down(n):\n    return down(n + 1)\n"
                        "try:\n    down(0)\nexcept RecursionError as exc:\n    print(type(exc).__name__)"),
    "huge_output": "import sys\nfor i in range(200_000):\n    print(i, 'x' * 20)\nprint('end', file=sys.stderr)",
    "files": ("import os\nopen('made.txt', 'w').write('data')\nprint(open('made.txt').read())\n"
              "print(sorted(n for n in os.listdir('.') if not n.startswith('.execpool-')))"),
    "builtin_exit": "print('x', end='')\nexit(4)",
    "warnings": "import warnings\nwarnings.warn('careful')\nprint('went on')",
    "input_eof": "print(input())\nprint(input())\nprint(input())",
    "stdio_modes": ("import sys\nprint(sys.stdout.encoding, sys.stdout.errors, sys.stdout.line_buffering,\n"
                    "      sys.stdout.write_through, sys.stdin.encoding, sys.flags.unbuffered, sys.flags.optimize)"),
    "argv_and_file": ("import os, sys\n"
                      "print(len(sys.argv), os.path.basename(sys.argv[0]) == os.path.basename(__file__),\n"
                      "      os.path.isabs(__file__), __file__.endswith('.py'), __builtins__.__name__)"),
    "site_and_umask": ("import os, sys\nold = os.umask(0)\nos.umask(old)\n"
                       "print(oct(old), 'site' in sys.modules, callable(exit), sys.dont_write_bytecode)"),
}


#: The programs whose every comparison stays in the fast tier: there, the
#: rest of the corpus is compared once, warm against cold (the whole suite
#: compares each every way).
FAST_CORPUS = frozenset({"print", "unicode", "traceback", "exit_int", "stdin", "segfault"})


def _corpus(fast) -> list:
    """The corpus's names as parameters, slow unless in ``fast``."""
    return [pytest.param(name, marks=[] if name in fast else [pytest.mark.slow]) for name in sorted(CORPUS)]


def normalized(result) -> tuple:
    """Each run's file has a name of its own; nothing else may differ."""
    return (re.sub(r"\.execpool-\w+\.py", "JOB.py", result.output),
            re.sub(r"\.execpool-\w+\.py", "JOB.py", result.stderr), result.exit_code)


@pytest.fixture(scope="module")
def warm_pool():
    with ExecPool(workers=2) as pool:
        yield pool


@pytest.mark.parametrize("name", _corpus(set(CORPUS) - {"huge_output"}))
def test_warm_output_is_byte_identical_to_cold(warm_pool, name, tmp_path):
    code = CORPUS[name]
    cold = warm_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n"))
    warm = warm_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n", warm=True))
    assert normalized(warm) == normalized(cold)
    assert warm.text.startswith("Exit code") == cold.text.startswith("Exit code")


def test_warm_differs_from_cold_in_stack_depth_alone_as_documented(warm_pool):
    """What docs/library/warm.md says a warm job cannot have as a cold one does: its
    module runs a few frames deep in the spare (the recursion limit is the
    same; the depth left to the program, and what ``traceback.extract_stack``
    shows below its module, are not)."""
    probe = ("import sys, traceback\ndef depth(n=1):\n    try:\n        return depth(n + 1)\n"
             "    except RecursionError:\n        return n\n"
             "print(sys.getrecursionlimit(), depth(), len(traceback.extract_stack()))")
    cold = [int(x) for x in warm_pool.run(PythonJob(probe)).output.split()]
    warm = [int(x) for x in warm_pool.run(PythonJob(probe, warm=True)).output.split()]
    assert cold[0] == warm[0]
    assert 0 < cold[1] - warm[1] <= 16 and 0 < warm[2] - cold[2] <= 16, (cold, warm)


@pytest.mark.parametrize("name", _corpus(FAST_CORPUS))
def test_warm_output_is_byte_identical_to_cold_in_the_sandbox(warm_pool, name):
    """The service's default: strict, each job in a private directory of
    its own (no ``cwd``)."""
    if not sandbox_support().available:
        pytest.skip(f"no sandbox here: {sandbox_support().missing}")
    code = CORPUS[name]
    cold = warm_pool.run(PythonJob(code, stdin="line one\nline two\n", sandbox="strict"))
    warm = warm_pool.run(PythonJob(code, stdin="line one\nline two\n", sandbox="strict", warm=True))
    assert normalized(warm) == normalized(cold)
    assert (warm.output_chars, warm.output_bytes) == (cold.output_chars, cold.output_bytes)


@pytest.mark.parametrize("name", _corpus(FAST_CORPUS))
def test_warm_streams_kept_apart_are_byte_identical_to_cold(warm_pool, name, tmp_path):
    """With ``separate_stderr`` a spare's fd 2 is a pipe of its own, as a
    cold start's is: tracebacks, ``SystemExit`` messages and stderr prints
    land there, and nothing else does."""
    code = CORPUS[name]
    cold = warm_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n", separate_stderr=True))
    warm = warm_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n", separate_stderr=True,
                                   warm=True))
    assert normalized(warm) == normalized(cold)
    assert (warm.output_chars, warm.stderr_chars, warm.output_bytes) == (
        cold.output_chars, cold.stderr_chars, cold.output_bytes)


@pytest.fixture(scope="module")
def spare_pool():
    """One worker with a spare for every corpus program: each warm job below
    is handed to a parked spare, none forked from the worker."""
    with ExecPool(workers=1, warm_spares=len(CORPUS) + 1) as pool:
        pool.run(PythonJob("pass", warm=True))
        assert wait_for(lambda: len(_parked_spares(pool)) == len(CORPUS) + 1, timeout=30)
        yield pool


@pytest.mark.parametrize("name", _corpus(FAST_CORPUS))
def test_warm_output_in_a_spare_is_byte_identical_to_cold(warm_pool, spare_pool, name, tmp_path):
    code = CORPUS[name]
    parked = {spare.pid for spare in _parked_spares(spare_pool)}
    cold = warm_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n"))
    warm = spare_pool.run(PythonJob(code, cwd=str(tmp_path), stdin="line one\nline two\n", warm=True))
    assert normalized(warm) == normalized(cold)
    # One parked spare ran it (and is gone); none was forked for it.
    assert len(parked - {spare.pid for spare in _parked_spares(spare_pool)}) == 1


def test_a_spare_gets_the_jobs_limits_network_env_and_directory(spare_pool, tmp_path):
    parked = {spare.pid for spare in _parked_spares(spare_pool)}
    probe = ("import os, resource\nprint(resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.getcwd(),\n"
             "      os.environ['WHO'], open('/proc/net/dev').read().count(':'), os.getpid() == os.getsid(0))")
    job = PythonJob(probe, warm=True, cwd=str(tmp_path), env={"WHO": "me"}, network=False,
                    limits=Limits(open_files=40))
    result = spare_pool.run(job)
    if result.error and "Operation not permitted" in result.error:
        pytest.skip("this user may not create network namespaces")
    assert result.text == f"40 {tmp_path} me 1 True\n"  # loopback only, own session
    assert len(parked - {spare.pid for spare in _parked_spares(spare_pool)}) == 1


def test_a_spare_joins_its_jobs_cgroup(spare_pool):
    probe = "print(open('/proc/self/cgroup').read())"
    if "/execpool-" not in spare_pool.run(PythonJob(probe, limits=Limits(processes=5))).output:
        pytest.skip("no cgroup tier for process caps here (a cold job got none)")
    parked = {spare.pid for spare in _parked_spares(spare_pool)}
    result = spare_pool.run(PythonJob(probe, warm=True, limits=Limits(processes=5)))
    assert re.search(r"/execpool-\w+/job-\d+$", result.output, re.MULTILINE)
    assert len(parked - {spare.pid for spare in _parked_spares(spare_pool)}) == 1


@pytest.mark.slow
def test_warm_spares_option():
    with ExecPool(workers=1, warm_spares=0) as pool:
        # None parked: each warm job waits for a spare made for it.
        assert pool.run(PythonJob("print('made for me')", warm=True)).text == "made for me\n"
        assert len(_templates(pool)) == 1 and _parked_spares(pool) == []
    for bad, error in ((-1, ValueError), (65, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error):
            ExecPool(workers=1, warm_spares=bad)


def test_warm_ipython_false_keeps_ipython_out_of_warm_jobs_and_sessions_still_speak_it():
    """``warm_ipython=False`` (what ``execpool eval`` and ``execpool
    batch`` pass): the template builds no IPython shell, so warm jobs are
    copies of a smaller process; an IPython session there builds its own."""
    pytest.importorskip("IPython")
    probe = PythonJob("import sys; print('IPython' in sys.modules)", warm=True)
    with ExecPool(workers=1) as warm, ExecPool(workers=1, warm_ipython=False) as lean:
        assert warm.run(probe).output == "True\n"
        assert lean.run(probe).output == "False\n"
        with lean.session("python", ipython=True) as session:
            ran = session.run("%time x = 1\nx + 1")
            assert (ran.status, ran.value) == ("ok", "2") and ran.stdout.startswith("CPU times"), ran
    with pytest.raises(TypeError, match="warm_ipython must be a bool"):
        ExecPool(workers=1, warm_ipython="no")


def test_exit_codes_and_tracebacks(warm_pool):
    assert warm_pool.run(PythonJob(CORPUS["exit_int"], warm=True)).exit_code == 3
    assert warm_pool.run(PythonJob(CORPUS["keyboard_interrupt"], warm=True)).exit_code == -2
    result = warm_pool.run(PythonJob(CORPUS["traceback"], warm=True))
    assert result.exit_code == 1
    assert "warm.py" not in result.output and "/execpool/" not in result.output
    assert result.output.startswith("Traceback (most recent call last):\n  File ")


def test_warm_jobs_get_limits_session_and_working_directory(warm_pool, tmp_path):
    probe = ("import os, resource\nprint(os.getpid() == os.getpgid(0) == os.getsid(0))\n"
             "print(resource.getrlimit(resource.RLIMIT_NOFILE))\nprint(os.getcwd())\nprint(sorted(os.listdir('/proc/self/fd')))")
    out = warm_pool.run(PythonJob(probe, cwd=str(tmp_path), warm=True, limits=Limits(open_files=50))).output
    assert out.splitlines() == ["True", "(50, 50)", str(tmp_path), "['0', '1', '2', '3']"]


def test_warm_timeout_cancel_and_background_cleanup(warm_pool):
    result = warm_pool.run(PythonJob("import time\nprint('up', flush=True)\ntime.sleep(30)", warm=True, timeout=0.3))
    assert result.text == "Execution timed out after 0.3 seconds."
    result = warm_pool.run(PythonJob("import subprocess\nprint('PIDS', subprocess.Popen(['sleep', '100'], "
                                     "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)", warm=True))
    assert all_dead(pids_in(result.output))
    daemon = warm_pool.run(PythonJob(hostile.SETSID_DAEMON, warm=True))
    assert all_dead(pids_in(daemon.output))


def test_warm_memory_limit_fails_the_job_not_the_worker(warm_pool):
    result = warm_pool.run(PythonJob("x = bytearray(4 << 30)", warm=True, limits=Limits(address_space=1 << 30)))
    assert result.exit_code == 1 and "MemoryError" in result.output
    assert warm_pool.run(PythonJob("print('fine')", warm=True)).text == "fine\n"


def test_warm_job_state_does_not_leak_into_the_next(warm_pool):
    warm_pool.run(PythonJob("import json, os\njson.dumps = None\nos.environ['LEAK'] = '1'", warm=True))
    assert warm_pool.run(PythonJob("import json, os\nprint(json.dumps([1]), os.environ.get('LEAK'))",
                                   warm=True)).text == "[1] None\n"


@pytest.mark.slow
def test_preload(tmp_path):
    with ExecPool(workers=1, preload=["decimal"]) as pool:
        probe = "import sys\nprint('decimal' in sys.modules)"
        assert pool.run(PythonJob(probe, warm=True)).text == "True\n"
        assert pool.run(PythonJob(probe)).text == "False\n"
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        ExecPool(workers=1, preload=["no_such_module_xyz"])
    with pytest.raises(TypeError):
        ExecPool(workers=1, preload="json")
    with pytest.raises(ValueError):
        ExecPool(workers=1, preload=["not a module"])


def test_stdin_feeds_shell_and_python_and_defaults_to_empty(pool):
    assert pool.run(ShellJob("tr a-z A-Z", stdin="shout\n")).text == "SHOUT\n"
    assert pool.run(PythonJob("print(len(input()))", stdin="x" * 1_000_000 + "\n")).text == "1000000\n"
    assert pool.run(ShellJob("wc -c")).text == "0\n"
    with pytest.raises(TypeError):
        ShellJob("cat", stdin=b"bytes")


def test_warm_rejects_non_bool():
    with pytest.raises(TypeError):
        PythonJob("pass", warm=1)


# --- the template and its spares: warm starts without a fork from the worker ------


def _helpers(pool: ExecPool, name: str) -> list:
    return [child for pid in pool.worker_pids for child in psutil.Process(pid).children()
            if child.name() == name and child.status() != psutil.STATUS_ZOMBIE]


def _templates(pool: ExecPool) -> list:
    return _helpers(pool, TEMPLATE_NAME)


def _parked_spares(pool: ExecPool) -> list:
    return _helpers(pool, SPARE_NAME)


def _descriptors(pid: int) -> list:
    try:
        return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return []


def _holds_only_its_socket(pid: int) -> bool:
    targets = _descriptors(pid)
    sockets = [t for t in targets if t.startswith("socket:")]
    return len(sockets) == 1 and set(targets) - {os.devnull} == set(sockets)


@pytest.mark.slow
def test_each_warm_job_runs_exactly_once_in_its_spare():
    # A hand-over once ran the job a second time in a fresh fork when the
    # spare had closed its socket before the worker's last (empty) send.
    with ExecPool(workers=2) as pool:
        jobs = [PythonJob(f"print({i})", warm=True) for i in range(600)]
        outputs = [result.output for result in pool.map(jobs, max_in_flight=8)]
    assert outputs == [f"{i}\n" for i in range(600)]


@pytest.mark.slow
def test_a_warm_job_takes_a_spare_parked_by_the_ones_before():
    with ExecPool(workers=1) as pool:
        pool.run(PythonJob("pass", warm=True))
        # A spare takes its name before it has handed its socket over and
        # let go of the template's channel: wait until each is parked, with
        # nothing of the worker's or the template's channel -- /dev/null and
        # its own socket. (Read as soon as there were enough names, a spare
        # still setting up showed three sockets.)
        assert wait_for(lambda: len(_parked_spares(pool)) == WARM_SPARES
                        and all(_holds_only_its_socket(spare.pid) for spare in _parked_spares(pool))), \
            {spare.pid: _descriptors(spare.pid) for spare in _parked_spares(pool)}
        spares = {spare.pid for spare in _parked_spares(pool)}
        # A job ending with no job left does not take the template or a spare for a stray.
        assert pool.run(ShellJob("true")).exit_code == 0
        result = pool.run(PythonJob("import os, sys\nprint(os.getpid())\nsys.exit(3)", warm=True))
        assert int(result.output) in spares and result.exit_code == 3


@pytest.mark.slow
def test_killed_spares_and_templates_are_replaced():
    with ExecPool(workers=1) as pool:
        probe = PythonJob("import os\nprint(os.getpid())", warm=True)
        pool.run(probe)
        assert wait_for(lambda: len(_parked_spares(pool)) == WARM_SPARES)
        killed = _parked_spares(pool)
        for spare in killed:
            spare.kill()
        assert int(pool.run(probe).output) not in {spare.pid for spare in killed}
        assert wait_for(lambda: len(_parked_spares(pool)) == WARM_SPARES)
        template = _templates(pool)[0]
        template.kill()
        assert all_dead([template.pid])
        # Parked spares are the worker's children and outlive their template;
        # the next warm job has the worker start a new one.
        assert pool.run(probe).exit_code == 0
        assert wait_for(lambda: len(_templates(pool)) == 1 and _templates(pool)[0].pid != template.pid)
        assert wait_for(lambda: len(_parked_spares(pool)) == WARM_SPARES)
        assert pool.run(probe).exit_code == 0


@pytest.mark.slow
def test_pool_close_takes_the_template_and_spares_down():
    pool = ExecPool(workers=1)
    pool.run(PythonJob("pass", warm=True))
    assert wait_for(lambda: len(_parked_spares(pool)) == WARM_SPARES)
    pids = [_templates(pool)[0].pid, *(spare.pid for spare in _parked_spares(pool))]
    pool.close()
    assert all_dead(pids)


def test_a_busy_worker_hands_warm_jobs_to_spares_too():
    with ExecPool(workers=1, warm_spares=0) as pool:
        stream = pool.stream(ShellJob("echo up; sleep 30", timeout=None))
        assert next(stream)["text"] == "up\n"
        worker = pool.worker_pids[0]
        # No spare parked (warm_spares=0): one is made for the job, a clone of
        # the template in the template's session until it takes the job.
        probe = "import os\nprint(os.getppid(), os.getsid(0) == os.getpid())"
        assert pool.run(PythonJob(probe, warm=True)).output == f"{worker} True\n"
        assert len(_templates(pool)) == 1 and _parked_spares(pool) == []
        stream.close()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> str:
    """A bare venv of this CPython: the interpreter a service's jobs may run
    with, apart from the server's own."""
    import subprocess
    import sys

    where = tmp_path_factory.mktemp("runtime")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    return str(where / "bin" / "python")


def test_warm_jobs_run_with_the_pools_interpreter_as_cold_ones_do(runtime):
    """``ExecPool(python=...)`` chose the interpreter of cold jobs only: the
    warm template ran the worker's own, so a warm job saw the server's
    packages, not the runtime's."""
    probe = "import sys\nprint(sys.prefix, sys.executable == sys.argv[0] or sys.executable)"
    with ExecPool(workers=1, python=runtime) as pool:
        cold = pool.run(PythonJob("import sys\nprint(sys.prefix)"))
        warm = pool.run(PythonJob("import sys\nprint(sys.prefix)", warm=True))
    prefix = os.path.dirname(os.path.dirname(runtime))
    assert cold.output == warm.output == f"{prefix}\n", (cold.text, warm.text, probe)


@pytest.mark.slow
def test_preload_is_looked_for_in_the_pools_interpreter(runtime):
    """``tqdm`` is in the server's venv, not in the bare runtime: the pool
    says so rather than a template that died."""
    with pytest.raises(ValueError, match="tqdm: ModuleNotFoundError"):
        with ExecPool(workers=1, python=runtime, preload=["tqdm"]):
            pass
    with ExecPool(workers=1, python=runtime, preload=["json"]) as pool:
        assert pool.run(PythonJob("import sys\nprint('json' in sys.modules)", warm=True)).output == "True\n"


@pytest.mark.slow
def test_batch_runs_its_jobs_with_the_interpreter_given(runtime, tmp_path):
    import json
    import subprocess
    import sys

    lines = tmp_path / "in.jsonl"
    lines.write_text("".join(json.dumps({"id": i, "python": "import sys\nprint(sys.prefix)"}) + "\n" for i in (1, 2)))
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "execpool", "batch", str(lines), "-o", str(out), "--warm",
                           "--python", runtime, "--no-progress", "--workers", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    prefix = os.path.dirname(os.path.dirname(runtime))
    assert [json.loads(line)["output"] for line in out.read_text().splitlines()] == [f"{prefix}\n"] * 2


def _huge_pages_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


#: Whether a 64 MiB allocation of the interpreter sits in huge pages, and
#: whether the job or a program it starts sees the setting that asked.
HUGE_PAGES = ("b = bytearray(64 << 20)\nb[::4096] = b'x' * len(b[::4096])\nimport os, subprocess\n"
              "huge = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')]\n"
              "child = subprocess.run(['sh', '-c', 'echo ${GLIBC_TUNABLES-unset}'], capture_output=True, text=True)\n"
              "print(huge[0] >= 32 << 10, 'GLIBC_TUNABLES' in os.environ, child.stdout.strip())")


@pytest.mark.slow
@pytest.mark.skipif(_huge_pages_mode() != "madvise",
                    reason="huge pages on request only (the usual setting) tells the template's asking apart")
def test_warm_interpreters_ask_for_huge_pages_unseen_and_a_pool_s_own_tunables_win():
    """The template's malloc asks for transparent huge pages, so a session
    holding much forks as fast as one holding little; neither a job nor
    what it starts sees the setting, and a pool that gives its jobs glibc
    tunables of its own has its template use those."""
    with ExecPool(workers=1) as pool:
        assert pool.run(PythonJob(HUGE_PAGES, warm=True)).output == "True False unset\n"
        with pool.session("python") as session:
            assert session.run(HUGE_PAGES).stdout == "True False unset\n"
        assert pool.run(PythonJob(HUGE_PAGES)).output == "False False unset\n"  # cold: the system's way
    with ExecPool(workers=1, env={"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) as pool:
        assert pool.run(PythonJob(HUGE_PAGES, warm=True)).output == "False True glibc.malloc.hugetlb=0\n"
