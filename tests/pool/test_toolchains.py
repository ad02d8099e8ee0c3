"""Toolchains where users install them, and a list of languages that tells
the truth (execpool/shared/languages.py, execpool/pool/toolchains.py).

A tool installed in a home (rustup's, nvm's, pyenv's) or under /opt is run
from its install root, which a sandboxed job's view shows read-only, and
nothing else of the home it sits in. ``languages()`` says a language runs
only once its hello-world compiled and ran in the pool's sandbox; until
then it says it is being checked, and no request waits for that; what
failed is said in one line, and a job of that language is refused at once.

Each toolchain here is made by the test in a private home (0700), first on
the pool's PATH: a copy of the machine's perl, or a small script standing
in for a tool that works outside the sandbox and not inside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from execpool import CodeJob, ExecPool, PythonJob, Status, languages
from execpool.pool import toolchains
from execpool.shared import languages as table
from tests.support.helpers import Gates, run_as_nobody, wait_for
from tests.support.servers import Server

PERL = shutil.which("perl")
pytestmark = pytest.mark.skipif(PERL is None, reason="the toolchains here are made from the machine's perl")

#: A Perl program that says what of the home it sees: the interpreter it
#: runs as, the home's entries, whether the file beside the toolchain is
#: there, and whether it can write in the toolchain's root.
LOOKS_AROUND = textwrap.dedent("""\
    my ($home, $root) = @ARGV ? @ARGV : (HOME, ROOT);
    print "$^X\\n";
    opendir(my $d, $home) or die "opendir $home: $!";
    print join(",", sort grep { !/^\\.\\.?$/ } readdir($d)), "\\n";
    print((-e "$home/secret.txt") ? "secret seen\\n" : "no secret\\n");
    if (open(my $f, ">", "$root/lib/new")) { print "wrote\\n" } else { print "not written: $!\\n" }
