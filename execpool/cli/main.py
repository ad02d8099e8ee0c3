"""``execpool`` on the command line.

Runs in the user's shell process and owns one ExecPool for the command's life.

``execpool run [--timeout S] [--json] (--python CODE | --shell CMD | FILE.py)``
runs one tool, streamed live to the terminal, and exits with the tool's exit
code, 124 on timeout (as coreutils' ``timeout``), 128+N for a tool killed by
signal N, 130 when interrupted, and 1 with an ``Execution error:`` line when
execpool itself could not run the tool. With ``--json`` nothing is streamed:
stdout gets one JSON line instead, the job's record as ``execpool batch``
writes it (without ``id`` and ``line``), with what the job cost; the exit
status is the same.

``execpool eval SAMPLES --problems PROBLEMS`` judges samples against
problems' tests and prints pass@k (execpool/cli/eval.py).

``execpool batch IN.jsonl [-o OUT.jsonl]`` runs one job per input line through
``batch.run_tagged`` and appends one record per job to OUT as each job ends.
Re-running the same command resumes: ids already in OUT are skipped. The
rules that make that exact -- every input line ends up in OUT once, whatever
killed an earlier run -- are in ``execpool/formats/records.py`` and ``_Batch``.
"""


from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence, Tuple

from ..formats.request import BadField, timeout_flag
from ..mcp import settings as mcp_settings
from ..serve import settings
from ..shared import checks
from ..shared.output import BATCH_RECORD_CHARS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: scripts and humans both read it."""
        message = re.sub(r"^argument (\S+): \1 ", r"\1 ", message)  # a rule's message names its flag already
        self.exit(2, f"execpool: error: {message} (see '{self.prog} --help')\n")


def _flag(flag: str, convert: Callable[[str], Any], rule: Callable[..., Any], **bounds: Any) -> Callable[[str], Any]:
    """An argparse type for ``flag``: the text converted, then checked by the
    library's own rule, so that a flag takes exactly what the option it sets
    takes -- and a bad one stops the command before it does anything."""
    def parse(text: str) -> Any:
        try:
            return rule(flag, convert(text), **bounds)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _number(kind: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"give {what}, not {text!r}") from None
    return convert


def _count(flag: str, **bounds: Any) -> Callable[[str], int]:
    return _flag(flag, _number(int, "a whole number"), checks.integer, **bounds)


def _seconds(flag: str) -> Callable[[str], float]:
    """Seconds, finite (no 'none': the service always has a limit)."""
    return _flag(flag, _number(float, "a number of seconds"), checks.seconds)


def _modules(flag: str) -> Callable[[str], Tuple[str, ...]]:
    """Comma-separated module names."""
    return _flag(flag, lambda text: [name.strip() for name in text.split(",") if name.strip()], checks.names,
                 module=True)


def _interpreter(text: str) -> str:
    """An interpreter for the jobs, checked as the pool checks it, so a
    typo is a usage error before anything starts."""
    path = os.path.abspath(text)
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not an executable file")
    return path


_PYTHON_HELP = ("the interpreter Python jobs run with, warm ones too (default: this one); a venv of the jobs' "
                "own keeps the server's packages out of them and starts faster (see docs/service/index.md)")


def _timeout(text: str) -> Optional[float]:
    try:
        return timeout_flag(text)
    except BadField as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="execpool", description="Run untrusted code in isolated worker processes.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="run one Python or shell tool, streaming its output")
    run.add_argument("--timeout", type=_timeout, default=300.0,
                     help="wall-clock limit in seconds, or 'none' (default 300)")
    run.add_argument("--cwd", metavar="DIR",
                     help="working directory to run in and keep (default: a fresh temporary one)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON record (output, status, CPU time, memory, processes) instead of "
                          "streaming the output")
    run.add_argument("--sandbox", action="store_true",
                     help="run the tool in the strict sandbox: it writes only its directory "
                          "(see docs/sandbox/index.md)")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--python", metavar="CODE", help="Python code to run")
    source.add_argument("--shell", metavar="CMD", help="shell command to run with bash -c")
    source.add_argument("file", nargs="?", metavar="FILE.py", help="a Python file to run")

    batch = commands.add_parser(
        "batch", help="run a JSONL file of jobs, appending one JSONL record per job (resumable)",
        description="Run one job per line of IN.jsonl ({\"id\", \"python\": CODE | \"shell\": CMD, optional "
                    "\"timeout\", \"cwd\", \"env\", \"stdin\"}) and append one record per job to OUT as it ends. "
                    "Re-running the same command skips the ids already in OUT. Exit status: 0 when every line "
                    "has its record (whatever the jobs' own statuses), 130 when interrupted, 2 for bad usage, "
                    "1 when execpool itself failed.")
    batch.add_argument("input", metavar="IN.jsonl", help="the jobs, one JSON object per line")
    batch.add_argument("-o", "--output", metavar="OUT.jsonl",
                       help="where records go (default: IN with .jsonl replaced by .out.jsonl); "
                            "'-' writes to stdout, without resume")
    batch.add_argument("--workers", type=_count("--workers"), default=None, metavar="N",
                       help="worker processes (default: the number of CPUs)")
    batch.add_argument("--max-in-flight", type=_count("--max-in-flight"), default=None, metavar="N",
                       help="jobs running at once (default: two per worker)")
    batch.add_argument("--timeout", type=_timeout, default=300.0, metavar="S",
                       help="seconds per job for lines without a \"timeout\", or 'none' (default 300)")
    batch.add_argument("--warm", action="store_true",
                       help="run Python jobs in a fork of a worker instead of a new interpreter")
    batch.add_argument("--python", type=_interpreter, metavar="PATH", default=None, help=_PYTHON_HELP)
    batch.add_argument("--preload", type=_modules("--preload"), metavar="MODULES", default=(),
                       help="comma-separated modules every worker's warm template imports (speeds up --warm jobs)")
    batch.add_argument("--max-output-chars", type=_count("--max-output-chars"), default=BATCH_RECORD_CHARS,
                       metavar="N", help="output kept per record; output_chars has the full length "
                                         f"(default {BATCH_RECORD_CHARS})")
    batch.add_argument("--no-retry-infra", dest="retry_infra", action="store_false",
                       help="keep the records of jobs that execpool failed to run (status infra) instead of "
                            "running them again")
    batch.add_argument("--sandbox", action="store_true",
                       help="run every job in the strict sandbox: each writes only its directory "
                            "(see docs/sandbox/index.md)")
    _out_arguments(batch)
    evaluation = commands.add_parser(
        "eval", help="judge a model's samples against problems' tests: a verdict per sample, then pass@k (resumable)",
        description="Judge each sample of SAMPLES against its problem's tests (HumanEval-, MBPP- or CommonOJ-style) "
                    "and append one record per sample to OUT; then print the summary (pass@k and the counts of "
                    "all of OUT) as the last line of stdout, one JSON object. Re-running the same command judges "
                    "only the samples without a record. Exit status: 0 when every sample has its record, 130 when "
                    "interrupted, 2 for bad usage, 1 when execpool itself failed.")
    from .eval import add_arguments

    add_arguments(evaluation, _count, _seconds)
    _out_arguments(evaluation)
    serve = commands.add_parser("serve", help="serve the pool over HTTP (execpool's API and SandboxFusion's "
                                              "/run_code)")
    _serve_arguments(serve)
    mcp = commands.add_parser("mcp", help="serve the code tools to an MCP client over stdio (Claude Desktop, IDEs, "
                                          "agent frameworks)")
    _mcp_arguments(mcp)
    return parser


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``execpool serve``'s options; the service itself (execpool/serve:
    Starlette and uvicorn, the ``serve`` extra) is imported only when it runs."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other "
                                                            "needs a token)")
    parser.add_argument("--port", type=_count("--port", minimum=0, maximum=65535), default=8080,
                        help="port (default 8080; 0: any free port)")
    parser.add_argument("--workers", type=_count("--workers"), default=None,
                        help="pool workers (default: the number of CPUs)")
    parser.add_argument("--max-in-flight", type=_count("--max-in-flight"), default=None,
                        help="jobs running at once (default: two per CPU, as a job waits on I/O part of its time)")
    parser.add_argument("--max-queue", type=_count("--max-queue"), default=settings.DEFAULT_MAX_QUEUE,
                        help=f"requests waiting for a slot (default {settings.DEFAULT_MAX_QUEUE})")
    parser.add_argument("--queue-timeout", type=_seconds("--queue-timeout"),
                        default=settings.DEFAULT_QUEUE_TIMEOUT_S,
                        help=f"seconds a request may wait for a slot (default {settings.DEFAULT_QUEUE_TIMEOUT_S:g})")
    parser.add_argument("--token-file", help="file holding the bearer token (or set EXECPOOL_TOKEN)")
    parser.add_argument("--max-body-mb", type=_count("--max-body-mb"), default=settings.DEFAULT_MAX_BODY_MB,
                        help=f"largest request body (default {settings.DEFAULT_MAX_BODY_MB} MiB)")
    parser.add_argument("--max-connections", type=_count("--max-connections"),
                        default=settings.DEFAULT_MAX_CONNECTIONS,
                        help="open connections at most; more are closed at once (default "
                             f"{settings.DEFAULT_MAX_CONNECTIONS}, or what the descriptor limit leaves room for)")
    parser.add_argument("--read-timeout", type=_seconds("--read-timeout"), default=settings.DEFAULT_READ_TIMEOUT_S,
                        help=f"seconds a request's headers, then its body, may take to arrive "
                             f"(default {settings.DEFAULT_READ_TIMEOUT_S:g})")
    parser.add_argument("--write-timeout", type=_seconds("--write-timeout"),
                        default=settings.DEFAULT_WRITE_TIMEOUT_S,
                        help="seconds an answer may wait for its client to take any of it; then the connection is "
                             "reset and the answer's slot freed, so clients that do not read cannot hold the "
                             f"service (default {settings.DEFAULT_WRITE_TIMEOUT_S:g}, the default job timeout: a "
                             "client that stops reading holds a slot no longer than a job may run)")
    parser.add_argument("--max-sessions", type=_count("--max-sessions"), default=settings.DEFAULT_MAX_SESSIONS,
                        help=f"sessions open at once; past it 503 (default {settings.DEFAULT_MAX_SESSIONS})")
    parser.add_argument("--session-idle-timeout", type=_seconds("--session-idle-timeout"),
                        default=settings.DEFAULT_SESSION_IDLE_S,
                        help="seconds a session may go without a cell before it ends; also the longest a request "
                             f"may ask (default {settings.DEFAULT_SESSION_IDLE_S:g})")
    parser.add_argument("--grace", type=_seconds("--grace"), default=settings.DEFAULT_GRACE_S,
                        help=f"seconds running jobs get at shutdown (default {settings.DEFAULT_GRACE_S:g})")
    parser.add_argument("--timeout", type=_seconds("--timeout"), default=settings.DEFAULT_TIMEOUT_S,
                        help=f"timeout of jobs that give none (default {settings.DEFAULT_TIMEOUT_S:g} s)")
    parser.add_argument("--max-timeout", type=_seconds("--max-timeout"), default=settings.DEFAULT_MAX_TIMEOUT_S,
                        help=f"largest timeout a request may ask (default {settings.DEFAULT_MAX_TIMEOUT_S:g} s)")
    parser.add_argument("--heartbeat", type=_seconds("--heartbeat"), default=settings.DEFAULT_HEARTBEAT_S,
                        help="seconds between keep-alives of a quiet /v1/stream "
                             f"(default {settings.DEFAULT_HEARTBEAT_S:g})")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--warm", dest="warm", action="store_true", default=True,
                       help="run Python jobs warm, in a ready interpreter: the default (see "
                            "docs/library/warm.md for the little that differs from a cold start)")
    start.add_argument("--cold", dest="warm", action="store_false",
                       help="start an interpreter for every Python job, as `python -u FILE` would")
    parser.add_argument("--python", type=_interpreter, metavar="PATH", default=None, help=_PYTHON_HELP)
    parser.add_argument("--preload", type=_modules("--preload"), metavar="MODULES", default=(),
                        help="comma-separated modules the warm templates import")
    parser.add_argument("--no-network", dest="network", action="store_false",
                        help="jobs run without network (a network namespace of their own)")
    parser.add_argument("--sandbox", choices=("strict", "off"), default="strict",
                        help="the kernel-enforced sandbox every job runs in (default strict: a job writes only its "
                             "own directory and reads the system's software; see docs/sandbox/index.md); the service "
                             "does not start where the kernel lacks it, unless given off")
    _disk_arguments(parser)
    _tenant_caps(parser)
    ray = parser.add_argument_group("one service across a Ray cluster (the ray extra; docs/service-on-ray.md); every "
                                    "other option is each replica's")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="deploy onto the Ray cluster at ADDRESS (default: RAY_ADDRESS, else auto) as a Ray Serve "
                          "application, behind Ray Serve's HTTP proxy at --host/--port")
    ray.add_argument("--replicas", type=_count("--replicas"), default=None, metavar="N",
                     help="replicas, each an ExecPool (default: one per node that has CPUs)")
    ray.add_argument("--min-replicas", type=_count("--min-replicas", minimum=0), default=None, metavar="N",
                     help="with --max-replicas: Ray Serve's autoscaling on requests in flight")
    ray.add_argument("--max-replicas", type=_count("--max-replicas"), default=None, metavar="N")


def serve_options(argv: Sequence[str] = ()) -> argparse.Namespace:
    """``execpool serve``'s options from its command-line words: each Ray
    replica's (execpool/ray/serve.py), read as the command reads them.
    ValueError says what is wrong."""
    parser = argparse.ArgumentParser(prog="execpool serve", add_help=False, exit_on_error=False)
    _serve_arguments(parser)
    try:
        return parser.parse_args(list(argv))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"execpool serve {' '.join(argv)}: {exc}") from None


def _out_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``execpool batch`` and ``execpool eval`` share: OUT's syncing,
    the disk bounds, Ray and the progress bar."""
    parser.add_argument("--no-fsync", dest="fsync", action="store_false",
                        help="do not fdatasync OUT (a killed process still loses nothing; power loss may)")
    _disk_arguments(parser)
    parser.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="spread the jobs over a Ray cluster: ADDRESS, 'auto' (one running here), 'local' (a new "
                             "one), or nothing for Ray's default; --workers is then per node")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="show the progress bar even when stderr is not a terminal")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never show the progress bar")


