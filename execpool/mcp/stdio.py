"""The protocol's wire on this process's stdin and stdout, read and written
on the event loop.

Runs in ``execpool mcp``'s process. The SDK's own stdio transport wraps the
standard streams as anyio files, which moves every line read and every
write and flush to a worker thread: three thread hand-offs per call, most
of the time a trivial call spends in this process. A client starts the
server with pipes (or a socket) on both ends, which the event loop can
watch directly; the SDK's transport still does the framing and parsing
(its ``stdio_server`` takes the two streams given here), and serves where
the loop cannot watch them (a regular file as stdin).

While serving, fd 0 reads the null device and fd 1 writes to stderr, as the
SDK arranges for its own streams, so that a stray print of this process or
a child it starts with inherited descriptors cannot garble the wire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import stat
from typing import AsyncIterator, Awaitable, Callable, Deque, Optional, Tuple

#: The longest message read (a 60 MB program in one call is one line); a
#: longer one is dropped whole, said on stderr, and the server reads on --
#: the client is told nothing, as the message's id is in what was dropped.
#: As ``execpool serve``'s default ``--max-body-mb``.
LINE_LIMIT = 64 << 20

#: What one read takes off the reader's buffer.
_CHUNK = 1 << 20
#: The reader holds at most twice this unread before it stops reading the
#: pipe: a client that sends faster than the server takes its messages
#: waits, as one that does not read its answers does (``answers_out``).
_BUFFER = 64 << 10

logger = logging.getLogger("execpool")


def _watchable(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class LineReader:
    """The wire's lines, as the SDK iterates them (``async for``), framed
    here rather than by ``StreamReader.readline``, whose overlong line
    raises with no way to tell whether its end was read too."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._held = bytearray()  # the start of a line whose end has not come
        self._lines: Deque[bytes] = collections.deque()
        self._dropping = False  # in a line over the limit, until its end
        #: Returns once the answers written have gone out (or most of them):
        #: awaited before each message is taken, so a client that stops
        #: reading its answers has no more of its requests read, and the
        #: server does not hold an answer for every request it sends.
        self.answers_out: Optional[Callable[[], Awaitable[None]]] = None
        self.transport: Optional[asyncio.BaseTransport] = None  # what reads the pipe

    def __aiter__(self) -> "LineReader":
        return self

    async def __anext__(self) -> str:
        if self.answers_out is not None:
            await self.answers_out()
        while not self._lines:
            chunk = await self._reader.read(_CHUNK)
            if not chunk:
                if not self._held or self._dropping:
                    raise StopAsyncIteration
                self._lines.append(bytes(self._held))
                self._held.clear()
                break
            self._take(chunk)
        return self._lines.popleft().decode("utf-8", "replace")

    def _take(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end + 1]
            if not self._dropping:
                self._held += piece
                if len(self._held) > LINE_LIMIT:
                    logger.warning("execpool mcp: a message over %d MiB was dropped", LINE_LIMIT >> 20)
                    self._held.clear()
                    self._dropping = True
            if end < 0:
                return
            if not self._dropping:
                self._lines.append(bytes(self._held))
            self._held.clear()
            self._dropping = False
            start = end + 1

    def end(self) -> None:
        """No more lines: the client can no longer hear the answers. The
        pipe is closed, not only marked at its end: what the client still
        sends would be fed after the end."""
        if self.transport is not None:
            self.transport.close()
        else:
            self._reader.feed_eof()


class LineWriter:
    """The wire's other way: ``write`` then ``flush`` per message. A client
    that closed its end (stdout) but not stdin has gone all the same: the
    reading ends too, so the server winds down as when stdin closes, its
    calls cancelled, instead of dying of a broken pipe."""

    def __init__(self, writer: asyncio.StreamWriter, lines: LineReader) -> None:
        self._writer = writer
        self._lines = lines

    async def write(self, text: str) -> None:
        if not self._writer.is_closing():
            self._writer.write(text.encode("utf-8"))

    async def flush(self) -> None:
        try:
            await self._writer.drain()
        except OSError:
            self._writer.close()
            self._lines.end()


@contextlib.asynccontextmanager
async def loop_streams() -> AsyncIterator[Optional[Tuple[LineReader, LineWriter]]]:
    """The wire as loop-driven streams, fds 0 and 1 moved out of the way
    for the rest of the process; None where the loop cannot watch them."""
    if not (_watchable(0) and _watchable(1)):
        yield None
        return
    loop = asyncio.get_running_loop()
    wire_in, wire_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=_BUFFER)
    read_transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                     os.fdopen(wire_in, "rb", buffering=0))
    write_transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                              os.fdopen(wire_out, "wb", buffering=0))
    lines = LineReader(reader)
    lines.transport = read_transport
    writer = LineWriter(asyncio.StreamWriter(write_transport, protocol, None, loop), lines)
    lines.answers_out = writer.flush
    try:
        yield lines, writer
    finally:
        read_transport.close()
        write_transport.close()
