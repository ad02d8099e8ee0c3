"""``execpool run``: one tool, its output streamed live to the terminal.

Runs in the user's shell process and owns one ExecPool for the command's
life. Exits with the tool's exit code, 124 on timeout (as coreutils'
``timeout``), 128+N for a tool killed by signal N, 130 when interrupted,
141 when whoever reads the output goes away, and 1 with an ``Execution
error:`` line when execpool itself could not run the tool. With ``--json``
nothing is streamed: stdout gets one JSON line instead, the job's record as
``execpool batch`` writes it (without ``id`` and ``line``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..formats.records import result_record
from ..formats.request import COMMAND_LINE, BadField, Defaults, parse
from ..shared.result import Result, Status
from ..supervisor import ExecPool

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
#: 128 + SIGPIPE, as a shell reports a writer whose reader went away.
EXIT_BROKEN_PIPE = 141
EXIT_USAGE = 2

#: The command's own process is made non-dumpable: a tool running as the same
#: user could otherwise open its descriptors again through /proc/<pid>/fd.
NON_DUMPABLE = True


def _exit_status(result: Result) -> int:
    if result.status is Status.TIMEOUT:
        return EXIT_TIMEOUT
    if result.status is Status.CANCELLED:
        return EXIT_INTERRUPTED
    if result.exit_code is None:  # INFRA, a limit, no code
        return 1
    if result.exit_code < 0:
        return 128 - result.exit_code
    return result.exit_code


def run(args: argparse.Namespace) -> int:
    request: dict = {"timeout": args.timeout}
    if args.cwd is not None:
        request["cwd"] = args.cwd
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                request["python"] = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"execpool: error: cannot read {args.file}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    elif args.python is not None:
        request["python"] = args.python
    else:
        request["shell"] = args.shell
    try:
        job = parse(request, COMMAND_LINE, Defaults(timeout=args.timeout)).job
    except BadField as exc:
        print(f"execpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with ExecPool(workers=1, non_dumpable=NON_DUMPABLE, sandbox="strict" if args.sandbox else None) as pool:
        stream = pool.stream(job, tool_name="cli")
        try:
            while True:
                event = next(stream)
                if event["type"] == "tool_output" and not args.json:
                    sys.stdout.write(event["text"])
                    sys.stdout.flush()
        except StopIteration as stop:
            result = stop.value
        except KeyboardInterrupt:
            stream.close()
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            # Whoever read the output is gone (``| head``): stop the job, as
            # a shell pipeline's SIGPIPE would, and say nothing more there.
            stream.close()
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
    if args.json:
        record = {key: value for key, value in result_record(None, 1, result).items() if key not in ("id", "line")}
        print(json.dumps(record))
    elif result.timed_out or result.error is not None or result.empty_message is not None:
        print(result.text, file=sys.stderr)
    return _exit_status(result)
