"""A Python session's runtime: the interpreter that keeps a session's
state, taking one cell at a time.

Runs in the session's own process -- a warm spare that became the
session's tool (execpool/tool/spare.py), sandboxed, limited and
watched like any job's. The warm template imports this module (and the
standard library modules it needs) once, so a session starts with it
loaded; it imports nothing else of execpool's but, for a fork, its
fork's (execpool/tool/session_fork.py), and, for a session that speaks
IPython, the shell the template built (execpool/tool/ipython_shell.py),
which then runs each cell as a kernel's does: its displays, value and
error come here (``_Cell``, IPython's ``Outputs``). Its stdin
is the session's socket (execpool/worker/sessions/link.py); it moves that
off fd 0 (a cell's ``input()`` reads an empty stdin) to a descriptor that no
program the cell starts inherits.

In plain Python, a cell runs as Jupyter runs one: its statements in the session's
``__main__``, the last one's value, when it is an expression, kept as the
cell's value -- its ``text/plain`` and the richer types the object offers
(``_repr_html_`` and the rest, a matplotlib figure's PNG) -- and in ``_``;
``display(obj)`` adds to the cell's displays, as does every matplotlib
figure still open when the cell ends (then closed, as the inline backend
does); an exception is the cell's error, with a traceback of the cell's
frames only. Its stdout and stderr go where the session's go, the worker's
pipes, live. SIGINT (a timeout, a cancel) is a KeyboardInterrupt in the
cell; between cells it is ignored.

A cell comes as its number, a newline and its source; the runtime says
the number and ``!`` once SIGINT would interrupt it, and its reply, after
the cell's output is flushed, is the number, a colon, one JSON object --
``{"value", "data", "value_at", "display", "error", "execution_count",
"cost"}`` -- and a NUL (``value_at``: how many displays came before the
value). A fork comes as its number, ``*`` and a JSON spec, with the
copy's descriptors; the reply is the fork's (execpool/tool/session_fork.py),
after, for a sandboxed session, the number, ``+`` and the copy's pid: the
copy waits for its trees.
The cost is the CPU the cell took (the session's process, and the
processes it waited for) and the session's peak resident memory so far.
"""

from __future__ import annotations

import ast
import base64
import builtins
import io
import json
import linecache
import os
import resource
import signal
import socket
import sys
import traceback
import types
from typing import Any, Dict, List, Optional

from . import OWN_CODE

#: The richer representations an object may offer, Jupyter's names.
_REPR_METHODS = (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
                 ("image/svg+xml", "_repr_svg_"), ("image/png", "_repr_png_"), ("image/jpeg", "_repr_jpeg_"),
                 ("text/latex", "_repr_latex_"), ("application/json", "_repr_json_"))
_BINARY = {"image/png", "image/jpeg"}

#: A value's ``text/plain`` past this many characters is cut (saying so),
#: and a richer representation past MAX_MIME_CHARS is left out: the reply
#: goes whole through the worker, which ends a session whose reply is too
#: big (execpool/worker/sessions/link.py).
MAX_PLAIN_CHARS = 1_000_000
MAX_MIME_CHARS = 8_000_000

#: A fork frame's descriptors: the copy's socket, stdout, stderr and (a
#: sandboxed session's) its Landlock layer; one more is a frame the
#: worker never sends.
_MAX_FORK_FDS = 5

_in_cell = False
#: SIGINT came while the cell was open but none of its own code ran (IPython
#: between two statements, or in its hooks): the next statement is not run.
_interrupted = False


def _on_sigint(_signum: int, _frame: object) -> None:
    global _interrupted
    if _in_cell:
        raise KeyboardInterrupt
    _interrupted = True


