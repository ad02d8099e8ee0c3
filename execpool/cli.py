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

``execpool batch IN.jsonl [-o OUT.jsonl]`` runs one job per input line through
``batch.run_tagged`` and appends one record per job to OUT as each job ends.
Re-running the same command resumes: ids already in OUT are skipped. The
rules that make that exact -- every input line ends up in OUT once, whatever
killed an earlier run -- are in ``execpool/records.py`` and ``_Batch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any, Iterator, NoReturn, Optional, Sequence

from .batch import run_tagged
from .jobs import PythonJob, ShellJob
from . import checks
from .admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT_S
from .httpjobs import (DEFAULT_GRACE_S, DEFAULT_HEARTBEAT_S, DEFAULT_MAX_BODY_MB, DEFAULT_MAX_CONNECTIONS,
                       DEFAULT_READ_TIMEOUT_S, ServiceDefaults)
from .batchlines import JobDefaults, input_lines, make_job, parse_line
from .records import STATUSES, RecordsError, ResultsFile, invalid_record, result_record
from .result import Result, Status
from .supervisor import ExecPool

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
#: 128 + SIGPIPE, as a shell reports a writer whose reader went away.
EXIT_BROKEN_PIPE = 141
EXIT_USAGE = 2

#: Output kept per record by default (``output_chars`` always has the full
#: length). Smaller than the pool's default: a batch's OUT is a data file
#: that is scanned on every resume.
DEFAULT_BATCH_MAX_OUTPUT_CHARS = 100_000

#: The command's own process is made non-dumpable: it holds OUT, its stdin
#: and stdout, and a tool running as the same user could otherwise open any
#: of them again through /proc/<pid>/fd and write a forged record. Nothing
#: is lost: nobody wants a core dump of this process.
NON_DUMPABLE = True

#: How many duplicate ids the error message names, and how much of each.
DUPLICATES_SHOWN = 3
ID_SHOWN_CHARS = 80



class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's usage block: scripts and humans both read it."""
        self.exit(2, f"execpool: error: {message} (see 'execpool {self.prog.split()[-1]} --help')\n")


