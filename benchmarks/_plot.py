"""Figures as pictures: ``--plot PATH`` makes a benchmark also write its
figures as a PNG, beside the JSON line it prints, so the shape of a result
(where latency turns up with concurrency, which language is slow to start,
whether memory climbs) shows at a glance. The plot is drawn from the same
dict the JSON line prints, and its caption names the machine and its load
before and after the run, without which a figure on a shared machine means
little.

matplotlib (the ``bench`` extra) is imported only when a plot is asked
for: a benchmark without ``--plot`` runs where matplotlib is missing.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator, Optional, Sequence

from benchmarks import _common as C


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", metavar="PATH",
                        help="also write the figures as a PNG plot to PATH (matplotlib: the bench extra)")


def caption(figures: dict) -> str:
    """The machine and how busy it was, as the JSON line records them."""
    machine = figures.get("machine") or {}
    load = figures.get("load") or {"before": figures.get("load_before"), "after": figures.get("load_after")}
    parts = [f"{machine.get('cpus', '?')} CPUs", f"{machine.get('mem_total_mib', '?')} MiB",
             f"Linux {machine.get('kernel', '?')}", f"Python {machine.get('python', '?')}"]
    said = f"{', '.join(parts)}; load average (1, 5, 15 min) {load.get('before')} before, {load.get('after')} after"
    return said + (" -- a smoke run: these figures measure nothing" if C.is_smoke() else "")


def log_scales(ax: Any, x_base: Optional[int] = 10) -> None:
    """A logarithmic y axis (and x axis, unless ``x_base`` is None)
    labelled with plain numbers (1, 16, 256; 10, 100 ms), which read faster
    than powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    if x_base is not None:
        ax.set_xscale("log", base=x_base)
        ax.xaxis.set_major_formatter(plain)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(NullFormatter())


@contextlib.contextmanager
def figure(path: str, title: str, figures: dict, panels: int = 1) -> Iterator[Sequence[Any]]:
    """Axes for ``panels`` side-by-side plots, saved to ``path`` as a PNG
    with ``title`` and the machine's caption once the block ends."""
    import matplotlib
    matplotlib.use("Agg")  # no display: a file is all that is wanted
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels + 0.8, 4.2), squeeze=False)
    try:
        yield axes[0]
        fig.suptitle(title)
        fig.text(0.01, 0.01, caption(figures), fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
