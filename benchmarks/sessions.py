"""Sessions against a Jupyter kernel, in the same run.

Run from the repository root (the kernel side needs ``pip install
'execpool[bench]'``: ipykernel and jupyter_client)::

    python benchmarks/sessions.py
    python benchmarks/sessions.py --sandbox off --sessions 50

Measured, execpool's Python session (``pool.session("python")``, the strict
sandbox unless told otherwise) -- speaking IPython (``ipython=True``, where
the pool's Python has it) and plain Python (``ipython=False``) -- and an
``ipykernel`` kernel driven by ``jupyter_client`` -- what SandboxFusion's
``/run_jupyter`` and E2B's code interpreter start for each request or
sandbox:

- **start**: from asking for a session (a kernel) to the answer of its
  first cell, ``None``; the median of ``--starts`` starts, one after
  another. Target: the session's at most 1/20 of the kernel's, and 10 ms
  whether it speaks IPython or not. And the CPU a start costs, the
  steadier figure on a busy machine: what this process and every process
  below it spent over those starts (the pool's workers, template, spares
  and sessions; the kernel and its client), divided by their number.
- **small cell**: the round trip of ``x = 1`` in a live session (kernel);
  the median of ``--cells``. Target: at most 1/3 of the kernel's.
- **figure cell**: the round trip of a cell that draws a line and leaves
  its figure open (``plt.plot([1, 3, 2]);``), which IPython's inline
  backend, the kernel's, and plain Python's own each show as a PNG; the
  median of ``--figures``.
- **idle memory**: ``--sessions`` sessions open at once, each having run
  one cell; what they add to the machine (the unique set size of every
  process below this one, before and after, divided by their number),
  against one idle kernel's.
- **fork** (no kernel can): a session holding 1, 100 and 1000 MB
  (``--fork-mb``; a ``bytearray`` with every page written) forked
  ``--forks`` times, each copy closed before the next; the median time of
  ``fork()`` and of a fork and its copy's first cell. Measured without a sandbox, with the
  session's cgroup (as execpool makes one where it can) and without
  (``cgroups=False``), since moving a process into a cgroup-v1 group waits
  for an RCU grace period; and in the strict sandbox, where each copy also
  gets namespaces and directories of its own (a family makes FAMILY_FORKS
  forks, so a new parent every so many). Target: 100 MB forked in at most
  5 ms. The sessions forked speak IPython where they can; the first
  column pair again with plain Python (``ipython=False``).

Where ipykernel or jupyter_client is missing (CI installs no bench
extra), the kernel's side is left out and ``skipped`` says why.
Each answer is checked; the last line of stdout is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from benchmarks import _common as C
from benchmarks import _plot as P
from execpool import ExecPool, Limits, Status
from execpool.worker.sessions.family import FAMILY_FORKS


def _descendants_uss() -> int:
    """Unique memory of every process below this one, in bytes."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_full_info().uss
        except psutil.Error:
            continue
    return total


def _pool_cpu() -> float:
    """CPU seconds spent so far by this process and every process below it,
    with what each reaped: the caller's threads, the lifeline, the workers,
    their templates, the spares and sessions the workers reaped; a kernel
    and its client's threads."""
    own = psutil.Process()
    times = own.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in own.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _checked(result, want=None):
    if result.status is not Status.OK or (want is not None and result.value != want):
        raise AssertionError(f"a wrong answer: {result}")
    return result


#: What each session may write (``Limits(disk=...)``): its cells write
#: nothing but matplotlib's font cache. A sandboxed session holds its bound
#: of the pool's disk budget (half of memory and swap) while it lives, so
#: at the default 1 GiB a hundred idle sessions could not be open at once.
SESSION_DISK = 64 << 20

#: A cell that leaves a figure open: each side shows it at the cell's end.
FIGURE_CELL = "plt.plot([1, 3, 2]);"


def _timed(run, code: str, times: int) -> list:
    spent = []
    for _ in range(times):
        began = time.perf_counter()
        run(code)
        spent.append(time.perf_counter() - began)
    return spent


def _shows_a_figure(result):
    _checked(result)
    if not any("image/png" in bundle for bundle in result.shown):
        raise AssertionError(f"no figure shown: {result}")


