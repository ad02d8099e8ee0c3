"""The languages table: how a program in each language is compiled and run.

Shared: the job spec (execpool/shared/jobs.py) checks a ``CodeJob``'s
language against it in the caller's thread; the pool (execpool/pool/code.py)
runs the steps; the service and the command line list it. It is data --
a language is a row, and adding one is adding a row (docs/library/languages.md says how).

Names and meanings are SandboxFusion's (its ``sandbox/runners``): the same
file names (``Main.java``: the public class is ``Main``), compile commands
and flags (``g++ -std=c++17``, plain ``rustc``, ``javac`` then ``java -ea``),
so a program that passes there passes here. ``c`` and ``javascript`` are
added because users expect them.

Each step is an argv run in the job's own directory, where the program's
source is ``source`` (and the request's files beside it); a compile leaves
the files that ``outputs`` names, which are all the run gets of it.
Whether a language's toolchain is on this machine is asked of it
(:func:`probe`): the version it prints, or which tool is missing -- and
where it is installed. A tool outside the system's directories (rustup's
under ``~/.rustup``, nvm's node, a JDK under ``/opt``) is run by its
absolute path inside its *install root*, which a sandboxed job's view
shows read-only at its own path (only that root: nothing else of the home
it sits in). Whether it then runs in a pool's sandbox is asked of a
hello-world (execpool/pool/toolchains.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from .kernel.sandbox import beneath_system, homes, too_wide


@dataclass(frozen=True)
class Language:
    """One row of the table."""

    name: str
    #: The file the program is written to, in the job's directory.
    source: str
    #: The run step's argv.
    run: Tuple[str, ...]
    #: The compile step's argv; None for a language that does not compile.
    compile: Optional[Tuple[str, ...]] = None
    #: Glob patterns, in the job's directory, of what a compile leaves for
    #: the run: all the run gets of it (and all the compile cache keeps).
    outputs: Tuple[str, ...] = ()
    #: The command that prints the toolchain's version, and the pattern
    #: whose first group is the version (None: the whole first line).
    version: Tuple[str, ...] = ()
    version_pattern: Optional[str] = None
    #: What the toolchain is called in listings ("g++ 12.2.0").
    toolchain: str = ""
    #: Files the steps need besides the commands (a test runner's jar).
    needs: Tuple[str, ...] = ()
    #: Files written beside the program, (name, text): a test runner's
    #: configuration.
    support: Tuple[Tuple[str, str], ...] = ()
    #: Where a toolchain is not one command on PATH (a test runner's
    #: libraries, a language no package here provides): why it cannot run.
    unavailable: Optional[str] = None
    #: Text put before the program when it lacks it (PHP's opening tag).
    prologue: str = ""
    #: Where the program names its entry (Scala's object, JUnit's public
    #: class): a pattern whose first group is put for "{entry}" in
    #: ``source`` and the steps, and the name when it matches nothing.
    entry: Optional[Tuple[str, str]] = None
    #: The command that prints the toolchain's install root, for a row
    #: whose command on PATH is a proxy that finds the toolchain elsewhere
    #: (rustup's ``rustc`` in ``~/.cargo/bin``): the job runs the root's own
    #: ``bin/`` command instead, which needs no proxy.
    root: Tuple[str, ...] = ()
    #: Commands the steps' tools run by name (scalac's script runs java):
    #: found on PATH like the steps' own, and their install roots shown too.
    uses: Tuple[str, ...] = ()

    @property
    def compiles(self) -> bool:
        return self.compile is not None

    def for_program(self, code: str) -> "Language":
        """This row with the program's entry name in place of "{entry}"."""
        if self.entry is None:
            return self
        pattern, default = self.entry
        found = re.search(pattern, code)
        name = found.group(1) if found else default

        def put(step: Tuple[str, ...]) -> Tuple[str, ...]:
            return tuple(part.replace("{entry}", name) for part in step)

        return replace(self, source=self.source.replace("{entry}", name), run=put(self.run),
                       compile=None if self.compile is None else put(self.compile), entry=None)

    @property
    def tools(self) -> Tuple[str, ...]:
        """The commands the steps need on PATH (a compiled program's own
        path, ``./test``, is none), and those they run by name."""
        return tuple(dict.fromkeys([*(step[0] for step in (self.compile, self.run) if step and "/" not in step[0]),
                                    *self.uses]))


