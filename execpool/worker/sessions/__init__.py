"""Sessions, the worker's side: its sessions' cells, interrupts and forks
(host.py), the link to each one's runtime (link.py), a sandboxed session's
forks' directories (family.py). What runs in the session's own process --
the runtimes, Python's and bash's, and a Python session's fork -- is the
tool's: execpool/tool/python_session.py, bash_session.sh, session_fork.py."""

from __future__ import annotations

from pathlib import Path

#: A Python session's tool is a warm job running this: it removes its own
#: file from the session's directory and becomes the runtime (IPython's
#: or plain Python's: the argument of ``main``).
PYTHON_BOOTSTRAP = ("import os\nos.unlink(__file__)\ndel os\n"
                    "from execpool.tool.python_session import main\nmain({})\n")

#: A bash session's tool is ``bash -c`` with this.
BASH_RUNTIME = (Path(__file__).parents[2] / "tool" / "bash_session.sh").read_text(encoding="utf-8")


def runtime_source(argv_kind: str, ipython: bool) -> str:
    return PYTHON_BOOTSTRAP.format(ipython) if argv_kind == "python" else BASH_RUNTIME
