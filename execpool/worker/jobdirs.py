"""Jobs' private directories: made where no job can guess them, taken off
their path the moment the job ends, deleted once its Result is out.

Runs in the worker process, on its loop. A job without a ``cwd`` (and a
sandboxed job's private ``TMPDIR``) gets a fresh directory in the worker's
``jobs_dir``, which the pool made and removes when the worker is gone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Optional

from ..shared.kernel.dirs import remove_tree


class JobDirs:
    """The worker's ``jobs_dir``, and its trash: where a job's directory
    goes when the job ends. A rename is a quarter of an rmdir here, and the
    rmdir can wait until the Result is out (the pool removes whatever is
    left with ``jobs_dir``)."""

    def __init__(self, jobs_dir: str) -> None:
        self.jobs_dir = jobs_dir
        self.trash = os.path.join(jobs_dir, ".trash")
        os.mkdir(self.trash, 0o700)

    def private(self) -> str:
        """A new private directory. A job runs as the worker's user and can
        move ``jobs_dir`` away (its own directory's parent): it is made
        again -- same path, which the pool and the lifeline remove -- rather
        than every later job failing to start."""
        try:
            return tempfile.mkdtemp(dir=self.jobs_dir)
        except FileNotFoundError:
            for path in (self.jobs_dir, self.trash):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
            return tempfile.mkdtemp(dir=self.jobs_dir)

    def discard(self, path: str) -> Optional[str]:
        """Take a private directory off its path now; return where it went,
        for the caller to ``remove`` once the Result is out (None: gone
        already)."""
        trashed = os.path.join(self.trash, os.path.basename(path))
        try:
            os.rename(path, trashed)
        except OSError:
            remove(path)
            return None
        return trashed


def remove(path: str) -> None:
    """Whatever a job left at ``path``, never following a link it put
    there. Most private directories are empty: one rmdir, not a walk."""
    try:
        os.rmdir(path)
    except NotADirectoryError:
        unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        remove_tree(path)


def unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
