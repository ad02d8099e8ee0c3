"""The package is laid out by process (docs/design.md; the site's "How it
works", docs/how-it-works.md): a module's folder says which process runs it, and what a folder
may import is fixed here. The worker's and the lifeline's folders import
only the shared one; the caller's folders never import theirs. Checked
twice: statically, from every module's imports, and in fresh interpreters,
since this test process has imported everything."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys

import pytest

import execpool

PACKAGE = os.path.dirname(os.path.abspath(execpool.__file__))

#: What each folder may import (besides itself and the package's top,
#: ``execpool/__init__.py``, which imports nothing at import time).
ALLOWED = {
    "shared": set(),
    "worker": {"shared", "tool", "sandbox"},
    # The tool's process: beside untrusted code, it takes nothing but the
    # shared definitions and how to confine itself (no channel to the
    # caller, no pool, no worker).
    "tool": {"shared", "sandbox"},
    # How the sandbox is done: loaded by the worker and the tool only.
    "sandbox": {"shared"},
    "lifeline": {"shared"},
    "pool": {"shared"},
    "formats": {"shared"},
    # Scoring samples (execpool eval): jobs through the pool's public submit.
    "eval": {"pool", "formats", "shared"},
    "agent": {"pool", "shared"},
    # The service on Ray: each replica is the app of `execpool serve`, made from its parsed options;
    # the proxies' router answers a lost replica's requests in the service's formats; the replicas
    # pass an MCP session's requests on by the header that names it.
    "ray": {"pool", "shared", "serve", "cli", "formats", "mcp"},
    "serve": {"pool", "formats", "shared", "mcp", "eval"},
    "mcp": {"pool", "agent", "shared"},
    "cli": {"pool", "formats", "shared", "ray", "serve", "mcp", "eval"},
}

#: The top of the package: the public face -- the re-exports, ``python -m
#: execpool``, and the tool layer and the loop under the names they were
#: first published with -- and the design card's two caller-side modules.
TOP = {"__init__", "__main__", "tools", "loop", "supervisor", "drain"}

#: The design card's modules at the top, by the folder whose process runs
#: them and whose rules they keep: the supervisor and the parent-side
#: stream are the library's, in the caller's process.
CARD = {"supervisor": "pool", "drain": "pool"}


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, str]:
    """Every Python file of the package, by dotted name."""
    found = {}
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _folder(module: str) -> str:
    """The top folder a module is in, or whose rules it keeps ("" for the
    package's public face)."""
    path = _modules()[module]
    rel = os.path.relpath(path, PACKAGE).split(os.sep)
    return rel[0] if len(rel) > 1 else CARD.get(rel[0][:-3], "")


def _imports(module: str, path: str, typing: bool = True) -> set[str]:
    """The execpool modules ``module`` imports, wherever in it (a lazy
    import inside a function counts: it runs in the same process), and
    under ``if TYPE_CHECKING:`` too unless ``typing`` is false."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("execpool"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("execpool"):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


#: The most lines a module of the package may have: past it, it does more
#: than one job (the eval judge grew to 774 before anyone noticed).
MAX_MODULE_LINES = 700


def test_no_module_is_over_the_most_lines_a_module_may_have():
    long = {module: n for module, path in _modules().items()
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > MAX_MODULE_LINES}
    assert not long, long


def test_every_module_is_in_a_folder_of_its_process():
    modules = _modules()
    top = {os.path.basename(path)[:-3] for path in modules.values() if os.path.dirname(path) == PACKAGE}
    assert top == TOP, f"the package's top holds only its public face; found {sorted(top - TOP)}"
    folders = {_folder(name) for name in modules} - {""}
    assert folders == set(ALLOWED), folders ^ set(ALLOWED)


def test_each_folder_imports_only_what_its_process_may():
    modules = _modules()
    crossings = []
    for module, path in sorted(modules.items()):
        folder = _folder(module)
        if not folder:
            continue  # the top re-exports everything, lazily
        for target in _imports(module, path):
            if target == "execpool" or target.count(".") == 0:
                continue
            other = CARD.get(target.split(".")[1], target.split(".")[1])
            if other in ALLOWED and other != folder and other not in ALLOWED[folder]:
                crossings.append(f"{module} imports {target}")
    assert not crossings, "\n".join(crossings)


def _loaded_by(*modules: str) -> set:
    code = (f"import importlib, json, sys\nfor name in {list(modules)!r}:\n    importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('execpool'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(done.stdout))


def _in(folders: set, loaded: set) -> set:
    """What of ``loaded`` lies outside ``folders`` (the package itself aside)."""
    return {m for m in loaded if m != "execpool" and m.split(".")[1] not in folders}


def test_every_documented_import_path_still_works():
    """The names the README and the contract give, wherever the code moved."""
    code = ("import execpool, execpool.tools, execpool.loop, execpool.agent.tools, execpool.agent.loop\n"
            "from execpool import ExecPool, PythonJob, ShellJob, Result, Status, ExecPoolError, drain_queue\n"
            "from execpool.ray import RayPool\nfrom execpool.serve import create_app\n"
            "from execpool.loop import chat_with_tools\n"
            "from execpool.supervisor import ExecPool as Supervised\n"
            "from execpool.drain import stream_tool_execution, drain_queue as drained\n"
            "assert Supervised is ExecPool and drained is drain_queue and callable(stream_tool_execution)\n"
            "assert execpool.tools is execpool.agent.tools and execpool.loop is execpool.agent.loop\n"
            "assert callable(create_app) and callable(chat_with_tools) and RayPool.submit\n"
            "assert set(execpool.__all__) <= set(dir(execpool))\n"
            "for name in execpool.__all__:\n    getattr(execpool, name)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
def test_every_benchmark_imports_what_it_uses():
    """benchmarks/serve.py imported a constant from where it no longer
    lived, and nothing ran it: each benchmark is at least imported here."""
    benchmarks = os.path.join(os.path.dirname(PACKAGE), "benchmarks")
    names = sorted(name[:-3] for name in os.listdir(benchmarks) if name.endswith(".py") and name != "__main__.py")
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module('benchmarks.' + name)\n"
    subprocess.run([sys.executable, "-c", code, *names], check=True, timeout=120, cwd=os.path.dirname(PACKAGE))


def test_the_code_names_only_what_it_defines_or_imports():
    """A test's ``except psutil.Error`` without ``import psutil`` waited for
    the rare run that reached it, to fail there with a NameError: the
    package passes the project's whole lint, the tests, the benchmarks
    and the docs' hooks pyflakes' checks."""
    root = os.path.dirname(PACKAGE)
    for args in (["execpool"], ["--select", "F", "tests", "benchmarks", "docs"]):
        linted = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *args],
                                cwd=root, capture_output=True, text=True, timeout=120)
        assert linted.returncode == 0, linted.stdout + linted.stderr


def test_a_worker_loads_only_its_folder_the_tools_and_the_shared_one():
    """What a worker process imports: it starts tools, so it has their code."""
    loaded = _loaded_by("execpool.worker.event_loop")
    assert {"execpool.worker.event_loop", "execpool.worker.warm.handover", "execpool.shared.worker_wire",
            "execpool.tool.become"} <= loaded
    assert not _in({"worker", "tool", "sandbox", "shared"}, loaded)


def test_the_tools_process_loads_nothing_of_the_workers_or_the_callers():
    """The template, a spare, a session's runtime and its fork run beside
    untrusted code: nothing of the worker's loop, channel or secrets, and
    the shim (which runs inside the user's own interpreter) nothing at all."""
    tool = [name for name in _modules() if _folder(name) == "tool" and ".shim" not in name]
    loaded = _loaded_by(*tool)
    assert set(tool) <= loaded
    assert not _in({"tool", "sandbox", "shared"}, loaded)
    assert "execpool.shared.worker_wire" not in loaded
    shim = os.path.join(PACKAGE, "tool", "shim", "sitecustomize.py")
    assert not _imports("sitecustomize", shim), "the shim imports nothing of execpool"


def test_the_lifeline_loads_only_its_folder_and_the_shared_one():
    loaded = _loaded_by("execpool.lifeline.process")
    assert not _in({"lifeline", "shared"}, loaded)


def test_the_shared_folder_loads_nothing_else():
    shared = [name for name in _modules() if name.startswith("execpool.shared")]
    assert not _in({"shared"}, _loaded_by(*shared))


def test_how_the_sandbox_is_done_loads_only_the_shared_folder():
    sandbox = [name for name in _modules() if _folder(name) == "sandbox"]
    loaded = _loaded_by(*sandbox)
    assert set(sandbox) <= loaded and not _in({"sandbox", "shared"}, loaded)


def test_no_module_imports_one_that_imports_it():
    """No two modules import each other at run time: each folder's modules
    form layers (a name imported only for its type, under TYPE_CHECKING,
    aside)."""
    graph = {name: {t for t in _imports(name, path, typing=False) if t in _modules()}
             for name, path in _modules().items()}
    pairs = sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets
                   if a < b and a in graph.get(b, ()) and not (a == "execpool" or b == "execpool"))
    assert not pairs, "\n".join(pairs)


def test_the_callers_side_loads_nothing_of_the_workers_or_the_lifelines():
    """Every module of the caller's folders at once, in one interpreter."""
    modules = _modules()
    callers = [name for name in modules if _folder(name) in {"pool", "formats", "agent", "serve", "cli", "ray", "eval"}
               and not name.endswith("__main__")]
    loaded = _loaded_by("execpool", "execpool.tools", "execpool.loop", *callers)
    assert set(callers) <= loaded
    assert not {m for m in loaded if m.split(".")[1:2] in (["worker"], ["lifeline"], ["tool"], ["sandbox"])}


def test_what_is_built_beside_submit_reaches_the_pool_only_through_its_engine():
    """Sessions and workspaces take execpool/pool/engine.py's protocol; no
    module but the supervisor touches a pool's private attributes, and
    the dispatcher knows no layer built on the pool."""
    private = re.compile(r"\b_?pool\._[a-z]\w*")
    reaching = [f"{module}: {hit}" for module, path in sorted(_modules().items())
                if module != "execpool.supervisor"
                for hit in private.findall(open(path, encoding="utf-8").read())]
    assert not reaching, reaching
    dispatch = _imports("execpool.pool.dispatch", os.path.join(PACKAGE, "pool", "dispatch.py"))
    assert not {t for t in dispatch if t.split(".")[-1] in ("sessions", "workspaces", "code", "many")}, dispatch


def test_the_package_cites_only_files_of_the_repository():
    """Module docstrings cited a DESIGN.md the repository did not have and
    paths that a move had left behind: every file the package names is here."""
    root = os.path.dirname(PACKAGE)
    cited = re.compile(r"\b((?:execpool|docs|tests|benchmarks)/[\w/.-]*\w\.(?:py|md|c|sh|html))")
    outside = re.compile(r"\b(?:DESIGN|SPEC|SERVE|STYLE)\.md\b|\bSPEC §")
    missing = []
    for folder, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith((".py", ".c", ".sh", ".html")):
                path = os.path.join(folder, name)
                text = open(path, encoding="utf-8").read()
                where = os.path.relpath(path, root)
                missing += [f"{where}: {hit.group(0)}" for hit in outside.finditer(text)]
                missing += [f"{where}: {hit}" for hit in cited.findall(text)
                            if not os.path.exists(os.path.join(root, hit))]
    assert not missing, "\n".join(sorted(set(missing)))


@pytest.mark.slow
def test_every_test_module_keeps_a_test_in_the_fast_tier():
    """The fast tier exercises every module: a module whose tests all went
    to the slow tier would break unseen until a whole run."""
    root = os.path.dirname(PACKAGE)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                             "-p", "no:cacheprovider", "tests"], cwd=root, capture_output=True, text=True, timeout=300)
    fast = {line.split("::", 1)[0] for line in listed.stdout.splitlines() if "::" in line}
    modules = {os.path.relpath(os.path.join(folder, name), root)
               for folder, _dirs, files in os.walk(os.path.join(root, "tests"))
               for name in files if name.startswith("test_") and name.endswith(".py")}
    assert modules and not modules - fast, sorted(modules - fast)
