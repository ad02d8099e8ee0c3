"""The closed set of messages between the supervisor and a worker.

Both ends import this module and nothing else decides what crosses the pipe.
Messages are frozen dataclasses sent with ``multiprocessing.connection``
(length-prefixed pickles), each naming the job it concerns by the
supervisor-assigned ``job_id``.

supervisor -> worker:  Start, Cancel, Shutdown
worker -> supervisor:  Ready, Spawned, Output, Finished
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .jobs import Limits
from .result import Result


@dataclass(frozen=True)
class Start:
    """Run one tool. ``env`` is complete: the worker adds only the job marker."""

    job_id: int
    argv_kind: str  # "python" or "shell"
    source: str
    cwd: Optional[str]
    env: dict
    timeout: Optional[float]
    limits: Limits
    live_cap: Optional[int]  # None: the caller does not stream, send no Output
    max_output_chars: int
    keep_background: bool
    python: str
    stdin: Optional[str]
    warm: bool
    network: bool


@dataclass(frozen=True)
class Cancel:
    job_id: int


@dataclass(frozen=True)
class Shutdown:
    """Kill every tree the worker owns, then exit."""


@dataclass(frozen=True)
class Ready:
    """The worker takes jobs; ``preload_errors`` names modules it could not import."""

    pid: int
    preload_errors: tuple = ()


@dataclass(frozen=True)
class Spawned:
    """Sent as soon as a tool exists, so a supervisor outliving a crashed
    worker still knows which process groups to kill."""

    job_id: int
    pid: int
    pgid: int


@dataclass(frozen=True)
class Output:
    job_id: int
    text: str


@dataclass(frozen=True)
class Finished:
    job_id: int
    result: Result


ToWorker = Union[Start, Cancel, Shutdown]
FromWorker = Union[Ready, Spawned, Output, Finished]
