"""The worker's side of a session: the socket its runtime takes cells on,
the cell running now, its deadlines.

Runs in the worker process, on its loop (execpool/worker/event_loop.py), which
owns the session's job like any other (its tree, its output pipes, its
Result when the session ends); this is what a session has besides. The
runtime (execpool/tool/python_session.py, bash.sh) is given one end of a
socket pair as its stdin and moves it off fd 0 before any cell runs; the
worker keeps the other end. A cell goes down as its number, a newline, its
source and a NUL; the runtime says the number and ``!`` and a NUL as the
cell starts -- an interrupt wanted before then waits for it, since the
runtime ignores SIGINT between cells -- and answers with the number, a
colon, its reply and a NUL -- JSON from Python, the exit status from bash
-- which the worker passes on, unread, as a ``CellDone``. A fork takes a
turn as a cell does: its frame is the number, ``*`` and a JSON spec, sent
with the copy's descriptors, and its reply names the copy
(execpool/tool/session_fork.py), which the worker checks before it
says anything of it; a sandboxed session's copy first asks for its own
trees (the number, ``+`` and its pid: execpool/worker/sessions/family.py).

The session's own code can write on that socket too. It can end its own
cell early or garble its reply, which the caller reads as untrusted
(execpool/shared/cells.py); anything else -- a frame that is neither of
the two for the running cell, a byte between cells, a reply past
MAX_REPLY_BYTES -- ends the session (``ProtocolError``). Past the worker's
budget for all its sessions' unfinished replies, the loop ends the
sessions holding the most of it (``SessionLink.buffered``), never one for
another's bytes. Reading it costs the worker's loop at most READ_BUDGET
bytes a turn, as any tool's output does.
"""

from __future__ import annotations

import array
import json
import socket
import time
from typing import List, Optional, Tuple

from ...shared.kernel.proctree import boot_ticks

#: A reply larger than this (a cell displaying tens of megabytes of
#: images) ends the session: the worker holds a reply whole until its NUL.
MAX_REPLY_BYTES = 32 << 20
#: What every session of a worker may hold at once in replies not yet whole.
WORKER_REPLY_BYTES = 256 << 20

#: How long an interrupted cell has to stop (its KeyboardInterrupt handled,
#: its foreground command ended) before the session is killed with its tree.
INTERRUPT_GRACE_S = 2.0

_READ_SIZE = 1 << 16
#: Bytes read from one session's socket per turn of the worker's loop.
READ_BUDGET = 4 * _READ_SIZE

#: What the runtime said: its cell started, its reply, or (a sandboxed
#: session forking) the pid of a copy waiting for its trees.
STARTED, REPLY, MOUNT = "started", "reply", "mount"


def fork_answer(answer: bytes) -> Tuple[Optional[int], str]:
    """The pid a runtime says its copy has (unchecked: the session's code
    could have written it), else None and why there is none."""
    try:
        said = json.loads(answer)
    except (ValueError, RecursionError):  # RecursionError: brackets nested past the parser's depth
        said = None
    if not isinstance(said, dict):
        return None, "the session answered its fork with garbage"
    pid, why = said.get("pid"), said.get("error")
    return (pid if type(pid) is int and pid > 0 else None), (
        why if isinstance(why, str) else "the session answered its fork with garbage")


class ProtocolError(ValueError):
    """The session wrote on its socket what its runtime never writes."""


