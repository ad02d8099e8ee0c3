"""IPython's language in a Python session: an ``InteractiveShell`` whose
outputs are the cell's (execpool/tool/python_session.py) rather than a
terminal's or a kernel's wire.

Runs in the session's own process, beside the cell's code, sandboxed like
it: what a cell writes reaches nothing but this process and its
directories. The warm template (execpool/tool/template.py) imports this
module and builds the shell once (``prepare``) -- IPython's import and the
shell's construction are most of a session's start otherwise -- and every
spare cloned from it has that shell, unused. A session's runtime takes it
(``take``) and makes it the process's IPython; a warm job never does, so for
it IPython is only a module already imported (``prepare`` leaves no trace of
a running IPython: no singleton, no ``__IPYTHON__`` or ``display`` builtins,
no prompts in ``sys``).

What a kernel sends on its iopub channel is, here, a call on the cell's
``Outputs``: a ``display_data`` (``display()``, a figure the inline
backend shows, ``update_display``) is ``publish``, an ``execute_result`` is
``result``, ``clear_output`` is ``clear``, an ``error`` is ``failed``. A
``!`` command runs as ``bash -c`` (stderr on stdout, as a kernel's pty
merges them) writing straight to the session's pipes, so its output is the
cell's, live. ``?`` help, which a kernel hands its frontend's pager, is
printed: a session has no pager. ``input()`` raises what a kernel raises
when its frontend takes no input: a session's cells get none.
"""

from __future__ import annotations

import builtins
import fnmatch
import importlib
import io
import os
import pathlib
import signal
import subprocess
import sys
import threading
import types
from typing import Any, Callable, Dict, Optional, Protocol

from IPython.core import interactiveshell
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from . import OWN_CODE

#: The shell ``!`` commands run in; POSIX sh where bash is missing.
_SHELL = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"

#: matplotlib's backend in a session that speaks IPython: the one a
#: kernel sets, which shows a cell's figures at its end.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


class Outputs(Protocol):
    """Where a cell's rich outputs go (the runtime's cell)."""

    def publish(self, data: Dict[str, Any], display_id: Optional[str], update: bool) -> None: ...

    def result(self, data: Dict[str, Any]) -> None: ...

    def clear(self, wait: bool) -> None: ...

    def failed(self, ename: str, evalue: str, traceback: list) -> None: ...


class _Publisher(DisplayPublisher):
    """``display()`` and its kin, into the running cell's outputs."""

    def publish(self, data: Any, metadata: Any = None, source: Any = None, *, transient: Any = None,
                update: bool = False, **kwargs: Any) -> None:
        outputs = _running(self.shell)
        display_id = transient.get("display_id") if isinstance(transient, dict) else None
        if outputs is None:
            print(data.get("text/plain", ""))  # between cells: nobody's display
        else:
            outputs.publish(dict(data), display_id if isinstance(display_id, str) else None, update)

    def clear_output(self, wait: bool = False) -> None:
        outputs = _running(self.shell)
        if outputs is not None:
            outputs.clear(wait)


class _ValueHook(DisplayHook):
    """The last expression's value as the cell's ``execute_result``; the
    ``_``, ``__``, ``_N`` and ``Out`` bookkeeping is IPython's own."""

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: Any, md_dict: Any = None) -> None:
        outputs = _running(self.shell)
        if outputs is not None:
            outputs.result(dict(format_dict))


class _MemoryStore(dict):
    """``get_ipython().db`` in memory, for the session's life: what
    ``%cd`` keeps (its directory history, the bookmarks ``%bookmark``
    makes and ``%cd -b`` follows) and the rest of IPython that keeps keys
    in it. A kernel's lives in ``~/.ipython``, which a session has not:
    the template must not write a home, and a sandboxed session's is its
    own and fresh."""

    def keys(self, globpat: Optional[str] = None) -> Any:
        """pickleshare's ``keys``: all, or those matching a glob."""
        names = list(super().keys())
        return names if globpat is None else [name for name in names if fnmatch.fnmatch(name, globpat)]

    def uncache(self, *items: Any) -> None:
        """Nothing is cached apart from the store: it is the store."""


