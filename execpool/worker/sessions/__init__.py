"""Sessions. The worker's side: its sessions' cells, interrupts and forks
(host.py), the link to each one's runtime (link.py), a sandboxed session's
forks' directories (family.py). The session's own process: the runtimes,
Python's (python.py) and bash's (bash.sh), and a Python session's fork
(fork.py)."""

from __future__ import annotations

from pathlib import Path

#: A Python session's tool is a warm job running this: it removes its own
#: file from the session's directory and becomes the runtime.
PYTHON_BOOTSTRAP = ("import os\nos.unlink(__file__)\ndel os\n"
                    "from execpool.worker.sessions.python import main\nmain()\n")

#: A bash session's tool is ``bash -c`` with this.
BASH_RUNTIME = (Path(__file__).parent / "bash.sh").read_text(encoding="utf-8")


def runtime_source(argv_kind: str) -> str:
    return PYTHON_BOOTSTRAP if argv_kind == "python" else BASH_RUNTIME
