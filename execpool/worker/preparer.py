"""A sandboxed job's own namespace, made before the job comes, by a helper
of the worker.

Who runs this module: the worker (``Ahead``, on its loop) and its
**preparer** (``_prepare``), a fork of the worker made once per template,
which lives until the template changes or the worker stops. A job's view
(execpool/sandbox/view.py) is the worker's template copied, with what is the
job's own mounted in the copy: its home (its private directory), its
``/tmp`` and its ``/dev/shm``. Made in the tool's new process, that copy,
those mounts, the job's private directory and its Landlock ruleset were
most of what the sandbox added to a job's start. The preparer makes them
ahead -- the space (execpool/worker/space.py), the ruleset, and a mount
namespace a short-lived child leaves behind
(execpool.tool._spawn.prepare_view) -- on whichever core is free, and
sends the worker their descriptors; the job's tool only enters the
namespace. The worker keeps it until the job's Result is out and closes
it then, so that its teardown is not on the job's way out.

Only for jobs that have nothing but what is their own: the strict sandbox as
it is (``Sandbox()``: no paths, no ports), no ``cwd``, the interpreter and
disk bound it was made for, the template it was made in. Any other job, and
one that finds nothing ready, has its view made in its tool's process as
before. What is made for one job is given to that job alone: a namespace is
entered by one job's processes only, and a space is one job's.

The socket between them carries a request (an interpreter's path and a
disk bound) one way and, the other way, a made job's space's, ruleset's and
mount namespace's descriptors, or the reason it could not be made. The
job's own user namespace (execpool/worker/userns.py) is the worker's to
give, as the job takes what was made.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import selectors
import signal
import socket
from dataclasses import dataclass
from typing import Callable, Deque, Optional, Tuple

from ..sandbox.enter import child_arguments
from ..sandbox.rulesets import Confiner
from ..sandbox.view import HOME, Template, View, Views
from ..shared.kernel.sandbox import Sandbox
from ..tool.become import _spawn
from . import space
from .helper_forks import PREPARER_NAME, fork_helper

logger = logging.getLogger("execpool")

#: The only sandbox a namespace is made ahead for.
_STRICT = Sandbox()
#: How many are made ahead at most: one for the next job, one for the job
#: that comes before the preparer is done with the next.
STOCK = 2


@dataclass
class Made:
    """One job's own part of its view, ready: its space, its ruleset (the
    only layer a job with a view enters) and its view, whose namespace is
    made."""

    wanted: Tuple[str, Optional[int]]  # (interpreter, disk bound)
    template: Template
    space: space.Space
    ruleset: int
    view: View

    def discard(self, release: Callable[[list], None]) -> None:
        os.close(self.ruleset)
        self.view.close()
        release([self.space.take()])


class Ahead:
    """The worker's side: its preparer, and what it has made that no job
    has taken yet."""

    def __init__(self, sel: selectors.BaseSelector, release: Callable[[list], None]) -> None:
        #: The worker's selector, which takes what the preparer sends as it
        #: comes (the worker holds what is made, not the socket); what lets
        #: go of a space's descriptor (the worker's remover).
        self.sel = sel
        self.release = release
        self.stock: Deque[Made] = collections.deque()
        #: The interpreter and disk bound of the last job that could have
        #: used one.
        self.wanted: Optional[Tuple[str, Optional[int]]] = None
        self._asked = 0
        self._sock: Optional[socket.socket] = None
        self._pid = 0
        self._template: Optional[Template] = None
        #: The preparer failed: said once, never tried again.
        self.failed = False

    @staticmethod
    def fits(cwd: Optional[str], box: Optional[Sandbox]) -> bool:
        return _spawn is not None and cwd is None and box == _STRICT

    def take(self, python: str, disk: Optional[int], template: Template) -> Optional[Made]:
        """What was made for a job that fits, if made for its interpreter and
        disk bound in the current ``template``; the caller's from here."""
        self.wanted = (python, disk)
        if template is not self._template:
            self._stop()
            return None
        self._receive()
        while self.stock:
            made = self.stock.popleft()
            if made.wanted == self.wanted:
                return made
            made.discard(self.release)
        return None

    def ask(self, confiner: Confiner, views: Views) -> None:
        """Ask for as many as the stock lacks, once a Result is out (the
        preparer is made at the first ask, in the current template)."""
        if self.wanted is None or self.failed or views.template is None:
            return
        if self._sock is None or views.template is not self._template:
            self._stop()
            try:
                self._start(confiner, views, views.template)
            except OSError as exc:  # no process to spare now: the next Result asks again
                logger.debug("execpool: the preparer cannot start now (%s)", exc.strerror)
                return
        self._receive()
        while self._sock is not None and len(self.stock) + self._asked < STOCK:
            try:
                self._sock.send(json.dumps(self.wanted).encode())
            except OSError as exc:
                self._fail(f"the preparer is gone ({exc.strerror})")
                return
            self._asked += 1

    def _start(self, confiner: Confiner, views: Views, template: Template) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        keep = {theirs.fileno(), *template.descriptors(), *confiner.descriptors()}
        with theirs:
            try:
                pid = fork_helper(PREPARER_NAME, keep, lambda: _prepare(theirs, confiner, views, template))
            except OSError:
                ours.close()
                raise
        ours.setblocking(False)
        self._sock, self._pid, self._template = ours, pid, template
        self.sel.register(ours, selectors.EVENT_READ, lambda _fd: self._receive())

    def _receive(self) -> None:
        """What the preparer has sent since: made jobs, or why not."""
        while self._sock is not None:
            try:
                message, fds, _flags, _addr = socket.recv_fds(self._sock, 1 << 12, 3)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(f"the preparer is gone ({exc.strerror})")
                return
            if not message:
                self._fail("the preparer is gone")
                return
            self._asked -= 1
            reply = json.loads(message)
            if "error" in reply or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                self._fail(reply.get("error", "no descriptors"))
                return
            assert self._template is not None
            space_fd, ruleset, mnt_fd = fds
            template = self._template
            user_fd = -1 if template.user_fd < 0 else os.dup(template.user_fd)
            python, disk = reply["wanted"]
            view = View(user_fd, mnt_fd, (), HOME, own_namespace=True)
            self.stock.append(Made((python, disk), template, space.Space(space_fd, disk), ruleset, view))

    def _fail(self, why: str) -> None:
        logger.warning("execpool: sandboxed jobs' namespaces cannot be made ahead here (%s); "
                       "each job's is made as it starts", why)
        self.failed = True
        self._stop()

    def _stop(self) -> None:
        """The preparer killed and what it made discarded: it was made for
        a template that is not the current one, or the worker stops."""
        if self._sock is not None:
            self.sel.unregister(self._sock)
            self._sock.close()
            self._sock = None
        if self._pid:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            self._pid = 0
        self._template = None
        self._asked = 0
        while self.stock:
            self.stock.popleft().discard(self.release)

    def close(self) -> None:
        self._stop()

    @property
    def pid(self) -> int:
        """The preparer's pid (0: none), which the worker's sweeps leave alone."""
        return self._pid


