"""``execpool mcp``, the command: one pool and one MCP client on stdio.

Runs in its own process, started by the MCP client (Claude Desktop, an IDE,
an agent framework) with its stdin and stdout as the protocol's wire; the
SDK's stdio transport moves them out of the way, so nothing printed by
this process can garble a message. The process owns the pool, so the
pool's lifeline takes every worker and tool tree with it however it ends --
the client closing stdin (the server returns, the calls still running are
cancelled, the connection's interpreter and directory go, the pool
closes), Ctrl-C, or a SIGKILL (the lifeline).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional, Tuple

import anyio
from mcp.server.stdio import stdio_server

from ..agent.tools import SANDBOX_ROOT_ENV, TOOL_SANDBOX_ENV
from ..pool.config import disk_options
from ..shared.jobs import Limits
from ..shared.kernel.sandbox import sandbox_support
from ..supervisor import ExecPool
from .calls import Runner, Workspace
from .catalog import Catalog
from .server import Context, create_server
from .stdio import loop_streams

MiB = 1 << 20


def main(args: argparse.Namespace) -> int:
    """``execpool mcp``: 0 once the client has gone, 2 for bad usage, 130
    when interrupted."""
    if args.timeout > args.max_timeout:
        print(f"execpool mcp: --timeout {args.timeout:g} is over --max-timeout {args.max_timeout:g}", file=sys.stderr)
        return 2
    strict = args.sandbox != "off"
    if strict and not sandbox_support().available:
        print(f"execpool mcp: {sandbox_support().missing}. Give --sandbox off to serve without it.", file=sys.stderr)
        return 2
    if not strict:
        os.environ[TOOL_SANDBOX_ENV] = "off"  # the tool layer's own switch: its jobs take the pool's (none)
    try:
        with ExecPool(workers=args.workers, python=args.python, preload=args.preload,
                      sandbox="strict" if strict else None, non_dumpable=True,
                      **disk_options(args.disk_mb, args.disk_budget_mb, limits_of(args))) as pool:
            # The connection's directory lives under the pool's own, which
            # goes with the pool even when this process is SIGKILLed.
            os.environ.setdefault(SANDBOX_ROOT_ENV, pool.scratch_dir())
            anyio.run(_serve, pool, args)
    except KeyboardInterrupt:
        return 130
    return 0


def limits_of(args: argparse.Namespace) -> Limits:
    """The pool's limits, those the flags give replacing the defaults."""
    given = {"address_space": _bytes(args.address_space_mb), "cpu_seconds": args.cpu_seconds,
             "file_size": _bytes(args.file_size_mb), "open_files": args.open_files,
             "processes": args.processes, "memory": _bytes(args.memory_mb)}
    return dataclasses.replace(Limits(), **{name: value for name, value in given.items() if value is not None})


def _bytes(megabytes: Optional[int]) -> Optional[int]:
    return None if megabytes is None else megabytes * MiB


async def _serve(pool: ExecPool, args: argparse.Namespace) -> None:
    with pool.on_loop():  # the pool's messages read on this loop: no thread switch per call
        space = Workspace(pool, args.idle_timeout, ipython=args.ipython)

        async def workspace(ctx: Context) -> Tuple[Workspace, bool]:
            return space, False  # one client per process: its connection is the process's

        server = create_server(Runner(pool, stateful=args.stateful),
                               Catalog(args.stateful, args.timeout, args.max_timeout), workspace)
        try:
            async with loop_streams() as wire, stdio_server(*(wire or ())) as (read, write):
                await server.run(read, write, server.create_initialization_options())
        finally:
            await space.aclose()
