"""The closed set of messages between the supervisor and a worker.

Both ends import this module and nothing else decides what crosses the pipe.
Messages are frozen dataclasses sent with ``multiprocessing.connection``
(length-prefixed pickles), each naming the job it concerns by the
supervisor-assigned ``job_id``.

supervisor -> worker:  WorkerConfig (first, once), Start, Cancel, Shutdown,
                       Cell, Interrupt, Fork (a session's), OpenWorkspace,
                       CloseWorkspace
worker -> supervisor:  Ready, Spawned, Output, Finished, CellDone (a session's)

A session (execpool/pool/sessions.py) is a job that lives until it is
closed: its tool is a runtime that takes cells -- Python's
(execpool/tool/python_session.py) or bash's -- on a socket the worker
gives it as its stdin, and answers each on the same socket with a reply
that the worker passes on as a ``CellDone`` once the cell's output went out.

Both ends decode with an allow-list unpickler and then check every field
against the dataclass's annotations: a tool runs as the same user as its
worker and may find a way to write into one of these pipes, and a plain
``pickle.loads`` would then run whatever it sent in the caller, while a
message of an allowed class with a field of the wrong type (a list for a
job id) would fail wherever it is used -- in the supervisor, that is the
one thread every job depends on. Anything else is a :class:`ChannelError`,
and the end that reads it treats the writer as broken.

The supervisor reads its workers' pipes without blocking, through a
:class:`FrameReader`: a worker stopped (or forged into stopping) halfway
through a message then holds up nobody but itself.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import socket
import struct
import typing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Dict, Literal, Optional, Tuple, Union

from .files import File
from .jobs import Limits
from .kernel.sandbox import Sandbox
from .result import Result, Status


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to know of its pool, sent once as the first
    message: typed and checked like any other, rather than argv strings."""

    token: str  # names the worker's processes, cgroups and job markers
    spawn_method: str  # "vfork" or "fork" (execpool/worker/spawn.py)
    preload: Tuple[str, ...]  # modules the warm template imports
    warm_ipython: bool  # whether the warm template builds IPython's shell
    cgroups: bool  # whether the worker may create cgroups for its jobs
    jobs_dir: str  # where jobs without a cwd get their private directory
    warm_spares: int  # spares kept parked once warm jobs came
    python: str  # the interpreter Python jobs run with, the warm template's too


@dataclass(frozen=True)
class Start:
    """Run one tool. ``env`` is complete: the worker adds only the job marker."""

    job_id: int
    argv_kind: str  # "python" or "shell"
    source: str
    cwd: Optional[str]
    env: Dict[str, str]
    timeout: Optional[float]
    limits: Limits
    live_cap: Optional[int]  # None: the caller does not stream, send no Output
    max_output_chars: int
    keep_background: bool
    python: str
    stdin: Optional[str]
    warm: bool
    network: bool
    separate_stderr: bool = False  # stderr on a pipe of its own, not merged into stdout
    sandbox: Optional[Sandbox] = None  # the job's, or the pool's; None: none
    #: A session: its stdin is its cell socket, ``timeout`` is None, and
    #: it ends after ``idle_timeout`` seconds without a cell (None: never).
    session: bool = False
    idle_timeout: Optional[float] = None
    #: A Python session that speaks IPython (execpool/tool/ipython_shell.py).
    ipython: bool = False
    #: Written into its working directory before it starts, and brought
    #: back from it once it ended (execpool/shared/files.py).
    files: Tuple[Tuple[str, File], ...] = ()
    fetch: Tuple[str, ...] = ()
    #: The workspace it runs in (OpenWorkspace's id), whose space is its
    #: own for its run; None: a space of its own.
    workspace: Optional[int] = None


@dataclass(frozen=True)
class OpenWorkspace:
    """Make a space of ``disk`` bytes (None: no bound of its own) that
    outlives jobs: the jobs and sessions started with its id run in it."""

    workspace_id: int
    disk: Optional[int]


@dataclass(frozen=True)
class CloseWorkspace:
    """Let the workspace go: what its jobs wrote goes once the last of them
    is gone."""

    workspace_id: int


@dataclass(frozen=True)
class Cancel:
    job_id: int


@dataclass(frozen=True)
class Cell:
    """Run ``source`` in session ``job_id`` (one cell at a time): past
    ``timeout`` it is interrupted (SIGINT to the session's group), and past
    the grace after that the session is killed."""

    job_id: int
    source: str
    timeout: Optional[float]


