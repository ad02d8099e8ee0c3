"""The warm template: the process every warm job's spare is cloned from.

Who runs this module: the **template**, ``python -m
execpool.tool.template WORKER_PID PRELOAD``, a fresh interpreter the
worker starts with an exec (never a fork of the worker), so it has never
held any job's code, environment, stdin or output. It imports what warm
jobs should find loaded, rehearses a warm start once, freezes its heap, and
then does one thing: on each request from its worker it clones a *spare*
with CLONE_PARENT (``linux.fork_sibling``), so the spare is the worker's own
child -- reaped by the worker, killed with it. The clone then runs
execpool/tool/spare.py: it hands its socket to the worker and waits
for one job.

The worker's side of the template and its spares is
execpool/worker/warm/supply.py.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import socket
import sys
from typing import Iterable, List, NoReturn

from ..shared.kernel import linux, sandbox
from . import spare
from .become import DEVNULL, Setup
from .spare_wire import TEMPLATE_NAME, UNLIMITED, decode_job, encode_job


def unfindable(names: Iterable[str]) -> List[str]:
    """Which of ``names`` this interpreter cannot import, each with why --
    asked before a template imports them, so the pool can name the module
    at fault rather than a template that died."""
    errors = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                errors.append(f"{name}: ModuleNotFoundError: No module named {name!r}")
        except BaseException as exc:  # noqa: BLE001 - any failure is the caller's to see
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return errors


def main(argv: list) -> NoReturn:
    """The template's life: set up once, then one spare per request until
    the worker closes its socket."""
    worker_pid, preload, ipython = int(argv[0]), [name for name in argv[1].split(",") if name], argv[2] == "ipython"
    try:
        # The worker's socket came as stdin; the template writes nothing.
        sock = socket.socket(fileno=os.dup(0))
        for fd in (0, 1, 2):
            os.dup2(DEVNULL, fd)
        # Only root may then read a spare's memory or trace it: a parked
        # spare is a template's clone, and a job's tools run as this user.
        linux.prctl(linux.PR_SET_DUMPABLE, 0)
        if os.getppid() != worker_pid:
            os._exit(0)  # the worker died before we got here
        for name in preload:
            with contextlib.suppress(BaseException):  # the worker already reported it
                importlib.import_module(name)
        # A session (execpool/worker/sessions/) is a warm job running this
        # runtime: imported here once -- ast, json, traceback: a third of a
        # session's start when each spare imported them -- and shared by
        # every clone.
        importlib.import_module("execpool.tool.python_session")
        # And IPython, where the pool's Python has it and the pool wants it
        # warm: imported and its shell built here, once (80 ms), not in each
        # session that speaks it.
        try:
            if ipython:
                importlib.import_module("execpool.tool.ipython_shell").prepare()
        except Exception:  # noqa: BLE001 - no IPython, or a broken one: sessions say so when asked for it
            pass
        spare.rehearse(shell=True)
        decode_job(encode_job("", {}, Setup("/", UNLIMITED)))
        sandbox.prepare()
        gc.collect()
        gc.freeze()
        with open("/proc/self/comm", encoding="utf-8") as f:
            name = f.read().strip()
        linux.set_name(TEMPLATE_NAME)
        # As little as possible between clones: every page the template
        # writes after one is copied, the clone having shared it.
        while sock.recv(16):
            if linux.fork_sibling() == 0:
                spare.park(sock, worker_pid, name)
    except BaseException:  # noqa: BLE001 - the worker sees EOF and starts another template
        os._exit(1)
    os._exit(0)



if __name__ == "__main__":
    main(sys.argv[1:])
