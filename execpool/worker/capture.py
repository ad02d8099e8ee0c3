"""What a worker keeps of a tool's output for its Result.

Runs in the worker (execpool/worker/event_loop.py), once per output pipe of a running
tool: one for its merged stdout/stderr, or one for each when the job keeps
them apart. A tool may print a gigabyte; the Result needs only a head of at
most ``max_output_chars``, the total length (so a flood is measurable
without being kept) and the lines naming missing files, which the
model-facing hint is computed from even when they come after the head
(execpool/agent/tools.py) -- whichever stream they came on, so a job's two
Captures share one list of them. Decoding happens here too, incrementally,
as ``communicate(text=True)`` would decode the whole: UTF-8 with
replacement, universal newlines; each stream has its own decoder, since a
character split across reads of one pipe has nothing to do with the other.
"""

from __future__ import annotations

import codecs
import fcntl
import io
import struct
import termios
from collections import deque
from typing import Literal

from ..shared.result import ERROR_LINE_MARKERS

#: Which of a tool's streams a pipe carries (a merged job's one pipe: "stdout").
Stream = Literal["stdout", "stderr"]

#: One read of an output pipe per wake-up of the worker's loop; 64 KiB is
#: a full default pipe buffer.
READ_SIZE = 1 << 16

MAX_ERROR_LINES = 32
MAX_ERROR_LINE_CHARS = 4096


class Capture:
    """One output pipe of one tool. ``stream`` ("stdout" or "stderr") labels
    its live output; ``error_lines`` is the job's, shared with its other
    Capture, so the hint sees the lines of both in the order they were read."""

    def __init__(self, stream: Stream, max_chars: int, error_lines: deque[str]) -> None:
        self.stream = stream
        self.head: list[str] = []
        self.kept = 0
        self.total = 0
        self.bytes = 0
        self.max_chars = max_chars
        self.partial = ""
        self.error_lines = error_lines
        self.decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"),
                                                    translate=True)

    def feed(self, data: bytes) -> str:
        """Keep what the Result needs of ``data``; return it decoded, for the
        live stream."""
        self.bytes += len(data)
        text = self.decoder.decode(data)
        self._keep(text)
        return text

    def finish(self) -> str:
        """At EOF: what the decoder still held, decoded and kept."""
        text = self.decoder.decode(b"", final=True)
        self._keep(text)
        if any(marker in self.partial for marker in ERROR_LINE_MARKERS):
            self.error_lines.append(self.partial)
        self.partial = ""
        return text

    @property
    def output(self) -> str:
        return "".join(self.head)

    def release(self) -> None:
        """Drop the kept head once the Result is out, before the worker
        hands freed memory back (execpool/worker/event_loop.py)."""
        self.head = []

    def _keep(self, text: str) -> None:
        if not text:
            return
        self.total += len(text)
        room = self.max_chars - self.kept
        if room > 0:
            piece = text[:room]
            self.head.append(piece)
            self.kept += len(piece)
        joined = self.partial + text
        if any(marker in joined for marker in ERROR_LINE_MARKERS):
            lines = joined.split("\n")
            joined = lines.pop()
            self.error_lines.extend(
                line[-MAX_ERROR_LINE_CHARS:] for line in lines if any(marker in line for marker in ERROR_LINE_MARKERS)
            )
        else:
            joined = joined[joined.rfind("\n") + 1:]
        self.partial = joined[-MAX_ERROR_LINE_CHARS:]


def waiting_bytes(fd: int) -> int:
    """How many bytes a pipe holds now (0 once it is closed): what a cell
    wrote before its reply is read up to there, no further."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0