class SessionLink:
    """One session's socket and cell state; the loop calls it and acts on
    what it returns."""

    #: Bytes of replies not yet whole, all this worker's sessions together.
    buffered = 0

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        self.sock = ours
        # The runtime's end: given as its stdin, at a cold start or a warm
        # hand-over (again if its spare dies before taking it); closed with
        # the session.
        self.theirs = theirs
        self._pending = b""  # of the cell being sent
        self._reply = bytearray()
        #: The cell running now: its number (timers name it), whether it was
        #: interrupted, how it is to end if it does not stop.
        self.cell = 0
        self.running = False
        self._answering = False  # its reply may come; after it, no byte may
        self.started = False  # the runtime said the cell runs: SIGINT reaches it
        self.interrupted = False
        self.cancelled = False
        #: When the cell began, in boot ticks: what it started is what began since.
        self.began = 0
        self.deadline: Optional[float] = None
        self.idle_since = time.monotonic()
        self.printed_before = 0
        #: A frame out of turn that came after frames to pass on first.
        self.violation: Optional[ProtocolError] = None
        #: While a fork is the turn: the copy's job and its output pipes'
        #: read ends, until the copy runs it.
        self.forking: Optional[Tuple[int, List[int]]] = None
        self.mount_asked = False  # a sandboxed fork's copy asks for its trees once

    @property
    def runtime_fd(self) -> int:
        return self.theirs.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._pending)

    def begin(self, source: str, printed: int) -> int:
        """A cell is sent (as far as the socket takes it now; the rest as it
        drains); its number. ``printed``: the session's output so far."""
        self._turn(printed)
        self._pending = b"%d\n" % self.cell + source.encode("utf-8", "surrogatepass") + b"\0"
        self.send_pending()
        return self.cell

    def begin_fork(self, spec: bytes, fds: List[int], printed: int) -> None:
        """A fork frame goes down whole, with the copy's descriptors (the
        socket is idle between cells, so it takes it now); OSError if it
        does not."""
        frame = b"%d*" % (self.cell + 1) + spec + b"\0"
        sent = self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent != len(frame):
            raise ProtocolError(f"the session's socket took {sent} of the fork frame's {len(frame)} bytes")
        self._turn(printed)

    def _turn(self, printed: int) -> None:
        self.cell += 1
        self.printed_before = printed
        self.running = self._answering = True
        self.started = self.interrupted = self.cancelled = self.mount_asked = False
        self.began = boot_ticks()

    def send_pending(self) -> None:
        """What of the cell the socket takes now; OSError once the runtime
        closed its end."""
        if self._pending:
            try:
                sent = self.sock.send(self._pending)
            except BlockingIOError:
                return
            self._pending = self._pending[sent:]

    def read(self) -> Tuple[List[Tuple[str, bytes]], bool]:
        """What the runtime said, in order -- (STARTED, b"") and (REPLY,
        the reply without its number) -- from at most READ_BUDGET bytes, and
        whether its end is closed; ProtocolError for anything else. What
        came whole before a violation is said first: the violation then
        waits in ``violation`` (a forged reply and the real one after it
        can arrive in one read, and the forged one is the cell's answer)."""
        said: List[Tuple[str, bytes]] = []
        try:
            return self._read(said)
        except ProtocolError as exc:
            if not said:
                raise
            self.violation = exc
            return said, False

    def _read(self, said: List[Tuple[str, bytes]]) -> Tuple[List[Tuple[str, bytes]], bool]:
        closed = False
        taken = 0
        while taken < READ_BUDGET:
            try:
                data = self.sock.recv(_READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                closed = True
                break
            if not self._answering:
                raise ProtocolError("the session wrote on its socket between cells")
            taken += len(data)
            searched = len(self._reply)  # what was there holds no NUL
            self._hold(len(data))
            self._reply += data
            while (end := self._reply.find(b"\0", searched)) >= 0:
                said.append(self._frame(bytes(self._reply[:end])))
                self._hold(-(end + 1))
                del self._reply[:end + 1]
                searched = 0
                if self._reply and not self._answering:
                    raise ProtocolError("the session wrote on its socket after its reply")
            if len(self._reply) > MAX_REPLY_BYTES:
                raise ProtocolError(f"the session's reply went over {MAX_REPLY_BYTES >> 20} MiB")
        return said, closed

    def _hold(self, change: int) -> None:
        SessionLink.buffered += change

    @property
    def held(self) -> int:
        """Bytes of its reply not yet whole."""
        return len(self._reply)

    def drop_reply(self) -> None:
        """The session is being ended: what it held goes now."""
        self._hold(-len(self._reply))
        self._reply.clear()

    def _frame(self, frame: bytes) -> Tuple[str, bytes]:
        if not self._answering:
            raise ProtocolError("the session wrote on its socket after its reply")
        if frame == b"%d!" % self.cell and not self.started:
            self.started = True
            return STARTED, b""
        if self.forking is not None and not self.mount_asked and frame.startswith(b"%d+" % self.cell):
            self.mount_asked = True
            return MOUNT, frame[len(b"%d+" % self.cell):]
        number, colon, answer = frame.partition(b":")
        if not colon or number != b"%d" % self.cell:
            raise ProtocolError("the session wrote on its socket what its runtime never writes")
        self._answering = False
        return REPLY, answer

    def done(self) -> None:
        self.running = False
        self.forking = None
        self.deadline = None
        self._pending = b""
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.drop_reply()
        self.sock.close()
        self.theirs.close()