_GCC_VERSION = r"\) (\d+\.\d+\.\d+)"

#: Jest's configuration for a program's tests in TypeScript or JavaScript,
#: as SandboxFusion's runtime sets it up: Babel with its env (this Node)
#: and TypeScript presets -- taken from npm's global modules (``npm install
#: --global jest babel-jest @babel/core @babel/preset-env
#: @babel/preset-typescript @jest/globals``), where tests find
#: ``@jest/globals`` too.
_JEST_CONFIG = """\
const path = require("path");
const root = path.join(path.dirname(process.execPath), "..", "lib", "node_modules");
module.exports = {
  rootDir: __dirname,
  modulePaths: [root],
  transform: {
    "\\\\.[jt]sx?$": [path.join(root, "babel-jest"), {
      presets: [[path.join(root, "@babel/preset-env"), { targets: { node: "current" } }],
                path.join(root, "@babel/preset-typescript")],
    }],
  },
};
"""

#: The JUnit console launcher, as Debian's junit5 installs it.
_JUNIT = "/usr/share/java/junit-platform-console-standalone.jar"

#: Every language, by its SandboxFusion name. "python" and "bash" run as
#: the pool's Python and shell jobs do (PythonJob, and bash on a file).
TABLE: Tuple[Language, ...] = (
    Language("python", "main.py", ("python3", "main.py"), version=("python3", "--version"),
             version_pattern=r"Python (\S+)", toolchain="Python"),
    Language("pytest", "test_main.py", ("python3", "-m", "pytest", "-q", "test_main.py"),
             version=("python3", "-m", "pytest", "--version"), version_pattern=r"pytest (\S+)", toolchain="pytest"),
    Language("bash", "main.sh", ("bash", "main.sh"), version=("bash", "--version"),
             version_pattern=r"version (\S+)", toolchain="bash"),
    Language("c", "main.c", ("./test",), ("gcc", "-std=c11", "main.c", "-o", "test", "-lm"), ("test",),
             ("gcc", "--version"), _GCC_VERSION, "gcc"),
    Language("cpp", "main.cpp", ("./test",), ("g++", "-std=c++17", "main.cpp", "-o", "test", "-lpthread"), ("test",),
             ("g++", "--version"), _GCC_VERSION, "g++"),
    Language("java", "Main.java", ("java", "-cp", ".", "-ea", "Main"),
             ("javac", "-encoding", "UTF-8", "-cp", ".", "Main.java"), ("*.class",),
             ("javac", "-version"), r"javac (\S+)", "javac"),
    Language("junit", "{entry}.java",
             ("java", "-jar", _JUNIT, "--class-path", ".", "--scan-class-path", "--disable-banner"),
             ("javac", "-encoding", "UTF-8", "-cp", f".:{_JUNIT}", "{entry}.java"), ("*.class",),
             ("javac", "-version"), r"javac (\S+)", "JUnit 5 with javac", needs=(_JUNIT,),
             entry=(r"public\s+(?:final\s+|abstract\s+)*class\s+(\w+)", "Main")),
    Language("rust", "main.rs", ("./test",), ("rustc", "main.rs", "-o", "test"), ("test",),
             ("rustc", "--version"), r"rustc (\S+)", "rustc", root=("rustc", "--print", "sysroot")),
    Language("go", "main.go", ("./out",), ("go", "build", "-o", "out", "main.go"), ("out",),
             ("go", "version"), r"go version go(\S+)", "go"),
    Language("go_test", "main_test.go", ("go", "test", "main_test.go"), version=("go", "version"),
             version_pattern=r"go version go(\S+)", toolchain="go"),
    Language("nodejs", "main.js", ("node", "main.js"), version=("node", "--version"),
             version_pattern=r"v(\S+)", toolchain="node"),
    Language("javascript", "main.js", ("node", "main.js"), version=("node", "--version"),
             version_pattern=r"v(\S+)", toolchain="node"),
    # tsc without type checks, as tsx runs TypeScript: a type error does not
    # stop the program, a syntax error does. Not tsx itself: its WebAssembly
    # needs more address space than a job's default limit.
    Language("typescript", "main.ts", ("node", "main.js"),
             ("tsc", "--noCheck", "--module", "commonjs", "--target", "es2022", "--outDir", ".", "main.ts"),
             ("main.js",), ("tsc", "--version"), r"Version (\S+)", "tsc"),
    Language("jest", "main.test.ts", ("jest", "--ci", "--config", "jest.config.js"), version=("jest", "--version"),
             version_pattern=r"^(\d\S*)", toolchain="jest", support=(("jest.config.js", _JEST_CONFIG),),
             uses=("node",)),
    Language("php", "main.php", ("php", "-f", "main.php"), version=("php", "--version"),
             version_pattern=r"PHP (\S+)", toolchain="php", prologue="<?php\n"),
    # Mono's compiler, as Debian 12 has no .NET SDK: C# up to version 7, a
    # program with a Main (no top-level statements).
    Language("csharp", "Program.cs", ("mono", "test.exe"), ("mcs", "-out:test.exe", "Program.cs"), ("test.exe",),
             ("mcs", "--version"), r"version (\S+)", "Mono mcs"),
    Language("sql", "main.sql", ("sqlite3", "-bail", "db.sqlite3", ".read main.sql"),
             version=("sqlite3", "--version"), version_pattern=r"^(\S+)", toolchain="sqlite3"),
    Language("lua", "main.lua", ("lua", "main.lua"), version=("lua", "-v"), version_pattern=r"Lua (\S+)",
             toolchain="lua"),
    Language("R", "main.R", ("Rscript", "main.R"), version=("Rscript", "--version"),
             version_pattern=r"version (\S+)", toolchain="Rscript"),
    Language("perl", "main.pl", ("perl", "main.pl"), version=("perl", "-e", "print $^V"),
             version_pattern=r"v(\S+)", toolchain="perl"),
    Language("D_ut", "main.d", ("./test",), ("ldmd2", "main.d", "-unittest", "-of=test"), ("test",),
             ("ldmd2", "--version"), r"LDC - the LLVM D compiler \((\S+)\)", "ldc"),
    Language("ruby", "main.rb", ("ruby", "main.rb"), version=("ruby", "--version"), version_pattern=r"ruby (\S+)",
             toolchain="ruby"),
    Language("scala", "main.scala", ("scala", "{entry}"), ("scalac", "main.scala"), ("*.class",),
             ("scalac", "-version"), r"version (\S+)", "scalac", entry=(r"object\s+(\w+)", "Main"), uses=("java",)),
    Language("julia", "main.jl", ("julia", "main.jl"), unavailable="needs Julia, which Debian 12 does not package"),
    Language("kotlin_script", "main.kts", ("kotlinc", "-script", "main.kts"), version=("kotlinc", "-version"),
             version_pattern=r"kotlinc-jvm (\S+)", toolchain="kotlinc", uses=("java",)),
    Language("verilog", "main.sv", ("vvp", "-n", "test.vvp"),
             ("iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o", "test.vvp", "main.sv"),
             ("test.vvp",), ("iverilog", "-V"), r"Icarus Verilog version (\S+)", "iverilog"),
    Language("lean", "Main.lean", ("lake",), unavailable="needs Lean 4 and Mathlib, which no package here "
             "provides"),
    Language("swift", "main.swift", ("swiftc",), unavailable="needs the Swift toolchain, which Debian 12 does "
             "not package"),
    Language("racket", "main.rkt", ("racket", "main.rkt"), version=("racket", "--version"),
             version_pattern=r"v(\S+?)\.?\s", toolchain="racket"),
)

