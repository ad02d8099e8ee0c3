"""Files into a job's directory before it starts (``files=``) and out of it
after (``fetch=``, ``Result.files``): written and read by its worker, by
descriptor, confined to the directory whatever the request asks or the job
plants (execpool/worker/files.py); and a caller's directory given back as
it was."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import pytest

from execpool import CodeJob, ExecPool, File, PythonJob, ShellJob, Status, sandbox_support
from execpool.formats.request import BadField, check_path
from execpool.shared.files import FETCH_MAX_FILES
from tests.support.helpers import run_as_nobody, wait_for

SANDBOXES = [False, pytest.param("strict", marks=pytest.mark.skipif(not sandbox_support().available,
                                                                    reason="the kernel lacks the sandbox"))]


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:
        yield p


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "", "a//b", "./a", "a/.", "a\x00b", "a/"])
def test_paths_that_leave_or_are_not_plain_are_refused_before_anything_runs(path):
    with pytest.raises(BadField, match="file path"):
        check_path("file path", path)
    with pytest.raises(ValueError, match="files"):
        ShellJob("true", files={path: b"x"})
    with pytest.raises(ValueError, match="fetch"):
        ShellJob("true", fetch=[path])


@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize("kind", ["shell", "cold", "warm"])
def test_files_go_in_and_come_back_with_their_modes(pool, sandbox, kind):
    given = {"in.txt": b"hello\n", "data/deep/n.bin": bytes(range(256)), "run.sh": File(b"echo ran\n", 0o755)}
    script = "cat in.txt; wc -c < data/deep/n.bin; ./run.sh; mkdir -p out; printf made > out/r.txt; chmod 600 out/r.txt"
    fetch = ["out/*", "data/deep/n.bin", "run.sh", "missing.txt", "*.nothing"]
    if kind == "shell":
        job = ShellJob(script, files=given, fetch=fetch, sandbox=sandbox)
    else:
        job = PythonJob(f"import subprocess\nsubprocess.run({script!r}, shell=True)", files=given, fetch=fetch,
                        sandbox=sandbox, warm=kind == "warm")
    result = pool.run(job)
    assert result.status is Status.OK and result.output == "hello\n256\nran\n", result.text
    assert result.files == {"out/r.txt": File(b"made", 0o600), "data/deep/n.bin": File(bytes(range(256))),
                            "run.sh": File(b"echo ran\n", 0o755)}
    assert result.files_left_out == ()


def test_a_fetch_past_its_bound_says_what_it_left_out(pool):
    made = pool.run(ShellJob(f"seq 1 {FETCH_MAX_FILES + 5} | while read n; do echo $n > f$n.txt; done",
                             fetch=["*.txt"]))
    assert made.status is Status.OK, made.text
    assert len(made.files) == FETCH_MAX_FILES and len(made.files_left_out) == 5
    assert not set(made.files) & set(made.files_left_out)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_in_a_callers_directory_its_files_win_the_run_and_the_callers_come_back(pool, tmp_path, sandbox):
    """The program's files are there for its run, a file of the caller's of
    the same name waits aside meanwhile (a CodeJob in a directory holding
    its source failed with "File exists", and then deleted the caller's
    file), and the directory ends as it was but for what the job wrote."""
    (tmp_path / "main.c").write_text("the caller's")
    (tmp_path / "keep.txt").write_text("kept")
    result = pool.run(ShellJob("cat main.c; echo; cat keep.txt; echo; echo out > made-by-job.txt",
                               files={"main.c": b"the job's", "sub/x.txt": b"x"}, cwd=str(tmp_path),
                               sandbox=sandbox))
    assert result.output == "the job's\nkept\n", result.text
    assert sorted(os.listdir(tmp_path)) == ["keep.txt", "made-by-job.txt", "main.c"]
    assert (tmp_path / "main.c").read_text() == "the caller's"


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_codejob_in_a_directory_holding_its_source_runs_and_leaves_the_callers_files(pool, tmp_path, sandbox):
    (tmp_path / "main.c").write_text("int not_the_program;")
    (tmp_path / "test").write_text("the caller's own test")
    program = '#include <stdio.h>\nint main(void) { puts("ran"); return 0; }\n'
    for _ in range(2):  # the second finds what the first left: nothing
        result = pool.run(CodeJob("c", program, cwd=str(tmp_path), sandbox=sandbox))
        assert result.status is Status.OK and result.output == "ran\n", result.text
    assert sorted(os.listdir(tmp_path)) == ["main.c", "test"]
    assert (tmp_path / "main.c").read_text() == "int not_the_program;"
    assert (tmp_path / "test").read_text() == "the caller's own test"


def test_links_a_job_planted_are_never_followed(tmp_path, pool):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("SECRET")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    command = (f"ln -s {outside}/secret link; ln -s {outside} dir; mkdir real; ln -s {outside}/secret real/link; "
               "echo planted")
    planted = pool.run(ShellJob(command, cwd=str(job_dir), fetch=["link", "dir/secret", "real/link", "dir/*"]))
    assert planted.output == "planted\n" and planted.files == {}, planted.files
    through = pool.run(ShellJob("echo ran", cwd=str(job_dir), files={"dir/new": b"x"}))
    assert through.status is Status.ERROR and "'dir/new'" in through.text, through.text
    assert sorted(os.listdir(outside)) == ["secret"], "something was written through the planted link"
    assert sorted(os.listdir(job_dir)) == ["dir", "link", "real"]


def test_a_fifo_or_a_device_is_left_out_and_blocks_nothing(pool):
    result = pool.run(ShellJob("mkfifo pipe; ln -s /dev/zero zero; mknod -m 666 null c 1 3 2>/dev/null; echo ok",
                               fetch=["pipe", "zero", "null"], timeout=30))
    assert result.output == "ok\n" and result.files == {}, result.text


@pytest.mark.skipif(not sandbox_support().available, reason="the kernel lacks the sandbox")
def test_files_that_do_not_fit_the_disk_bound_are_the_jobs_failure_not_execpools(pool):
    from execpool import Limits

    result = pool.run(ShellJob("echo never", files={"big": b"x" * (4 << 20)}, limits=Limits(disk=2 << 20),
                               sandbox="strict"))
    assert result.status is Status.ERROR and "'big'" in result.text and "No space left" in result.text, result.text


#: A sandboxed session that shares the caller's directory with CodeJobs
#: and swaps the compiled program for a link to a file outside every view
#: the moment it is there (the pool once wrote the program, then chmod-ed
#: it by path: it set the host file to 0755, first try).
SWAPPER = textwrap.dedent("""\
    import os, stat, threading
    def swap(target):
        while True:
            try:
                if stat.S_ISREG(os.lstat("test").st_mode):
                    os.unlink("test")
                    os.symlink(target, "test")
            except OSError:
                pass
    threading.Thread(target=swap, args=(TARGET,), daemon=True).start()
