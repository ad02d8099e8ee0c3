"""``execpool batch IN.jsonl [-o OUT.jsonl]``: one job per input line, one
record per job in OUT, resumable.

Runs in the user's shell process and owns one pool (an ExecPool, or a
RayPool with ``--ray``) for the command's life. Jobs run through
``run_tagged`` (execpool/pool/mapping.py) and each record is appended to OUT
as its job ends. Re-running the same command resumes: ids already in OUT
are skipped. The rules that make that exact -- every input line ends up in
OUT once, whatever killed an earlier run -- are in execpool/cli/results_file.py
and ``_Batch``; IN is read by execpool/cli/jobs_file.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any, Iterator, Optional

from tqdm import tqdm

from ..formats.records import STATUSES, invalid_record, result_record
from ..formats.request import Defaults
from ..pool.config import disk_options
from ..pool.mapping import run_tagged
from ..supervisor import ExecPool
from .jobs_file import input_lines, make_job, parse_line
from .results_file import RecordsError, ResultsFile, StdoutResults, Stop, encoded
from .run import EXIT_INTERRUPTED, EXIT_USAGE, NON_DUMPABLE

#: How many duplicate ids the error message names, and how much of each.
DUPLICATES_SHOWN = 3
ID_SHOWN_CHARS = 80


class _UsageError(Exception):
    """A one-line ``execpool: error:`` and exit status 2."""



def default_output_path(input_path: str) -> str:
    """``runs/evals.jsonl`` -> ``runs/evals.out.jsonl``, beside the input, so
    re-running the same command finds it and resumes."""
    base = input_path[: -len(".jsonl")] if input_path.endswith(".jsonl") else input_path
    return base + ".out.jsonl"


def _shortened(key: str) -> str:
    return key if len(key) <= ID_SHOWN_CHARS else key[:ID_SHOWN_CHARS] + "..."



class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: Optional[bool], unit: str = "job") -> Any:
    if enabled is False:
        return _NoBar()
    # disable=None is tqdm's own "only on a terminal"; --progress forces it.
    return tqdm(total=total, file=sys.stderr, unit=unit, dynamic_ncols=True, smoothing=0.05,
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
        defaults = Defaults(timeout=args.timeout, warm=args.warm)
        options = self._pool_options()
        self.out = StdoutResults() if out_path == "-" else ResultsFile(out_path, args.fsync, args.retry_infra)
        try:
            lines, todo = self._check_input(self.out.done)
            skipped = lines - todo
            if todo == 0:
                print(f"execpool batch: all {lines} lines of {self.input} already have a record in "
                      f"{out_path}; nothing to run (remove it or pass another -o to run them again)",
                      file=sys.stderr)
                return 0
            # The pool before OUT is touched: a flag it refuses (a --preload
            # module that does not import) must leave OUT as it was.
            pool, max_in_flight = self._start_pool(options)
            try:
                self.out.prepare()
            except BaseException:
                pool.close()
                raise
            if self.out.retried:
                print(f"execpool batch: {len(self.out.retried)} record(s) in {out_path} say execpool failed to run "
                      "the job (status infra); running them again (--no-retry-infra keeps them)", file=sys.stderr)
            if self.out.torn_bytes:
                print(f"execpool batch: {out_path} ended with a torn record ({self.out.torn_bytes} bytes, "
                      "from a run that was killed); removed, its job runs again", file=sys.stderr)
            return self._run(pool, max_in_flight, defaults, todo, skipped, out_path)
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

    def _pool_options(self) -> dict:
        """The pool's options, from flags the pool's own rules checked as
        they were parsed (execpool/cli/main.py)."""
        args = self.args
        return {"workers": args.workers or os.cpu_count() or 2, "max_output_chars": args.max_output_chars,
                "non_dumpable": NON_DUMPABLE, "sandbox": "strict" if args.sandbox else None, "preload": args.preload,
                "warm_ipython": False,
                "python": args.python, **disk_options(args.disk_mb, args.disk_budget_mb)}

    def _start_pool(self, options: dict) -> tuple:
        """The pool (an ExecPool, or a RayPool with --ray: the driver keeps
        OUT, its lock and the bar, each node's actor an ExecPool), and how
        many jobs it runs at once."""
        args = self.args
        try:
            if args.ray is None:
                return ExecPool(**options), args.max_in_flight or 2 * options["workers"]
            from ..ray.pool import batch_pool

            pool = batch_pool(args.ray, options, args.workers is not None)
            return pool, args.max_in_flight or pool.default_max_in_flight
        except ValueError as exc:  # a --preload module the workers cannot import
            raise _UsageError(str(exc)) from None

    def _run(self, pool: Any, max_in_flight: int, defaults: Defaults, todo: int, skipped: int, out_path: str) -> int:
        started = time.monotonic()
        args = self.args
        self.bar = progress_bar(todo, args.progress)
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
            except Stop as stop:
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

    def _jobs(self, defaults: Defaults) -> Iterator[tuple[tuple[int, Any], Any]]:
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
        data = encoded(record)
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
            raise Stop(self._pending_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # A record is never cut in half: a signal during a write waits for it.
        if self._stopping:
            return
        if self._writing:
            self._pending_signal = signum
            return
        self._stopping = True
        raise Stop(signum)


def batch(args: argparse.Namespace) -> int:
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