def _tenant_caps(parser: argparse.ArgumentParser) -> None:
    """What one request's job or session may hold, whatever it asks: with
    no cap, one tenant could take every neighbour's memory or processes."""
    parser.add_argument("--memory-mb", type=_count("--memory-mb"), default=settings.DEFAULT_MEMORY_MB, metavar="N",
                        help="MiB of memory a job's or session's whole tree may use, a cgroup cap where the machine "
                             "has a memory controller; a request's memory_limit_MB may ask less (default "
                             f"{settings.DEFAULT_MEMORY_MB})")
    parser.add_argument("--processes", type=_count("--processes"), default=settings.DEFAULT_PROCESSES, metavar="N",
                        help="processes and threads a job or session may have at once (default "
                             f"{settings.DEFAULT_PROCESSES})")


def _disk_arguments(parser: argparse.ArgumentParser) -> None:
    """What every sandboxed tenant may write, and what all of them may at
    once (execpool/pool/budget.py): the pool's ``limits.disk`` and
    ``disk_budget``, as ``execpool.pool.config.disk_options`` gives them."""
    parser.add_argument("--disk-mb", type=_count("--disk-mb"), default=None, metavar="N",
                        help="MiB a sandboxed job or session may write in all: its directory, home, /tmp and "
                             "/dev/shm, memory until it ends (default 1024)")
    parser.add_argument("--disk-budget-mb", type=_count("--disk-budget-mb"), default=None, metavar="N",
                        help="MiB the sandboxed jobs and sessions alive at once may write in all; past it a job waits "
                             "and a session is refused (default: half of the machine's memory and swap)")


