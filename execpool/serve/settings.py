"""What ``execpool serve`` runs with unless told otherwise, named once for
the command's flags (execpool/cli/main.py), the command and the app.

Runs in the service's process, and in the command line's while it parses
flags: nothing here imports the service's stack.
"""

from __future__ import annotations

import os

#: The timeout of jobs that give none, and the largest one a request may ask:
#: a service's jobs always have one.
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_TIMEOUT_S = 600.0

#: The largest request body (MiB), and how often a quiet stream says it is alive.
DEFAULT_MAX_BODY_MB = 64
DEFAULT_HEARTBEAT_S = 10.0

#: How long running jobs get to finish when the service is told to stop.
DEFAULT_GRACE_S = 10.0

#: Seconds a request's headers, and then its body, may take to arrive: a
#: client that trickles them would hold a connection for ever.
DEFAULT_READ_TIMEOUT_S = 30.0

#: Seconds an answer may wait for its client to take any of it (once the
#: connection's buffers are full): a client that asks for a big answer and
#: reads nothing would hold the answer's slot for ever. As long as a job
#: may run by default, so a client that stops reading holds a slot no
#: longer than one that asks for a slow job; any client that reads at all
#: takes something of a blocked answer far sooner.
DEFAULT_WRITE_TIMEOUT_S = 30.0

#: Connections the service keeps open at most: each is a descriptor, and a
#: job can open thousands of connections to the server it runs under.
DEFAULT_MAX_CONNECTIONS = 4096

#: Requests that may wait for a slot, and for how long: verl's client waits
#: compile + run + 10 s and retries only a 504, so a request that cannot
#: start within a few seconds is told so well before that.
DEFAULT_MAX_QUEUE = 256
#: What one job or session may hold at once, unless the server is told
#: otherwise: memory (a cgroup, where the machine has one) and processes.
DEFAULT_MEMORY_MB = 4096
DEFAULT_PROCESSES = 512


def default_max_in_flight() -> int:
    """Jobs running at once without --max-in-flight: two per CPU."""
    return 2 * (os.cpu_count() or 2)
DEFAULT_QUEUE_TIMEOUT_S = 5.0

#: Sessions open at once (docs/service/sessions.md), and how long one may go
#: without a cell -- the longest a request may ask, too.
DEFAULT_MAX_SESSIONS = 64
DEFAULT_SESSION_IDLE_S = 600.0

#: Bytes of one file an answer brings back, and of all of them: what a
#: JSON answer can carry without the service holding much more than a
#: Result already does (a job brings back at most FETCH_MAX_BYTES).
FETCH_FILE_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_FETCH_MAX_BYTES = FETCH_FILE_MAX_BYTES

#: What ``execpool serve`` (and importing the app) says when its stack is missing.
INSTALL_HINT = "the service needs its extra: pip install 'execpool[serve]'"

#: The service's stack: the ``serve`` extra's top-level modules.
STACK = ("starlette", "uvicorn", "prometheus_client")


def stack_missing(exc: ImportError) -> bool:
    """Whether ``exc`` says the service's stack is not installed (and not
    that something else failed to import)."""
    return exc.name is not None and exc.name.split(".")[0] in STACK