def _prepare(sock: socket.socket, confiner: Confiner, views: Views, template: Template) -> None:
    """The preparer's life (execpool/worker/helper_forks.py: what it keeps of the
    worker's, the template and the ruleset maker's descriptors besides its
    socket): a job's own part made for each request, until the socket closes."""
    while True:
        try:
            request = sock.recv(1 << 12)
        except InterruptedError:
            continue
        if not request:
            return
        python, disk = json.loads(request)
        made = None
        try:
            made = space.make(disk, template.user_fd, template.mnt_fd if template.user_fd >= 0 else -1)
            plan = views.plan_own(template, made.fd, python)
            if plan is None:
                raise OSError(errno.ESTALE, "the template lacks a directory the job's view needs")
            try:
                handles = made.handles()
                try:
                    ruleset, = confiner.rulesets(python, _STRICT, handles, template)
                finally:
                    for fd in handles:
                        os.close(fd)
                try:
                    mnt_fd = _spawn.prepare_view(child_arguments((ruleset,), plan.arguments()))
                except BaseException:
                    os.close(ruleset)
                    raise
            finally:
                plan.close()
        except OSError as exc:
            if made is not None:
                made.close()
            sock.send(json.dumps({"error": str(exc)}).encode())
            continue
        try:
            socket.send_fds(sock, [json.dumps({"wanted": [python, disk]}).encode()], [made.fd, ruleset, mnt_fd])
        finally:
            made.close()
            os.close(ruleset)
            os.close(mnt_fd)