@dataclass(frozen=True)
class Interrupt:
    """Interrupt session ``job_id``'s running cell, as its timeout would:
    the cell's caller cancelled it."""

    job_id: int


@dataclass(frozen=True)
class Fork:
    """Copy Python session ``job_id`` (between its cells: the pool sends it
    in the session's turn, as a cell) into a new session, ``child``, of the
    same worker. The copy's Spawned (or its Finished, when it could not be
    made) comes first; then the parent's ``CellDone``, whose reply is the
    runtime's: ``{"pid": N}`` or ``{"error": why}``."""

    job_id: int
    child: Start


@dataclass(frozen=True)
class Shutdown:
    """Kill every tree the worker owns, then exit."""


@dataclass(frozen=True)
class Ready:
    """The worker takes jobs; ``preload_errors`` names modules it could not import."""

    pid: int
    preload_errors: Tuple[str, ...] = ()


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
    # Only a job with ``separate_stderr`` has a stderr of its own; a merged
    # job's output is all "stdout".
    stream: Literal["stdout", "stderr"] = "stdout"


@dataclass(frozen=True)
class Finished:
    job_id: int
    result: Result


@dataclass(frozen=True)
class CellDone:
    """Session ``job_id``'s reply to its cell, as its runtime wrote it (the
    caller reads it: the session's own code could have written it), sent
    after every Output of the cell; ``interrupted``: its timeout or an
    Interrupt came first; ``printed``: the characters of output the cell
    printed, though past the cell's live cap no more went out."""

    job_id: int
    reply: bytes
    interrupted: bool
    printed: int


ToWorker = Union[WorkerConfig, Start, Cancel, Shutdown, Cell, Interrupt, Fork, OpenWorkspace, CloseWorkspace]
FromWorker = Union[Ready, Spawned, Output, Finished, CellDone]

#: What each end accepts: a message going the other way is as wrong as garbage.
TO_WORKER = typing.get_args(ToWorker)
FROM_WORKER = typing.get_args(FromWorker)
MESSAGES = TO_WORKER + FROM_WORKER

#: The only classes a message may name: the messages and what they carry.
_ALLOWED = {(__name__, cls.__name__) for cls in MESSAGES} | {
    (Limits.__module__, "Limits"), (Result.__module__, "Result"), (Status.__module__, "Status"),
    (Sandbox.__module__, "Sandbox"), (File.__module__, "File")}

#: ``multiprocessing.connection``'s framing: a signed 32-bit length, or -1
#: and an unsigned 64-bit one for messages of 2 GiB and more.
_SHORT_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")

_READ_SIZE = 1 << 16


class ChannelError(OSError):
    """Bytes that are no message this end accepts: a broken or forged writer.
    An OSError, as a broken pipe is, for callers that treat both alike."""


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a channel message")
        return super().find_class(module, name)


#: Each message class's fields as :func:`_fields` gives them, once made.
_FIELDS: Dict[type, tuple] = {}


def _fields(cls: type) -> tuple:
    """(name, type, check) for each field, built once per class from its
    annotations."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = tuple((field.name, hints[field.name], _checker(hints[field.name]))
                             for field in dataclasses.fields(cls))
    return _FIELDS[cls]


@functools.lru_cache(maxsize=None)
def _checker(hint: object) -> Callable[[object], bool]:
    """Whether a value is of the annotated type. Exact types, not
    isinstance: an unpickled bool must not pass for a job id; an int passes
    for a float, as a timeout of 2 is 2.0 seconds."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        options = tuple(map(_checker, args))
        return lambda value: any(check(value) for check in options)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _checker(args[0])
        return lambda value: type(value) is tuple and all(map(item, value))
    if origin is tuple:
        items = tuple(map(_checker, args))
        return lambda value: (type(value) is tuple and len(value) == len(items)
                              and all(check(v) for check, v in zip(items, value, strict=True)))
    if origin is dict:
        key, item = map(_checker, args)
        return lambda value: type(value) is dict and all(key(k) and item(v) for k, v in value.items())
    if origin is Literal:
        return lambda value: any(type(value) is type(arg) and value == arg for arg in args)
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return lambda value: type(value) is float or type(value) is int
    if dataclasses.is_dataclass(hint):
        return lambda value: type(value) is hint and _fault(value) is None
    return lambda value: type(value) is hint


