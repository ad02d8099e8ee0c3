"""Programs in every language of the table that runs here (CodeJob), and the
compile cache: each program compiled once per pool, also when many jobs
ask at once, and nothing a job does reaching an artifact another job runs.

Run as the test process's user (root here) in the strict sandbox, as the
service runs jobs. Each language's program takes its case on stdin, so a
compiled language is compiled once for all its cases -- through the cache
this module tests.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import wait

import pytest

from execpool import CodeJob, ExecPool, Result, ShellJob, Status, languages
from execpool.shared import languages as table
from tests.support.helpers import IN_CI, language_cases, needs, run_as_nobody, toolchains, wait_for
from tests.support.programs import BROKEN, CRASH_EXIT, PROGRAMS, TEST_RUNNERS, slow_to_compile

#: SandboxFusion's language names (its sandbox/runners), and the two added.
SANDBOX_FUSION_NAMES = ("python", "pytest", "cpp", "go", "go_test", "java", "junit", "nodejs", "typescript", "jest",
                        "php", "csharp", "bash", "sql", "rust", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia",
                        "kotlin_script", "verilog", "lean", "swift", "racket")

LANGUAGES = language_cases(PROGRAMS)


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2, sandbox="strict") as p:
        yield p


def test_the_table_has_every_sandbox_fusion_name_and_the_two_aliases():
    names = [language.name for language in table.TABLE]
    assert len(names) == len(set(names))
    assert set(SANDBOX_FUSION_NAMES) | {"c", "javascript"} == set(names)


def test_the_languages_of_the_machines_this_suite_runs_on_are_there():
    """.ci/run installs these; under CI a machine without one fails here,
    loudly, rather than skipping its tests."""
    if not IN_CI:
        pytest.skip("only CI (CI=true) installs every toolchain")
    assert {"c", "cpp", "java", "rust", "nodejs", "javascript", "perl", "bash", "python", "sql", "pytest", "go",
            "go_test", "typescript", "php", "lua", "R", "D_ut", "ruby", "scala", "verilog", "racket", "junit",
            "kotlin_script", "jest", "csharp"} <= {name for name, row in toolchains().items() if row.runs}


def test_each_language_says_its_toolchain_or_why_not():
    for toolchain in languages():
        assert toolchain.compiles is table.get(toolchain.name).compiles and not toolchain.checking
        if toolchain.runs:
            assert toolchain.toolchain and toolchain.version and toolchain.why_not is None
        else:
            assert toolchain.why_not and "\n" not in toolchain.why_not


def test_a_missing_toolchain_is_named():
    found = table.probe(table.get("cpp"), path="/nonexistent")
    assert not found.runs and found.why_not == "g++ is not installed here (not on PATH)"


def test_a_job_in_a_language_whose_toolchain_is_missing_ends_infra_naming_the_tool():
    with ExecPool(workers=1, env={"PATH": "/nonexistent"}) as p:
        result = p.run(CodeJob("cpp", PROGRAMS["cpp"], timeout=10))
    assert result.status is Status.INFRA
    assert result.error == "language 'cpp' does not run here: g++ is not installed here (not on PATH)"


@pytest.mark.parametrize("kwargs, message", [
    (dict(language="cobol"), "language 'cobol' is not in the languages table; known: python, pytest, "),
    (dict(files={"../x": b""}), "files: the path '../x' must be a plain relative path"),
    (dict(files={"main.cpp": b""}), "files must not hold 'main.cpp'"),
    (dict(compile_timeout=0), "compile_timeout must be a positive, finite number of seconds"),
])
def test_a_bad_code_job_is_refused_where_it_is_built(kwargs, message):
    arguments = dict(language="cpp", code="int main(){}")
    arguments.update(kwargs)
    with pytest.raises(ValueError) as caught:
        CodeJob(**arguments)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("language", LANGUAGES)
def test_hello_in_unicode_from_stdin(pool, language):
    result = pool.run(CodeJob(language, PROGRAMS[language], stdin="wörld\n", timeout=30, separate_stderr=True))
    assert result.status is Status.OK, result.text
    assert result.output == "héllo wörld ✓\n"
    assert (result.compile_status is Status.OK) is table.get(language).compiles


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_non_zero_exit(pool, language):
    result = pool.run(CodeJob(language, PROGRAMS[language], stdin="exit\n", timeout=30))
    assert (result.status, result.exit_code) == (Status.ERROR, 3), result.text


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_runtime_error(pool, language):
    result = pool.run(CodeJob(language, PROGRAMS[language], stdin="crash\n", timeout=30, separate_stderr=True))
    assert (result.status, result.exit_code) == (Status.ERROR, CRASH_EXIT[language]), result.text
    if language not in ("c", "cpp"):  # a signal: the program says nothing
        assert "boom" in result.stderr + result.output


#: Seconds before the "hang" case is killed: enough for the slowest
#: runtime here to start its program and the program its shell.
HANG_TIMEOUT_S = {"kotlin_script": 20.0, "scala": 8.0, "racket": 6.0, "java": 6.0, "junit": 6.0, "csharp": 6.0}


@pytest.mark.parametrize("language", language_cases(PROGRAMS, fast={"python"}))  # each waits out its timeout
def test_a_tree_that_ignores_sigterm_dies_at_the_timeout(pool, language):
    result = pool.run(CodeJob(language, PROGRAMS[language], stdin="hang\n",
                              timeout=HANG_TIMEOUT_S.get(language, 1.5), separate_stderr=True))
    assert result.status is Status.TIMEOUT and result.timed_out, result.text
    assert result.compile_status in (None, Status.OK)
    shell = int(result.output.split()[0])  # the shell said its pid: it had started
    assert wait_for(lambda: not os.path.exists(f"/proc/{shell}"), 5)


@pytest.mark.slow
def test_a_timed_out_tree_that_ignores_sigterm_dies_whole(pool):
    program = r'''#include <signal.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
    signal(SIGTERM, SIG_IGN);
    if (fork() == 0) { setsid(); if (fork() == 0) { printf("%d\n", getpid()); fflush(stdout); for (;;) pause(); } }
    for (;;) pause();
}
'''
    result = pool.run(CodeJob("c", program, timeout=1))
    assert result.status is Status.TIMEOUT
    daemon = int(result.output.split()[0])
    assert wait_for(lambda: not os.path.exists(f"/proc/{daemon}"), 5)


@pytest.mark.parametrize("language", language_cases(sorted(BROKEN)))
def test_a_compile_error_is_the_compile_s_and_nothing_runs(pool, language):
    result = pool.run(CodeJob(language, BROKEN[language], timeout=30))
    assert result.status is Status.ERROR and result.compile_status is Status.ERROR
    assert result.compile_failed and result.exit_code not in (0, None)
    # The Result is the compile's: what the compiler said is all there is.
    assert result.compile_output.strip() and result.output + result.stderr == result.compile_output
    assert result.text.startswith(f"Compilation failed (exit code {result.exit_code}):\n")


@pytest.mark.slow
@pytest.mark.parametrize("language", language_cases(sorted(TEST_RUNNERS)))
def test_a_test_runner_passes_and_fails(pool, language):
    code, passed, failed = TEST_RUNNERS[language]
    good = pool.run(CodeJob(language, code.replace("WANT", "2"), timeout=60, separate_stderr=True))
    assert good.status is Status.OK and passed in good.output + good.stderr, good.text
    bad = pool.run(CodeJob(language, code.replace("WANT", "3"), timeout=60, separate_stderr=True))
    assert bad.status is Status.ERROR and bad.exit_code != 0 and failed in bad.output + bad.stderr, bad.text


@needs("verilog")
def test_verilog_simulates_its_testbench(pool):
    code = ("module tb;\n  reg [3:0] a = 4'd9;\n  initial begin\n    $display(\"a + 1 = %0d\", a + 1);\n"
            "    $finish;\n  end\nendmodule\n")
    result = pool.run(CodeJob("verilog", code, timeout=30))
    assert (result.status, result.output.splitlines()[0]) == (Status.OK, "a + 1 = 10"), result.text


def test_sql_runs_on_a_fresh_database(pool):
    code = "create table t(a int, b text); insert into t values (1, 'é'), (2, '✓'); select a, b from t order by a;"
    result = pool.run(CodeJob("sql", code, timeout=30))
    assert (result.status, result.output) == (Status.OK, "1|é\n2|✓\n")
    broken = pool.run(CodeJob("sql", "select * from missing;", timeout=30, separate_stderr=True))
    assert broken.status is Status.ERROR and "no such table: missing" in broken.stderr


@pytest.mark.slow
def test_pytest_runs_the_tests_with_the_pool_s_python(pool):
    passing = pool.run(CodeJob("pytest", "def test_one():\n    assert 1 + 1 == 2\n", timeout=60))
    assert passing.status is Status.OK and "1 passed" in passing.output, passing.text
    failing = pool.run(CodeJob("pytest", "def test_one():\n    assert 1 + 1 == 3\n", timeout=60))
    assert (failing.status, failing.exit_code) == (Status.ERROR, 1) and "1 failed" in failing.output


@pytest.mark.slow
def test_batch_lines_in_a_language_compile_once(tmp_path):
    lines = [{"id": n, "language": "cpp", "code": _fresh(f"batch {time.time_ns()}"), "stdin": ""} for n in range(2)]
    lines[1]["code"] = lines[0]["code"]
    lines.append({"id": 2, "language": "cobol", "code": "x"})
    given = tmp_path / "in.jsonl"
    given.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "execpool", "batch", str(given), "-o", str(tmp_path / "out.jsonl"),
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [records[n]["status"] for n in range(3)] == ["ok", "ok", "invalid"]
    assert records[0]["output"].startswith("batch") and records[0]["compile_status"] == "ok"
    assert records[0]["compile_duration_s"] == records[1]["compile_duration_s"]  # one compile
    assert "not in the languages table" in records[2]["error"]


@pytest.mark.slow
@needs("junit")
def test_programs_naming_their_entry_differently_ask_the_toolchain_once(pool):
    """The entry name comes from the program: a flood of names must not
    make a version probe (a JVM start) each."""
    pool.run(CodeJob("junit", TEST_RUNNERS["junit"][0].replace("WANT", "2"), timeout=60))
    probed = len(table._probed)
    for n in range(3):
        code = TEST_RUNNERS["junit"][0].replace("WANT", "2").replace("SumTest", f"Sum{n}Test")
        assert pool.run(CodeJob("junit", code, timeout=60)).ok
    assert len(table._probed) == probed


def test_files_lie_beside_the_program(pool):
    code = '#include <stdio.h>\n#include "lib.h"\nint main(void){ FILE *f = fopen("data.txt", "r"); ' \
           'char s[32]; fgets(s, 32, f); printf("%d %s", TWICE(21), s); return 0; }\n'
    files = {"lib.h": b"#define TWICE(x) (2 * (x))\n", "data.txt": b"from a file\n"}
    result = pool.run(CodeJob("c", code, files=files, timeout=30))
    assert (result.status, result.output) == (Status.OK, "42 from a file\n"), result.text


def test_a_run_in_the_caller_s_directory_leaves_what_it_made_and_none_of_the_program(pool, tmp_path):
    code = '#include <stdio.h>\nint main(void){ FILE *f = fopen("out.txt", "w"); fputs("made", f); return 0; }\n'
    result = pool.run(CodeJob("c", code, files={"in.txt": b"given"}, cwd=tmp_path, timeout=30))
    assert result.ok, result.text
    assert sorted(os.listdir(tmp_path)) == ["out.txt"]
    assert (tmp_path / "out.txt").read_text() == "made"


# -- the compile cache ---------------------------------------------------------------------------------------


def _fresh(tag: str) -> str:
    """A C++ program no other test compiles."""
    return f'#include <cstdio>\nint main() {{ std::puts("{tag}"); }}\n'


def test_the_same_program_compiles_once(pool):
    before = pool.compile_cache
    code = _fresh(f"once {time.time_ns()}")
    results = [pool.run(CodeJob("cpp", code, timeout=30)) for _ in range(5)]
    after = pool.compile_cache
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 4)
    assert all(r.status is Status.OK and r.output.startswith("once") for r in results)
    assert [r.compile_cached for r in results] == [False, True, True, True, True]
    # Every run carries that one compile's Result.
    assert len({id(r.compile_result) for r in results}) == 1
    assert after.compile_seconds - before.compile_seconds == pytest.approx(results[0].compile_duration_s)


def test_jobs_asking_at_once_wait_for_one_compile(pool):
    before = pool.compile_cache
    code = _fresh(f"together {time.time_ns()}")
    futures = [pool.submit(CodeJob("cpp", code, timeout=30)) for _ in range(8)]
    done, _ = wait(futures, timeout=60)
    assert len(done) == 8
    after = pool.compile_cache
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 7)
    assert sum(not f.result().compile_cached for f in futures) == 1
    assert all(f.result().status is Status.OK for f in futures)


def test_a_compile_error_is_kept_once_a_second_compile_failed_alike(pool):
    """A first failure may be the machine's (a disk another job filled, an
    out-of-memory kill): it is served from the cache only once a second
    compile failed the same way."""
    before = pool.compile_cache
    code = f"int main() {{ nope_{time.time_ns()}(); }}\n"
    results = [pool.run(CodeJob("cpp", code, timeout=30)) for _ in range(3)]
    assert all(r.compile_status is Status.ERROR for r in results)
    assert [r.compile_cached for r in results] == [False, False, True]
    assert pool.compile_cache.misses - before.misses == 2
    assert results[2].text == results[0].text


def _artifact(status=Status.ERROR, exit_code=1, output="error: nope", **fields):
    from execpool.pool.compile_cache import kept
    result = Result(status=status, exit_code=exit_code, output=output, **fields)
    return kept(result, size=100) if status is Status.OK else kept(result)


def _cache(tmp_path, max_bytes=1 << 20):
    from execpool.pool.compile_cache import CompileCache
    removed = []
    return CompileCache(str(tmp_path), max_bytes, removed.append), removed


def test_a_failure_is_served_only_when_confirmed_and_a_killed_compiler_never(tmp_path):
    cache, _ = _cache(tmp_path)
    assert cache.claim("k") == (None, None)
    cache.settle("k", _artifact(output="error: a typo"))
    assert cache.claim("k") == (None, None)  # tentative: compiled again
    cache.settle("k", _artifact(status=Status.OK, exit_code=0, output=""))  # the first was the machine's
    assert cache.claim("k")[0].compiled
    assert cache.claim("j") == (None, None)
    cache.settle("j", _artifact(exit_code=-9, output="Killed signal terminated program cc1plus"))
    assert cache.claim("j") == (None, None)
    cache.settle("j", _artifact(exit_code=-9, output="Killed signal terminated program cc1plus"))
    assert cache.claim("j") == (None, None)  # a signal's work, never kept
    cache.settle("j", _artifact())
    assert cache.claim("j") == (None, None)
    cache.settle("j", _artifact(output="error: other"))  # not the same failure: still tentative
    assert cache.claim("j") == (None, None)
    cache.settle("j", _artifact(output="error: other"))
    served, _ = cache.claim("j")
    assert served is not None and served.confirmed and served.result.output == "error: other"


@pytest.mark.parametrize("said", ["ld: final link failed: No space left on device", "cc1plus: out of memory",
                                  "Disk quota exceeded", "java.lang.OutOfMemoryError: Java heap space",
                                  "virtual memory exhausted: Cannot allocate memory",
                                  "collect2: fatal error: cannot fork: Resource temporarily unavailable"])
def test_the_machine_s_failure_is_never_kept_however_often(tmp_path, said):
    """Red team: two compiles of a neighbour's correct program that failed
    for want of space became its cached failure for ten minutes."""
    cache, _ = _cache(tmp_path)
    for _ in range(3):
        assert cache.claim("k") == (None, None)
        cache.settle("k", _artifact(output=said))
    assert cache.claim("k") == (None, None)

@pytest.mark.slow
@pytest.mark.parametrize("status", [Status.ERROR, Status.OK])
def test_compiles_keep_a_head_of_their_output_within_a_memory_budget(tmp_path, status):
    """A compile's output is kept in the pool's memory: a head of it, and
    all of them within a budget of their own -- failures and successes
    (a program full of #warning) alike."""
    from execpool.pool.compile_cache import KEPT_OUTPUT_CHARS, MEMORY_MAX_BYTES
    huge = "é✓ warning line\n" * 100_000
    artifact = _artifact(status=status, exit_code=0 if status is Status.OK else 1, output=huge)
    assert len(artifact.result.output) == KEPT_OUTPUT_CHARS and artifact.result.output_chars == len(huge)
    assert artifact.memory >= 4 * KEPT_OUTPUT_CHARS
    if status is Status.ERROR:
        assert "truncated" in artifact.result.text
    cache, _ = _cache(tmp_path, max_bytes=1 << 40)
    for n in range(2 * MEMORY_MAX_BYTES // artifact.memory):
        cache.claim(f"k{n}")
        cache.settle(f"k{n}", _artifact(status=status, exit_code=artifact.result.exit_code, output=huge + str(n)))
    assert cache._memory <= MEMORY_MAX_BYTES and len(cache._entries) < n


def test_what_a_compile_left_past_what_a_job_brings_back_fails_it_saying_so(tmp_path, monkeypatch):
    """A compile's outputs come back as its job's fetch: past its bounds
    the job leaves some out, and the compile is a failure that says why,
    not a program missing a file."""
    from execpool import File
    from execpool.pool import compile_cache as cache_module
    cache, _ = _cache(tmp_path)
    monkeypatch.setattr(cache_module, "ARTIFACT_MAX_BYTES", 1024)
    big = cache.store("k", Result(status=Status.OK, exit_code=0, files={"test": File(b"x" * 4096, 0o755)}))
    assert not big.compiled and "execpool keeps at most" in big.result.error
    left = cache.store("k", Result(status=Status.OK, exit_code=0, files={}, files_left_out=("test",)))
    assert not left.compiled and "execpool keeps at most" in left.result.error
    kept = cache.store("k", Result(status=Status.OK, exit_code=0, files={"test": File(b"x" * 512, 0o755)}))
    assert kept.compiled and kept.size == 512 and kept.files[0][2] == 0o555
    assert cache_module.read_back(kept) == {"test": File(b"x" * 512, 0o555)}


def test_another_language_version_or_program_compiles_again():
    """The key holds the language, its toolchain's version, the compile
    command, the program and the files."""
    from execpool.pool.code import _CodeRun

    def key(language="cpp", code="int main(){}", files=None, version="12.2.0", sandbox="Sandbox()"):
        run = _CodeRun.__new__(_CodeRun)
        run.job = CodeJob(language, code, files=files)
        run.language = run.job.spec
        return run._cache_key(table.Toolchain(language, True, True, f"x {version}", None, version), sandbox)

    keys = {key(), key(language="c"), key(version="12.3.0"), key(code="int main(){ }"),
            key(files={"a.h": b"1"}), key(files={"a.h": b"2"}), key(sandbox="None")}
    assert len(keys) == 7 and key() == key()


def test_a_compile_that_timed_out_is_not_kept(pool):
    before = pool.compile_cache
    code = slow_to_compile(1000)
    results = [pool.run(CodeJob("cpp", code, timeout=10, compile_timeout=0.3)) for _ in range(2)]
    for result in results:
        assert result.status is Status.TIMEOUT and result.compile_status is Status.TIMEOUT
        assert result.text.startswith("Compilation failed. ")
    assert pool.compile_cache.misses - before.misses == 2


def test_a_job_cannot_change_an_artifact_another_job_runs(pool):
    """The program overwrites its own copy of the compiled file and looks
    for the cache; the next job still runs the compiled program."""
    code = r'''#include <cstdio>
#include <cstdlib>
int main() {
    std::remove("./test");  // a running program's file cannot be written, but it can be replaced
    FILE *self = std::fopen("./test", "wb");
    std::printf("own copy %s\n", self && std::fputs("#!/bin/sh\necho changed\n", self) >= 0 ? "written" : "kept");
    std::printf("cache %s\n", std::fopen(std::getenv("CACHE"), "rb") ? "visible" : "unseen");
}
'''
    cache_file = next(iter(_cache_files(pool)), None)
    assert cache_file is not None
    env = {"CACHE": cache_file}
    first = pool.run(CodeJob("cpp", code, timeout=30, env=env))
    second = pool.run(CodeJob("cpp", code, timeout=30, env=env))
    assert first.output == second.output == "own copy written\ncache unseen\n", (first.text, second.text)
    assert second.compile_cached


def test_an_artifact_changed_in_the_cache_is_compiled_again(pool):
    """The pool's own files changed under it (the sandbox keeps jobs out; a
    job without one runs as the pool's user): the hash check catches it."""
    code = _fresh(f"checked {time.time_ns()}")
    assert pool.run(CodeJob("cpp", code, timeout=30)).output.startswith("checked")
    before = pool.compile_cache
    for path in _cache_files(pool):
        os.chmod(path, 0o755)
        with open(path, "r+b") as f:
            f.seek(200)
            f.write(b"\xcc" * 16)
    result = pool.run(CodeJob("cpp", code, timeout=30))
    assert result.status is Status.OK and result.output.startswith("checked"), result.text
    assert pool.compile_cache.misses - before.misses == 1


def test_a_run_in_the_caller_s_directory_recompiles_a_changed_artifact_there(pool, tmp_path):
    """The retry after a failed check writes the caller's directory again:
    what the first attempt wrote there is taken away first."""
    code = _fresh(f"again {time.time_ns()}")
    assert pool.run(CodeJob("cpp", code, timeout=30)).ok
    for path in _cache_files(pool):
        os.chmod(path, 0o755)
        with open(path, "r+b") as f:
            f.seek(200)
            f.write(b"\xcc" * 16)
    result = pool.run(CodeJob("cpp", code, timeout=30, cwd=tmp_path, files={"in.txt": b"x"}))
    assert result.ok and result.output.startswith("again"), result.text


def test_a_compile_that_leaves_too_much_fails_saying_so(pool, monkeypatch):
    from execpool.pool import compile_cache as code_module

    monkeypatch.setattr(code_module, "ARTIFACT_MAX_BYTES", 1000)
    result = pool.run(CodeJob("c", f"int main(void) {{ return {time.time_ns() % 100}; }}\n", timeout=30))
    assert result.status is Status.ERROR and result.compile_failed and result.exit_code is None
    assert "execpool keeps at most 1000 files and 1000 bytes" in result.error, result.text
    assert result.text.startswith("Compilation failed. Execution error: the compile left 1 files of ")
    monkeypatch.setattr(code_module, "ARTIFACT_MAX_BYTES", 256 << 20)
    monkeypatch.setattr(code_module, "ARTIFACT_MAX_FILES", 0)
    many = pool.run(CodeJob("c", f"int main(void) {{ return {time.time_ns() % 100 + 1}; }}\n", timeout=30))
    assert many.compile_failed and "execpool keeps at most 0 files" in many.error


@pytest.mark.slow
@pytest.mark.nobody
def test_a_run_directory_the_program_made_unreadable_is_still_removed():
    """The pool's owner is nobody, so only its ownership, not a capability,
    lets its worker remove what the program locked (mode 0 on a directory)
    in the run's directory (a private one: no sandbox here)."""
    script = textwrap.dedent("""
        import os, sys, time
        from execpool import CodeJob, ExecPool
        with ExecPool(workers=1) as pool:
            code = 'mkdir -p locked/inner && touch locked/inner/f && chmod 0 locked && echo done'
            result = pool.run(CodeJob("bash", code, timeout=30))
            jobs_dir = pool._workers.all[0].jobs_dir
            def left():
                return sorted(name for name in os.listdir(jobs_dir) if not name.startswith(".")) + \\
                    os.listdir(os.path.join(jobs_dir, ".trash"))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and left():
                time.sleep(0.02)
            print(result.output.strip(), left())
    """)
    done = run_as_nobody(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "done []", done.stdout


@pytest.mark.slow
def test_removing_a_big_directory_holds_up_no_other_code_job():
    """Two programs leave 20 000 directories each in their run's directory
    (private ones: no sandbox); a cached C program sent as they end gets
    its Result while their directories are still being removed."""
    with ExecPool(workers=1) as one:
        c_program = _fresh(f"quick {time.time_ns()}")
        assert one.run(CodeJob("cpp", c_program, timeout=30)).ok
        flood = 'for my $i (1..20000) { mkdir "d$i" or last; } print "made\n";'
        floods = [one.submit(CodeJob("perl", flood, timeout=60)) for _ in range(2)]
        assert all(f.result(timeout=60).output == "made\n" for f in floods)
        quick = one.submit(CodeJob("cpp", c_program, timeout=30))
        trash = os.path.join(one._workers.all[0].jobs_dir, ".trash")
        assert os.listdir(trash)  # their removal has begun, not ended
        assert quick.result(timeout=30).ok
        assert wait_for(lambda: not os.listdir(trash), 60)


def test_a_compile_its_owner_and_then_its_last_waiter_left_is_cancelled(pool):
    code = slow_to_compile(1000)
    owner = pool.submit(CodeJob("cpp", code, timeout=30))
    waiter = pool.submit(CodeJob("cpp", code, timeout=30))
    assert wait_for(lambda: pool._code.cache.waiters() == 1 and pool.running_jobs == 1, 10)
    assert owner.cancel() and owner.result(timeout=5).status is Status.CANCELLED
    assert pool.running_jobs == 1  # the compile goes on for the waiter
    assert waiter.cancel() and waiter.result(timeout=5).status is Status.CANCELLED
    assert wait_for(lambda: pool.running_jobs == 0, 2.5)  # not the compile's whole 3 s


def _cache_files(pool) -> list:
    root = pool._code.cache.root
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def test_the_cache_stays_within_its_bytes():
    with ExecPool(workers=1, sandbox="strict", compile_cache_mb=0) as p:
        result = p.run(CodeJob("c", "int main(void){return 0;}", timeout=30))
        again = p.run(CodeJob("c", "int main(void){return 0;}", timeout=30))
        assert result.ok and again.ok and not again.compile_cached
        assert wait_for(lambda: _cache_files(p) == [], 5)


# -- cancelling ----------------------------------------------------------------------------------------------


def test_cancelling_a_run_kills_it(pool):
    assert pool.run(CodeJob("c", PROGRAMS["c"], stdin="compiled\n", timeout=30)).ok
    future = pool.submit(CodeJob("c", PROGRAMS["c"], stdin="hang\n", timeout=60))
    assert wait_for(lambda: pool.running_jobs == 1, 30)  # the run: the program was compiled
    assert future.cancel()
    result = future.result(timeout=10)
    assert result.status is Status.CANCELLED and result.compile_cached


@pytest.mark.slow
def test_a_job_waiting_for_another_s_compile_can_leave_without_stopping_it(pool):
    code = slow_to_compile(700)
    first = pool.submit(CodeJob("cpp", code, timeout=30))
    second = pool.submit(CodeJob("cpp", code, timeout=30))
    assert wait_for(lambda: pool._code.cache.waiters() == 1, 10)
    assert second.cancel()
    assert second.result(timeout=5).status is Status.CANCELLED
    assert pool._code.cache.waiters() == 0
    assert first.result(timeout=60).status is Status.OK


def test_cancelling_the_only_job_a_compile_is_for_kills_the_compile(pool):
    before = pool.compile_cache
    future = pool.submit(CodeJob("cpp", slow_to_compile(1000), timeout=30))
    assert wait_for(lambda: pool.running_jobs == 1, 10)
    started = time.monotonic()
    assert future.cancel()
    result = future.result(timeout=10)
    assert result.status is Status.CANCELLED and result.compile_status is Status.CANCELLED
    assert time.monotonic() - started < 2.5  # not the compile's whole 3 s
    assert pool.compile_cache.misses - before.misses == 1


def test_closing_the_pool_ends_every_code_job():
    p = ExecPool(workers=1, sandbox="strict")
    futures = [p.submit(CodeJob("c", PROGRAMS["c"], stdin="hang\n", timeout=60)) for _ in range(3)]
    assert wait_for(lambda: p.running_jobs > 0, 30)
    closer = threading.Thread(target=p.close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive()
    assert all(f.result(timeout=5).status in (Status.INFRA, Status.CANCELLED) for f in futures)


@pytest.mark.slow
def test_a_waiter_gives_up_at_its_own_compile_timeout_and_the_compile_goes_on(pool):
    code = slow_to_compile(1000)
    owner = pool.submit(CodeJob("cpp", code, timeout=30, compile_timeout=120))
    assert wait_for(lambda: pool.running_jobs == 1, 10)
    waiter = pool.run(CodeJob("cpp", code, timeout=30, compile_timeout=0.5))
    assert not owner.done()  # the waiter left at its own 0.5 s, the compile (3 s) goes on
    assert (waiter.status, waiter.compile_status, waiter.compile_result.timeout) == (Status.TIMEOUT,
                                                                                      Status.TIMEOUT, 0.5)
    assert owner.result(120).status is Status.OK


@pytest.mark.slow
def test_a_waiter_that_allows_longer_compiles_again_when_the_owner_timed_out(pool):
    """A job sending the same program with a tiny compile_timeout cannot
    make another's compile time out."""
    before = pool.compile_cache
    code = slow_to_compile(1000)
    owner = pool.submit(CodeJob("cpp", code, timeout=30, compile_timeout=0.5))
    waiter = pool.submit(CodeJob("cpp", code, timeout=30, compile_timeout=120))
    assert owner.result(30).compile_status is Status.TIMEOUT
    result = waiter.result(120)
    assert (result.status, result.compile_status) == (Status.OK, Status.OK), result.text
    assert pool.compile_cache.misses - before.misses == 2


@pytest.mark.slow
def test_a_cancelled_waiter_does_not_take_an_uncached_artifact_from_the_others():
    """Past the cache's bytes (here: none kept) a compiled program lives
    as long as its jobs still copy it; a waiter that left is not one."""
    with ExecPool(workers=2, sandbox="strict", compile_cache_mb=0) as own:
        code = slow_to_compile(700)
        jobs = [own.submit(CodeJob("cpp", code, timeout=30)) for _ in range(3)]
        assert wait_for(lambda: own._code.cache.waiters() == 2, 10)
        assert jobs[1].cancel() and jobs[1].result(5).status is Status.CANCELLED
        assert [jobs[n].result(60).status for n in (0, 2)] == [Status.OK, Status.OK]
        assert own.compile_cache.misses == 1
        assert wait_for(lambda: not own._code.cache._transient and not _cache_files(own), 5)


def test_files_cannot_take_the_program_s_own_names_as_directories():
    with pytest.raises(ValueError, match="files must not hold 'main.cpp/x': execpool writes 'main.cpp'"):
        CodeJob("cpp", "int main(){}", files={"main.cpp/x": b""})
    with pytest.raises(ValueError, match="longer than 255 bytes"):
        CodeJob("junit", "public class " + "A" * 300 + "Test { }")


@pytest.mark.slow
def test_the_sandbox_a_compile_had_is_in_its_key():
    """A compile with wider rights may have read what a strict one may not."""
    from execpool import Sandbox
    with ExecPool(workers=1, sandbox="strict") as own:
        program = _fresh(f"sandbox key {time.time_ns()}")
        first = own.run(CodeJob("cpp", program, timeout=30))
        wider = own.run(CodeJob("cpp", program, timeout=30, sandbox=Sandbox(read=("/root",))))
        unconfined = own.run(CodeJob("cpp", program, timeout=30, sandbox=False))
        again = own.run(CodeJob("cpp", program, timeout=30))
        assert [r.compile_cached for r in (first, wider, unconfined, again)] == [False, False, False, True]


_PROCESSOR = r'''
import java.util.Set;
import javax.annotation.processing.*;
import javax.lang.model.element.TypeElement;
@SupportedAnnotationTypes("*")
public class Stray extends AbstractProcessor {
    @Override public synchronized void init(ProcessingEnvironment env) {
        super.init(env);
        try {
            Process p = new ProcessBuilder("setsid", "sh", "-c",
                "env -i /bin/sleep 300 </dev/null >/dev/null 2>&1 & echo PIDS $!").start();
            System.out.print(new String(p.getInputStream().readAllBytes()));
            p.waitFor();
        } catch (Exception e) { throw new RuntimeException(e); }
    }
    @Override public boolean process(Set<? extends TypeElement> a, RoundEnvironment r) { return false; }
}
'''


@pytest.mark.slow
@needs("java")
def test_nothing_a_compile_started_outlives_it(pool, tmp_path, doomed):
    """javac runs the annotation processors a request's own files name: one
    that leaves a daemon in a session of its own with an empty environment
    (no job marker) must not keep it past the compile, where it could change
    what the compile left after the cache looked -- while another job keeps
    the worker busy, so no sweep of strays would find it."""
    from tests.support.helpers import all_dead, pids_in, remember
    (tmp_path / "Stray.java").write_text(_PROCESSOR)
    subprocess.run(["javac", "-d", str(tmp_path), str(tmp_path / "Stray.java")], check=True, timeout=120)
    files = {"Stray.class": (tmp_path / "Stray.class").read_bytes(),
             "META-INF/services/javax.annotation.processing.Processor": b"Stray\n"}
    busy = [pool.submit(ShellJob("sleep 60", timeout=120)) for _ in range(2)]
    try:
        result = pool.run(CodeJob("java", PROGRAMS["java"], files=files, stdin="x", timeout=30, compile_timeout=120))
        pids = pids_in(result.compile_output)
        remember(doomed, pids)
        assert result.status is Status.OK and len(pids) == 1, result.text
        assert all_dead(pids, timeout=5)
    finally:
        for job in busy:
            job.cancel()


@pytest.mark.slow
def test_waiters_on_a_first_failure_compile_it_once_more():
    """A failure may be the machine's: the jobs that waited for it do not
    take it from the cache; one of them compiles again, the others wait."""
    with ExecPool(workers=2, sandbox="strict") as own:
        code = slow_to_compile(700).replace("int main() {}", "static_assert(false, \"nope\");\nint main() {}")
        jobs = [own.submit(CodeJob("cpp", code, timeout=30)) for _ in range(4)]
        assert wait_for(lambda: own._code.cache.waiters() == 3, 10)
        results = [job.result(120) for job in jobs]
        assert all(r.compile_status is Status.ERROR and "nope" in r.compile_output for r in results)
        assert own.compile_cache.misses == 2
        assert not own._code.deadlines._heap  # each waiter's deadline went with its wait


def test_closing_the_pool_under_a_compile_others_wait_for_ends_every_job():
    """The worker dies and the pool closes before the compile's Result:
    its owner and every waiter still end, INFRA."""
    own = ExecPool(workers=1, sandbox="strict")
    try:
        code = slow_to_compile(1000)
        jobs = [own.submit(CodeJob("cpp", code, timeout=30)) for _ in range(3)]
        assert wait_for(lambda: own._code.cache.waiters() == 2 and own.running_jobs == 1, 10)
        os.kill(own.worker_pids[0], signal.SIGKILL)
    finally:
        own.close()
    assert [job.result(0).status for job in jobs] == [Status.INFRA] * 3
    assert not own._code.cache._pending


@pytest.mark.slow
def test_a_waiter_cancelled_as_it_comes_to_wait_is_not_left_counted(pool, monkeypatch):
    """A cancel between the cache counting a job as a waiter and the job
    saying it waits: the job still leaves the count (a count left over
    kept an orphaned compile alive)."""
    code = slow_to_compile(700)
    first = pool.submit(CodeJob("cpp", code, timeout=30))
    assert wait_for(lambda: pool.running_jobs == 1, 10)
    cache, real = pool._code.cache, pool._code.cache.claim
    submitted = threading.Event()
    jobs = {}

    def claim(key):
        found = real(key)
        if found[1] is not None and submitted.wait(10):
            jobs["second"].cancel()  # on the job's own step, right after it was counted
        return found

    monkeypatch.setattr(cache, "claim", claim)
    jobs["second"] = pool.submit(CodeJob("cpp", code, timeout=30))
    submitted.set()
    assert jobs["second"].result(10).status is Status.CANCELLED
    assert wait_for(lambda: cache.waiters() == 0, 5)
    assert first.result(60).status is Status.OK
