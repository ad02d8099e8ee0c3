"""What ``execpool mcp`` (and the ``/mcp`` endpoint of ``execpool serve``)
runs with unless told otherwise, named once for the command's flags
(execpool/cli/main.py), the command and the server.

Runs in the MCP server's process, and in the command line's while it parses
flags: nothing here imports the MCP SDK, so ``execpool --help`` works
without the ``mcp`` extra.
"""

from __future__ import annotations

#: Seconds a call may run when it does not say, and the most it may ask.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MAX_TIMEOUT_S = 3600.0

#: Seconds a connection's Python interpreter may go without a call before
#: it ends (its state with it; the next call starts a fresh one). Over
#: HTTP, also how long an MCP session may go without a request in flight.
DEFAULT_IDLE_TIMEOUT_S = 3600.0

#: The largest request body ``/mcp`` reads where its server does not say
#: (the SDK's own bound; ``execpool serve`` gives its ``--max-body-mb``).
DEFAULT_MAX_BODY_BYTES = 4 << 20

#: Seconds a call may wait for the tree it cancelled to be gone before the
#: server stops waiting (the kill itself is the pool's, and at once).
CANCEL_WAIT_S = 5.0

#: The header that names a client's MCP session over HTTP.
SESSION_HEADER = "mcp-session-id"

#: What the server says its name is in the MCP handshake.
SERVER_NAME = "execpool"

#: What ``execpool mcp`` (and importing the server) says when the SDK is missing.
INSTALL_HINT = "the MCP server needs its extra: pip install 'execpool[mcp]'"

#: The MCP server's stack: the ``mcp`` extra's top-level modules.
STACK = ("mcp", "mcp_types", "anyio")


def stack_missing(exc: ImportError) -> bool:
    """Whether ``exc`` says the MCP SDK is not installed (and not that
    something else failed to import)."""
    return exc.name is not None and exc.name.split(".")[0] in STACK
