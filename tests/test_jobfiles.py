"""Files into and out of a job's directory: confined to it whatever the
request asks or the job plants (execpool/pool/files.py)."""

from __future__ import annotations

import os
import threading

import pytest

from execpool import ExecPool, ShellJob
from execpool.formats.request import BadField, check_path
from execpool.pool.files import JobFileError, read_files, write_files


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=1) as p:
        yield p


@pytest.mark.parametrize("path", ["../x", "a/../../x", "/etc/passwd", "", "a//b", "./a", "a/.", "a\x00b", "a/"])
def test_paths_that_leave_or_are_not_plain_are_refused_before_anything_runs(path):
    with pytest.raises(BadField, match="file path"):
        check_path("file path", path)


def test_files_go_in_and_come_back(tmp_path, pool):
    write_files(str(tmp_path), {"in.txt": b"hello\n", "data/deep/n.bin": bytes(range(256))})
    result = pool.run(ShellJob("cat in.txt; wc -c < data/deep/n.bin; mkdir -p out; printf made > out/r.txt",
                               cwd=str(tmp_path)))
    assert result.output == "hello\n256\n"
    got = read_files(str(tmp_path), ["out/r.txt", "data/deep/n.bin", "missing.txt"])
    assert got == {"out/r.txt": b"made", "data/deep/n.bin": bytes(range(256))}


def test_an_existing_file_is_not_overwritten_through_a_second_write(tmp_path):
    write_files(str(tmp_path), {"a.txt": b"1"})
    with pytest.raises(JobFileError, match="a.txt"):
        write_files(str(tmp_path), {"a.txt": b"2"})


def test_symlinks_a_job_planted_are_never_followed(tmp_path, pool):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("SECRET")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    command = (f"ln -s {outside}/secret link; ln -s {outside} dir; mkdir real; ln -s {outside}/secret real/link; "
               "echo planted")
    assert pool.run(ShellJob(command, cwd=str(job_dir))).output == "planted\n"
    assert read_files(str(job_dir), ["link", "dir/secret", "real/link"]) == {}
    with pytest.raises(JobFileError, match="dir"):
        write_files(str(job_dir), {"dir/new": b"x"})
    assert sorted(os.listdir(outside)) == ["secret"], "nothing was written through the planted link"


def test_a_fifo_or_a_device_does_not_block_the_reader_and_is_left_out(tmp_path, pool):
    assert pool.run(ShellJob("mkfifo pipe; ln -s /dev/zero zero; echo ok", cwd=str(tmp_path))).output == "ok\n"
    got = {}
    reader = threading.Thread(target=lambda: got.update(read_files(str(tmp_path), ["pipe", "zero"])))
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert got == {}


def test_a_file_over_the_limit_is_left_out(tmp_path):
    write_files(str(tmp_path), {"small": b"x" * 10, "big": b"x" * 11})
    assert read_files(str(tmp_path), ["small", "big"], max_bytes=10) == {"small": b"x" * 10}
