"""``execpool`` on the command line: run one tool, streamed live to the terminal.

``execpool run [--timeout S] (--python CODE | --shell CMD | FILE.py)`` exits
with the tool's exit code, 124 on timeout (as coreutils' ``timeout``), 128+N
for a tool killed by signal N, 130 when interrupted, and 1 with an
``Execution error:`` line when execpool itself could not run the tool.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn, Optional, Sequence

from .jobs import PythonJob, ShellJob
from .supervisor import ExecPool

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: scripts and humans both read it."""
        self.exit(2, f"execpool: error: {message} (see 'execpool {self.prog.split()[-1]} --help')\n")


def _timeout(text: str) -> Optional[float]:
    if text.lower() in ("none", "0", "inf"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: give seconds, or 'none'") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"invalid timeout {text!r}: must be positive")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="execpool", description="Run untrusted code in isolated worker processes.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="run one Python or shell tool, streaming its output")
    run.add_argument("--timeout", type=_timeout, default=300.0,
                     help="wall-clock limit in seconds, or 'none' (default 300)")
    run.add_argument("--cwd", metavar="DIR",
                     help="working directory to run in and keep (default: a fresh temporary one)")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--python", metavar="CODE", help="Python code to run")
    source.add_argument("--shell", metavar="CMD", help="shell command to run with bash -c")
    source.add_argument("file", nargs="?", metavar="FILE.py", help="a Python file to run")
    return parser


def _exit_status(result) -> int:
    if result.timed_out:
        return EXIT_TIMEOUT
    if result.cancelled:
        return EXIT_INTERRUPTED
    if result.error is not None or result.exit_code is None:
        return 1
    if result.exit_code < 0:
        return 128 - result.exit_code
    return result.exit_code


def _run(args: argparse.Namespace) -> int:
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                job = PythonJob(f.read(), timeout=args.timeout, cwd=args.cwd)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            print(f"execpool: error: cannot read {args.file}: {exc}", file=sys.stderr)
            return 2
    elif args.python is not None:
        job = PythonJob(args.python, timeout=args.timeout, cwd=args.cwd)
    else:
        job = ShellJob(args.shell, timeout=args.timeout, cwd=args.cwd)
    with ExecPool(workers=1) as pool:
        stream = pool.stream(job, tool_name="cli")
        try:
            while True:
                event = next(stream)
                if event["type"] == "tool_output":
                    sys.stdout.write(event["text"])
                    sys.stdout.flush()
        except StopIteration as stop:
            result = stop.value
        except KeyboardInterrupt:
            stream.close()
            return EXIT_INTERRUPTED
    if result.timed_out or result.error is not None or result.empty_message is not None:
        print(result.text, file=sys.stderr)
    return _exit_status(result)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"execpool: error: {exc}", file=sys.stderr)
        return 2


def console_main() -> None:
    sys.exit(main())
