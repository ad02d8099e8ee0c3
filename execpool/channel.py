"""The closed set of messages between the supervisor and a worker.

Both ends import this module and nothing else decides what crosses the pipe.
Messages are frozen dataclasses sent with ``multiprocessing.connection``
(length-prefixed pickles), each naming the job it concerns by the
supervisor-assigned ``job_id``.

supervisor -> worker:  Start, Cancel, Shutdown
worker -> supervisor:  Ready, Spawned, Output, Finished

Both ends decode with an allow-list unpickler: a tool runs as the same user
as its worker and may find a way to write into one of these pipes, and a
plain ``pickle.loads`` would then run whatever it sent in the caller.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
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


#: The only classes a message may name: the messages and what they carry.
_ALLOWED = {
    (__name__, cls.__name__) for cls in (Start, Cancel, Shutdown, Ready, Spawned, Output, Finished)
} | {("execpool.jobs", "Limits"), ("execpool.result", "Result")}


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a channel message")
        return super().find_class(module, name)


def send(conn: Connection, msg: Union[ToWorker, FromWorker]) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection, max_bytes: Optional[int] = None) -> Union[ToWorker, FromWorker]:
    """The next message; OSError (as for a broken pipe) for anything that is
    not one, or is longer than ``max_bytes``."""
    data = conn.recv_bytes(max_bytes)
    try:
        return _MessageUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise OSError(f"not a channel message: {exc}") from None