def sessions(args: argparse.Namespace, ipython: bool) -> dict:
    sandbox = None if args.sandbox == "off" else "strict"
    with ExecPool(workers=args.workers, sandbox=sandbox, limits=Limits(disk=SESSION_DISK)) as pool:
        with pool.session("python", ipython=ipython) as warmup:  # the worker's template and spares exist from here on
            _checked(warmup.run("None"))
        starts = []
        cpu_before = _pool_cpu()
        for _ in range(args.starts):
            began = time.perf_counter()
            session = pool.session("python", ipython=ipython)
            _checked(session.run("None"))
            starts.append(time.perf_counter() - began)
            session.close()
        start_cpu = (_pool_cpu() - cpu_before) / args.starts
        with pool.session("python", ipython=ipython) as session:
            _checked(session.run("x = 1"))
            cells = _timed(lambda code: _checked(session.run(code)), "x = 1", args.cells)
            _checked(session.run("import matplotlib.pyplot as plt", timeout=120))
            figures = _timed(lambda code: _shows_a_figure(session.run(code)), FIGURE_CELL, args.figures)
        before = _descendants_uss()
        opened = [pool.session("python", ipython=ipython) for _ in range(args.sessions)]
        try:
            for n, session in enumerate(opened):
                _checked(session.run(f"x = {n}\nx"), str(n))
            idle = (_descendants_uss() - before) / args.sessions
        finally:
            for session in opened:
                session.close()
    return {"start_ms": C.ms(statistics.median(starts)), "start_cpu_ms": C.ms(start_cpu),
            "cell_ms": C.ms(statistics.median(cells)), "cell_p90_ms": C.ms(C.quantile(cells, 0.9)),
            "figure_ms": C.ms(statistics.median(figures)), "idle_mib": C.mib(idle)}


def forks(args: argparse.Namespace, cgroups: bool, sandbox: bool = False, ipython: bool | None = None) -> dict:
    figures = {}
    with ExecPool(workers=1, cgroups=cgroups, limits=Limits(disk=SESSION_DISK)) as pool:
        for megabytes in args.fork_mb:
            calls: list = []
            firsts: list = []
            while len(calls) < args.forks:  # a sandboxed family makes FAMILY_FORKS forks: then a new parent
                with pool.session("python", sandbox="strict" if sandbox else False, ipython=ipython) as parent:
                    _checked(parent.run(f"held = bytearray({megabytes} << 20)\n"
                                        f"held[::4096] = b'x' * len(held[::4096])"))
                    for _ in range(min(args.forks - len(calls), FAMILY_FORKS if sandbox else args.forks)):
                        began = time.perf_counter()
                        child = parent.fork()
                        made = time.perf_counter()
                        _checked(child.run("None"))
                        firsts.append(time.perf_counter() - began)
                        calls.append(made - began)
                        child.close()
            figures[f"{megabytes}mb_fork_ms"] = C.ms(statistics.median(calls))
            figures[f"{megabytes}mb_fork_and_cell_ms"] = C.ms(statistics.median(firsts))
    return figures