BY_NAME: Dict[str, Language] = {language.name: language for language in TABLE}

#: What every hello-world prints.
HELLO_TEXT = "hello, execpool"

#: A hello-world per language, and a text its output holds when it
#: compiled and ran (a test runner's verdict where the program is a test):
#: what tells whether a language runs in a pool's sandbox
#: (execpool/pool/toolchains.py). Empty text: exiting 0 is the verdict.
HELLO: Dict[str, Tuple[str, str]] = {
    "python": (f"print({HELLO_TEXT!r})", HELLO_TEXT),
    "pytest": ("def test_hello():\n    assert 1 + 1 == 2\n", "1 passed"),
    "bash": (f"echo '{HELLO_TEXT}'\n", HELLO_TEXT),
    "c": (f'#include <stdio.h>\nint main(void) {{ puts("{HELLO_TEXT}"); return 0; }}\n', HELLO_TEXT),
    "cpp": (f'#include <iostream>\nint main() {{ std::cout << "{HELLO_TEXT}" << std::endl; }}\n', HELLO_TEXT),
    "java": (f'public class Main {{ public static void main(String[] a) {{ System.out.println("{HELLO_TEXT}"); }} }}\n',
             HELLO_TEXT),
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.assertEquals;\n"
              "public class HelloTest { @Test void hello() { assertEquals(2, 1 + 1); } }\n", "1 tests successful"),
    "rust": (f'fn main() {{ println!("{HELLO_TEXT}"); }}\n', HELLO_TEXT),
    "go": (f'package main\nimport "fmt"\nfunc main() {{ fmt.Println("{HELLO_TEXT}") }}\n', HELLO_TEXT),
    "go_test": ('package main\nimport "testing"\nfunc TestHello(t *testing.T) { if 1+1 != 2 { t.Fatal("sum") } }\n',
                "ok"),
    "nodejs": (f'console.log("{HELLO_TEXT}");\n', HELLO_TEXT),
    "javascript": (f'console.log("{HELLO_TEXT}");\n', HELLO_TEXT),
    "typescript": (f'const greeting: string = "{HELLO_TEXT}";\nconsole.log(greeting);\n', HELLO_TEXT),
    "jest": ('test("hello", () => { expect(1 + 1).toBe(2); });\n', "1 passed"),
    "php": (f'<?php echo "{HELLO_TEXT}\\n";\n', HELLO_TEXT),
    "csharp": (f'class Program {{ static void Main() {{ System.Console.WriteLine("{HELLO_TEXT}"); }} }}\n',
               HELLO_TEXT),
    "sql": (f"SELECT '{HELLO_TEXT}';\n", HELLO_TEXT),
    "lua": (f'print("{HELLO_TEXT}")\n', HELLO_TEXT),
    "R": (f'cat("{HELLO_TEXT}\\n")\n', HELLO_TEXT),
    "perl": (f'print "{HELLO_TEXT}\\n";\n', HELLO_TEXT),
    # With -unittest, D runs the unit tests and, by default, not main.
    "D_ut": ("unittest { assert(1 + 1 == 2); }\nvoid main() {}\n", ""),
    "ruby": (f'puts "{HELLO_TEXT}"\n', HELLO_TEXT),
    "scala": (f'object Main {{ def main(args: Array[String]): Unit = println("{HELLO_TEXT}") }}\n', HELLO_TEXT),
    "kotlin_script": (f'println("{HELLO_TEXT}")\n', HELLO_TEXT),
    "verilog": (f'module tb; initial begin $display("{HELLO_TEXT}"); $finish; end endmodule\n', HELLO_TEXT),
    "racket": (f'#lang racket\n(displayln "{HELLO_TEXT}")\n', HELLO_TEXT),
}


