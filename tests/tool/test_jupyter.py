"""Sessions that speak IPython (issue 45), side by side with a real
Jupyter kernel: a corpus of notebook cells -- magics, ``!`` commands,
displays, figures, errors and tracebacks, interrupts, ``input()`` -- run in
order through an execpool session (sandboxed, as the service runs them)
and through ``ipykernel`` driven by ``jupyter_client``. Each cell must give
the same stdout and stderr, the same MIME types in the same order (with
the same text, and images of the same size), and the same error name;
what differs for a reason is normalised here, each reason in docs/library/ipython-sessions.md
(the differences from a kernel)."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import struct
import tempfile
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
from jupyter_client.manager import start_new_kernel

from execpool import ExecPool, JobOutput, PythonJob, Status
from tests.support.helpers import run_as_nobody

#: What a kernel colours its tracebacks and help with; a session does not.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: Where each side says a cell's code came from: ipykernel writes each cell
#: to a file named by its hash, IPython names it in memory.
_CELL_FILES = re.compile(r"(/tmp/ipykernel_\d+/\d+\.py|<ipython-input-[0-9a-f-]+>)")

#: Objects live at other addresses in each process.
_ADDRESS = re.compile(r"0x[0-9a-f]+")

#: Timings differ from run to run.
_DURATIONS = re.compile(r"\d[-+.\de]* (ns|μs|µs|ms|s)\b")

#: A 1x1 PNG, as IPython.display.Image takes it.
_PIXEL = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


@dataclass(frozen=True)
class Cell:
    code: str
    #: Applied to both sides' streams and texts before they are compared.
    normalize: Optional[Callable[[str], str]] = None
    #: Compare the error's value too (off where it names each side's own file).
    evalue: bool = True
    #: Interrupt it once it printed this.
    interrupt_after: Optional[str] = None
    #: SandboxFusion's kernel driver lists what a notebook shows (it does
    #: not where a cell updates or clears a display or opens the pager).
    sandbox_fusion: bool = True


def _timings(text: str) -> str:
    return _DURATIONS.sub("T", text)


def _no_file_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("File:"))


CORPUS: List[Cell] = [
    # values, _ and Out
    Cell("x = 41\nx + 1"),
    Cell("print('hello')\nimport sys\nprint('oops', file=sys.stderr)"),
    Cell("_ * 2"),
    Cell("Out[1] + __"),
    Cell("In[1]"),
    Cell("print('x')\n1;"),
    Cell(""),
    Cell("import asyncio\nawait asyncio.sleep(0)\n'awaited'"),
    # line and cell magics
    Cell("%time y = sum(range(1000))", normalize=_timings),
    Cell("%%time\nz = 1", normalize=_timings),
    Cell("%timeit -n 1 -r 1 pass", normalize=_timings),
    Cell("%env MY_VAR=1"),
    Cell("import os\nos.environ['MY_VAR']"),
    Cell("%%writefile notes.txt\nline one\nline two"),
    Cell("%%capture captured\nprint('hidden')"),
    Cell("captured.stdout"),
    Cell("%%bash\necho from bash\necho to err >&2"),
    Cell("%%html\n<p>cell magic html</p>"),
    Cell("%%markdown\n# a title"),
    Cell("%matplotlib inline"),
    # shell escapes
    Cell("!cat notes.txt"),
    Cell("!echo $x"),
    Cell("listed = !ls notes.txt\nlisted"),
    Cell("!exit 3"),
    Cell("_exit_code"),
    Cell("!ls /no-such-directory"),
    Cell("!sleep 1 &", evalue=False),
    # the working directory: %cd and its history (_dh) from where each side started
    Cell("os.makedirs('sub', exist_ok=True)\n%cd -q sub\nos.path.basename(os.getcwd())"),
    Cell("%cd -q -\nos.getcwd() == str(_dh[0]), len(_dh)"),
    Cell("%cd -q no-such-directory"),
    # help
    Cell("?len", normalize=_no_file_lines, sandbox_fusion=False),
    Cell("def double(n):\n    'Twice n.'\n    return 2 * n"),
    Cell("double?", normalize=_no_file_lines, sandbox_fusion=False),
    # displays
    Cell("from IPython.display import HTML, JSON, SVG, Image, Latex, Markdown, clear_output, display, "
         "update_display\ndisplay(HTML('<b>bold</b>'))"),
    Cell("display(Markdown('*m*'), Latex('$x^2$'))"),
    Cell("display(JSON({'a': 1}))"),
    Cell("SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"10\"><circle r=\"4\" cx=\"5\" "
         "cy=\"5\"/></svg>')"),
    Cell(f"Image(data=__import__('base64').b64decode('{_PIXEL}'))"),
    Cell("class Rich:\n    def _repr_html_(self):\n        return '<i>rich</i>'\n"
         "    def _repr_markdown_(self):\n        return '**rich**'\nRich()"),
    Cell("class Bundle:\n    def _repr_mimebundle_(self, include=None, exclude=None):\n"
         "        return {'text/plain': 'bundle', 'application/vnd.custom+json': {'k': 1}}\nBundle()"),
    Cell("display('first', display_id='counter')\nupdate_display('second', display_id='counter')",
         sandbox_fusion=False),
    Cell("handle = display('a', display_id=True)\nhandle.update('b')", sandbox_fusion=False),
    Cell("print('before')\ndisplay('gone')\nclear_output()\ndisplay('kept')", sandbox_fusion=False),
    Cell("for i in range(3):\n    clear_output(wait=True)\n    display(i)", sandbox_fusion=False),
    Cell("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf"),
    # figures
    Cell("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);"),
    Cell("fig, ax = plt.subplots()\nax.bar([1, 2], [3, 4])\nfig"),
    Cell("plt.figure()\nplt.plot([1])\nplt.show()\nprint('after show')"),
    Cell("first = plt.figure()\nplt.plot([1])\nsecond = plt.figure(figsize=(3, 2))\nplt.plot([2]);"),
    Cell("closed = plt.figure()\nplt.close(closed)\nclosed"),
    Cell("plt.get_fignums()"),
    # errors and tracebacks
    Cell("1/0"),
    Cell("def inner():\n    return undefined_name\ninner()"),
    Cell("def broken(:\n    pass", evalue=False),
    Cell("raise ValueError('custom message')"),
    Cell("import sys\nsys.exit(2)"),
    Cell("import warnings\nwarnings.warn('careful')"),
    Cell("del z\nz"),
    # input() gets no answer in either
    Cell("input('name? ')", evalue=False),
    # interrupts: the cell stops, the state stays
    # (once the whole line came: print writes its end apart, and the interrupt would cut it off)
    Cell("import time\nprint('started', flush=True)\ntime.sleep(60)", interrupt_after="started\n"),
    Cell("!echo started; sleep 60", interrupt_after="started\n"),
    Cell("_exit_code"),
    Cell("x"),
]


@dataclass
class Seen:
    """One cell's outputs as a notebook keeps them: the streams as
    printed, the rich outputs after updates and clears, the error."""

    stdout: str = ""
    stderr: str = ""
    outputs: Optional[List[Dict[str, Any]]] = None
    ename: Optional[str] = None
    evalue: Optional[str] = None


class Kernel:
    """An ipykernel, driven as a notebook frontend drives it."""

    def __init__(self, cwd: str) -> None:
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=cwd)

    def run(self, cell: Cell, notebook: bool = True) -> Seen:
        """The cell's outputs as a notebook shows them (updates and clears
        applied, help from the pager), or, not ``notebook``, as
        SandboxFusion's kernel driver lists them (every display, in order,
        and nothing else)."""
        seen = Seen(outputs=[])
        by_id: Dict[str, List[int]] = {}
        clear_pending = False
        assert seen.outputs is not None

        def clear_if_pending() -> None:
            nonlocal clear_pending
            if clear_pending:
                clear_pending = False
                seen.outputs.clear()
                by_id.clear()

        def hook(msg: Dict[str, Any]) -> None:
            nonlocal clear_pending
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                setattr(seen, content["name"], getattr(seen, content["name"]) + content["text"])
                if (cell.interrupt_after and cell.interrupt_after in seen.stdout.replace("\r\n", "\n")  # a pty's
                        and not interrupting.is_alive()):
                    interrupting.start()
            elif kind in ("display_data", "execute_result"):
                clear_if_pending()
                display_id = (content.get("transient") or {}).get("display_id")
                if display_id:
                    by_id.setdefault(display_id, []).append(len(seen.outputs))
                seen.outputs.append(content["data"])
            elif kind == "update_display_data" and notebook:
                for index in by_id.get(content["transient"]["display_id"], ()):
                    seen.outputs[index] = content["data"]
            elif kind == "clear_output" and notebook:
                clear_pending = True
                if not content["wait"]:
                    clear_if_pending()
            elif kind == "error":
                seen.ename, seen.evalue = content["ename"], content["evalue"]

        answered = threading.Event()

        def interrupt() -> None:
            """What interrupt_kernel() does, without its own event loop (a
            second one, in a thread, while the hook runs in the first); and
            again each second until the cell ends, as a user presses it
            again: a SIGINT that lands in the kernel's own code rather than
            the cell's is only logged ("KeyboardInterrupt caught in kernel"),
            and the cell slept on past the test's timeout once."""
            while True:
                os.kill(self.manager.provisioner.process.pid, signal.SIGINT)
                if answered.wait(1.0):
                    return

        interrupting = threading.Thread(target=interrupt, name="interrupt-kernel")
        try:
            reply = self.client.execute_interactive(cell.code, output_hook=hook, allow_stdin=False, timeout=120)
        finally:
            answered.set()
            if interrupting.is_alive():
                interrupting.join()
        for payload in reply["content"].get("payload", ()) if notebook else ():
            if payload.get("source") == "page":  # a frontend's pager; a session prints it
                seen.stdout += payload["data"]["text/plain"] + "\n"
        return seen

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
        # Its sockets, and the event loop jupyter_client made to drive them,
        # are descriptors the leak check counts.
        self.manager.context.destroy(linger=0)
        self.client.context.destroy(linger=0)
        asyncio.get_event_loop_policy().get_event_loop().close()
        asyncio.set_event_loop(None)