class _Kernel:
    """An ipykernel kernel and its client, started and ready."""

    def __init__(self) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel()
        self.client = self.manager.client()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=60)
        except BaseException:
            self.close()
            raise

    def run(self, code: str) -> list:
        """The kernel's rich outputs for ``code`` (its MIME bundles)."""
        shown: list = []

        def hook(msg: dict) -> None:
            if msg["header"]["msg_type"] in ("display_data", "execute_result"):
                shown.append(msg["content"]["data"])

        reply = self.client.execute_interactive(code, timeout=60, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"the kernel failed: {reply['content']}")
        return shown

    def show_a_figure(self, code: str) -> None:
        if not any("image/png" in bundle for bundle in self.run(code)):
            raise AssertionError("the kernel showed no figure")

    def uss(self) -> int:
        kernel = psutil.Process(self.manager.provisioner.process.pid)
        return sum(p.memory_full_info().uss for p in [kernel, *kernel.children(recursive=True)])

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def kernel_missing() -> str | None:
    """Why no kernel can be started here; None when one can."""
    missing = [name for name in ("ipykernel", "jupyter_client") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed (pip install 'execpool[bench]')" if missing else None


def kernels(args: argparse.Namespace) -> dict:
    starts = []
    cpu_before = _pool_cpu()
    for _ in range(args.kernel_starts):
        began = time.perf_counter()
        kernel = _Kernel()
        try:
            kernel.run("None")
            starts.append(time.perf_counter() - began)
        finally:
            kernel.close()
    start_cpu = (_pool_cpu() - cpu_before) / args.kernel_starts
    kernel = _Kernel()
    try:
        kernel.run("x = 1")
        cells = _timed(kernel.run, "x = 1", args.cells)
        idle = kernel.uss()
        kernel.run("import matplotlib.pyplot as plt")
        figures = _timed(kernel.show_a_figure, FIGURE_CELL, args.figures)
    finally:
        kernel.close()
    return {"start_ms": C.ms(statistics.median(starts)), "start_cpu_ms": C.ms(start_cpu),
            "cell_ms": C.ms(statistics.median(cells)), "cell_p90_ms": C.ms(C.quantile(cells, 0.9)),
            "figure_ms": C.ms(statistics.median(figures)), "idle_mib": C.mib(idle)}


def _ratio(theirs: dict | None, ours: dict | None, key: str) -> float | str:
    return round(theirs[key] / ours[key], 1) if theirs is not None and ours is not None and ours[key] > 0 else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandbox", choices=("strict", "off"), default="strict")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--starts", type=int, default=50)
    parser.add_argument("--kernel-starts", type=int, default=5)
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--figures", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--fork-mb", type=C.positive_ints, default=[1, 100, 1000],
                        help="what the forked sessions hold, comma-separated MB (default 1,100,1000)")
    P.add_option(parser)
    args = C.parse_args(parser, argv, smoke={"starts": 2, "kernel_starts": 1, "cells": 3, "figures": 1,
                                             "sessions": 2, "forks": 1, "fork_mb": [1]})
    load = C.load()
    plain = sessions(args, ipython=False)
    no_ipython = None if importlib.util.find_spec("IPython") else "no IPython: pip install 'execpool[jupyter]'"
    ours = plain if no_ipython else sessions(args, ipython=True)
    forked = {"cgroup": forks(args, True), "no_cgroup": forks(args, False), "strict": forks(args, True, True),
              "cgroup_plain": forks(args, True, ipython=False)}
    missing = kernel_missing()
    theirs = None if missing else kernels(args)
    C.print_table(f"Python sessions ({args.sandbox} sandbox) against an ipykernel kernel",
                  ["", "session, plain Python", "session, IPython", "Jupyter kernel", "kernel / IPython session"],
                  [[label, plain[key], None if no_ipython else ours[key], theirs[key] if theirs else None,
                    _ratio(theirs, None if no_ipython else ours, key) if ratio else ""]
                   for label, key, ratio in (("start, median ms", "start_ms", True),
                                             ("start, CPU ms each", "start_cpu_ms", True),
                                             ("small cell, median ms", "cell_ms", True),
                                             ("small cell, p90 ms", "cell_p90_ms", False),
                                             ("figure cell, median ms", "figure_ms", True),
                                             ("idle memory, MiB each", "idle_mib", True))])
    for side, why in (("no IPython session", no_ipython), ("no kernel side", missing)):
        if why:
            print(f"  note: {side}: {why}")
    print()
    C.print_table("Forks of a Python session, median ms",
                  ["held", "fork(), cgroup", "fork() + cell, cgroup", "fork(), no cgroup", "fork() + cell, no cgroup",
                   "fork(), strict sandbox", "fork() + cell, strict sandbox", "fork(), cgroup, plain Python",
                   "fork() + cell, cgroup, plain Python"],
                  [[f"{mb} MB", *(forked[kind][f"{mb}mb_{what}_ms"]
                                  for kind in ("cgroup", "no_cgroup", "strict", "cgroup_plain")
                                  for what in ("fork", "fork_and_cell"))]
                   for mb in args.fork_mb])
    targets = {"start <= 10 ms": C.target(ours["start_ms"], 10, "<=", "ms"),
               "plain start <= 10 ms": C.target(plain["start_ms"], 10, "<=", "ms")}
    if theirs is not None:
        targets["start <= kernel / 20"] = C.target(ours["start_ms"], theirs["start_ms"] / 20, "<=", "ms")
        targets["cell <= kernel / 3"] = C.target(ours["cell_ms"], theirs["cell_ms"] / 3, "<=", "ms")
    if 100 in args.fork_mb:
        targets["fork of 100 MB <= 5 ms"] = C.target(forked["cgroup"]["100mb_fork_ms"], 5, "<=", "ms")
    C.print_targets(targets)
    skipped = {name: why for name, why in (("jupyter", missing), ("ipython", no_ipython)) if why}
    figures = {"benchmark": "sessions", "sandbox": args.sandbox, "execpool": ours, "plain": plain, "forks": forked,
               "fork_mb": args.fork_mb, "jupyter": theirs, "skipped": skipped,
               "targets": targets, "load_before": load, "load_after": C.load(), "machine": C.machine()}
    C.emit_json(figures)
    plot(args.plot, figures)


#: The kinds of fork a plot shows: (key in "forks", label).
_PLOTTED_FORKS = (("cgroup", "a cgroup each"), ("no_cgroup", "no cgroup"), ("strict", "strict sandbox"),
                  ("cgroup_plain", "plain Python, a cgroup each"))


def plot(path: str | None, figures: dict) -> None:
    """Fork time against what the session holds: ``fork()`` alone, and
    with the copy's first cell, for each kind of session."""
    if path is None:  # no --plot
        return
    held = figures["fork_mb"]
    with P.figure(path, "Forking a Python session: time against what it holds", figures, panels=2) as axes:
        for ax, what, title in ((axes[0], "fork", "fork()"),
                                (axes[1], "fork_and_cell", "fork() and the copy's first cell")):
            for kind, label in _PLOTTED_FORKS:
                ax.plot(held, [figures["forks"][kind][f"{mb}mb_{what}_ms"] for mb in held], "o-", label=label)
            P.log_scales(ax)
            ax.set_ylim(bottom=1)
            ax.set_title(title)
            ax.set_xlabel("MB the session holds (every page written)")
            ax.set_ylabel("ms, median")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)


if __name__ == "__main__":
    main()
