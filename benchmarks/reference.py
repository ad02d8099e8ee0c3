"""The reference design every benchmark compares execpool against: a THREAD
PER CALL, the way LLM servers run code tools today.

::

    caller thread (one per call)      reader thread (one per call)      watcher thread (one per call)
    ----------------------------      ----------------------------      -----------------------------
    Popen(bash -c / python -u,        for line in readline():           while not cancel.is_set():
      start_new_session=True)           lines.append(line)  # all           if the call is done: return
      from the caller's process         queue.put(line)                     sleep(0.2)
    yields events from the queue      proc.wait(); queue.put(EOF)       killpg(pgid, SIGKILL); wait
    returns ReferenceResult

So a call costs three threads in the caller (the consumer, whatever thread of
the server iterates the stream, plus a reader and a watcher), one pipe, and a
fork/exec *from the caller's process*; it keeps every line of output in memory
(``"".join(lines)`` is the result); the live-output cap is applied where the
events are yielded, so every line still crosses the queue; and cancellation
(``cancel_event.set()`` or closing the stream) is noticed by a watcher that
polls every 0.2 s and then kills the process group.

This is written to be a *fair* baseline, not a straw man: the same tools
(``bash -c`` and ``python -u FILE``), the same session and group kill, the
same live-output cap and notice, the same event dicts as ``pool.stream``.
With ``reap_orphans=True`` (for a caller that made itself a child
subreaper) the watcher also reaps the killed group's orphans, so a kill
benchmark times the design's own cleanup rather than PID 1's.

Use::

    ref = ThreadPerCall()
    gen = ref.stream(shell_argv("echo hi"), cancel_event=ev)   # like pool.stream
    result = yield from gen                                    # ReferenceResult
    result = ref.run(shell_argv("echo hi"))                    # like pool.run
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Optional, Sequence

BASH = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"

#: The watcher's poll period: what servers use today.
WATCH_POLL_S = 0.2
#: The same live-output cap and notice as execpool.drain.
LIVE_CAP_CHARS = 400_000
CAP_NOTICE = "\n... (further live output not streamed)\n"

_EOF = object()
_ids = itertools.count(1)


def shell_argv(command: str) -> list[str]:
    return [BASH, "-c", command]


def python_argv(script: str, python: str = sys.executable) -> list[str]:
    return [python, "-u", script]


@dataclass(frozen=True)
class ReferenceResult:
    output: str
    exit_code: Optional[int]
    timed_out: bool = False
    cancelled: bool = False
    duration_s: float = 0.0

    @property
    def output_chars(self) -> int:
        return len(self.output)


class ReferenceCall:
    """One running call: the child, its reader thread and its watcher thread."""

    def __init__(self, argv: Sequence[str], cancel: threading.Event, *, timeout: Optional[float],
                 cwd: Optional[str], env: Optional[dict], poll_s: float, reap_orphans: bool) -> None:
        self.cancel = cancel
        self.timeout = timeout
        self.poll_s = poll_s
        self.reap_orphans = reap_orphans
        self.lines: list[str] = []
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.done = threading.Event()
        self.killed_for: Optional[str] = None  # "cancel" | "timeout"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, encoding="utf-8", errors="replace", cwd=cwd, env=env, start_new_session=True,
        )
        self.pgid = self.proc.pid  # a new session: its leader's pid is the group
        n = next(_ids)
        self.reader = threading.Thread(target=self._read, name=f"ref-reader-{n}", daemon=True)
        self.watcher = threading.Thread(target=self._watch, name=f"ref-watcher-{n}", daemon=True)
        self.reader.start()
        self.watcher.start()

    def _read(self) -> None:
        try:
            for line in iter(self.proc.stdout.readline, ""):
                self.lines.append(line)
                self.queue.put(line)
            self.proc.stdout.close()
            self.proc.wait()
        finally:
            self.done.set()
            self.queue.put(_EOF)

    def _watch(self) -> None:
        deadline = None if self.timeout is None else self.started + self.timeout
        while not self.cancel.is_set():
            if self.done.is_set():
                return
            if deadline is not None and time.monotonic() >= deadline:
                self.killed_for = "timeout"
                break
            time.sleep(self.poll_s)
        else:
            self.killed_for = "cancel"
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.reap_orphans:
            while True:  # the group's orphans, re-parented to this subreaper
                try:
                    os.waitpid(-self.pgid, 0)
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue

    def result(self) -> ReferenceResult:
        return ReferenceResult(
            output="".join(self.lines),
            exit_code=None if self.killed_for else self.proc.returncode,
            timed_out=self.killed_for == "timeout",
            cancelled=self.killed_for == "cancel",
            duration_s=time.monotonic() - self.started,
        )


class ThreadPerCall:
    """The reference executor; ``stream`` and ``run`` mirror ``ExecPool``'s."""

    def __init__(self, *, poll_s: float = WATCH_POLL_S, reap_orphans: bool = False,
                 on_start: Optional[Callable[[ReferenceCall], None]] = None) -> None:
        self.poll_s = poll_s
        self.reap_orphans = reap_orphans
        self.on_start = on_start  # sees each call once started (benchmarks record its pid)

    def start(self, argv: Sequence[str], cancel_event: Optional[threading.Event] = None, *,
              timeout: Optional[float] = None, cwd: Optional[str] = None,
              env: Optional[dict] = None) -> ReferenceCall:
        call = ReferenceCall(argv, cancel_event if cancel_event is not None else threading.Event(),
                             timeout=timeout, cwd=cwd, env=env, poll_s=self.poll_s,
                             reap_orphans=self.reap_orphans)
        if self.on_start is not None:
            self.on_start(call)
        return call

    def stream(self, argv: Sequence[str], *, tool_name: str = "", tool_call_id: str = "",
               cancel_event: Optional[threading.Event] = None, heartbeat_interval_s: float = 10.0,
               timeout: Optional[float] = None, cwd: Optional[str] = None,
               env: Optional[dict] = None) -> Generator[dict, None, ReferenceResult]:
        """Events as ``pool.stream`` yields them; returns the ReferenceResult.
        ``close()`` sets the cancel event and returns at once: the watcher
        kills the group at its next poll."""
        cancel = cancel_event if cancel_event is not None else threading.Event()
        call = self.start(argv, cancel, timeout=timeout, cwd=cwd, env=env)
        streamed = 0
        capped = False
        next_beat = time.monotonic() + heartbeat_interval_s
        finished = False
        try:
            while True:
                try:
                    item = call.queue.get(timeout=max(0.0, next_beat - time.monotonic()))
                except queue.Empty:
                    next_beat = time.monotonic() + heartbeat_interval_s
                    yield {"type": "heartbeat"}
                    continue
                if item is _EOF:
                    break
                if capped:
                    continue
                room = LIVE_CAP_CHARS - streamed
                if len(item) > room:
                    if room > 0:
                        yield _event(tool_name, tool_call_id, item[:room])
                    yield _event(tool_name, tool_call_id, CAP_NOTICE)
                    capped = True
                else:
                    streamed += len(item)
                    yield _event(tool_name, tool_call_id, item)
                next_beat = time.monotonic() + heartbeat_interval_s
            # The watcher is not joined: it notices the end at its next poll
            # and exits on its own, as in the servers this models.
            call.reader.join()
            finished = True
            return call.result()
        finally:
            if not finished:
                cancel.set()

    def run(self, argv: Sequence[str], *, cancel_event: Optional[threading.Event] = None,
            timeout: Optional[float] = None, cwd: Optional[str] = None,
            env: Optional[dict] = None) -> ReferenceResult:
        call = self.start(argv, cancel_event, timeout=timeout, cwd=cwd, env=env)
        call.reader.join()
        return call.result()


def _event(tool_name: str, tool_call_id: str, text: str) -> dict:
    return {"type": "tool_output", "tool_name": tool_name, "tool_call_id": tool_call_id, "text": text}


def consume(gen: Generator[dict, None, ReferenceResult]):
    """Iterate a stream (execpool's or the reference's) to its end; return
    (event count, the result)."""
    count = 0
    while True:
        try:
            next(gen)
            count += 1
        except StopIteration as stop:
            return count, stop.value