def _session_run(session: Any, cell: Cell) -> Seen:
    printed = threading.Event()
    text: List[str] = []

    def on_event(event: object) -> None:
        if isinstance(event, JobOutput) and cell.interrupt_after:
            text.append(event.text)
            if cell.interrupt_after in "".join(text):
                printed.set()

    future = session.submit(cell.code, timeout=120, on_event=on_event)
    if cell.interrupt_after:
        assert printed.wait(60), "the cell never printed"
        session.interrupt()
    result = future.result()
    assert result.alive, result.message
    error = result.error or {}
    return Seen(result.stdout, result.stderr, list(result.shown), error.get("ename"), error.get("evalue"))


def _png_size(encoded: str) -> Tuple[int, int]:
    png = base64.b64decode(encoded)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def _comparable(seen: Seen, cell: Cell) -> Dict[str, Any]:
    def text(value: str) -> str:
        value = _ADDRESS.sub("0x", _CELL_FILES.sub("CELL", _ANSI.sub("", value))).replace("\r\n", "\n")
        return cell.normalize(value) if cell.normalize else value

    outputs = []
    for bundle in seen.outputs or ():
        shown = {}
        for mime, value in bundle.items():
            if mime.startswith("image/") and mime != "image/svg+xml":
                shown[mime] = _png_size(value) if mime == "image/png" else len(base64.b64decode(value))
            else:
                shown[mime] = text(value) if isinstance(value, str) else value
        outputs.append((list(bundle), shown))
    return {"stdout": text(seen.stdout), "stderr": text(seen.stderr), "outputs": outputs, "ename": seen.ename,
            "evalue": text(seen.evalue or "") if cell.evalue else None}


