"""The worker's side of a session: the socket its runtime takes cells on,
the cell running now, its deadlines.

Runs in the worker process, on its loop (execpool/worker/loop.py), which
owns the session's job like any other (its tree, its output pipes, its
Result when the session ends); this is what a session has besides. The
runtime (execpool/worker/sessions/python.py, bash.sh) is given one end of a
socket pair as its stdin and moves it off fd 0 before any cell runs; the
worker keeps the other end. A cell goes down as its number, a newline, its
source and a NUL; the runtime says the number and ``!`` and a NUL as the
cell starts -- an interrupt wanted before then waits for it, since the
runtime ignores SIGINT between cells -- and answers with the number, a
colon, its reply and a NUL -- JSON from Python, the exit status from bash
-- which the worker passes on, unread, as a ``CellDone``. The session's own code can
write on that socket too: it can end its own cell early or garble its
reply, which the caller reads as untrusted (execpool/shared/cells.py),
and nothing else; what it wrote between cells, or a reply to a cell that
ended already, is dropped by its number.
"""

from __future__ import annotations

import socket
import time
from typing import Optional

#: A reply larger than this (a cell displaying hundreds of megabytes of
#: images) ends the session: the worker holds a reply whole until its NUL.
MAX_REPLY_BYTES = 64 << 20

#: How long an interrupted cell has to stop (its KeyboardInterrupt handled,
#: its foreground command ended) before the session is killed with its tree.
INTERRUPT_GRACE_S = 2.0

_READ_SIZE = 1 << 16


class SessionLink:
    """One session's socket and cell state; the loop calls it and acts on
    what it returns."""

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
        self.started = False  # the runtime said the cell runs: SIGINT reaches it
        self.interrupted = False
        self.cancelled = False
        self.deadline: Optional[float] = None
        self.idle_since = time.monotonic()
        self.printed_before = 0

    @property
    def runtime_fd(self) -> int:
        return self.theirs.fileno()

    @property
    def wants_write(self) -> bool:
        return bool(self._pending)

    def begin(self, source: str, printed: int) -> int:
        """A cell is sent (as far as the socket takes it now; the rest as it
        drains); its number. ``printed``: the session's output so far."""
        self.cell += 1
        self.printed_before = printed
        self.running = True
        self.started = self.interrupted = self.cancelled = False
        self._pending = b"%d\n" % self.cell + source.encode("utf-8", "surrogatepass") + b"\0"
        self.send_pending()
        return self.cell

    def send_pending(self) -> None:
        """What of the cell the socket takes now; OSError once the runtime
        closed its end."""
        if self._pending:
            try:
                sent = self.sock.send(self._pending)
            except BlockingIOError:
                return
            self._pending = self._pending[sent:]

    def read(self) -> tuple[list[bytes], bool]:
        """The replies completed by what the socket holds, and whether the
        runtime's end is closed; ValueError for a reply over MAX_REPLY_BYTES."""
        replies = []
        closed = False
        while True:
            try:
                data = self.sock.recv(_READ_SIZE)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                closed = True
                break
            self._reply += data
            while (end := self._reply.find(b"\0")) >= 0:
                replies.append(bytes(self._reply[:end]))
                del self._reply[:end + 1]
            if len(self._reply) > MAX_REPLY_BYTES:
                raise ValueError(f"the session's reply went over {MAX_REPLY_BYTES >> 20} MiB")
        return replies, closed

    def answer(self, frame: bytes) -> Optional[bytes]:
        """The reply to the running cell, without its number; None for a
        frame that is none (the cell's start, a late or forged reply)."""
        if not self.running:
            return None
        if frame == b"%d!" % self.cell:
            self.started = True
            return None
        number, colon, answer = frame.partition(b":")
        return answer if colon and number == b"%d" % self.cell else None

    def done(self) -> None:
        self.running = False
        self.deadline = None
        self._pending = b""
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.sock.close()
        self.theirs.close()

