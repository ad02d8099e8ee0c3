"""The exceptions execpool raises about itself, under one root.

Shared, though only the caller's side raises them: misuse of an argument is
a ``TypeError`` or ``ValueError`` naming it (execpool/shared/checks.py), and
a job's own failure is never an exception but a Result. What is left is the
pool's state -- closed, or unable to run anything -- and a caller that
wants to catch "execpool could not take this" catches ``ExecPoolError``.
"""

from __future__ import annotations


class ExecPoolError(Exception):
    """The root of the errors execpool raises about its own state."""


class PoolClosedError(ExecPoolError, ValueError, RuntimeError):
    """The pool was closed: a ValueError like I/O on a closed file, and a
    RuntimeError like submitting to a shut-down executor."""


class PoolBrokenError(ExecPoolError, RuntimeError):
    """The pool has no worker to run a job: its workers cannot start (a
    broken interpreter or package -- for good), or every worker died at
    once and none could be started again yet (a passing shortage of
    processes or descriptors). The message says which."""


class SessionClosedError(ExecPoolError, RuntimeError):
    """A cell was sent to a session that is closed or gone (closed by its
    owner, idle past its timeout, killed after an ignored interrupt, its
    worker dead, its pool closed). The message says which."""


class SessionForkError(ExecPoolError, RuntimeError):
    """``Session.fork()`` made no copy: the session cannot be forked (a bash
    session, a sandboxed family that used its forks -- docs/library/sessions.md says
    which), or the copy could not start. The message says which; the
    session itself goes on."""


class DiskBudgetError(ExecPoolError, RuntimeError):
    """A session (or a session's fork) whose disk bound does not fit its
    pool's disk budget now: the spaces of the sandboxed jobs and sessions
    alive take it (execpool/pool/budget.py). A session does not wait for
    room, as a job does: close one, or ask for a smaller bound."""