@pytest.mark.slow
def test_the_corpus_gives_what_a_jupyter_kernel_gives():
    assert len(CORPUS) >= 40
    with tempfile.TemporaryDirectory() as kernel_dir, ExecPool(workers=1, sandbox="strict") as pool:
        kernel = Kernel(kernel_dir)
        try:
            with pool.session("python", ipython=True) as session:
                for cell in CORPUS:
                    ours, theirs = _session_run(session, cell), kernel.run(cell)
                    assert _comparable(ours, cell) == _comparable(theirs, cell), cell.code
        finally:
            kernel.close()


@pytest.mark.slow
def test_run_jupyter_gives_what_sandbox_fusion_s_kernel_driver_gives():
    """The corpus's cells (but those it does not list as a notebook does, and
    the interrupts, which a request cannot make) in one ``/run_jupyter``
    request, against a kernel read as SandboxFusion's driver reads it."""
    from tests.support.servers import Server

    cells = [cell for cell in CORPUS if cell.sandbox_fusion and cell.interrupt_after is None]
    server = Server("--workers", "1")
    try:
        answer = server.client.post("/run_jupyter", json={"cells": [cell.code for cell in cells],
                                                          "total_timeout": 300}).json()
    finally:
        assert server.stop() == 0
    assert answer["status"] == "Success" and len(answer["cells"]) == len(cells), answer
    with tempfile.TemporaryDirectory() as kernel_dir:
        kernel = Kernel(kernel_dir)
        try:
            for cell, ours in zip(cells, answer["cells"], strict=True):
                error = ours["error"][0] if ours["error"] else {}
                seen = Seen(ours["stdout"], ours["stderr"], ours["display"], error.get("ename"), error.get("evalue"))
                assert _comparable(seen, cell) == _comparable(kernel.run(cell, notebook=False), cell), cell.code
        finally:
            kernel.close()