""")


@pytest.fixture
def private_home(tmp_path):
    """A home of its own, 0700 as a user's is, with a secret in it: under
    /opt where the tests run as root (a directory the sandbox's view shows
    nothing of, as it shows nothing of /root), else under ``tmp_path``."""
    base = "/opt" if os.getuid() == 0 and os.access("/opt", os.W_OK) else str(tmp_path)
    home = tempfile.mkdtemp(prefix="execpool-home-", dir=base)
    with open(os.path.join(home, "secret.txt"), "w") as f:
        f.write("s3cret\n")
    yield home
    shutil.rmtree(home)


def _install(home: str, script: str | None = None) -> tuple[str, str]:
    """A toolchain in ``home``: ``perl`` in ``toolchain/bin`` beside a
    ``lib`` -- a copy of the machine's, or ``script`` -- and the PATH that
    finds it first: (its root, PATH)."""
    root = os.path.join(home, "toolchain")
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "lib"))
    tool = os.path.join(root, "bin", "perl")
    if script is None:
        shutil.copy2(os.path.realpath(PERL), tool)
    else:
        with open(tool, "w") as f:
            f.write(script)
        os.chmod(tool, 0o755)
    return root, os.pathsep.join((os.path.join(root, "bin"), os.environ["PATH"]))


def _rows(pool, wait: bool = True) -> dict:
    return {row.name: row for row in pool.languages(wait=wait)}


@pytest.mark.slow
def test_a_toolchain_in_a_private_home_runs_from_its_root_and_nothing_else_of_the_home_is_seen(private_home):
    root, path = _install(private_home)
    program = LOOKS_AROUND.replace("HOME", repr(private_home)).replace("ROOT", repr(root))
    with ExecPool(workers=1, sandbox="strict", env={"PATH": path}) as pool:
        perl = _rows(pool)["perl"]
        assert perl.runs and not perl.checking, perl
        assert perl.roots == (root,) and dict(perl.commands) == {"perl": os.path.join(root, "bin", "perl")}
        seen = pool.run(CodeJob("perl", program, timeout=30))
        # The negative control: outside the sandbox, the same program sees
        # the whole home -- what the sandbox hides is there.
        unsandboxed = pool.run(CodeJob("perl", program, timeout=30, sandbox=False))
    assert seen.status is Status.OK, seen.text
    assert seen.output == (f"{root}/bin/perl\ntoolchain\nno secret\nnot written: Read-only file system\n")
    assert unsandboxed.output.splitlines()[1:3] == ["secret.txt,toolchain", "secret seen"]
    os.unlink(os.path.join(root, "lib", "new"))


@pytest.mark.slow
@pytest.mark.nobody
def test_a_toolchain_in_nobody_s_private_home_runs_for_nobody_s_pool():
    done = run_as_nobody(textwrap.dedent(f"""\
        import json, os, shutil, sys
        from execpool import CodeJob, ExecPool
        home = os.path.join(sys.argv[1], "home")
        os.mkdir(home, 0o700)
        open(os.path.join(home, "secret.txt"), "w").write("s3cret")
        root = os.path.join(home, "toolchain")
        os.makedirs(os.path.join(root, "bin")); os.makedirs(os.path.join(root, "lib"))
        shutil.copy2({os.path.realpath(PERL)!r}, os.path.join(root, "bin", "perl"))
        path = os.path.join(root, "bin") + ":" + os.environ.get("PATH", os.defpath)
        program = {LOOKS_AROUND!r}.replace("HOME", repr(home)).replace("ROOT", repr(root))
        with ExecPool(workers=1, sandbox="strict", env={{"PATH": path}}) as pool:
            perl = {{row.name: row for row in pool.languages(wait=True)}}["perl"]
            result = pool.run(CodeJob("perl", program, timeout=30))
        print(json.dumps([perl.runs, perl.why_not, list(perl.roots), root, result.status.value, result.output]))
    """))
    assert done.returncode == 0, done.stderr
    runs, why_not, roots, root, status, output = json.loads(done.stdout)
    assert runs and roots == [root], why_not
    assert (status, output) == ("ok", f"{root}/bin/perl\ntoolchain\nno secret\nnot written: Read-only file system\n")


#: A tool that says its version and works outside the sandbox, but reads
#: its configuration from the home it sits in, outside its install root --
#: as rustup's proxy in ~/.cargo/bin reads ~/.rustup.
NEEDS_ITS_HOME = """#!/bin/sh
if [ "$1" = "-e" ]; then printf v5.36.0; exit 0; fi
exec cat {home}/config/perl.conf
"""


@pytest.mark.slow
def test_a_toolchain_that_cannot_run_in_the_sandbox_says_why_and_its_jobs_are_refused_at_once(private_home):
    os.mkdir(os.path.join(private_home, "config"))
    with open(os.path.join(private_home, "config", "perl.conf"), "w") as f:
        f.write(f"{table.HELLO_TEXT}\n")
    _, path = _install(private_home, NEEDS_ITS_HOME.format(home=private_home))
    with ExecPool(workers=1, sandbox="strict", env={"PATH": path}) as pool:
        perl = _rows(pool)["perl"]
        refused = pool.run(CodeJob("perl", "print 1;", timeout=30))
        outside = pool.run(CodeJob("perl", "print 1;", timeout=30, sandbox=False))
    assert not perl.runs and not perl.checking and perl.toolchain == "perl 5.36.0"
    assert perl.why_not.startswith("a hello-world failed in the pool's sandbox: `") and "\n" not in perl.why_not
    assert f"{private_home}/config/perl.conf: No such file or directory" in perl.why_not
    assert refused.status is Status.INFRA and refused.error == f"language 'perl' does not run here: {perl.why_not}"
    assert refused.duration_s == 0  # nothing ran
    assert (outside.status, outside.output) == (Status.OK, f"{table.HELLO_TEXT}\n")  # the tool itself works


#: A tool the machine fails while ``lib/busy`` is in its root: out of
#: processes (EAGAIN), as under a fork bomb elsewhere on the machine.
BUSY_WHEN_RUN = """#!/bin/sh
if [ "$1" = "-e" ]; then printf v5.36.0; exit 0; fi
if [ -e {root}/lib/busy ]; then echo "sh: fork: retry: Resource temporarily unavailable" >&2; exit 254; fi
echo "{hello}"
"""


@pytest.mark.slow
def test_a_check_the_machine_failed_is_not_kept_and_is_done_again_on_the_next_listing(private_home):
    root = os.path.join(private_home, "toolchain")
    _, path = _install(private_home, BUSY_WHEN_RUN.format(root=root, hello=table.HELLO_TEXT))
    open(os.path.join(root, "lib", "busy"), "w").close()
    with ExecPool(workers=1, sandbox="strict", env={"PATH": path}) as pool:
        busy = _rows(pool)["perl"]
        os.unlink(os.path.join(root, "lib", "busy"))
        again = _rows(pool)["perl"]
    assert not busy.runs and busy.why_not.startswith("could not be checked: the machine failed")
    assert busy.why_not.endswith("checked again on the next listing") and "Resource temporarily" in busy.why_not
    assert again.runs and again.why_not is None


#: A tool whose version the machine fails while ``busy`` is beside it.
BUSY_WHEN_ASKED = """#!/bin/sh
if [ -e {root}/lib/busy ]; then echo "perl: fork: Resource temporarily unavailable" >&2; exit 1; fi
if [ -e {root}/lib/slow ]; then exec sleep 30; fi
printf v5.36.0
"""


@pytest.mark.parametrize("why", ["busy", pytest.param("slow", marks=pytest.mark.slow)])
def test_a_probe_the_machine_failed_is_asked_again(private_home, monkeypatch, why):
    """Red team: a version probe that met EAGAIN (or a timeout) under
    process exhaustion was kept for the life of the process, and the
    language stayed off until a restart."""
    monkeypatch.setattr(table, "VERSION_TIMEOUT_S", 1.0)
    root = os.path.join(private_home, "toolchain")
    _, path = _install(private_home, BUSY_WHEN_ASKED.format(root=root))
    open(os.path.join(root, "lib", why), "w").close()
    failed = table.probe(table.get("perl"), path)
    os.unlink(os.path.join(root, "lib", why))
    found = table.probe(table.get("perl"), path)
    assert not failed.runs and failed.why_not.endswith("asked again on the next listing"), failed
    assert ("Resource temporarily unavailable" if why == "busy" else "did not answer within 1 s") in failed.why_not
    assert found.runs and found.version == "5.36.0"


#: A tool whose hello-world waits at a gate the test opens.
HELD = """#!/bin/bash
if [ "$1" = "-e" ]; then printf v5.36.0; exit 0; fi
{wait}
echo "{hello}"
"""


@pytest.mark.slow
def test_no_listing_and_no_job_waits_for_the_checks(private_home):
    with Gates() as gates:
        _, path = _install(private_home, HELD.format(wait=gates.shell("checked"), hello=table.HELLO_TEXT))
        with ExecPool(workers=2, sandbox="strict", env={"PATH": path}) as pool:
            first = _rows(pool, wait=False)  # returns with the perl check held at its gate
            assert first["perl"].checking and not first["perl"].runs
            assert wait_for(lambda: _rows(pool, wait=False)["perl"].toolchain == "perl 5.36.0", 30)
            during = _rows(pool, wait=False)["perl"]
            ran = pool.run(CodeJob("c", table.HELLO["c"][0], timeout=30))
            assert _rows(pool, wait=False)["perl"].checking  # still held while the job ran
            gates.open("checked")
            assert wait_for(lambda: _rows(pool, wait=False)["perl"].runs, 60)
    assert during.checking and not during.runs and during.why_not == toolchains.CHECKING
    assert (ran.status, ran.output) == (Status.OK, f"{table.HELLO_TEXT}\n")


def test_a_python_in_a_venv_under_a_private_home_runs_jobs_and_shows_nothing_else(private_home):
    venv = os.path.join(private_home, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    code = f"import os, sys\nprint(sys.prefix, sorted(os.listdir({private_home!r})))"
    with ExecPool(workers=1, sandbox="strict", python=os.path.join(venv, "bin", "python")) as pool:
        seen = pool.run(PythonJob(code, timeout=30))
        unsandboxed = pool.run(PythonJob(code, timeout=30, sandbox=False))
    assert (seen.status, seen.output) == (Status.OK, f"{venv} ['venv']\n"), seen.text
    assert unsandboxed.output == f"{venv} ['secret.txt', 'venv']\n"


@pytest.mark.slow
def test_the_service_lists_checking_then_the_truth_and_refuses_what_does_not_run(private_home):
    os.mkdir(os.path.join(private_home, "config"))
    _, path = _install(private_home, NEEDS_ITS_HOME.format(home=private_home))
    server = Server("--workers", "1", env={"PATH": path})
    try:
        def perl():
            return {row["name"]: row for row in server.client.get("/v1/languages").json()}["perl"]

        assert set(perl()) == {"name", "runs", "toolchain", "compiles", "why_not", "checking"}
        assert wait_for(lambda: not perl()["checking"], 60)
        row = perl()
        answer = server.client.post("/run_code", json={"code": "print 1;", "language": "perl"}).json()
    finally:
        assert server.stop() == 0
    assert not row["runs"] and row["why_not"].startswith("a hello-world failed in the pool's sandbox")
    assert answer["status"] == "SandboxError" and answer["run_result"] is None
    assert answer["message"] == f"execpool could not run the code: language 'perl' does not run here: {row['why_not']}"


def _tool(path: str, script: str = "#!/bin/sh\nprintf v5.36.0\n") -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    return path


def test_an_install_root_is_the_prefix_or_the_lone_tool_and_of_local_only_bin_and_lib(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))  # a home, as execpool.shared.kernel.sandbox.homes() finds them
    prefix = tmp_path / "opt" / "vendor"
    (prefix / "lib").mkdir(parents=True)
    assert table.install_roots(_tool(f"{prefix}/bin/tool")) == (str(prefix),)
    lone = _tool(f"{home}/.cargo/bin/tool")  # ~/.cargo holds no lib: only the tool is shown
    (home / ".cargo" / "credentials.toml").write_text("token = 's3cret'\n")
    assert table.install_roots(lone) == (lone,)
    local = home / ".local"
    for name in ("lib", "share/keyrings"):
        (local / name).mkdir(parents=True)
    assert table.install_roots(_tool(f"{local}/bin/tool")) == (f"{local}/bin", f"{local}/lib")
    (tmp_path / "current").symlink_to(prefix)  # sdkman's "current": the root is where it leads
    assert table.install_roots(os.path.realpath(tmp_path / "current" / "bin" / "tool")) == (str(prefix),)


def test_a_toolchain_whose_root_would_be_a_home_is_refused_saying_so(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "lib").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    _tool(f"{home}/bin/perl")
    found = table.probe(table.get("perl"), f"{home}/bin:{os.environ['PATH']}")
    assert not found.runs and found.why_not == (f"perl is installed in {home}/bin, whose install root {home} would "
                                                "show a job a home directory or the whole system; install it in a "
                                                "directory of its own")


def test_what_a_row_s_tools_run_by_name_is_shown_too(private_home):
    """scalac and scala are scripts that run ``java`` from PATH: a JDK
    installed in a home (sdkman's) must be in their jobs' view as well."""
    scala, jdk = os.path.join(private_home, "scala"), os.path.join(private_home, "jdk")
    for prefix in (scala, jdk):
        os.makedirs(os.path.join(prefix, "lib"))
    _tool(f"{scala}/bin/scalac", "#!/bin/sh\necho 'Scala compiler version 2.13.12'\n")
    _tool(f"{scala}/bin/scala")
    _tool(f"{jdk}/bin/java")
    found = table.probe(table.get("scala"), f"{scala}/bin:{jdk}/bin:{os.environ['PATH']}")
    assert found.runs and found.version == "2.13.12"
    assert sorted(found.roots) == [jdk, scala] and sorted(found.bins) == [f"{jdk}/bin", f"{scala}/bin"]
    assert dict(found.commands) == {"scala": f"{scala}/bin/scala", "scalac": f"{scala}/bin/scalac",
                                    "java": f"{jdk}/bin/java"}


@pytest.mark.slow
def test_a_pool_lists_at_once_what_another_with_its_sandbox_checked():
    """Checked once per toolchain for the process: a second pool with the
    same sandbox, limits and tools needs no hello-world to list them."""
    truth = {row.name: row.runs for row in languages()}  # its own pool checks, or the process knows already
    with ExecPool(workers=1, sandbox="strict") as pool:
        first = pool.languages()
    assert not any(row.checking for row in first) and {row.name: row.runs for row in first} == truth


#: A process with a pool of its own whose tools' PATH has a perl of its
#: own and nothing else: the languages that run once every row is known,
#: and how many jobs (hello-worlds) the pool ran to know them.
CHECKED_IN_A_PROCESS = """
import json, sys
from execpool import ExecPool
with ExecPool(workers=1, sandbox="strict", env={"PATH": sys.argv[1]}) as pool:
    runs = sorted(row.name for row in pool.languages(wait=True) if row.runs)
    print(json.dumps([runs, pool.stats().jobs_total]))
"""


def _checked_in_a_process(cache: str, tools: str) -> list:
    done = subprocess.run([sys.executable, "-c", CHECKED_IN_A_PROCESS, tools], capture_output=True, text=True,
                          timeout=180, env={**os.environ, toolchains.CACHE_DIR_ENV: cache})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_process_knows_at_once_what_one_before_it_checked(private_home, tmp_path):
    """Each start of ``execpool serve`` compiled every language's hello-world
    again: about twenty CPU-seconds, with every JVM compiler. What ran is
    recorded for the user's next processes; a record that cannot be read
    as one is not believed."""
    tools = os.path.join(private_home, "bin")
    os.mkdir(tools)
    shutil.copy2(os.path.realpath(PERL), os.path.join(tools, "perl"))
    cache = str(tmp_path / "cache")
    runs, checks = _checked_in_a_process(cache, tools)
    assert "perl" in runs and checks >= 1, (runs, checks)
    assert _checked_in_a_process(cache, tools) == [runs, 0]
    record = os.path.join(cache, toolchains.RECORD_FILE)
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700" and oct(os.stat(record).st_mode & 0o777) == "0o600"
    with open(record, "w") as f:
        f.write("{not json")
    assert _checked_in_a_process(cache, tools) == [runs, checks]


def test_a_record_is_believed_for_a_day_and_only_for_what_it_names(tmp_path, monkeypatch):
    monkeypatch.setenv(toolchains.CACHE_DIR_ENV, str(tmp_path))
    row = table.TABLE[0]
    ran = table.Toolchain(row.name, True, row.compiles, "a version", None, checking=True)
    key = (row, ran, "/usr/bin:/bin", "a sandbox", "some limits")
    toolchains.keep(key, dataclasses.replace(ran, checking=False))
    monkeypatch.setattr(toolchains, "_outcomes", {})
    assert toolchains.known(key) == dataclasses.replace(ran, checking=False)
    assert toolchains.known((*key[:4], "other limits")) is None
    path = tmp_path / toolchains.RECORD_FILE
    written = path.read_text()
    failed = dataclasses.replace(ran, runs=False, why_not="a hello-world failed", checking=False)
    toolchains.keep((*key[:4], "failing limits"), failed)
    assert path.read_text() == written, "a failed check was recorded"
    monkeypatch.setattr(toolchains, "_outcomes", {})
    path.write_text(json.dumps({digest: at - toolchains.RECORD_KEPT_S - 1
                                for digest, at in json.loads(written).items()}))
    assert toolchains.known(key) is None


def test_the_record_follows_no_link(tmp_path, monkeypatch):
    """A record that is a link is read as none and replaced, its target
    untouched; a cache directory that is a link gets nothing."""
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / toolchains.RECORD_FILE).symlink_to(target)
    monkeypatch.setenv(toolchains.CACHE_DIR_ENV, str(cache))
    row = table.TABLE[0]
    ran = table.Toolchain(row.name, True, row.compiles, "a version", None)
    toolchains.keep((row, ran, "", "", ""), ran)
    assert target.read_text() == "{}" and not (cache / toolchains.RECORD_FILE).is_symlink()
    assert len(json.loads((cache / toolchains.RECORD_FILE).read_text())) == 1
    linked = tmp_path / "linked"
    linked.symlink_to(target.parent / "other", target_is_directory=True)
    (target.parent / "other").mkdir()
    monkeypatch.setenv(toolchains.CACHE_DIR_ENV, str(linked))
    toolchains.keep((row, ran, "", "", "more"), ran)
    assert list((target.parent / "other").iterdir()) == []


def test_a_cache_directory_that_cannot_be_written_records_nothing_and_fails_nothing(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    monkeypatch.setenv(toolchains.CACHE_DIR_ENV, str(blocked / "cache"))
    row = table.TABLE[0]
    ran = table.Toolchain(row.name, True, row.compiles, "a version", None)
    toolchains.keep((row, ran, "", "", ""), ran)
    assert blocked.read_text() == ""


@pytest.mark.slow
def test_a_lone_binary_in_a_home_shows_only_itself(private_home):
    """A tool with no prefix of its own (``cargo install``'s, in
    ``~/.cargo/bin`` beside ``~/.cargo/credentials.toml``) is shown alone."""
    bin_dir = os.path.join(private_home, "bin")
    os.mkdir(bin_dir)
    shutil.copy2(os.path.realpath(PERL), os.path.join(bin_dir, "perl"))
    with open(os.path.join(bin_dir, "credentials.toml"), "w") as f:
        f.write("token = 's3cret'\n")
    program = (f"opendir(my $d, {bin_dir!r}) or die $!; print join(',', sort grep {{ !/^\\.\\.?$/ }} readdir($d)), "
               f"\"\\n\"; print((-e {bin_dir + '/credentials.toml'!r}) ? \"seen\\n\" : \"unseen\\n\");")
    with ExecPool(workers=1, sandbox="strict", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}) as pool:
        perl = _rows(pool)["perl"]
        seen = pool.run(CodeJob("perl", program, timeout=30))
    assert perl.runs and perl.roots == (os.path.join(bin_dir, "perl"),), perl
    assert (seen.status, seen.output) == (Status.OK, "perl\nunseen\n"), seen.text


def test_closing_a_pool_ends_the_probe_under_way_and_asks_no_other(tmp_path):
    """Every tool on the pool's PATH stands in for a toolchain whose version
    takes as long as the test likes; the pool closes while the first one is
    asked -- without waiting for its answer (a JVM's version held a
    service's exit 13 s under load) -- and nothing is asked after it."""
    gate, asked = tmp_path / "gate", tmp_path / "asked"
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in {tool for row in table.TABLE for tool in (*row.tools, *row.version[:1])}:
        stub = tools / os.path.basename(name)
        stub.write_text(f"#!/bin/sh\necho $$ >> {asked}\nwhile [ ! -e {gate} ]; do sleep 0.01; done\necho 1.0\n")
        stub.chmod(0o755)
    pool = ExecPool(workers=1, env={"PATH": f"{tools}:/usr/bin:/bin"})
    closer = threading.Thread(target=pool.close)
    try:
        pool.languages()
        assert wait_for(lambda: asked.exists() and asked.read_text().endswith("\n"), 30), "no toolchain was probed"
        closer.start()
        closer.join(table.VERSION_TIMEOUT_S / 2)
        assert not closer.is_alive(), "the pool's close waited for the probe's answer"
    finally:
        gate.touch()
        if closer.ident is None:
            pool.close()
        else:
            closer.join(60)
    (probe,) = asked.read_text().split()
    assert not os.path.exists(f"/proc/{probe}"), "the probe under way was left running"