""")

#: Run by the pool's owner as root and as nobody: a file outside every
#: view (0600, in a 0700 directory), a shared directory, the swapper and
#: C CodeJobs whose program is 48 MB (time to swap it while it is
#: written); the file's mode and bytes after, and how the jobs ended.
RACE = textwrap.dedent("""\
    import json, os, sys
    from execpool import CodeJob, ExecPool
    base = sys.argv[1]
    private = os.path.join(base, "private")
    os.mkdir(private, 0o700)
    target = os.path.join(private, "host-file")
    with open(target, "w") as f:
        f.write("host")
    os.chmod(target, 0o600)
    shared = os.path.join(base, "shared")
    os.mkdir(shared, 0o755)
    program = ('#include <stdio.h>\\nstatic volatile char big[48 << 20] = {1};\\n'
               'int main(void) { puts(big[0] ? "ran" : "?"); return 0; }\\n')
    outcomes = []
    with ExecPool(workers=2) as pool:
        with pool.session("python", sandbox="strict", cwd=shared) as swapper:
            started = swapper.run(SWAPPER.replace("TARGET", repr(target)))
            assert started.status == "ok", started.text
            for n in range(6):
                result = pool.run(CodeJob("c", program + "/* %d */" % (n % 2), cwd=shared, sandbox="strict"))
                outcomes.append(result.status.value)
    print(json.dumps({"mode": oct(os.stat(target).st_mode & 0o7777), "bytes": open(target).read(),
                      "outcomes": sorted(set(outcomes))}))
""")


@pytest.mark.slow
@pytest.mark.hostile
@pytest.mark.skipif(not sandbox_support().available, reason="the kernel lacks the sandbox")
@pytest.mark.parametrize("user", ["root", pytest.param("nobody", marks=pytest.mark.nobody)])
def test_a_tenant_swapping_names_for_links_changes_no_host_file(user, tmp_path):
    script = RACE.replace("SWAPPER", repr(SWAPPER))
    if user == "nobody":
        done = run_as_nobody(script)
    else:
        import subprocess
        import sys

        os.chmod(tmp_path, 0o755)
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["mode"] == oct(0o600) and seen["bytes"] == "host", seen
    assert "infra" not in seen["outcomes"], seen


def test_what_waits_aside_is_put_back_when_the_job_is_cancelled(pool, tmp_path):
    (tmp_path / "a.txt").write_text("the caller's")
    future = pool.submit(ShellJob("echo started; exec sleep 60", files={"a.txt": b"the job's"}, cwd=str(tmp_path)))
    assert wait_for(lambda: (tmp_path / "a.txt").read_text() == "the job's", 10.0)
    assert future.cancel()
    assert future.result(10).status is Status.CANCELLED
    assert sorted(os.listdir(tmp_path)) == ["a.txt"] and (tmp_path / "a.txt").read_text() == "the caller's"
    assert stat.S_IMODE(os.stat(tmp_path / "a.txt").st_mode) == 0o644