# -- what the corpus does not show ----------------------------------------------------------

@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=1, sandbox="strict") as p:
        yield p


def test_a_figure_as_the_value_comes_before_the_figures_shown_at_the_end(pool):
    with pool.session("python", ipython=True) as session:
        result = session.run("import matplotlib.pyplot as plt\nfrom IPython.display import display\n"
                             "display('first')\nfig = plt.figure()\nplt.plot([1])\nfig", timeout=120)
    assert result.status is Status.OK, result.text
    assert [sorted(bundle) for bundle in result.shown] == [["text/plain"], ["image/png", "text/plain"],
                                                           ["image/png", "text/plain"]]
    assert result.value_at == 1 and result.shown[1] == result.data


def test_a_shell_escape_runs_in_the_sandbox_and_streams_live(pool):
    events: List[str] = []
    with pool.session("python", ipython=True) as session:
        result = session.submit("!echo first; cat /etc/shadow; echo last",
                                on_event=lambda e: events.append(e.text) if isinstance(e, JobOutput) else None
                                ).result()
    assert result.status is Status.OK
    assert result.stdout.startswith("first\n") and result.stdout.endswith("last\n")
    assert "Permission denied" in result.stdout or "No such file" in result.stdout
    assert "".join(events) == result.stdout


def test_a_traceback_shows_the_cells_frames_and_none_of_execpool(pool):
    with pool.session("python", ipython=True) as session:
        session.run("def inner():\n    return 1 / 0")
        for code in ("print('before')\ninner()", "input()", "def (", "!sleep 1 &"):
            result = session.run(code)
            assert result.status is Status.ERROR and result.alive, code
            traceback = "\n".join(result.error["traceback"])
            assert "execpool" not in traceback and "\x1b[" not in traceback, traceback
        assert "Cell In[1], line 2, in inner" in "\n".join(session.run("inner()").error["traceback"])


def test_bookmarks_and_directory_history_are_the_session_s_own(pool):
    """``%bookmark`` and ``%cd`` keep what a kernel keeps in ``~/.ipython``
    in the session's memory: a fork has the copy, another session none."""
    with pool.session("python", ipython=True) as session:
        start = session.run("import os\nos.getcwd()").value
        session.run("os.makedirs('sub')\n%bookmark there sub")
        moved = session.run("%cd -b there")
        assert moved.status is Status.OK and moved.stdout.startswith("(bookmark:there) -> sub\n"), moved.text
        with session.fork() as copy:
            assert copy.run("%cd -q -\n%cd -q -b there\nos.path.basename(os.getcwd())").value == "'sub'"
        with pool.session("python", ipython=True) as other:
            assert other.run("%bookmark -l").stdout == "Current bookmarks:\n"
            assert other.run("_dh").value == f"[PosixPath({start})]"


def test_exit_leaves_the_session_and_its_state(pool):
    with pool.session("python", ipython=True) as session:
        session.run("x = 1")
        for code in ("exit()", "quit()", "exit"):
            assert session.run(code).status is Status.OK, code
        assert session.run("x").value == "1"


@pytest.mark.slow
def test_figures_are_inline_when_the_pool_preloads_matplotlib():
    with ExecPool(workers=1, preload=["matplotlib.pyplot"]) as preloaded, preloaded.session("python") as session:
        result = session.run("import matplotlib.pyplot as plt\nplt.plot([1, 2]);", timeout=120)
    assert [sorted(bundle) for bundle in result.display] == [["image/png", "text/plain"]], result.text


def test_ipython_false_is_plain_python(pool):
    with pool.session("python", ipython=False) as session:
        assert session.run("%time 1").error["ename"] == "SyntaxError"
        assert session.run("input()").error["ename"] == "EOFError"


def test_a_bash_session_cannot_be_asked_for_ipython(pool):
    with pytest.raises(ValueError, match="Python sessions"):
        pool.session("bash", ipython=True)
    with pytest.raises(TypeError, match="ipython"):
        pool.session("python", ipython="yes")


