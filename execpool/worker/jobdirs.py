"""Jobs' private directories: made where no job can guess them, taken off
their path the moment the job ends, deleted once its Result is out -- by a
helper when there is more to delete than an empty directory; and jobs'
spaces (execpool/worker/space.py) let go of by the same helper.

Runs in the worker process, on its loop, and in its **remover**
(``_remove_trash``), a fork of the worker (execpool/worker/helper_forks.py). A
job without a ``cwd`` (and a sandboxed job's private ``TMPDIR``) gets a
fresh directory in the worker's ``jobs_dir``, which the pool made and
removes when the worker is gone. What a job leaves in it is the job's
choice: five seconds of ``mkdir`` left 70 000 directories, a minute of the
worker's loop to remove, during which no other job's timeout was enforced
and the watchdog killed the worker. The loop's part is now a rename and,
for the common empty directory, an rmdir; the rest is the remover's, on
whichever core is free. It runs at the jobs' priority, not below: on a
saturated machine a lower one starved it, and the leftovers piled up for
the pool to remove when the worker died. And it keeps more than one
removal in flight (``REMOVER_IN_FLIGHT``): one at a time, it starved at
that priority too. A space goes to it too, by its descriptor: the kernel
frees a tmpfs when its last holder lets go, in that holder's time -- 128
ms for sixty thousand directories here, 50 ms for every 200 MB.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import tempfile
from typing import Iterable, Optional, Sequence

from ..shared.kernel.dirs import TRASH, make_own, remove_tree
from .helper_forks import REMOVER_NAME, fork_helper

logger = logging.getLogger("execpool")

#: How many directories the remover removes at once. Each ``rmdir`` may
#: wait in the kernel -- on ext4 without a journal, mounted with
#: ``discard``, for a synchronous discard of the block it frees, as long
#: as the removal's own work or longer -- and a remover with nothing else
#: to run left the run queue at every one. Alone in its autogroup (the
#: worker's session; each job has one of its own), it got the CPU back
#: from a busy job only at the tick that ended that job's slice: 3.4 ms
#: for each few tens of microseconds of its own work. With a busy loop on
#: each of two CPUs, a 60 000-directory flood took 221 s to remove, not
#: 6.5 s, at 2% of a CPU. More weight did not shorten those waits (its
#: autogroup at nice -5 waited as long). While one removal waits, the
#: others run and keep its autogroup on the run queue, if there are enough
#: of them to cover the wait: two fell into step and slept together
#: (43-59 s); four took 5-8 s (3.4-3.9 s on a quiet machine).
REMOVER_IN_FLIGHT = 4


class JobDirs:
    """The worker's ``jobs_dir``, and its trash: where a job's directory
    goes when the job ends. A rename is a quarter of an rmdir here, and the
    rmdir can wait until the Result is out (the pool removes whatever is
    left with ``jobs_dir``)."""

    def __init__(self, jobs_dir: str) -> None:
        self.jobs_dir = jobs_dir
        self.trash = os.path.join(jobs_dir, TRASH)
        os.mkdir(self.trash, 0o700)
        #: The remover's pid (0: none yet), and the socket that wakes it
        #: (and carries it what to let go of).
        self.remover = 0
        self._wake: Optional[socket.socket] = None

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
        for the caller to :meth:`collect` once the Result is out (None: gone
        already, or left where it is). Never a removal here: a job can make
        the rename fail -- ``chmod 555`` on its own directory (a directory
        moves only with the right to rewrite its ``..``; root needs no
        right), or a file where the trash was (without the sandbox) -- and
        the removal of its sixty thousand directories would then hold up
        the worker's loop. Its rights are given back, the trash made again;
        what still cannot move stays for the pool to remove with
        ``jobs_dir``."""
        trashed = os.path.join(self.trash, os.path.basename(path))
        for attempt in range(3):
            try:
                os.rename(path, trashed)
                return trashed
            except FileNotFoundError:
                if not os.path.lexists(path):
                    return None
            except OSError:
                pass
            if attempt == 0:
                with contextlib.suppress(OSError):
                    make_own(path, None)
            else:
                self._renew_trash()
        logger.warning("execpool: cannot move %s to the trash; it stays until its worker is gone", path)
        return None

    def _renew_trash(self) -> None:
        """A trash that is no longer a directory of the worker's: moved
        aside (the pool removes it with ``jobs_dir``) and made again."""
        with contextlib.suppress(OSError):
            os.rename(self.trash, f"{self.trash}-{secrets.token_hex(8)}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.trash, 0o700)

    def drop(self, path: str) -> None:
        """:meth:`discard` and :meth:`collect` at once: a directory no Result waits for."""
        trashed = self.discard(path)
        if trashed is not None:
            self.collect(trashed)

    def collect(self, trashed: str, script: Optional[str] = None) -> None:
        """Delete a directory :meth:`discard` moved to the trash, with the
        job's ``script`` in it: here when that leaves it empty (one rmdir,
        most jobs), else by the remover, which empties the whole trash
        each time it is woken."""
        if script is not None:
            unlink(os.path.join(trashed, os.path.basename(script)))
        try:
            os.rmdir(trashed)
            if os.stat(self.trash).st_nlink <= 2:
                return
            # Directories in the trash that no job of this worker put there:
            # a dead worker's, which the pool hands over (execpool/pool/workers.py).
        except FileNotFoundError:
            return
        except OSError:
            pass
        self._wake_remover()

    def release(self, fds: Iterable[int]) -> None:
        """Let go of descriptors whose last close may be long -- a space
        whose job left a flood in it, a namespace holding one -- in the
        remover; closed here where it cannot take them."""
        given = list(fds)
        if given and not self._wake_remover(given):
            for fd in given:
                os.close(fd)

    def _wake_remover(self, fds: Sequence[int] = ()) -> bool:
        """Wake the remover (with ``fds`` to close, which are its from
        then on); whether it took them."""
        for _ in range(2):  # once more with a new remover if the last one died
            wake = self._wake if self._wake is not None else self._start_remover()
            if wake is None:
                return False
            try:
                socket.send_fds(wake, [b"."], fds) if fds else wake.send(b".")
            except BlockingIOError:
                return not fds  # woken already, and not yet awake: it will look at the trash
            except OSError:  # it died: reaped by the worker's loop
                wake.close()
                self._wake, self.remover = None, 0
                continue
            for fd in fds:
                os.close(fd)  # the remover has its own now
            return True
        return False

    def _start_remover(self) -> Optional[socket.socket]:
        """The new remover's wake; None where the machine refuses it a
        process now (the next wake tries again): what was to be its to let
        go of is let go of here, and the trash waits."""
        try:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:
            return None
        with theirs:
            try:
                self.remover = fork_helper(REMOVER_NAME, (theirs.fileno(),), lambda: _remove_trash(theirs, self.trash))
            except OSError as exc:
                ours.close()
                logger.warning("execpool: cannot start the remover of jobs' directories now (%s)", exc.strerror)
                return None
        ours.setblocking(False)
        self._wake = ours
        return ours

    def close(self) -> None:
        """Let the remover finish the trash and exit, and wait for it: the
        worker stops (retired, or its pool closes -- which bounds the wait
        by killing the worker, and the remover with it). Left to the pool,
        a flood's directories would be removed by the pool's own process."""
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self.remover:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.remover, 0)
            self.remover = 0


#: Descriptors one wake may carry: a space and its directories.
_RELEASED_AT_ONCE = 16


def _remove_trash(wake: socket.socket, trash: str) -> None:
    """The remover's life: let go of what the worker sends and empty the
    trash each time the worker wakes it, and once more when the worker
    lets it go. Whatever one pass cannot remove (a job made it unremovable)
    stays until the next, and with ``jobs_dir`` until the pool removes that."""
    while True:
        woken, fds, _flags, _address = socket.recv_fds(wake, 1 << 12, _RELEASED_AT_ONCE)
        for fd in fds:
            os.close(fd)
        try:
            names = os.listdir(trash)
        except OSError:
            names = []
        for name in names:
            remove(os.path.join(trash, name), REMOVER_IN_FLIGHT)
        if not woken:
            return


def remove(path: str, in_flight: int = 1) -> None:
    """Whatever a job left at ``path``, never following a link it put
    there. Most private directories are empty: one rmdir, not a walk
    (``in_flight``: see :func:`remove_tree`)."""
    try:
        os.rmdir(path)
    except NotADirectoryError:
        unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        remove_tree(path, in_flight)


def unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
