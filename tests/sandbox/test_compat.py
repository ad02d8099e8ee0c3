"""Ordinary code does not notice the strict sandbox.

tests/sandbox/test_sandbox.py proves what a sandboxed job cannot do; this module
checks the other half of the bargain: that the everyday things a model's
code does -- temporary files, sqlite, archives, subprocesses,
multiprocessing, sockets, git, compilers, caches under ``~``, reading
``/proc`` and ``/dev`` -- work the same inside ``sandbox="strict"`` as
without it. A sandbox that breaks them is one people turn off.

Each program of the corpus runs twice on one pool: without the sandbox
(the control -- a program that fails there is a broken case, not a finding)
and inside it, and must give the same status, exit code and output. So
every program prints only what is the same on both sides (booleans,
lengths, normalised values -- never a path that varies, a pid or a time), and cleans up
what it makes outside its working directory, since the control writes the
real ``/tmp`` (under names with a random token it draws itself).

The control gets a fresh ``HOME`` of the test's own (so git and caches
never touch the real one) and the pool's Python first on ``PATH`` (in the
sandbox ``python3``/``python`` are meant to be the pool's Python). The
sandboxed run gets the caller's ``PATH`` and ``HOME`` as the pool passes
them on: a writable home of its own is the sandbox's business. A case
whose host tools (gcc, javac, node, rustc, git...) are missing is skipped.
A few Python cases run again as warm jobs.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import NamedTuple, Tuple

import pytest

import execpool
from execpool import ExecPool, PythonJob, ShellJob, Status

pytestmark = pytest.mark.skipif(not execpool.sandbox_support().available,
                                reason=f"no sandbox here: {execpool.sandbox_support().missing}")

#: Generous: javac and rustc take seconds, and a sandboxed run that hangs
#: should still end as a clear difference, not stall the module forever.
JOB_TIMEOUT_S = 60


class Case(NamedTuple):
    name: str
    kind: str  # "python" or "shell"
    source: str
    needs: Tuple[str, ...] = ()


def py(name: str, code: str, *needs: str) -> Case:
    return Case(name, "python", textwrap.dedent(code).strip() + "\n", needs)


def sh(name: str, command: str, *needs: str) -> Case:
    return Case(name, "shell", textwrap.dedent(command).strip() + "\n", needs)


# -- Python programs -----------------------------------------------------------

PYTHON_CASES = [
    py("py_tmp_file", """
        import os, secrets
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.txt"
        with open(path, "w") as f:
            f.write("hello /tmp\\n")
        with open(path) as f:
            print(f.read(), end="")
        print(os.path.getsize(path))
        os.remove(path)
        print(os.path.exists(path))
    """),
    py("py_var_tmp_file", """
        import os, secrets
        path = f"/var/tmp/execpool-compat-{secrets.token_hex(6)}"
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
        print(os.path.getsize(path))
        os.remove(path)
    """),
    py("py_cwd_file", """
        import os
        with open("notes.txt", "w") as f:
            f.write("one\\ntwo\\n")
        os.makedirs("sub/dir", exist_ok=True)
        with open("sub/dir/data.bin", "wb") as f:
            f.write(bytes(range(256)))
        print(open("notes.txt").read().split())
        print(os.path.getsize("sub/dir/data.bin"))
        print(sorted(os.listdir(".")) == sorted([os.path.basename(__file__), "notes.txt", "sub"]))
    """),
    py("py_tempfile_mkstemp", """
        import os, tempfile
        fd, path = tempfile.mkstemp(prefix="execpool-compat-", suffix=".dat")
        os.write(fd, b"mkstemp")
        os.close(fd)
        print(open(path, "rb").read())
        print(oct(os.stat(path).st_mode & 0o777))
        os.unlink(path)
        print(os.path.isabs(tempfile.gettempdir()), os.access(tempfile.gettempdir(), os.W_OK))
    """),
    py("py_tempfile_temporary_directory", """
        import os, tempfile
        with tempfile.TemporaryDirectory(prefix="execpool-compat-") as d:
            for i in range(3):
                with open(os.path.join(d, f"f{i}"), "w") as f:
                    f.write(str(i) * (i + 1))
            print(sorted(os.listdir(d)), [os.path.getsize(os.path.join(d, n)) for n in sorted(os.listdir(d))])
            kept = d
        print(os.path.exists(kept))
    """),
    py("py_tempfile_named_temporary_file", """
        import os, tempfile
        with tempfile.NamedTemporaryFile("w+", prefix="execpool-compat-", suffix=".txt") as f:
            f.write("named\\n")
            f.flush()
            print(open(f.name).read(), end="")
            name = f.name
        print(os.path.exists(name))
        with tempfile.SpooledTemporaryFile(max_size=10) as s:
            s.write(b"spooled beyond ten bytes")
            s.seek(0)
            print(s.read())
        with tempfile.TemporaryFile() as t:
            t.write(b"anonymous")
            t.seek(0)
            print(t.read())
    """),
    py("py_sqlite_tmp", """
        import os, secrets, sqlite3
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.db"
        con = sqlite3.connect(path)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
        con.executemany("INSERT INTO t (v) VALUES (?)", [(c,) for c in "abcde"])
        con.commit()
        con.close()
        con = sqlite3.connect(path)
        print(con.execute("SELECT count(*), group_concat(v, '') FROM t").fetchone())
        con.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
        print(os.path.exists(path))
    """),
    py("py_sqlite_cwd", """
        import sqlite3
        con = sqlite3.connect("data.db")
        con.execute("CREATE TABLE squares (n INTEGER, sq INTEGER)")
        con.executemany("INSERT INTO squares VALUES (?, ?)", [(n, n * n) for n in range(10)])
        con.commit()
        print(con.execute("SELECT sum(sq) FROM squares WHERE n % 2 = 0").fetchone()[0])
        con.execute("CREATE TEMP TABLE scratch AS SELECT * FROM squares ORDER BY n DESC")
        print(con.execute("SELECT n FROM scratch LIMIT 3").fetchall())
        con.close()
    """),
    py("py_zipfile_roundtrip", """
        import io, zipfile
        with zipfile.ZipFile("archive.zip", "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("a.txt", "alpha\\n" * 100)
            z.writestr("dir/b.txt", "beta\\n")
        with zipfile.ZipFile("archive.zip") as z:
            print(sorted(z.namelist()))
            print(z.read("dir/b.txt"))
            z.extractall("out")
        print(open("out/a.txt").read().count("alpha"))
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("m", "memory")
        print(zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("m"))
    """),
    py("py_tarfile_roundtrip_tmp", """
        import os, secrets, shutil, tarfile
        base = f"/tmp/execpool-compat-{secrets.token_hex(6)}"
        os.makedirs(f"{base}/src/inner")
        with open(f"{base}/src/inner/f.txt", "w") as f:
            f.write("tar me\\n")
        with tarfile.open(f"{base}/a.tar.gz", "w:gz") as t:
            t.add(f"{base}/src", arcname="src")
        with tarfile.open(f"{base}/a.tar.gz") as t:
            print(sorted(m.name for m in t.getmembers()))
            if hasattr(tarfile, "data_filter"):
                t.extractall(f"{base}/dst", filter="data")
            else:
                t.extractall(f"{base}/dst")
        print(open(f"{base}/dst/src/inner/f.txt").read(), end="")
        shutil.rmtree(base)
        print(os.path.exists(base))
    """),
    py("py_subprocess_python", """
        import subprocess, sys
        out = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv[1:] , 6 * 7)", "x"],
                             capture_output=True, text=True, check=True)
        print(out.stdout, end="")
        proc = subprocess.run([sys.executable, "-c", "import sys; sys.exit(3)"])
        print(proc.returncode)
    """),
    py("py_subprocess_shell_pipeline", """
        import subprocess
        out = subprocess.run("printf 'pear\\\\napple\\\\nfig\\\\n' | sort | tr a-z A-Z | head -2",
                             shell=True, capture_output=True, text=True, check=True)
        print(out.stdout, end="")
        p1 = subprocess.Popen(["seq", "1", "10"], stdout=subprocess.PIPE)
        p2 = subprocess.Popen(["wc", "-l"], stdin=p1.stdout, stdout=subprocess.PIPE, text=True)
        p1.stdout.close()
        print(p2.communicate()[0].strip(), p1.wait())
    """),
    py("py_multiprocessing_pool_map", """
        import multiprocessing as mp

        def square(n):
            return n * n

        if __name__ == "__main__":
            with mp.Pool(2) as pool:
                print(pool.map(square, range(10)))
                print(sum(pool.imap_unordered(square, range(100))))
    """),
    py("py_multiprocessing_process_queue", """
        import multiprocessing as mp

        def worker(q, n):
            q.put(("done", n, n ** 3))

        if __name__ == "__main__":
            q = mp.Queue()
            procs = [mp.Process(target=worker, args=(q, n)) for n in range(3)]
            for p in procs:
                p.start()
            results = sorted(q.get(timeout=30) for _ in procs)
            for p in procs:
                p.join()
            print(results, [p.exitcode for p in procs])
    """),
    py("py_multiprocessing_lock_semaphore", """
        import multiprocessing as mp

        def bump(lock, sem, counter):
            for _ in range(100):
                with sem:
                    with lock:
                        counter.value += 1

        if __name__ == "__main__":
            lock, sem = mp.Lock(), mp.Semaphore(2)
            counter = mp.Value("i", 0, lock=False)
            procs = [mp.Process(target=bump, args=(lock, sem, counter)) for _ in range(3)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            print(counter.value, mp.Event().is_set(), mp.Condition() is not None)
    """),
    py("py_concurrent_process_pool", """
        from concurrent.futures import ProcessPoolExecutor

        def fib(n):
            return n if n < 2 else fib(n - 1) + fib(n - 2)

        if __name__ == "__main__":
            with ProcessPoolExecutor(max_workers=2) as ex:
                print(list(ex.map(fib, range(15))))
    """),
    py("py_threads", """
        import threading
        from concurrent.futures import ThreadPoolExecutor
        total, lock = [0], threading.Lock()

        def add(n):
            with lock:
                total[0] += n
            return n * 2

        with ThreadPoolExecutor(max_workers=8) as ex:
            doubled = list(ex.map(add, range(1000)))
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=barrier.wait) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(total[0], sum(doubled), threading.active_count())
    """),
    py("py_shared_memory", """
        from multiprocessing import Process, shared_memory

        def fill(name):
            shm = shared_memory.SharedMemory(name=name)
            shm.buf[:5] = b"hello"
            shm.close()

        if __name__ == "__main__":
            shm = shared_memory.SharedMemory(create=True, size=64)
            p = Process(target=fill, args=(shm.name,))
            p.start()
            p.join()
            print(bytes(shm.buf[:5]), p.exitcode)
            shm.close()
            shm.unlink()
    """),
    py("py_tcp_echo_threads", """
        import socket, threading
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()

        def echo():
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data.upper())

        t = threading.Thread(target=echo)
        t.start()
        with socket.create_connection(server.getsockname(), timeout=10) as c:
            c.sendall(b"ping over loopback")
            c.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := c.recv(1024):
                reply += chunk
        t.join()
        server.close()
        print(reply)
    """),
    py("py_tcp_echo_process", """
        import multiprocessing as mp, socket

        def serve(sock):
            conn, _ = sock.accept()
            with conn:
                conn.sendall(conn.recv(1024)[::-1])

        if __name__ == "__main__":
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            p = mp.Process(target=serve, args=(sock,))
            p.start()
            with socket.create_connection(sock.getsockname(), timeout=10) as c:
                c.sendall(b"abcdef")
                print(c.recv(1024))
            p.join()
            print(p.exitcode)
            sock.close()
    """),
    py("py_udp_loopback", """
        import socket
        a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        a.bind(("127.0.0.1", 0))
        b.sendto(b"datagram", a.getsockname())
        a.settimeout(10)
        print(a.recvfrom(100)[0])
        print(socket.gethostbyname("localhost").startswith("127."))
        a.close(); b.close()
    """),
    py("py_unix_socket_tmp", """
        import os, secrets, socket, threading
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.sock"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen()

        def answer():
            conn, _ = server.accept()
            with conn:
                conn.sendall(b"unix:" + conn.recv(100))

        t = threading.Thread(target=answer)
        t.start()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(path)
            c.sendall(b"hi")
            print(c.recv(100))
        t.join()
        server.close()
        os.unlink(path)
        left, right = socket.socketpair()
        left.sendall(b"pair")
        print(right.recv(10))
        left.close(); right.close()
    """),
    py("py_listdir_root", """
        import os
        entries = set(os.listdir("/"))
        print(sorted({"usr", "etc", "tmp", "dev", "proc", "bin"} & entries))
        print(os.path.isdir("/usr/lib"), os.path.isdir("/tmp"), os.path.isdir("/var/tmp"))
        print(sorted(e.name for e in os.scandir("/") if e.name in ("usr", "etc")))
    """),
    py("py_os_walk", """
        import os
        for d in ("tree/a/b", "tree/c"):
            os.makedirs(d)
        for f in ("tree/top.txt", "tree/a/one.txt", "tree/a/b/two.txt", "tree/c/three.txt"):
            with open(f, "w") as fh:
                fh.write(f)
        for root, dirs, files in sorted(os.walk("tree")):
            dirs.sort()
            print(root, sorted(files))
    """),
    py("py_home_cache", """
        import json, os
        cache = os.path.join(os.path.expanduser("~"), ".cache", "execpool-compat")
        os.makedirs(cache, exist_ok=True)
        with open(os.path.join(cache, "fontlist.json"), "w") as f:
            json.dump({"fonts": ["DejaVu Sans"], "version": 3}, f)
        with open(os.path.join(cache, "fontlist.json")) as f:
            print(json.load(f))
        print(os.path.isdir(os.path.expanduser("~/.cache")))
    """),
    py("py_home_config_matplotlib_style", """
        import os
        home = os.path.expanduser("~")
        print(home != "~", os.path.isabs(home), os.path.isdir(home))
        config = os.path.join(home, ".config", "matplotlib")
        os.makedirs(config, exist_ok=True)
        with open(os.path.join(config, "matplotlibrc"), "w") as f:
            f.write("backend: Agg\\n")
        print(open(os.path.join(config, "matplotlibrc")).read(), end="")
        print(os.access(config, os.W_OK))
    """),
    py("py_home_writable", """
        import os, pathlib
        home = os.path.expanduser("~")
        print(os.access(home, os.W_OK))
        probe = pathlib.Path.home() / ".execpool-compat-probe"
        probe.write_text("ok")
        print(probe.read_text())
        probe.unlink()
    """),
    py("py_pip_metadata", """
        import importlib.metadata, re
        version = importlib.metadata.version("pip")
        print(bool(re.fullmatch(r"\\d+(\\.\\d+)+", version)), version)
        print(len(list(importlib.metadata.distributions())) > 0)
    """),
    py("py_ctypes_strlen", """
        import ctypes, ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        print(libc.strlen(b"execpool"))
        buf = ctypes.create_string_buffer(16)
        libc.snprintf(buf, 16, b"%d-%s", 42, b"ok")
        print(buf.value)
    """),
    py("py_locale_time", """
        import calendar, locale, time
        print(locale.setlocale(locale.LC_ALL, "C"))
        t = (2024, 2, 29, 13, 5, 9, 3, 60, 0)
        print(time.strftime("%Y-%m-%d %H:%M:%S %A %b", t))
        print(calendar.timegm(t))
        print(time.strftime("%Y", time.gmtime(0)))
        print(locale.getpreferredencoding(False) != "")
    """),
    py("py_proc_self_status", """
        import os
        fields = {line.split(":")[0] for line in open("/proc/self/status")}
        print([f for f in ("Name", "State", "Pid", "PPid", "Uid", "Gid", "Threads", "VmRSS") if f in fields])
        print(os.readlink("/proc/self/cwd") == os.getcwd())
        print(len(os.listdir("/proc/self/fd")) >= 3)
        print(open("/proc/self/cmdline", "rb").read().split(b"\\0")[0] != b"")
    """),
    py("py_proc_meminfo_cpuinfo", """
        meminfo = open("/proc/meminfo").read()
        print("MemTotal:" in meminfo, "MemAvailable:" in meminfo)
        cpuinfo = open("/proc/cpuinfo").read()
        print("processor" in cpuinfo)
        import os
        print(os.cpu_count() >= 1, len(os.sched_getaffinity(0)) >= 1)
        print(len(open("/proc/loadavg").read().split()) == 5)
    """),
    # A runtime sets the ordinary class on each thread it starts, by the
    # thread's own id (Mono does, and printed a warning on stdout when
    # the sandbox refused it).
    py("py_thread_sets_its_own_scheduling", """
        import os, threading
        def own():
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_OTHER, os.sched_param(0))
            print("set", os.sched_getscheduler(0) == os.SCHED_OTHER)
        thread = threading.Thread(target=own)
        thread.start()
        thread.join()
    """),
    py("py_dev_urandom_null", """
        import os, secrets
        with open("/dev/urandom", "rb") as f:
            print(len(f.read(64)))
        with open("/dev/random", "rb") as f:
            print(len(f.read(8)))
        with open("/dev/null", "w") as f:
            print(f.write("discarded"))
        print(open("/dev/null").read() == "", len(os.urandom(32)), len(secrets.token_bytes(16)))
    """),
    py("py_dev_zero_full_tty", """
        import errno
        with open("/dev/zero", "rb") as f:
            print(f.read(8))
        try:
            with open("/dev/full", "w") as f:
                f.write("x")
        except OSError as e:
            print("full:", errno.errorcode[e.errno])
        try:
            open("/dev/tty").close()
            print("tty: opened")
        except OSError as e:
            print("tty:", errno.errorcode[e.errno])
    """),
    py("py_dev_fd_and_shm", """
        import os, secrets
        print({"0", "1", "2"} <= set(os.listdir("/dev/fd")))
        print(os.path.isdir("/dev/shm"))
        name = f"/dev/shm/execpool-compat-{secrets.token_hex(6)}"
        with open(name, "w") as f:
            f.write("in shm")
        print(open(name).read())
        os.unlink(name)
        print(os.path.exists(name))
    """),
    py("py_hash_json_csv_cwd", """
        import csv, hashlib, json
        rows = [{"n": str(i), "sq": str(i * i)} for i in range(5)]
        with open("t.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["n", "sq"])
            w.writeheader()
            w.writerows(rows)
        with open("t.csv", newline="") as f:
            print(list(csv.DictReader(f)) == rows)
        with open("t.json", "w") as f:
            json.dump(rows, f, sort_keys=True)
        print(json.load(open("t.json")) == rows)
        print(hashlib.sha256(open("t.csv", "rb").read()).hexdigest()[:16])
        print(hashlib.md5(b"abc").hexdigest())
    """),
    py("py_read_own_file", """
        import os, sys
        source = open(__file__).read()
        print("read_own_file_marker" in source, os.path.basename(__file__).endswith(".py"))
        print(os.path.dirname(os.path.abspath(__file__)) == os.getcwd())
        print(sys.path[0] == os.getcwd())
    """),
    py("py_import_module_from_cwd", """
        import importlib, os, sys
        with open("helper_mod.py", "w") as f:
            f.write("def triple(x):\\n    return 3 * x\\n")
        importlib.invalidate_caches()
        import helper_mod
        print(helper_mod.triple(14))
        import compileall
        print(bool(compileall.compile_file("helper_mod.py", quiet=1)), os.path.isdir("__pycache__"))
    """),
    py("py_signal_handler", """
        import os, signal
        got = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
        os.kill(os.getpid(), signal.SIGUSR1)
        signal.signal(signal.SIGALRM, lambda signum, frame: got.append("alarm"))
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        while len(got) < 2:
            signal.pause()  # returns once a handler ran: the alarm's (the job's timeout bounds it)
        print(got == [signal.SIGUSR1, "alarm"])
    """),
    py("py_copytree_rmtree_tmp", """
        import filecmp, os, secrets, shutil
        base = f"/tmp/execpool-compat-{secrets.token_hex(6)}"
        os.makedirs(f"{base}/src/deep/er")
        for i in range(5):
            with open(f"{base}/src/deep/er/f{i}", "w") as f:
                f.write("x" * i)
        shutil.copytree(f"{base}/src", f"{base}/dst")
        cmp = filecmp.dircmp(f"{base}/src/deep/er", f"{base}/dst/deep/er")
        print(sorted(cmp.common_files), cmp.diff_files)
        shutil.move(f"{base}/dst", f"{base}/moved")
        print(sorted(os.listdir(base)))
        shutil.rmtree(base)
        print(os.path.exists(base))
    """),
    py("py_symlinks_tmp", """
        import os, secrets, shutil
        base = f"/tmp/execpool-compat-{secrets.token_hex(6)}"
        os.mkdir(base)
        with open(f"{base}/target", "w") as f:
            f.write("pointed at\\n")
        os.symlink("target", f"{base}/link")
        os.symlink(f"{base}/target", f"{base}/abslink")
        os.link(f"{base}/target", f"{base}/hard")
        print(os.readlink(f"{base}/link"), os.path.islink(f"{base}/abslink"))
        print(open(f"{base}/link").read(), end="")
        same = os.path.realpath(f"{base}/link") == os.path.realpath(f"{base}/target")
        print(os.stat(f"{base}/target").st_nlink, same)
        shutil.rmtree(base)
    """),
    py("py_chmod_tmp", """
        import os, secrets, stat
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.sh"
        with open(path, "w") as f:
            f.write("#!/bin/sh\\necho executable\\n")
        os.chmod(path, 0o700)
        print(oct(stat.S_IMODE(os.stat(path).st_mode)), os.access(path, os.X_OK))
        import subprocess
        print(subprocess.run([path], capture_output=True, text=True).stdout, end="")
        os.chmod(path, 0o644)
        print(oct(stat.S_IMODE(os.stat(path).st_mode)))
        os.utime(path, (0, 0))
        print(os.stat(path).st_mtime)
        os.remove(path)
    """),
    py("py_fcntl_lock_tmp", """
        import fcntl, os, secrets
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("second lock: granted")
        except BlockingIOError:
            print("second lock: busy")
        fcntl.lockf(fd, fcntl.LOCK_UN)
        fcntl.flock(fd, fcntl.LOCK_UN)
        fcntl.lockf(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("posix lock: ok")
        os.close(fd); os.close(other)
        os.remove(path)
    """),
    py("py_select_poll_pipe", """
        import os, select
        r, w = os.pipe()
        print(select.select([r], [], [], 0)[0] == [])
        os.write(w, b"ready")
        print(select.select([r], [], [], 5)[0] == [r])
        p = select.poll()
        p.register(r, select.POLLIN)
        print([(fd == r, bool(ev & select.POLLIN)) for fd, ev in p.poll(1000)])
        ep = select.epoll()
        ep.register(r, select.EPOLLIN)
        print(len(ep.poll(1)))
        print(os.read(r, 100))
        ep.close(); os.close(r); os.close(w)
    """),
    py("py_mmap_tmp", """
        import mmap, os, secrets
        path = f"/tmp/execpool-compat-{secrets.token_hex(6)}.mm"
        with open(path, "wb") as f:
            f.write(b"\\0" * 4096)
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), 0)
            m[:6] = b"mapped"
            m.flush()
            m.close()
        print(open(path, "rb").read(6))
        anon = mmap.mmap(-1, 1 << 20)
        anon[-1:] = b"z"
        print(len(anon), anon[-1:])
        os.remove(path)
    """),
    py("py_asyncio_subprocess_socket", """
        import asyncio, sys

        async def main():
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "print('child')",
                                                        stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            print(out.decode().strip(), proc.returncode)

            async def handle(reader, writer):
                writer.write((await reader.readline()).upper())
                await writer.drain()
                writer.close()

            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            host, port = server.sockets[0].getsockname()[:2]
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"async line\\n")
            print(await reader.readline())
            writer.close()
            server.close()
            await server.wait_closed()

        asyncio.run(main())
    """),
    py("py_logging_and_env", """
        import logging, os, platform, pwd
        logging.basicConfig(filename="app.log", level=logging.INFO, format="%(levelname)s %(message)s")
        logging.info("started")
        logging.warning("careful")
        logging.shutdown()
        print(open("app.log").read(), end="")
        print(platform.system(), bool(pwd.getpwuid(os.getuid()).pw_name))
        print("HOME" in os.environ, "PATH" in os.environ)
    """),
    py("py_python3_on_path", """
        import shutil, subprocess
        for name in ("python3", "python"):
            found = shutil.which(name)
            out = subprocess.run([name, "-c", "import sys; print(sys.version_info[0])"],
                                 capture_output=True, text=True) if found else None
            print(name, found is not None, out and out.stdout.strip(), out and out.returncode)
    """),
]

# -- shell programs ------------------------------------------------------------

SHELL_CASES = [
    sh("sh_echo_tmp", """
        f=/tmp/x-execpool-compat-$$-$RANDOM$RANDOM
        echo hi > "$f" && cat "$f"
        rm -f "$f"
    """),
    sh("sh_var_tmp", """
        f=/var/tmp/execpool-compat-$$-$RANDOM$RANDOM
        printf 'abc' > "$f" && wc -c < "$f"
        rm -f "$f"
    """),
    sh("sh_mktemp", """
        f=$(mktemp)
        d=$(mktemp -d)
        echo data > "$f"
        cat "$f"
        touch "$d/inside"
        ls "$d"
        rm -f "$f"
        rm -r "$d"
        test -e "$f" || echo removed
    """),
    sh("sh_cd_tmp_pwd", """
        cd /tmp && pwd
        cd /var/tmp && pwd
        cd - >/dev/null && pwd
    """),
    sh("sh_python3", "python3 -c 'print(1)'"),
    sh("sh_python", "python -c 'import sys; print(sys.version_info[0], 2 + 2)'"),
    sh("sh_python_heredoc", """
        python3 - <<'EOF'
        import json
        print(json.dumps({"from": "heredoc", "n": [1, 2, 3]}, sort_keys=True))
        EOF
    """),
    sh("sh_pip_version", "python3 -m pip --version | cut -d' ' -f1-2"),
    sh("sh_home_writable", """
        test -w "$HOME" && echo writable
        test -d "$HOME" && echo directory
        case "$HOME" in /*) echo absolute;; *) echo relative;; esac
    """),
    sh("sh_home_cache", """
        mkdir -p ~/.cache/execpool-compat ~/.config/execpool-compat
        echo cached > ~/.cache/execpool-compat/entry
        echo '[core]' > ~/.config/execpool-compat/conf
        cat ~/.cache/execpool-compat/entry ~/.config/execpool-compat/conf
        cd ~ && echo "home is cd-able"
    """),
    sh("sh_ls_root", """
        ls / | grep -xE 'usr|etc|tmp|dev|proc' | sort
        ls -d /usr/bin /etc >/dev/null && echo listed
    """),
    sh("sh_ls_dev", "ls /dev | grep -xE 'null|zero|full|random|urandom|tty|shm|fd' | sort"),
    sh("sh_find", """
        mkdir -p made/a/b made/c
        touch made/a/one made/a/b/two made/c/three made/top
        find . -type f -path './made/*' | sort
        find made -type d | sort | tr '\\n' ' '; echo
    """),
    sh("sh_pipeline", """
        seq 1 100 | awk '{s += $1} END {print s}'
        printf 'b\\na\\nc\\na\\n' | sort | uniq -c | awk '{print $2 "=" $1}'
        echo 'Hello World' | tr 'a-z' 'A-Z' | rev
        seq 200000 | sort -rn | head -1
    """),
    sh("sh_dev_urandom_null", """
        head -c 32 /dev/urandom | wc -c
        echo discarded > /dev/null && echo null ok
        head -c 8 /dev/zero | od -An -tx1 | tr -s ' '
        echo x > /dev/full 2>/dev/null || echo full refuses
    """),
    sh("sh_dev_fd_process_substitution", """
        cat <(echo from process substitution)
        diff <(printf 'a\\nb\\n') <(printf 'a\\nb\\n') && echo same
        exec 3>fd3.txt; echo via fd 3 >&3; exec 3>&-; cat fd3.txt
        ls /dev/fd/ | grep -cxE '0|1|2'
    """),
    sh("sh_dev_shm", """
        test -d /dev/shm && echo shm dir
        f=/dev/shm/execpool-compat-$$-$RANDOM
        echo shared > "$f" && cat "$f"
        rm -f "$f"
    """),
    sh("sh_proc", """
        grep -q '^Pid:' /proc/self/status && echo status
        grep -q '^MemTotal:' /proc/meminfo && echo memtotal
        grep -q '^processor' /proc/cpuinfo && echo cpuinfo
        test "$(readlink /proc/self/cwd)" = "$(pwd -P)" && echo cwd
        test -r /proc/self/cmdline && echo cmdline
    """),
    sh("sh_tar_gzip_cwd", """
        mkdir -p pkg/docs
        echo readme > pkg/docs/README
        tar czf pkg.tgz pkg
        rm -r pkg
        tar tzf pkg.tgz | sort
        tar xzf pkg.tgz && cat pkg/docs/README
        gzip -c pkg/docs/README | gunzip
    """),
    sh("sh_sqlite3_cli_tmp", """
        db=/tmp/execpool-compat-$$-$RANDOM.db
        sqlite3 "$db" 'CREATE TABLE t(x); INSERT INTO t VALUES (1),(2),(3);'
        sqlite3 "$db" 'SELECT sum(x) FROM t;'
        rm -f "$db"
    """, "sqlite3"),
    sh("sh_symlink_chmod_tmp", """
        d=$(mktemp -d /tmp/execpool-compat-XXXXXX)
        echo target > "$d/t"
        ln -s t "$d/l"
        readlink "$d/l"
        cat "$d/l"
        chmod 600 "$d/t" && stat -c %a "$d/t"
        chmod +x "$d/t" && test -x "$d/t" && echo executable
        touch -d '2001-02-03 04:05:06 UTC' "$d/t" && TZ=UTC date -r "$d/t" '+%Y-%m-%d %H:%M'
        rm -r "$d"
    """),
    sh("sh_flock_tmp", """
        f=/tmp/execpool-compat-$$-$RANDOM.lock
        flock "$f" -c 'echo got the lock'
        exec 9>"$f"
        flock -n 9 && echo fd lock
        flock -u 9
        rm -f "$f"
    """, "flock"),
    sh("sh_sed_awk_cwd", """
        printf 'name=old\\nsize=3\\n' > conf.ini
        sed -i 's/old/new/' conf.ini
        cat conf.ini
        awk -F= '{print toupper($1)}' conf.ini | xargs echo
    """),
    sh("sh_date_locale", """
        TZ=UTC date -d @0 '+%Y-%m-%d %H:%M:%S %Z'
        LC_ALL=C TZ=UTC date -d '2024-02-29 12:00' '+%A %B'
        LC_ALL=C printf '%.2f\\n' 3.14159
    """),
    sh("sh_dd_wc_tmp", """
        f=/tmp/execpool-compat-$$-$RANDOM.bin
        dd if=/dev/zero of="$f" bs=1024 count=64 2>/dev/null
        wc -c < "$f"
        sha256sum < "$f" | cut -c1-16
        rm -f "$f"
    """),
    sh("sh_background_and_wait", """
        (sleep 0.2; echo child done) &
        wait
        for i in 1 2 3; do echo "$i" & done | sort
        wait
        trap 'echo trapped' USR1
        kill -USR1 $$
    """),
    sh("sh_git", """
        git config --global user.name "Compat Test"
        git config --global user.email compat@example.invalid
        git config --global init.defaultBranch main
        git init -q repo && cd repo
        echo one > file.txt
        git add file.txt
        git commit -q -m "first commit"
        echo two >> file.txt
        git commit -q -am "second commit"
        git log --oneline | cut -d' ' -f2-
        git rev-parse --abbrev-ref HEAD
        git config --global user.name
        git status --porcelain | wc -l
    """, "git"),
    sh("sh_cc", """
        cat > hello.c <<'EOF'
        #include <stdio.h>
        int main(void) { printf("hello from C %d\\n", 6 * 7); return 0; }
        EOF
        cc -O1 -o hello hello.c && ./hello
    """, "cc"),
    sh("sh_gxx", """
        cat > hello.cpp <<'EOF'
        #include <iostream>
        #include <vector>
        #include <numeric>
        int main() {
            std::vector<int> v{1, 2, 3, 4};
            std::cout << "sum " << std::accumulate(v.begin(), v.end(), 0) << std::endl;
        }
        EOF
        g++ -o hellocpp hello.cpp && ./hellocpp
    """, "g++"),
    sh("sh_make_cc", """
        printf 'int main(void){return 7;}\\n' > seven.c
        printf 'seven: seven.c\\n\\tcc -o seven seven.c\\n' > Makefile
        make -s && ./seven; echo "exit $?"
    """, "make", "cc"),
    sh("sh_java", """
        cat > Hello.java <<'EOF'
        public class Hello {
            public static void main(String[] args) {
                System.out.println("hello from Java " + (6 * 7));
            }
        }
        EOF
        javac -J-XX:-UsePerfData Hello.java && java -XX:-UsePerfData -cp . Hello
    """, "javac", "java"),
    sh("sh_node", """
        node -e 'const fs = require("fs"); fs.writeFileSync("n.json", JSON.stringify({a: 1}));
                 console.log("node", JSON.parse(fs.readFileSync("n.json")).a + 41)'
        node -e 'require("os").tmpdir() && console.log("tmpdir ok")'
    """, "node"),
    sh("sh_rustc", """
        cat > hello.rs <<'EOF'
        fn main() { println!("hello from Rust {}", 6 * 7); }
        EOF
        /usr/bin/rustc -O hello.rs -o hellors && ./hellors
    """, "/usr/bin/rustc"),
]

CASES = PYTHON_CASES + SHELL_CASES

#: Python cases run a second time as warm jobs (a fork of the worker).
WARM_CASES = [case for case in PYTHON_CASES if case.name in {
    "py_tmp_file", "py_sqlite_tmp", "py_multiprocessing_lock_semaphore", "py_home_cache",
    "py_listdir_root", "py_dev_urandom_null", "py_tcp_echo_threads", "py_python3_on_path",
}]

def _control_env(home: str) -> dict:
    """The unsandboxed run's environment: a home of its own and the pool's
    Python first on PATH (what ``python3`` is meant to be in the sandbox).
    A rustup install under the real home still needs to find its toolchains."""
    env = {"HOME": home, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.update(_toolchain_env())
    return env


def _sandbox_env() -> dict:
    env = {"PATH": os.environ["PATH"]}
    env.update(_toolchain_env())
    return env


def _toolchain_env() -> dict:
    env = {}
    real_home = os.path.expanduser("~")
    for name, default in (("RUSTUP_HOME", ".rustup"), ("CARGO_HOME", ".cargo")):
        value = os.environ.get(name) or os.path.join(real_home, default)
        if os.path.isdir(value):
            env[name] = value
    return env


@pytest.fixture(scope="module")
def compat_pool():
    with ExecPool(2) as pool:
        yield pool


def _job(case: Case, *, sandbox, env: dict, warm: bool = False):
    if case.kind == "python":
        return PythonJob(case.source, timeout=JOB_TIMEOUT_S, env=env, sandbox=sandbox, warm=warm)
    return ShellJob(case.source, timeout=JOB_TIMEOUT_S, env=env, sandbox=sandbox)


def _show(result) -> str:
    return (f"status={result.status.value} exit_code={result.exit_code} error={result.error!r}\n"
            f"--- output ---\n{result.output}--- end ---")


def _run_both(pool: ExecPool, case: Case, home: str, *, warm: bool = False) -> None:
    missing = [tool for tool in case.needs if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{case.name} needs {', '.join(missing)}, not installed here")
    plain_future = pool.submit(_job(case, sandbox=False, env=_control_env(home), warm=warm))
    boxed_future = pool.submit(_job(case, sandbox="strict", env=_sandbox_env(), warm=warm))
    plain, boxed = plain_future.result(), boxed_future.result()
    assert plain.status is Status.OK and plain.exit_code == 0, (
        f"the control (no sandbox) of {case.name} failed -- a broken case:\n{_show(plain)}")
    assert (boxed.status, boxed.exit_code, boxed.output) == (plain.status, plain.exit_code, plain.output), (
        f"{case.name} differs inside the sandbox\n"
        f"=== without the sandbox ===\n{_show(plain)}\n=== sandbox='strict' ===\n{_show(boxed)}")


@pytest.fixture
def home(tmp_path) -> str:
    """A fresh HOME for the control, so git and caches never touch the real one."""
    path = tmp_path / "home"
    path.mkdir()
    return str(path)


def test_corpus_is_big_enough():
    names = [case.name for case in CASES]
    assert len(CASES) >= 60
    assert len(names) == len(set(names)), "case names must be unique"
    assert len(PYTHON_CASES) >= 40 and len(SHELL_CASES) >= 24
    assert len(WARM_CASES) >= 6


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_same_inside_sandbox(compat_pool, home, case):
    _run_both(compat_pool, case, home)


@pytest.mark.parametrize("case", WARM_CASES, ids=[case.name for case in WARM_CASES])
def test_same_inside_sandbox_warm(compat_pool, home, case):
    _run_both(compat_pool, case, home, warm=True)