def get(name: str) -> Language:
    """The row named ``name``; ``ValueError`` naming the known ones."""
    language = BY_NAME.get(name)
    if language is None:
        raise ValueError(f"language {name!r} is not in the languages table; known: {', '.join(BY_NAME)}")
    return language


@dataclass(frozen=True)
class Toolchain:
    """What this machine has of a language: whether it runs here, the
    toolchain's version ("g++ 12.2.0"), and otherwise why not.

    ``runs`` is what was found: from :func:`probe`, that the toolchain is
    there and says its version; from a pool (``ExecPool.languages``), that
    a hello-world compiled and ran in its sandbox -- ``checking`` while
    that is under way (``runs`` is False until it is known)."""

    name: str
    runs: bool
    compiles: bool
    toolchain: Optional[str]
    why_not: Optional[str]
    #: The bare version, a part of a compiled artifact's cache key.
    version: Optional[str] = None
    #: Each tool installed outside the system's directories, and the
    #: absolute path a job runs it by (in its install root).
    commands: Tuple[Tuple[str, str], ...] = ()
    #: Those tools' install roots: what a sandboxed job's view shows of
    #: them, read-only, at their own paths.
    roots: Tuple[str, ...] = ()
    checking: bool = False

    def placed(self, argv: Tuple[str, ...]) -> Tuple[str, ...]:
        """A step's argv with its tool by the path it is run by."""
        found = dict(self.commands)
        return (found.get(argv[0], argv[0]), *argv[1:]) if argv else argv

    @property
    def bins(self) -> Tuple[str, ...]:
        """The install roots' ``bin`` directories: on a job's PATH, so that
        what a tool runs by name (``#!/usr/bin/env node``) is found."""
        return tuple(os.path.join(root, "bin") for root in self.roots if os.path.isdir(os.path.join(root, "bin")))