def _fault(obj: object) -> Optional[str]:
    """What is wrong with an unpickled dataclass, which never went through
    ``__init__``: a field missing, one too many, or one not of its annotated
    type. None if nothing is."""
    fields = _fields(type(obj))
    state = getattr(obj, "__dict__", None)
    if type(state) is not dict:
        return "it has no fields"
    if len(state) != len(fields):
        unknown = set(state) - {name for name, _, _ in fields}
        if unknown:
            return f"it has no field {sorted(map(repr, unknown))[0]}"
    for name, hint, check in fields:
        if name not in state:
            return f"{name} is missing"
        value = state[name]
        if not check(value):
            inner = _fault(value) if dataclasses.is_dataclass(hint) and type(value) is hint else None
            return f"{name}.{inner}" if inner else f"{name} has the wrong type ({type(value).__name__})"
    return None


def decode(data: bytes, accept: tuple = MESSAGES) -> Union[ToWorker, FromWorker]:
    """The message in one frame; ChannelError unless it is one of ``accept``,
    well formed."""
    try:
        msg = _MessageUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - whatever the bytes made the unpickler do, they are no message
        raise ChannelError(f"not a channel message: {exc}") from None
    if type(msg) not in accept:
        raise ChannelError(f"a {type(msg).__name__} is not a message this end takes")
    fault = _fault(msg)
    if fault is not None:
        raise ChannelError(f"a malformed {type(msg).__name__}: {fault}")
    return msg


def pipe() -> tuple[int, int]:
    """``os.pipe()``, but made of a socket pair: the read end and the write
    end of a one-way byte stream. A pipe can be opened again by any process
    of the same user through ``/proc/<pid>/fd`` of a dumpable process -- the
    caller's, usually -- so a tool could read the next job's Start or write
    a forged message; a socket cannot be opened that way by anyone. Every
    channel between the pool's processes is one of these."""
    reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader.shutdown(socket.SHUT_WR)
    writer.shutdown(socket.SHUT_RD)
    return reader.detach(), writer.detach()


def send(conn: Connection, msg: Union[ToWorker, FromWorker]) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def decode_from_worker(data: bytes) -> FromWorker:
    """The message in one frame a worker sent (ChannelError unless it is
    one of FROM_WORKER, well formed)."""
    msg = decode(data, FROM_WORKER)
    assert isinstance(msg, FROM_WORKER)  # decode took nothing else
    return msg


def recv(conn: Connection, max_bytes: Optional[int] = None,
         accept: tuple = MESSAGES) -> Union[ToWorker, FromWorker]:
    """The next message; OSError (as for a broken pipe; ChannelError for
    garbage) for anything that is not one of ``accept``, or is longer than
    ``max_bytes``."""
    return decode(conn.recv_bytes(max_bytes), accept)


class FrameReader:
    """Whole frames from a pipe read without blocking, as they complete."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        os.set_blocking(fd, False)
        self.fd = fd
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._eof = False

    def frames(self, budget: int) -> list:
        """The frames completed by what the pipe holds now (up to ``budget``
        bytes of it, so that one flooding writer cannot keep the reader from
        its other pipes); ChannelError for a length no message has, EOFError
        once the writer is gone and every whole frame it sent was taken (a
        message cut short by the writer's death is no message)."""
        taken = 0
        while taken < budget and not self._eof:
            try:
                data = os.read(self.fd, _READ_SIZE)
            except BlockingIOError:
                break
            self._eof = not data
            self._buffer += data
            taken += len(data)
        frames = self._split()
        if self._eof and not frames:
            raise EOFError
        return frames

    def _split(self) -> list:
        frames = []
        view = memoryview(self._buffer)
        start = 0
        try:
            while len(view) - start >= _SHORT_HEADER.size:
                size, = _SHORT_HEADER.unpack_from(view, start)
                header = _SHORT_HEADER.size
                if size == -1:
                    if len(view) - start < header + _LONG_HEADER.size:
                        break
                    size, = _LONG_HEADER.unpack_from(view, start + header)
                    header += _LONG_HEADER.size
                if not 0 <= size <= self.max_bytes:
                    raise ChannelError(f"a message of {size} bytes")
                if len(view) - start < header + size:
                    break
                frames.append(bytes(view[start + header:start + header + size]))
                start += header + size
        finally:
            view.release()
        del self._buffer[:start]
        return frames