class SessionShell(InteractiveShell):
    """A shell that keeps no files (no profile, history in memory), shows
    tracebacks without colours (they are read as text, by people and
    models), and sends what it shows to the running cell."""

    display_pub_class = _Publisher
    displayhook_class = _ValueHook

    #: The running cell's outputs; None between cells.
    outputs: Optional[Outputs] = None
    #: Told True as the cell's own code starts, False as it stops
    #: (execpool/tool/python_session.py): only then may SIGINT interrupt it,
    #: never in IPython's hooks around it, which swallow the interrupt.
    code_gate: Optional[Callable[[bool], None]] = None

    async def run_code(self, code_obj: Any, result: Any = None, *, async_: bool = False) -> Any:
        gate = self.code_gate
        if gate is not None:
            gate(True)
        try:
            return await super().run_code(code_obj, result, async_=async_)
        finally:
            if gate is not None:
                gate(False)

    def init_ipython_dir(self, ipython_dir: Any) -> None:
        # No ~/.ipython: the template must not write the worker's home, and
        # a sandboxed session's home is its own and fresh.
        pass

    def init_profile_dir(self, profile_dir: Any) -> None:
        self.profile_dir = None

    def _get_exc_info(self, exc_tuple: Any = None) -> Any:
        """The exception to show, without execpool's frames -- this module's
        (``input()``, a ``!`` command put in the background), the /mnt/data
        shim's -- as plain Python's tracebacks leave them out: the cell's
        code is what went wrong, not execpool's."""
        etype, value, tb = super()._get_exc_info(exc_tuple)
        entries = []
        while tb is not None:
            if not tb.tb_frame.f_code.co_filename.startswith(OWN_CODE):
                entries.append(tb)
            tb = tb.tb_next
        for entry in reversed(entries):
            tb = types.TracebackType(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        return etype, value, tb

    def _showtraceback(self, etype: Any, evalue: Any, stb: Any) -> None:
        outputs = self.outputs
        if outputs is None:
            super()._showtraceback(etype, evalue, stb)
        else:
            outputs.failed(etype.__name__, str(evalue), list(stb))

    def system_piped(self, cmd: str) -> None:
        """``!cmd``: bash in this session's process group (an interrupt
        reaches it as the cell's), stdout and stderr together on the
        session's stdout; its status in ``_exit_code``, as IPython keeps it."""
        if cmd.rstrip().endswith("&"):
            raise OSError("a ! command cannot run in the background: its output is the cell's; "
                          "use subprocess.Popen for a process that outlives the cell")
        command = self.var_expand(cmd, depth=1)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        process: Optional[subprocess.Popen] = None
        try:
            process = _started(command)
            code = process.wait()
        except KeyboardInterrupt:
            # The interrupt reached the command too (it is in the session's
            # group); as a kernel does, the cell goes on without an error.
            if process is not None:
                process.kill()
                process.wait()
            print("^C")  # where a kernel's terminal echoes it
            code = -2
        self.user_ns["_exit_code"] = code
        if self.system_raise_on_error and code != 0:
            raise subprocess.CalledProcessError(code, cmd)

    system = system_piped

    def ask_exit(self) -> None:
        """``exit()`` and ``quit()``: nothing. A session ends when its
        owner closes it; a model ending its code with ``exit()`` keeps its
        state, as in a notebook whose kernel stays up."""

    def enable_gui(self, gui: Optional[str] = None) -> None:
        """``%matplotlib inline`` asks for no GUI (the inline backend draws
        into the cell); a session has no window for any other."""
        if gui not in (None, "inline"):
            raise UsageError(f"a session has no GUI event loop for {gui!r}: use %matplotlib inline")


def _started(command: str) -> subprocess.Popen:
    """``command`` started; an interrupt that comes while it starts (its
    first output can reach the caller before Popen returns) is raised once
    it has, so that the caller holds the process it must stop."""
    if threading.current_thread() is not threading.main_thread():
        return subprocess.Popen(command, shell=True, executable=_SHELL, stdin=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: interrupted.append(True))
    try:
        process = subprocess.Popen(command, shell=True, executable=_SHELL, stdin=subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        process.kill()
        process.wait()
        raise KeyboardInterrupt
    return process


def _running(shell: Any) -> Optional[Outputs]:
    return getattr(shell, "outputs", None)


def _page(_shell: Any, data: Any, start: int = 0, screen_lines: int = 0, pager_cmd: Any = None) -> None:
    """``?`` and ``??`` help, and whatever else would open a pager: its text,
    printed (a kernel gives it to its frontend's pager; a session has none)."""
    text = data.get("text/plain", "") if isinstance(data, dict) else str(data)
    print(text)


def _no_input(prompt: object = "", *args: Any, **kwargs: Any) -> str:
    raise StdinNotImplementedError("input() cannot be answered here: a session's cells get no input; "
                                   "give the data in the code or in a file")


#: What IPython imports only once a session needs it, imported by the
#: template with the shell: a session's first cell (its logger, the cell's
#: hash, the debugger's base), first traceback (stack_data), first
#: ``%time`` and first ``?`` would each take 5 to 30 ms more otherwise.
_FIRST_USE = ("IPython.core.logger", "hashlib", "bdb", "stack_data", "IPython.core.magics.execution",
              "IPython.core.magics.namespace")

#: The shell the template built for its spares; None before ``prepare``.
_warm: Optional[SessionShell] = None
#: The builtins its construction added (``__IPYTHON__``, ``display``), which
#: the template takes back and a session puts back.
_builtins: Dict[str, Any] = {}


def _build() -> SessionShell:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"  # and so no history thread: a fork copies no thread
    shell = SessionShell(config=config, user_module=types.ModuleType("__main__"), colors="nocolor")
    shell.set_hook("show_in_pager", _page)
    shell.db = _MemoryStore()
    return shell


def prepare() -> None:
    """In the template: build the shell its spares' sessions will take,
    leaving the process as a plain interpreter would be."""
    global _warm
    names = set(builtins.__dict__)
    main = sys.modules.get("__main__")
    prompts = {name: getattr(sys, name) for name in ("ps1", "ps2", "ps3") if hasattr(sys, name)}
    try:
        shell = _build()
        _rehearse(shell)
    finally:  # a shell that failed to build leaves no more trace than one that did
        for name in set(builtins.__dict__) - names:
            _builtins[name] = builtins.__dict__.pop(name)
        for name in ("ps1", "ps2", "ps3"):
            if name in prompts:
                setattr(sys, name, prompts[name])
            elif hasattr(sys, name):
                delattr(sys, name)
        if main is not None:
            sys.modules["__main__"] = main
    _warm = shell


def _rehearse(shell: SessionShell) -> None:
    """What a session's first cell, first value and first traceback would
    set up (IPython's modules imported on first use, the tokenizer's
    patterns, the formatters' defaults, the traceback formatter's tables),
    done once, in the template, for every session: 15, 12 and 20 ms of
    their first cells otherwise. None of it is the shell's state: no cell
    runs, nothing is counted or kept."""
    for name in _FIRST_USE:
        importlib.import_module(name)
    shell.transform_cell("x = 1\n")
    formatter = shell.display_formatter
    assert formatter is not None  # made by the shell's construction
    formatter.format(0)
    try:
        _no_input()  # raised in a file: inspect's table of modules by file is made
    except StdinNotImplementedError as exc:
        shell.InteractiveTB.structured_traceback(type(exc), exc, exc.__traceback__)


def rehearse() -> None:
    """In a parked spare (and the template): a silent cell -- not counted,
    not kept in the history, showing nothing -- through the template's
    shell, so that the pages a session's first cells write are copied
    while the spare waits, not on the session's way (its first two cells
    take half the time). A spare that becomes a plain job has its
    builtins and ``sys`` as the cell found them."""
    if _warm is not None:
        _warm.run_cell("None", store_history=False, silent=True)


def take() -> SessionShell:
    """The session's shell -- the template's, else one built now -- made
    this process's IPython: ``get_ipython()``, the ``display`` builtin,
    the prompts, matplotlib's inline backend, no ``input()``. IPython's
    ``open`` (which refuses descriptors 0-2) wraps ``io.open`` as the
    session has it: the /mnt/data shim's, which the session imported after
    the template had imported IPython."""
    shell = _warm if _warm is not None else _build()
    interactiveshell.io_open = io.open
    for cls in SessionShell.mro():
        if issubclass(cls, InteractiveShell):
            cls._instance = shell  # type: ignore[assignment]  # what SingletonConfigurable.instance() sets
    builtins.__dict__.update(_builtins)
    # ``_dh`` (``%cd -``, ``%dhist``) starts where the session does, not
    # where the template built the shell.
    history = shell.history_manager
    assert history is not None  # made by the shell's construction
    history.dir_hist[:] = [pathlib.Path.cwd()]
    shell.init_prompts()
    builtins.input = _no_input
    sys.modules["__main__"] = shell.user_module
    if os.environ.setdefault("MPLBACKEND", INLINE_BACKEND) == INLINE_BACKEND and "matplotlib" in sys.modules:
        # The pool preloaded matplotlib: it read its backend in the template.
        shell.enable_matplotlib("inline")
    return shell