def _mcp_arguments(parser: argparse.ArgumentParser) -> None:
    """``execpool mcp``'s options; the server itself (execpool/mcp: the MCP
    SDK, the ``mcp`` extra) is imported only when it runs."""
    parser.add_argument("--workers", type=_count("--workers"), default=None,
                        help="pool workers (default: the number of CPUs)")
    parser.add_argument("--sandbox", choices=("strict", "off"), default="strict",
                        help="the kernel-enforced sandbox every call runs in (default strict: a call writes only the "
                             "connection's directory and reads the system's software; see docs/sandbox/index.md); the "
                             "server does not start where the kernel lacks it, unless given off")
    parser.add_argument("--stateless", dest="stateful", action="store_false",
                        help="run each python call in a fresh interpreter, as the tool layer's python tool does "
                             "(default: one interpreter per connection keeps variables between calls; reset starts "
                             "it over)")
    parser.add_argument("--timeout", type=_seconds("--timeout"), default=mcp_settings.DEFAULT_TIMEOUT_S,
                        help="seconds a call may run when it does not say "
                             f"(default {mcp_settings.DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--max-timeout", type=_seconds("--max-timeout"), default=mcp_settings.DEFAULT_MAX_TIMEOUT_S,
                        help=f"most seconds a call may ask (default {mcp_settings.DEFAULT_MAX_TIMEOUT_S:g})")
    parser.add_argument("--idle-timeout", type=_seconds("--idle-timeout"),
                        default=mcp_settings.DEFAULT_IDLE_TIMEOUT_S,
                        help="seconds the connection's Python interpreter may go without a call before it ends, its "
                             f"variables with it (default {mcp_settings.DEFAULT_IDLE_TIMEOUT_S:g})")
    parser.add_argument("--python", type=_interpreter, metavar="PATH", default=None, help=_PYTHON_HELP)
    parser.add_argument("--plain-python", dest="ipython", action="store_const", const=False, default=None,
                        help="the connection's interpreter speaks plain Python (default: IPython, as a Jupyter kernel "
                             "does -- magics, ! commands, display -- where the pool's Python has it)")
    parser.add_argument("--preload", type=_modules("--preload"), metavar="MODULES", default=(),
                        help="comma-separated modules the warm templates import (the interpreter starts with them)")
    _disk_arguments(parser)
    limits = parser.add_argument_group("limits of every call (the pool's; default: the library's)")
    for flag, what in (("--memory-mb", "memory of a call's whole tree, in MiB (a cgroup)"),
                       ("--processes", "processes and threads a call may have at once (a cgroup)"),
                       ("--address-space-mb", "address space of each process, in MiB"),
                       ("--cpu-seconds", "CPU seconds of each process"),
                       ("--file-size-mb", "largest file a call may write, in MiB"),
                       ("--open-files", "descriptors each process may have open")):
        limits.add_argument(flag, type=_count(flag), default=None, metavar="N", help=what)


#: Commands whose process is a folder of its own with its stack in an extra
#: (its ``command.main``), by the settings that name the extra.
_EXTRAS = {"serve": settings, "mcp": mcp_settings}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "batch":
        from .batch import batch

        return batch(args)
    if args.command == "eval":
        from .eval import evaluate_command

        return evaluate_command(args)
    if args.command == "serve" and args.ray is not None:
        try:
            from ..ray.service import main as on_ray
        except ImportError as exc:
            if exc.name is None or exc.name.split(".")[0] not in ("ray", *settings.STACK):
                raise
            print(f"execpool serve --ray: pip install 'execpool[ray,serve]' ({exc})", file=sys.stderr)
            return 2
        return on_ray(args)
    extra = _EXTRAS.get(args.command)
    if extra is not None:
        try:
            command = importlib.import_module(f"..{args.command}.command", __package__)
        except ImportError as exc:
            if not extra.stack_missing(exc):
                raise
            print(f"execpool {args.command}: {extra.INSTALL_HINT} ({exc})", file=sys.stderr)
            return 2
        return command.main(args)
    from .run import run

    return run(args)


def console_main() -> None:
    sys.exit(main())