#: Seconds a toolchain may take to say its version (a JVM starts slowly).
VERSION_TIMEOUT_S = 20.0

#: What a tool says when the machine, not the program or the toolchain,
#: failed it: out of space (gcc, ld, javac, rustc: the system's message),
#: out of memory (glibc, gcc's "virtual memory exhausted", C++'s bad_alloc,
#: the JVM's), out of processes or threads (EAGAIN: bash's "fork: retry",
#: the JVM's "unable to create native thread").
MACHINE_FAILURE = re.compile(r"No space left on device|Disk quota exceeded|Cannot allocate memory|"
                             r"virtual memory exhausted|std::bad_alloc|OutOfMemoryError|out of memory|"
                             r"Resource temporarily unavailable", re.IGNORECASE)
#: The errors of starting a process that say the machine is short of
#: something now, not that the tool is broken.
_TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EINTR})

_probed: Dict[Tuple[Language, str], Toolchain] = {}
_probe_lock = threading.Lock()

#: Whether the caller of the probes in this context has stopped wanting
#: them (see ``given_up_when``).
_given_up: contextvars.ContextVar[Callable[[], bool]] = contextvars.ContextVar("given_up", default=lambda: False)
#: How often a probe under way looks at whether its caller gave up.
_GIVE_UP_POLL_S = 0.05


@contextlib.contextmanager
def given_up_when(predicate: Callable[[], bool]) -> Iterator[None]:
    """Probes made in this block are killed once ``predicate`` says so, and
    say so (asked again next time): a closing pool waited for a JVM's
    version, seconds under load, before ``execpool serve`` could exit."""
    token = _given_up.set(predicate)
    try:
        yield
    finally:
        _given_up.reset(token)


