"""``execpool mcp`` against the library, in the same run.

Run from the repository root (needs ``pip install 'execpool[mcp]'``)::

    python benchmarks/mcp.py
    python benchmarks/mcp.py --calls 500

Measured, the round trip of a trivial ``python`` call (``x = 1``) made by
the official SDK's client over stdio to a real ``execpool mcp`` process,
against the same work done by the library in this process, one call of
each in turn (so that both see the same machine):

- **stateful** (the server's default): the MCP call runs as a cell of the
  connection's interpreter; the library's is ``session.run`` of a session
  of its own pool. Target: the MCP call costs at most 2 ms more (median
  of the paired differences).
- **stateless** (``execpool mcp --stateless``): the MCP call runs a fresh
  interpreter as the tool layer does; the library's is the tool layer's
  ``python_exec`` -- ``pool.run`` of the same job -- in this process.
  Reported, with the same 2 ms target.

Both sides run in the strict sandbox with two workers. Each answer is
checked; the last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    # Run as a script, this file's folder is first on the path, and this
    # file would be imported as the ``mcp`` package it measures.
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import anyio
from mcp import ClientSession, StdioServerParameters, stdio_client

from benchmarks import _common as C
from execpool import ExecPool
from execpool.tools import python_exec

CODE = "x = 1"


async def _paired(args: argparse.Namespace, stateful: bool, pool: ExecPool) -> dict:
    """Median round trips of the MCP call and the library's, in turn."""
    server = ["-m", "execpool", "mcp", "--workers", str(args.workers)] + ([] if stateful else ["--stateless"])
    params = StdioServerParameters(command=sys.executable, args=server, cwd=C.REPO)
    session = pool.session("python", sandbox="strict") if stateful else None
    ours, lib = [], []
    try:
        async with stdio_client(params) as (read, write), ClientSession(read, write) as client:
            await client.initialize()
            for i in range(args.warmup + args.calls):
                t0 = time.perf_counter()
                result = await client.call_tool("python", {"code": CODE})
                t1 = time.perf_counter()
                if session is not None:
                    cell = session.run(CODE)
                    answer, expected = cell.text, "(no output)"
                else:
                    answer, expected = python_exec(CODE, pool=pool), "(no output)"
                t2 = time.perf_counter()
                if result.is_error or result.content[0].text != expected or answer != expected:
                    raise SystemExit(f"wrong answer: {result!r} / {answer!r}")
                if i >= args.warmup:
                    ours.append(t1 - t0)
                    lib.append(t2 - t1)
    finally:
        if session is not None:
            session.close()
    differences = [a - b for a, b in zip(ours, lib)]
    return {"mcp_ms": C.ms(C.median(ours)), "library_ms": C.ms(C.median(lib)),
            "overhead_ms": C.ms(C.median(differences)), "mcp_p90_ms": C.ms(C.quantile(ours, 0.9)),
            "calls": len(ours)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls of each kind (default 200)")
    parser.add_argument("--warmup", type=int, default=20, help="calls of each kind before measuring (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="workers of each pool (default 2)")
    args = C.parse_args(parser, argv, smoke={"calls": 2, "warmup": 1})
    load_before = C.load()
    with ExecPool(workers=args.workers, sandbox="strict") as pool:
        stateful = anyio.run(_paired, args, True, pool)
    with ExecPool(workers=args.workers) as pool:  # the tool layer adds the strict sandbox itself
        stateless = anyio.run(_paired, args, False, pool)
    C.print_table("A trivial python call: MCP over stdio against the library (median of paired calls)",
                  ["mode", "MCP ms", "library ms", "MCP - library ms", "MCP p90 ms"],
                  [[name, row["mcp_ms"], row["library_ms"], row["overhead_ms"], row["mcp_p90_ms"]]
                   for name, row in (("stateful (session.run)", stateful), ("stateless (pool.run)", stateless))])
    targets = {"stateful: MCP - library <= 2 ms": C.target(stateful["overhead_ms"], 2, "<=", "ms"),
               "stateless: MCP - library <= 2 ms": C.target(stateless["overhead_ms"], 2, "<=", "ms")}
    C.print_targets(targets)
    C.emit_json({"benchmark": "mcp", "stateful": stateful, "stateless": stateless, "targets": targets,
                 "machine": C.machine(), "load_before": load_before, "load_after": C.load()})


if __name__ == "__main__":
    main()