def test_a_pool_whose_python_lacks_ipython_says_which_extra_to_install(tmp_path):
    venv = tmp_path / "bare"
    import venv as make_venv

    make_venv.create(venv, with_pip=False, system_site_packages=False)
    python = str(venv / "bin" / "python")
    with ExecPool(workers=1, python=python) as bare:
        with pytest.raises(ImportError, match=re.escape("pip install 'execpool[jupyter]'")):
            bare.session("python", ipython=True)


#: What a session that speaks IPython imports besides the standard library.
_IPYTHON_PACKAGES = ("IPython", "traitlets", "pygments", "stack_data", "executing", "asttokens", "pure_eval")


@pytest.mark.slow
@pytest.mark.nobody
def test_a_session_of_a_pool_run_by_nobody_speaks_ipython():
    done = run_as_nobody(textwrap.dedent("""
        from execpool import ExecPool
        with ExecPool(workers=1, sandbox="strict") as pool, pool.session("python", ipython=True) as s:
            r = s.run("!echo from bash\\nfrom IPython.display import display, HTML\\ndisplay(HTML('<b>x</b>'))")
            print(r.stdout.strip(), sorted(r.display[0]))
    """), extra=_IPYTHON_PACKAGES)
    assert done.stdout.strip() == "from bash ['text/html', 'text/plain']", done.stderr


@pytest.mark.slow
def test_the_service_s_sessions_and_run_jupyter_speak_ipython():
    from tests.support.servers import Server

    server = Server("--workers", "1")
    try:
        made = server.client.post("/v1/sessions", json={"language": "python", "ipython": False})
        assert made.status_code == 201 and made.json()["ipython"] is False
        plain = server.client.post(f"/v1/sessions/{made.json()['id']}/run", json={"code": "%time 1"}).json()
        assert plain["error"]["ename"] == "SyntaxError"
        made = server.client.post("/v1/sessions", json={"language": "python"})
        assert made.status_code == 201 and made.json()["ipython"] is True
        shell = server.client.post(f"/v1/sessions/{made.json()['id']}/run", json={"code": "!echo hi"}).json()
        assert (shell["status"], shell["stdout"]) == ("ok", "hi\n")
        bash = server.client.post("/v1/sessions", json={"language": "bash", "ipython": True})
        assert bash.status_code == 400 and bash.json()["detail"].startswith('"ipython": true is for a Python')
        bad = server.client.post("/v1/sessions", json={"language": "python", "ipython": "yes"})
        assert bad.status_code == 400 and bad.json()["detail"].startswith('"ipython" must be a boolean')
        answer = server.client.post("/run_jupyter", json={"cells": [
            "display('first')\nimport matplotlib.pyplot as plt\nfig = plt.figure()\nplt.plot([1])\nfig",
            "!echo shell", "%who"]}).json()
        assert answer["status"] == "Success", answer
        figure, shell_cell, who = answer["cells"]
        # As a kernel sends them: the display, the value, then the figure the cell left open.
        assert [sorted(bundle) for bundle in figure["display"]] == [
            ["text/plain"], ["image/png", "text/plain"], ["image/png", "text/plain"]]
        assert shell_cell["stdout"] == "shell\n" and who["stdout"] == "fig\t plt\t \n"
    finally:
        assert server.stop() == 0


def test_a_warm_job_finds_ipython_imported_and_not_running(pool):
    """The template built the sessions' shell; a warm job cloned from it
    is a plain interpreter all the same (a notebook check says no)."""
    probe = ("import builtins, sys\nprint('IPython' in sys.modules)\nimport IPython\n"
             "print(hasattr(builtins, '__IPYTHON__'), hasattr(builtins, 'display'), hasattr(sys, 'ps1'), "
             "IPython.get_ipython(), sys.displayhook is sys.__displayhook__, 'get_ipython' in dir(builtins))")
    result = pool.run(PythonJob(probe, warm=True))
    assert result.output == "True\nFalse False False None True False\n", result.text


def test_a_fork_copies_the_shell_and_its_history(pool):
    with pool.session("python", ipython=True) as parent:
        parent.run("x = 41\nx + 1")
        with parent.fork() as child:
            result = child.run("!echo copy\nOut[1], In[1], _")
            assert (result.stdout, result.value) == ("copy\n", "(42, 'x = 41\\nx + 1', 42)")
            assert result.execution_count == 2
            child.run("x = 0")
        assert parent.run("x").value == "41"