class _Transient(Exception):
    """A probe the machine failed (out of processes, memory, time): said
    to the caller, never kept -- the next probe asks again. Kept, one
    moment of process exhaustion disabled a language until restart."""

    def __init__(self, toolchain: Toolchain) -> None:
        super().__init__(toolchain.why_not)
        self.toolchain = toolchain


def probe(language: Language, path: Optional[str] = None) -> Toolchain:
    """Ask the toolchain of ``language`` on ``path`` (a PATH; the caller's
    by default) whether it is there, its version and where it is
    installed, once per process -- but a failure the machine caused
    (:data:`MACHINE_FAILURE`, a timeout, ``EAGAIN``) is asked again next
    time."""
    path = os.environ.get("PATH", os.defpath) if path is None else path
    key = (language, path)
    with _probe_lock:
        known = _probed.get(key)
    if known is not None:
        return known
    try:
        found = _ask(language, path)
    except _Transient as exc:
        return exc.toolchain
    with _probe_lock:
        return _probed.setdefault(key, found)


def probed(language: Language, path: str) -> Optional[Toolchain]:
    """What :func:`probe` found of ``language`` on ``path`` already, asking
    nothing: None where it has not asked."""
    with _probe_lock:
        return _probed.get((language, path))


def _said(language: Language, argv: Tuple[str, ...], path: str) -> str:
    """What ``argv`` prints (stdout then stderr); ``_Transient`` where the
    machine failed it, ``ValueError`` (the one line why) where it failed."""
    def transient(why: str) -> _Transient:
        return _Transient(Toolchain(language.name, False, language.compiles, None,
                                    f"{why}; asked again on the next listing"))

    given_up = _given_up.get()
    try:
        done = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                env={"PATH": path, "LC_ALL": "C.UTF-8"}, stdin=subprocess.DEVNULL)
    except OSError as exc:
        if exc.errno in _TRANSIENT_ERRNOS:
            raise transient(f"{argv[0]} could not start: {exc.strerror}") from None
        raise ValueError(f"{argv[0]} could not start: {exc}") from None
    deadline = time.monotonic() + VERSION_TIMEOUT_S
    with done:
        while True:
            try:
                stdout, stderr = done.communicate(timeout=_GIVE_UP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                late, unwanted = time.monotonic() > deadline, given_up()
                if late or unwanted:
                    done.kill()
                    done.communicate()
                    raise transient(f"{argv[0]} did not answer within {VERSION_TIMEOUT_S:g} s" if late
                                    else f"asking {argv[0]} was given up") from None
    said = (stdout + stderr).strip()
    if done.returncode != 0:
        failed = f"{' '.join(argv)} failed (exit {done.returncode}): {' '.join(said.split())[:200]}"
        if MACHINE_FAILURE.search(said):
            raise transient(failed)
        raise ValueError(failed)
    return said


def _ask(language: Language, path: str) -> Toolchain:
    def missing(why: str) -> Toolchain:
        return Toolchain(language.name, False, language.compiles, None, why)

    if language.unavailable is not None:
        return missing(language.unavailable)
    for tool in (*language.tools, language.version[0]):
        if shutil.which(tool, path=path) is None:
            return missing(f"{tool} is not installed here (not on PATH)")
    for needed in language.needs:
        if not os.path.exists(needed):
            return missing(f"{needed} is not here")
    try:
        said = _said(language, language.version, path)
        match = re.search(language.version_pattern, said, re.MULTILINE) if language.version_pattern else None
        if language.version_pattern and match is None:
            return missing(f"{' '.join(language.version)} did not say a version: {said[:200]}")
        version = match.group(1) if match else said.splitlines()[0]
        commands, roots = _installed(language, path)
    except ValueError as exc:
        return missing(str(exc))
    return Toolchain(language.name, True, language.compiles, f"{language.toolchain} {version}", None, version,
                     commands, roots)


def _installed(language: Language, path: str) -> Tuple[Tuple[Tuple[str, str], ...], Tuple[str, ...]]:
    """Where each of ``language``'s tools outside the system's directories
    is installed: (tool, the path a job runs it by), and the install
    roots. ValueError where a root would be too wide to show a job."""
    commands: Dict[str, str] = {}
    roots: List[str] = []
    for tool in language.tools:
        if tool == PYTHON:
            continue  # a job's python3 is its pool's interpreter, which its view shows (execpool/sandbox/view.py)
        found = shutil.which(tool, path=path)
        assert found is not None  # asked above
        found = os.path.abspath(found)
        real = os.path.realpath(found)
        if beneath_system(real):
            continue
        if language.root and language.root[0] == tool:
            shown: Tuple[str, ...] = (os.path.realpath(_said(language, language.root, path).splitlines()[-1].strip()),)
        else:
            shown = install_roots(real)
        for root in shown:
            if too_wide(root) or beneath_system(root):
                raise ValueError(f"{tool} is installed in {os.path.dirname(real)}, whose install root {root} would "
                                 "show a job a home directory or the whole system; install it in a directory of its "
                                 "own")
        commands[tool] = _run_by(tool, found, real, shown[0])
        roots += shown
    outermost = [root for root in roots if not any(_inside(root, other) and root != other for other in roots)]
    return tuple(commands.items()), tuple(dict.fromkeys(outermost))


def install_roots(real: str) -> Tuple[str, ...]:
    """What shows the tool at ``real`` (links resolved) with what it needs:
    the prefix whose ``bin`` holds it, where that prefix holds a ``lib``
    too (an nvm node, a pyenv or conda Python, a JDK, ``/opt/<vendor>``) --
    but of a home's ``~/.local``, which is also where desktops keep their
    data (keyrings, browsers' profiles), only ``bin`` and ``lib``;
    otherwise the tool alone: a lone binary (``cargo install``'s) shows
    nothing of the directory it sits in (``~/.cargo``'s credentials)."""
    directory = os.path.dirname(real)
    while directory != "/":
        prefix = os.path.dirname(directory)
        libs = [os.path.join(prefix, name) for name in ("lib", "lib64") if os.path.isdir(os.path.join(prefix, name))]
        if os.path.basename(directory) in ("bin", "sbin") and libs:
            if os.path.basename(prefix) == ".local" and os.path.dirname(prefix) in homes():
                return (directory, *libs)
            return (prefix,)
        directory = prefix
    return (real,)


def _run_by(tool: str, found: str, real: str, root: str) -> str:
    """The path a job runs ``tool`` by, inside ``root`` as its view shows
    it (at its real path, so with no link on the way): the name PATH found
    where it lies there (a multi-call tool reads its name), else the
    root's own ``bin/`` command (rustup's proxy is outside the root), else
    the resolved file."""
    if os.path.realpath(os.path.dirname(found)) == os.path.dirname(found) and _inside(found, root):
        return found
    own = os.path.join(root, "bin", tool)
    if os.path.isfile(own) and os.access(own, os.X_OK) and _inside(os.path.realpath(own), root):
        return own
    return real


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def toolchains_path(env: Mapping[str, str]) -> str:
    """The PATH jobs with ``env`` look their tools up on."""
    return env.get("PATH") or os.defpath


#: The command a row names for the Python that runs jobs; a pool puts its
#: own interpreter (its ``python=``) in its place (:func:`with_python`).
PYTHON = "python3"


def with_python(language: Language, python: str) -> Language:
    """``language`` with ``python`` wherever its steps run Python."""
    def swap(step: Tuple[str, ...]) -> Tuple[str, ...]:
        return tuple(python if part == PYTHON else part for part in step)

    if PYTHON not in (*(language.compile or ()), *language.run, *language.version):
        return language
    return replace(language, run=swap(language.run), version=swap(language.version),
                   compile=None if language.compile is None else swap(language.compile))