class _UsageError(Exception):
    """A one-line ``execpool: error:`` and exit status 2."""


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


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (no 'none': the service always has a limit)."""
    try:
        return checks.seconds("seconds", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seconds {text!r}: give a positive number") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: give a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be positive")
    return value


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
                     help="run the tool in the strict sandbox: it writes only its directory (see the README)")
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
    batch.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                       help="worker processes (default: the number of CPUs)")
    batch.add_argument("--max-in-flight", type=_positive_int, default=None, metavar="N",
                       help="jobs running at once (default: two per worker)")
    batch.add_argument("--timeout", type=_timeout, default=300.0, metavar="S",
                       help="seconds per job for lines without a \"timeout\", or 'none' (default 300)")
    batch.add_argument("--warm", action="store_true",
                       help="run Python jobs in a fork of a worker instead of a new interpreter")
    batch.add_argument("--preload", metavar="MODULES", default="",
                       help="comma-separated modules every worker's warm template imports (speeds up --warm jobs)")
    batch.add_argument("--max-output-chars", type=_positive_int, default=DEFAULT_BATCH_MAX_OUTPUT_CHARS,
                       metavar="N", help="output kept per record; output_chars has the full length "
                                         f"(default {DEFAULT_BATCH_MAX_OUTPUT_CHARS})")
    batch.add_argument("--no-retry-infra", dest="retry_infra", action="store_false",
                       help="keep the records of jobs that execpool failed to run (status infra) instead of "
                            "running them again")
    batch.add_argument("--no-fsync", dest="fsync", action="store_false",
                       help="do not fdatasync OUT (a killed process still loses nothing; power loss may)")
    batch.add_argument("--sandbox", action="store_true",
                       help="run every job in the strict sandbox: each writes only its directory (see the README)")
    batch.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help="spread the jobs over a Ray cluster: ADDRESS, 'auto' (one running here), 'local' (a new "
                            "one), or nothing for Ray's default; --workers is then per node")
    progress = batch.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="show the progress bar even when stderr is not a terminal")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never show the progress bar")
    serve = commands.add_parser("serve", help="serve the pool over HTTP (execpool's API and SandboxFusion's "
                                              "/run_code)")
    _serve_arguments(serve)
    return parser


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``execpool serve``'s options; the service itself (execpool/server.py
    and serve.py, Starlette and uvicorn) is imported only when it runs."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other "
                                                            "needs a token)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port)")
    parser.add_argument("--workers", type=_positive_int, default=None,
                        help="pool workers (default: the number of CPUs)")
    parser.add_argument("--max-in-flight", type=_positive_int, default=None,
                        help="jobs running at once (default: two per CPU, as a job waits on I/O part of its time)")
    parser.add_argument("--max-queue", type=_positive_int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting for a slot (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--queue-timeout", type=_seconds, default=DEFAULT_QUEUE_TIMEOUT_S,
                        help=f"seconds a request may wait for a slot (default {DEFAULT_QUEUE_TIMEOUT_S:g})")
    parser.add_argument("--token-file", help="file holding the bearer token (or set EXECPOOL_TOKEN)")
    parser.add_argument("--max-body-mb", type=_positive_int, default=DEFAULT_MAX_BODY_MB,
                        help=f"largest request body (default {DEFAULT_MAX_BODY_MB} MiB)")
    parser.add_argument("--max-connections", type=_positive_int, default=DEFAULT_MAX_CONNECTIONS,
                        help=f"open connections at most; more are closed at once (default {DEFAULT_MAX_CONNECTIONS}, "
                             "or what the descriptor limit leaves room for)")
    parser.add_argument("--read-timeout", type=_seconds, default=DEFAULT_READ_TIMEOUT_S,
                        help=f"seconds a request's headers, then its body, may take to arrive "
                             f"(default {DEFAULT_READ_TIMEOUT_S:g})")
    parser.add_argument("--grace", type=_seconds, default=DEFAULT_GRACE_S,
                        help=f"seconds running jobs get at shutdown (default {DEFAULT_GRACE_S:g})")
    parser.add_argument("--timeout", type=_seconds, default=ServiceDefaults.timeout,
                        help=f"timeout of jobs that give none (default {ServiceDefaults.timeout:g} s)")
    parser.add_argument("--max-timeout", type=_seconds, default=ServiceDefaults.max_timeout,
                        help=f"largest timeout a request may ask (default {ServiceDefaults.max_timeout:g} s)")
    parser.add_argument("--heartbeat", type=_seconds, default=DEFAULT_HEARTBEAT_S,
                        help=f"seconds between keep-alives of a quiet /v1/stream (default {DEFAULT_HEARTBEAT_S:g})")
    parser.add_argument("--warm", action="store_true", help="run Python jobs warm (see the README)")
    parser.add_argument("--preload", default="", help="comma-separated modules the warm templates import")
    parser.add_argument("--no-network", dest="network", action="store_false",
                        help="jobs run without network (a network namespace of their own)")
    parser.add_argument("--sandbox", choices=("strict", "off"), default="strict",
                        help="the kernel-enforced sandbox every job runs in (default strict: a job writes only its "
                             "own directory and reads the system's software; see the README); the service does not "
                             "start where the kernel lacks it, unless given off")


# -- execpool run ----------------------------------------------------------------


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


# -- execpool batch: input lines -------------------------------------------------------


def default_output_path(input_path: str) -> str:
    """``runs/evals.jsonl`` -> ``runs/evals.out.jsonl``, beside the input, so
    re-running the same command finds it and resumes."""
    base = input_path[: -len(".jsonl")] if input_path.endswith(".jsonl") else input_path
    return base + ".out.jsonl"


def _shortened(key: str) -> str:
    return key if len(key) <= ID_SHOWN_CHARS else key[:ID_SHOWN_CHARS] + "..."


class _StdoutResults:
    """``-o -``: records to stdout, as a pipe's reader wants them; no resume."""

    path = "-"
    done: dict = {}
    retried: frozenset = frozenset()
    torn_bytes = 0

    def __init__(self) -> None:
        self.written = 0

    def prepare(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            # The reader left (``| head``): stop as a shell pipeline would, and
            # point stdout at /dev/null so the exit flush stays quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise _Stop(signal.SIGPIPE) from None
        self.written += 1

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- execpool batch: the run --------------------------------------------------------------


class _Stop(KeyboardInterrupt):
    """SIGINT or SIGTERM: a KeyboardInterrupt, so no ``except Exception``
    between the signal and the batch loop swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: Optional[bool]):
    if enabled is False:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    # disable=None is tqdm's own "only on a terminal"; --progress forces it.
    return tqdm(total=total, file=sys.stderr, unit="job", dynamic_ncols=True, smoothing=0.05,
                disable=None if enabled is None else False)


class _Batch:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.input = args.input
        self.counts = {status: 0 for status in STATUSES}
        self.bar: Any = _NoBar()
        self.out: Any = None
        self._writing = False
        self._stopping = False
        self._pending_signal: Optional[int] = None

    # The whole command: check, then run.

    def main(self) -> int:
        args = self.args
        if not os.path.isfile(self.input):
            what = "does not exist" if not os.path.exists(self.input) else "is not a regular file"
            raise _UsageError(f"{self.input} {what} (the input is read twice: once for duplicate ids, "
                              "once to run)")
        out_path = args.output or default_output_path(self.input)
        if out_path != "-" and os.path.exists(out_path) and os.path.samefile(out_path, self.input):
            raise _UsageError(f"the output {out_path} is the input file")
        defaults = JobDefaults(timeout=args.timeout, warm=args.warm)
        if args.warm and "warm" not in {f.name for f in dataclasses.fields(PythonJob)}:
            raise _UsageError("--warm needs an execpool with warm Python (PythonJob(warm=True))")
        preload = tuple(m.strip() for m in args.preload.split(",") if m.strip())

        self.out = _StdoutResults() if out_path == "-" else ResultsFile(out_path, args.fsync, args.retry_infra)
        try:
            lines, todo = self._check_input(self.out.done)
            skipped = lines - todo
            if todo == 0:
                print(f"execpool batch: all {lines} lines of {self.input} already have a record in "
                      f"{out_path}; nothing to run (remove it or pass another -o to run them again)",
                      file=sys.stderr)
                return 0
            self.out.prepare()
            if self.out.retried:
                print(f"execpool batch: {len(self.out.retried)} record(s) in {out_path} say execpool failed to run "
                      "the job (status infra); running them again (--no-retry-infra keeps them)", file=sys.stderr)
            if self.out.torn_bytes:
                print(f"execpool batch: {out_path} ended with a torn record ({self.out.torn_bytes} bytes, "
                      "from a run that was killed); removed, its job runs again", file=sys.stderr)
            return self._run(defaults, preload, todo, skipped, out_path)
        finally:
            self.out.close()

    def _check_input(self, done) -> tuple[int, int]:
        """One streaming pass: count the lines still to run and refuse
        duplicate ids. Only the ids are kept (a million ids like
        "task/123456" take about 100 MB here, 180 MB when resuming); the jobs
        are read again, lazily, to run."""
        seen: set[str] = set()
        duplicates: list[tuple[str, int]] = []
        n_duplicates = lines = todo = 0
        with open(self.input, "rb") as f:
            for number, raw in input_lines(f):
                line = parse_line(number, raw)
                lines += 1
                if line.key not in done:
                    todo += 1
                if line.id is None:
                    continue
                if line.key in seen:
                    n_duplicates += 1
                    if len(duplicates) < DUPLICATES_SHOWN:
                        duplicates.append((line.key, number))
                else:
                    seen.add(done.get(line.key, line.key))
        if duplicates:
            raise _UsageError(self._duplicates_message(duplicates, n_duplicates))
        return lines, todo

    def _duplicates_message(self, duplicates: list[tuple[str, int]], total: int) -> str:
        wanted = {key for key, _ in duplicates}
        first: dict[str, int] = {}
        with open(self.input, "rb") as f:
            for number, raw in input_lines(f):
                key = parse_line(number, raw).key
                if key in wanted and key not in first:
                    first[key] = number
                if len(first) == len(wanted):
                    break
        shown = ", ".join(f"{_shortened(key)} on lines {first[key]} and {number}" for key, number in duplicates)
        more = f" and {total - len(duplicates)} more" if total > len(duplicates) else ""
        return (f"{self.input} has duplicate ids: {shown}{more}; ids must be unique, because resume skips "
                "the ids already in the output")

    def _run(self, defaults: JobDefaults, preload: tuple, todo: int, skipped: int, out_path: str) -> int:
        args = self.args
        workers = args.workers or os.cpu_count() or 2
        max_in_flight = args.max_in_flight or 2 * workers
        pool_kwargs: dict = {"workers": workers, "max_output_chars": args.max_output_chars,
                             "non_dumpable": NON_DUMPABLE}
        if preload:
            pool_kwargs["preload"] = preload
        if args.sandbox:
            pool_kwargs["sandbox"] = "strict"
        started = time.monotonic()
        try:
            if args.ray is None:
                pool: Any = ExecPool(**pool_kwargs)
            else:  # the driver keeps OUT, its lock and the bar; each node's actor an ExecPool
                from .ray import batch_pool

                pool = batch_pool(args.ray, pool_kwargs, args.workers is not None)
                max_in_flight = args.max_in_flight or pool.default_max_in_flight
        except TypeError as exc:
            raise _UsageError(f"--preload needs an execpool that supports it ({exc})") from None
        except ValueError as exc:  # e.g. a --preload module the workers cannot import
            raise _UsageError(str(exc)) from None
        self.bar = _progress_bar(todo, args.progress)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        interrupted: Optional[int] = None
        try:
            try:
                results = run_tagged(pool.submit, self._jobs(defaults), max_in_flight, on_idle=self.out.sync)
                try:
                    for (number, ident), result in results:
                        self._emit(result_record(ident, number, result))
                finally:
                    results.close()  # cancels whatever still runs
            except _Stop as stop:
                interrupted = stop.signum
            finally:
                self._stopping = True  # a second Ctrl-C must not cut the clean-up short
                self.bar.close()
                self.out.sync()
                pool.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        elapsed = time.monotonic() - started
        if interrupted is not None:
            where = "stdout" if out_path == "-" else out_path
            resume = "" if out_path == "-" else " Run the same command again to resume."
            print(f"execpool batch: interrupted ({signal.Signals(interrupted).name}): {self.out.written} of "
                  f"{todo} records written to {where}; running jobs cancelled, without a record.{resume}",
                  file=sys.stderr)
            return 128 + interrupted
        print(self._summary(elapsed, skipped, out_path), file=sys.stderr)
        return 0

    def _summary(self, elapsed: float, skipped: int, out_path: str) -> str:
        written = sum(self.counts.values())
        counts = ", ".join(f"{n} {status}" for status, n in self.counts.items() if n)
        already = f"; {skipped} already done, skipped" if skipped else ""
        where = "stdout" if out_path == "-" else out_path
        records = "record" if written == 1 else "records"
        return f"execpool batch: {written} {records} in {elapsed:.1f} s: {counts}{already} -> {where}"

    def _jobs(self, defaults: JobDefaults) -> Iterator[tuple[tuple[int, Any], Any]]:
        """The second, lazy pass: jobs for run_tagged, one line at a time.
        Invalid lines get their record here and are not submitted."""
        with open(self.input, "rb") as f:
            for number, raw in input_lines(f):
                line = parse_line(number, raw)
                if line.key in self.out.done:
                    continue
                job, reason = make_job(line, defaults)
                if job is None:
                    self._emit(invalid_record(line.id, line.number, reason or "invalid"))
                    continue
                yield (number, line.id), job

    def _emit(self, record: dict) -> None:
        text = json.dumps(record, ensure_ascii=False)
        try:
            data = (text + "\n").encode("utf-8")
        except UnicodeEncodeError:
            data = (json.dumps(record) + "\n").encode("ascii")
        self._writing = True
        try:
            self.out.write(data)
        finally:
            self._writing = False
        self.counts[record["status"]] += 1
        self.bar.set_postfix({s: self.counts[s] for s in ("ok", "error", "timeout", "infra", "invalid")
                              if s in ("ok", "error", "timeout") or self.counts[s]}, refresh=False)
        self.bar.update(1)
        if self._pending_signal is not None and not self._stopping:
            self._stopping = True
            raise _Stop(self._pending_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # A record is never cut in half: a signal during a write waits for it.
        if self._stopping:
            return
        if self._writing:
            self._pending_signal = signum
            return
        self._stopping = True
        raise _Stop(signum)


def _batch(args: argparse.Namespace) -> int:
    try:
        return _Batch(args).main()
    except (_UsageError, RecordsError) as exc:
        print(f"execpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("execpool batch: interrupted before any job ran", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, RuntimeError, ValueError) as exc:
        # The disk filled, the pool could not start, ...: what was written is
        # intact and a torn last record is repaired by the next run.
        print(f"execpool: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "batch":
        return _batch(args)
    if args.command == "serve":
        from .server import main as serve

        return serve(args)
    try:
        return _run(args)
    except ValueError as exc:
        print(f"execpool: error: {exc}", file=sys.stderr)
        return 2


def console_main() -> None:
    sys.exit(main())
