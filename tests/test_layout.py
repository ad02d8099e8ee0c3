"""The two sides of execpool meet only in the shared modules (DESIGN.md):
what runs in the caller never loads what runs only in a worker, and the
worker never loads the caller's side. Checked in fresh interpreters, since
this test process has imported everything."""

from __future__ import annotations

import json
import subprocess
import sys

CALLER_SIDE = {"execpool.supervisor", "execpool.ray", "execpool.runner", "execpool.config", "execpool.lifecycle",
               "execpool.dispatch",
               "execpool.future", "execpool.drain", "execpool.batch", "execpool.tools", "execpool.loop",
               "execpool.cli", "execpool.batchlines", "execpool.records", "execpool.stats", "execpool.jobfiles",
               "execpool.lifeline",
               "execpool.serve", "execpool.server", "execpool.metrics", "execpool.httpjobs", "execpool.admission"}
WORKER_SIDE = {"execpool.worker", "execpool.handover", "execpool.running", "execpool.spawn", "execpool.template",
               "execpool.rulesets", "execpool.warm", "execpool.capture", "execpool._spawn"}
SHARED = {"execpool.channel", "execpool.jobs", "execpool.result", "execpool.checks", "execpool.proctree",
          "execpool.cgroups", "execpool._linux", "execpool.dirs", "execpool.sandbox", "execpool.seccomp"}


def _loaded_by(*modules: str) -> set:
    code = (f"import importlib, json, sys\nfor name in {list(modules)!r}:\n    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('execpool'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(done.stdout))


def test_the_callers_side_loads_nothing_of_the_workers():
    loaded = _loaded_by(*sorted(CALLER_SIDE))
    assert loaded >= CALLER_SIDE
    assert not loaded & WORKER_SIDE


def test_the_workers_side_loads_nothing_of_the_callers():
    loaded = _loaded_by("execpool.worker", "execpool.template")
    assert loaded >= WORKER_SIDE - {"execpool._spawn"}
    assert not loaded & CALLER_SIDE


def test_the_lifeline_loads_only_itself_and_shared_modules():
    loaded = _loaded_by("execpool.lifeline")
    assert not loaded & (CALLER_SIDE | WORKER_SIDE) - {"execpool.lifeline"}


def test_the_shared_modules_load_neither_side():
    loaded = _loaded_by(*sorted(SHARED))
    assert loaded >= SHARED
    assert not loaded & (CALLER_SIDE | WORKER_SIDE)


def test_every_module_has_a_side():
    """A new module is placed on purpose: the checks above cover it."""
    import pkgutil

    import execpool

    modules = {f"execpool.{info.name}" for info in pkgutil.iter_modules(execpool.__path__)}
    modules -= {"execpool._shim", "execpool.__main__"}
    assert modules == CALLER_SIDE | WORKER_SIDE | SHARED, modules ^ (CALLER_SIDE | WORKER_SIDE | SHARED)
