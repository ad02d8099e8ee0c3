"""The words between a worker and its warm spares: how a job is handed to a
spare and what the spare answers.

Worker side, and the spare's: the worker (execpool/worker/warm/handover.py
and supply.py) writes these, a spare (execpool/tool/spare.py) reads
them, and both are code of the worker's folder -- a spare is a clone of the
worker's template, never anything of the caller's.

The hand-over is one ``SCM_RIGHTS`` message of descriptors: the job's
description as marshal data in an anonymous file (no unpickling, nothing
but strings, numbers and booleans), its stdin, its stdout and stderr (one
pipe twice unless the job keeps them apart), the ready pipe, the job's
sandbox rulesets when it has them, and its cgroup files.
"""

from __future__ import annotations

import marshal
import resource
import struct
from typing import List, Optional

from ..shared.jobs import Limits
from .become import RLIMIT_FIELDS, Setup, rlimit_values

#: Spare -> worker, over the template's channel: the spare's pid, its
#: socket passed along.
SPARE_PID = struct.Struct("=i")

#: Worker -> spare: the hand-over's one message, and the descriptors it
#: carries (description, stdin, stdout, stderr, ready pipe, then the
#: sandbox's rulesets, as many as the description says, then its view's
#: namespaces and space when it has one, then cgroup files).
JOB = b"job"
FIXED_FDS = 5
MAX_RULESETS = 2
MAX_VIEW_FDS = 4
MAX_CGROUP_FDS = 8

#: A spare's first word on the ready pipe: it has the job. A spare that dies
#: before saying it was killed while parked, and the job goes to another.
TAKEN = b"\x01"

#: Said with TAKEN, in the same write: the CPU seconds (user, system) the
#: spare had spent until then -- its clone, its wait, its rehearsals. They
#: are in its ``wait4`` figures but are not the job's, and the worker takes
#: them off, so a warm job's CPU is its own. Written before any of the job's
#: code runs, and the pipe is closed before it does: the job cannot forge it.
SPENT = struct.Struct("=dd")

#: Worker -> parked spare: rehearse a warm start now (execpool/tool/spare.py),
#: taking the copy-on-write faults a job would take. Only a worker idle for
#: REHEARSE_WHEN_IDLE_S asks: a busy worker's spares are taken soon, and
#: there a rehearsal would only spend CPU that a batch is short of.
REHEARSE = b"rehearse"
#: The same, and a silent cell through the template's IPython shell
#: (execpool/tool/ipython_shell.py): asked of the spares of a worker that
#: has started a session speaking IPython, since it costs every spare CPU
#: (2 ms) that only such a session's first cells get back.
REHEARSE_SHELL = b"rehearse shell"
REHEARSE_WHEN_IDLE_S = 0.01

#: What ``ps`` calls a worker's template and its parked spares.
TEMPLATE_NAME = "execpool-templ"
SPARE_NAME = "execpool-spare"


def encode_job(script: str, env: dict, setup: Setup) -> bytes:
    """marshal, not pickle: it builds plain values in C -- no class is
    looked up, nothing is called -- and it runs little Python in a spare,
    whose every page touched is a copy-on-write fault on a warm job's path.
    The setup's descriptors go beside it, in the hand-over's message: here
    is only how many rulesets there are, and of the view (the sandbox's
    ``View.arguments``) whether it has a user namespace, a space and a user
    namespace of the job's own, its steps, its working directory, and how
    its namespace is had (the job's own, made ahead, or the template's
    copied)."""
    view = None if setup.view is None else (setup.view[0] >= 0, setup.view[2] >= 0, setup.view[3] >= 0,
                                            *setup.view[4:])
    return marshal.dumps((script, env, setup.cwd, setup.rlimits, setup.no_network, len(setup.rulesets), view))


def view_fds(view: Optional[tuple]) -> tuple:
    """The descriptors of a view's arguments that go beside its
    description: its user namespace (if any), its mount namespace, its
    space and the job's own user namespace (if any)."""
    if view is None:
        return ()
    return tuple(fd for fd in view[:4] if fd >= 0)


def view_arguments(view: tuple, fds: List[int]) -> tuple:
    """A view's arguments again, in a spare, from its description and the
    descriptors that came beside it (``view_fds``' order)."""
    has_user, has_space, has_job_user, *rest = view
    fds = list(fds)
    user_fd = fds.pop(0) if has_user else -1
    mnt_fd = fds.pop(0)
    space_fd = fds.pop(0) if has_space else -1
    job_user_fd = fds.pop(0) if has_job_user else -1
    return (user_fd, mnt_fd, space_fd, job_user_fd, *rest)


def view_fd_count(view: Optional[tuple]) -> int:
    return 0 if view is None else 1 + view[0] + view[1] + view[2]


def decode_job(data: bytes) -> tuple[str, dict, str, tuple, bool, int, Optional[tuple]]:
    """The hand-over's description, checked field by field: a spare takes
    nothing but what :func:`encode_job` writes."""
    script, env, cwd, rlimits, no_network, rulesets, view = marshal.loads(data)
    if not (type(script) is str and type(cwd) is str and type(no_network) is bool and type(env) is dict
            and type(rulesets) is int and 0 <= rulesets <= MAX_RULESETS
            and (view is None or _is_view(view))
            and all(type(k) is str and type(v) is str for k, v in env.items())
            and type(rlimits) is tuple and len(rlimits) == len(RLIMIT_FIELDS)
            and all(type(value) is int for value in rlimits)):
        raise ValueError("not a warm job description")
    return script, env, cwd, rlimits, no_network, rulesets, view


def _is_view(view: object) -> bool:
    return (type(view) is tuple and len(view) == 6 and all(type(flag) is bool for flag in view[:3])
            and type(view[4]) is bytes and type(view[5]) is int
            and type(view[3]) is tuple and all(type(step) is tuple and len(step) == 3 and type(step[0]) is int
                                               and type(step[1]) is bytes and type(step[2]) is bytes
                                               for step in view[3]))


def taken() -> bytes:
    """What a spare says as it takes a job: TAKEN, and what it spent before."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return TAKEN + SPENT.pack(usage.ru_utime, usage.ru_stime)


def read_report(report: bytes) -> tuple[bool, tuple[float, float], bytes]:
    """What a spare said on its ready pipe: whether it took the job, the CPU
    it had spent before, and the failure it reported after (b"" for none)."""
    if not report.startswith(TAKEN) or len(report) < len(TAKEN) + SPENT.size:
        return False, (0.0, 0.0), report[len(TAKEN):]
    return True, SPENT.unpack_from(report, len(TAKEN)), report[len(TAKEN) + SPENT.size:]


#: No limits for the template itself: it runs no job's code.
UNLIMITED = rlimit_values(Limits(address_space=None, cpu_seconds=None, file_size=None, open_files=None))