def bundle(obj: Any) -> Dict[str, Any]:
    """An object's MIME bundle, as Jupyter's display would make it: its
    repr, and each richer type it offers (a method that raises, or answers
    None, offers nothing), as the reply carries them (``_sendable``)."""
    data: Dict[str, Any] = {"text/plain": _plain(obj)}
    figure = _figure_png(obj)
    if figure is not None:
        data["image/png"] = figure
    for mime, name in _REPR_METHODS:
        method = getattr(type(obj), name, None)
        if method is None or mime in data:
            continue
        try:
            value = method(obj)
        except Exception:  # noqa: BLE001 - an object's broken representation is not the cell's error
            continue
        if isinstance(value, tuple):  # (data, metadata)
            value = value[0]
        if isinstance(value, (str, bytes)) or (mime == "application/json" and value is not None):
            data[mime] = value
    return _sendable(data)


def _cpu() -> tuple:
    """CPU seconds (user, system) of the session's process and of the
    processes it has waited for: what a cell spent is the difference."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


def _plain(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ still shows something
        return f"<{type(obj).__name__} object (repr failed: {type(exc).__name__})>"
    return _cut(text)


def _cut(text: str) -> str:
    if len(text) > MAX_PLAIN_CHARS:
        return text[:MAX_PLAIN_CHARS] + f"\n... (cut: {len(text)} characters in all)"
    return text


def _sendable(data: Dict[str, Any]) -> Dict[str, Any]:
    """A bundle as the reply can carry it: binary types base64, a long
    ``text/plain`` cut, a type too big (or not JSON) left out."""
    sent: Dict[str, Any] = {}
    for mime, value in data.items():
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii") if mime in _BINARY else value.decode("utf-8", "replace")
        if isinstance(value, str):
            if mime == "text/plain":
                value = _cut(value)
            elif len(value) > MAX_MIME_CHARS:
                continue  # too big to send whole: its text/plain stands for it
        else:
            try:
                size = len(json.dumps(value))
            except (TypeError, ValueError, RecursionError):
                continue
            if size > MAX_MIME_CHARS:
                continue
        sent[str(mime)] = value
    return sent


def _figure_png(obj: Any) -> Optional[str]:
    """A matplotlib Figure as PNG, base64; None for anything else."""
    figure_module = sys.modules.get("matplotlib.figure")
    if figure_module is None or not isinstance(obj, figure_module.Figure):
        return None
    out = io.BytesIO()
    try:
        obj.savefig(out, format="png", bbox_inches="tight")
    except Exception:  # noqa: BLE001 - a figure that cannot draw shows as its repr
        return None
    return base64.b64encode(out.getvalue()).decode("ascii")


class _Cell:
    """What one cell produced besides its output: its displays, in order,
    and its value with where it came among them -- Jupyter's outputs but
    the streams, which went to the session's pipes as they were written."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.usage = _cpu()
        self.obj: Any = None  # the value, in plain Python; IPython's comes as its bundle
        self.has_value = False
        self.data: Optional[Dict[str, Any]] = None
        self.value_at: Optional[int] = None
        self.display: List[Dict[str, Any]] = []
        self.display_ids: Dict[str, List[int]] = {}
        self.clear_pending = False
        self.error: Optional[Dict[str, Any]] = None

    def show(self, *objs: Any) -> None:
        """Plain Python's ``display()`` and figures."""
        self.display += map(bundle, objs)

    # -- execpool.tool.ipython_shell.Outputs: what a kernel would send -------------------

    def publish(self, data: Dict[str, Any], display_id: Optional[str], update: bool) -> None:
        """A display; an update replaces, in place, what this cell showed
        under its id (an earlier cell's outputs were returned already)."""
        data = _sendable(data)
        if update:
            for index in self.display_ids.get(display_id or "", ()):
                self.display[index] = data
            return
        self._cleared()
        if display_id is not None:
            self.display_ids.setdefault(display_id, []).append(len(self.display))
        self.display.append(data)

    def result(self, data: Dict[str, Any]) -> None:
        self._cleared()
        self.data, self.value_at = _sendable(data), len(self.display)

    def clear(self, wait: bool) -> None:
        """``clear_output``: what the cell showed so far goes (with
        ``wait``, once it shows something new); what it printed stays."""
        self.clear_pending = True
        if not wait:
            self._cleared()

    def _cleared(self) -> None:
        if self.clear_pending:
            self.clear_pending = False
            self.display, self.display_ids, self.data, self.value_at = [], {}, None, None

    def failed(self, ename: str, evalue: str, traceback: list) -> None:
        self.error = {"ename": ename, "evalue": evalue, "traceback": traceback}

    def reply(self) -> bytes:
        if self.has_value:
            self.data = bundle(self.obj)
        data = self.data
        user, system = (round(now - then, 6) for now, then in zip(_cpu(), self.usage, strict=True))
        cost = {"cpu_user_s": max(0.0, user), "cpu_system_s": max(0.0, system),
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        return json.dumps({"value": None if data is None else data.get("text/plain"), "data": data,
                           "value_at": self.value_at, "display": self.display, "error": self.error,
                           "execution_count": self.count, "cost": cost}).encode("utf-8") + b"\0"


class Runtime:
    """The session's loop: cells and forks from the worker, one at a time.
    ``shell``: IPython's (execpool/tool/ipython_shell.py), which then runs
    each cell; None: plain Python, run here."""

    def __init__(self, channel: socket.socket, shell: Any = None) -> None:
        self.channel = channel
        self._buffer = bytearray()
        self._fds: List[int] = []
        self.count = 0
        self.cell: Optional[_Cell] = None
        self.shell = shell
        if shell is not None:
            self.main = shell.user_module
            return
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.main
        builtins.display = self._display  # type: ignore[attr-defined]

    def _display(self, *objs: Any) -> None:
        """``display(obj, ...)``, as in Jupyter: each object's bundle among
        the cell's displays (printed as its repr outside a cell)."""
        if self.cell is None:
            print(*map(_plain, objs))
        else:
            self.cell.show(*objs)

    def serve(self) -> None:
        while True:
            frame = self._frame()
            if frame is None:
                return  # the worker closed the session
            digits = len(frame) - len(frame.lstrip(b"0123456789"))
            tag, kind, body = frame[:digits], frame[digits:digits + 1], frame[digits + 1:]
            if kind == b"*":
                reply = self._fork(tag, body)
                if reply is None:
                    continue  # the copy: its parent answers the fork
            else:
                reply = self.run(body.decode("utf-8", "replace"), tag + b"!\0")
            self.channel.sendall(tag + b":" + reply)

    def _frame(self) -> Optional[bytes]:
        """The next frame from the worker, without its NUL; None at EOF. The
        descriptors a fork frame brings are kept for it (``_fds``); none
        other comes."""
        while (end := self._buffer.find(b"\0")) < 0:
            try:
                data, fds, _flags, _address = socket.recv_fds(self.channel, 1 << 16, _MAX_FORK_FDS)
            except InterruptedError:
                continue
            for fd in fds:
                os.set_inheritable(fd, False)
            self._fds += fds
            if not data:
                return None
            self._buffer += data
        frame = bytes(self._buffer[:end])
        del self._buffer[:end + 1]
        return frame

    def _fork(self, tag: bytes, body: bytes) -> Optional[bytes]:
        """A copy of this session, to become another session: the parent's
        reply (JSON: the copy's pid, or why there is none); None in the copy,
        which serves its own socket from here on. A sandboxed copy's request
        for its trees goes up as the number, ``+`` and its pid."""
        fds, self._fds = self._fds, []
        from .session_fork import fork_copy  # only a fork needs it
        try:
            spec = json.loads(body)
        except ValueError:
            spec = None
        result = fork_copy(self, spec, fds, lambda pid: self.channel.sendall(tag + b"+%d\0" % pid))
        if result is None:
            self._buffer.clear()  # the parent's frames are not the copy's
            return None
        return json.dumps(result).encode("utf-8") + b"\0"

    def run(self, source: str, started: bytes) -> bytes:
        """The cell's reply; ``started`` is said once SIGINT would interrupt it."""
        global _in_cell
        shell = self.shell
        # IPython counts only the cells it runs (not blank ones), as a kernel does.
        self.count = self.count + 1 if shell is None else shell.execution_count
        cell = self.cell = _Cell(self.count)
        global _interrupted
        said: List[bool] = []
        _interrupted = False  # one that came between cells is nobody's

        def gate(running: bool) -> None:
            """The cell's own code runs (or stops): SIGINT is its interrupt
            from the start, said once, to the end; one that came while
            IPython ran between statements ends the cell before the next
            (IPython shows it as the cell's KeyboardInterrupt)."""
            global _in_cell, _interrupted
            if running and not said:
                said.append(True)
                self.channel.sendall(started)
            if running and _interrupted:
                _interrupted = False
                raise KeyboardInterrupt
            _in_cell = running

        if shell is not None:
            shell.outputs, shell.code_gate = cell, gate
        try:
            try:
                if shell is None:
                    gate(True)
                    self._execute(source, cell)
                else:
                    shell.run_cell(source, store_history=True)
            finally:
                _in_cell = False
        except BaseException as exc:  # noqa: BLE001 - the cell's error, SystemExit and KeyboardInterrupt too
            cell.error = _error(exc)
        finally:
            if shell is not None:
                shell.outputs, shell.code_gate = None, None
        if shell is None:
            try:
                self._show_figures(cell)
            except BaseException as exc:  # noqa: BLE001
                cell.error = cell.error or _error(exc)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.cell = None
        return cell.reply()

    def _execute(self, source: str, cell: _Cell) -> None:
        name = f"<cell {self.count}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        tree = ast.parse(source, name, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        assert last is None or isinstance(last, ast.Expr)
        namespace = self.main.__dict__
        if tree.body:
            exec(compile(tree, name, "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
            if value is not None:
                cell.obj, cell.has_value, cell.value_at = value, True, len(cell.display)
                builtins._ = value  # type: ignore[attr-defined]

    def _show_figures(self, cell: _Cell) -> None:
        """Every matplotlib figure still open is shown, then closed, as the
        inline backend does; the cell's value, if it is one, only once."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            if not (cell.has_value and cell.obj is figure):
                cell.show(figure)
        pyplot.close("all")


def _error(exc: BaseException) -> Dict[str, Any]:
    """Jupyter's error: the exception's name and value, and a traceback of
    the frames of the cells and of what they called -- execpool's own, the
    runtime's and the shim's, are left out (as a cold run's are), in the
    exception and in those it was raised from."""
    report = traceback.TracebackException.from_exception(exc)
    pending: List[Optional[traceback.TracebackException]] = [report]
    seen = set()
    while pending:
        part = pending.pop()
        if part is None or id(part) in seen:
            continue
        seen.add(id(part))
        part.stack = traceback.StackSummary.from_list(
            [frame for frame in part.stack if not (frame.filename or "").startswith(OWN_CODE)])
        pending += [part.__cause__, part.__context__]
    lines = [line for chunk in report.format() for line in chunk.splitlines()]
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": lines}


def main(ipython: bool = False) -> None:
    """The session's process from its start: ``ipython`` says it speaks
    IPython (the pool checked that it can)."""
    channel = socket.socket(fileno=os.dup(0))  # dup: close-on-exec, unlike fd 0
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    signal.signal(signal.SIGINT, _on_sigint)
    shell = None
    if ipython:
        from . import ipython_shell  # the template imported it (and built its shell) where it could
        shell = ipython_shell.take()
    os.environ.setdefault("MPLBACKEND", "Agg")
    Runtime(channel, shell).serve()
