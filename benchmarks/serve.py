"""The HTTP service (``execpool serve``) against the library it wraps.

Run from the repository root::

    python benchmarks/serve.py              # or: python -m benchmarks.serve
    python benchmarks/serve.py --requests 256 --concurrency 1,16,64,256 --cold
    python benchmarks/serve.py --sandbox-fusion http://127.0.0.1:8080   # a third column

The service runs as a real subprocess, ``sys.executable -m execpool serve
--port 0 --workers W --max-in-flight M --max-queue Q --queue-timeout T``
(``--cold`` passed on: the service runs Python warm by default, and so does
the library side here unless ``--cold``), is asked through SandboxFusion's
``POST /run_code``, and is stopped with SIGTERM at the end. The client is
the standard library's ``http.client``, one keep-alive connection and one
thread per concurrent client (``--client httpx``: an ``httpx.AsyncClient``
per client instead; see LeanHttpSide for why the lean one is the default:
on this machine the client shares the server's CPUs). The baseline, in the
same run, is the library in this process: ``pool.submit`` of the job the
service makes of the body (``PythonJob(code, timeout=10,
separate_stderr=True)``, a ``ShellJob`` for bash) on an ``ExecPool`` of the
same W workers, awaited through ``asyncio.wrap_future`` as the service
awaits it, so that what differs is HTTP, the admission queue and the
client. ``--sandbox-fusion URL`` sends the same requests, through the same
client, to a SandboxFusion server too.

Three programs: ``print('hi')``, ``echo hi`` (``"language": "bash"``), and
a CPU-bound loop calibrated at start to ``--cpu-ms`` (100) ms in this
interpreter, the same code on every side. At each concurrency C of
``--concurrency``, C clients send ``max(--requests, C)`` requests in a
closed loop; reported per side: correct answers per second, median and p99
latency over every request, and the answers that were 504 (overloaded: the
service's admission said so, not an error), wrong (anything but HTTP 200
with status "Success" and the exact stdout) or lost (no answer within the
client timeout, queue timeout + run timeout + 10 s, as verl's client
waits). At concurrency 1 the sides alternate request by request
(interleaved pairs), the other client too; at higher ones they take turns
level by level, in an order that rotates. Beside them, the CPU time per
request of the service's process and of this one (the client, or the
library's caller side), jobs excluded: where the HTTP cost goes.

Targets (printed, not asserted; a target whose level was not run is left
out): the HTTP cost at concurrency 1, the median of the per-pair
differences service - library for ``print('hi')``, <= 1 ms, with each
client; the service's answers per second at concurrency 64 >= 0.9x the
library's (0.8x for the two short jobs, where HTTP is much of the cost), and
>= 0.9x its own at 16 (no collapse as clients pile up);
with ``--sandbox-fusion``, at 16 and at 64, >= 5x SandboxFusion's answers
per second for ``print('hi')`` and >= 3x for ``echo hi``; its p99 latency
at concurrency 256 <= the queue timeout plus the job's run time (the
library's median at concurrency 1, times the jobs in flight per CPU: what
each job gets of the CPUs): nobody waits longer than the queue allows; and no wrong or lost answer from the service at any level.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import functools
import http.client
import json
import os
import queue
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import httpx

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks import _plot as P
from execpool import ExecPool, PythonJob, ShellJob
from execpool.serve.settings import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT_S

#: SandboxFusion's default ``run_timeout``, and the library job's timeout.
RUN_TIMEOUT_S = 10
#: A client gives up this long after the queue timeout plus the run timeout.
CLIENT_MARGIN_S = 10
#: The service must say it is ready within this, and exit this long after SIGTERM.
READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30

TARGET_HTTP_COST_MS = 1.0
#: The service's answers per second over the library's at concurrency 64:
#: for short jobs, where HTTP is much of the cost, and for the CPU-bound
#: loop, where it should be next to nothing.
TARGET_THROUGHPUT_RATIO = {"hi": 0.8, "echo": 0.8, "cpu": 0.9}
#: Its answers per second at concurrency 64 over its own at 16: no collapse.
TARGET_NO_COLLAPSE = 0.9
#: Its answers per second over SandboxFusion's at 16 and at 64, per workload.
TARGET_OVER_SANDBOX_FUSION = {"hi": 5.0, "echo": 3.0}

CPU_LOOP = "total = 0\nfor i in range({n}):\n    total += i\n"
JSON_HEADERS = {"content-type": "application/json"}

OK, BUSY, WRONG, LOST = "ok", "504", "wrong", "lost"
#: One request: its outcome and, for a wrong or lost one, what came back.
Send = Callable[[], Awaitable[tuple[str, str]]]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    label: str
    code: str
    expected: str
    language: str = "python"

    def body(self) -> bytes:
        """The ``/run_code`` request."""
        return json.dumps({"code": self.code, "language": self.language, "run_timeout": RUN_TIMEOUT_S}).encode()

    def job(self, warm: bool) -> PythonJob | ShellJob:
        """The job the service makes of that request."""
        if self.language == "bash":
            return ShellJob(self.code, timeout=RUN_TIMEOUT_S, separate_stderr=True)
        return PythonJob(self.code, timeout=RUN_TIMEOUT_S, separate_stderr=True, warm=warm)


def calibrate_loop(target_s: float) -> tuple[int, float]:
    """Iterations of CPU_LOOP that take ``target_s`` in this interpreter, and
    what they took. Timed at module level (``exec`` in a fresh namespace, as
    the job's file runs: global lookups); the fastest of 5 runs, since other
    people's load only ever slows a run down; scaled from a probe, then once
    more from that first guess."""
    def fastest(n: int) -> float:
        code = compile(CPU_LOOP.format(n=n), "<calibrate>", "exec")
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            exec(code, {})  # noqa: S102 - our own constant loop
            runs.append(time.perf_counter() - t0)
        return min(runs)

    n = 200_000
    for _ in range(2):
        n = max(1, round(n * target_s / fastest(n)))
    return n, fastest(n)


class CpuMeter:
    """CPU seconds of this process and of the service's process, every
    thread, without their jobs (other processes): what the caller side of
    each design costs per request, and so where the HTTP cost goes.

    Read from Linux's CPU-time clock of a process (what
    ``clock_getcpuclockid`` returns, which Python does not wrap): exact to the
    nanosecond, where /proc's user and system times count 10 ms ticks.
    """

    def __init__(self, service_pid: int, ray_pids: tuple = ()) -> None:
        self.pids = (os.getpid(), service_pid)
        self.ray_pids = ray_pids

    def read(self) -> tuple:
        """This process's, the service's, and with ``--ray`` the sum over
        the cluster's proxies, replicas, raylets and GCS."""
        return (*(self._seconds(pid) for pid in self.pids), sum(self._seconds(pid) for pid in self.ray_pids))

    @staticmethod
    def _seconds(pid: int) -> float:
        try:
            return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
        except OSError:  # the service is gone: its figure is missing
            return float("nan")


# --- the service ----------------------------------------------------------------------


class ServiceFailed(RuntimeError):
    """``execpool serve`` did not say it was ready."""


def _sandbox() -> tuple:
    """Whether this execpool has the sandbox, and ``"strict"`` where this
    machine has it too (else None)."""
    try:
        from execpool import sandbox_support
    except ImportError:
        return False, None
    return True, "strict" if sandbox_support().available else None


class Service:
    """``execpool serve`` in a subprocess, its URL read from its ready line.

    Its stdout is read to the end by a thread (nothing the service prints
    can block it on a full pipe); stderr goes to a file, shown if it fails.
    """

    def __init__(self, options: list[str], patience: float = 1.0) -> None:
        self.patience = patience  # times READY_TIMEOUT_S and STOP_TIMEOUT_S (a Ray deployment takes longer)
        self.argv = [sys.executable, "-m", "execpool", "serve", "--port", "0", *options]
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, cwd=C.REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True)
        self.url = self._ready_url()

    def _ready_url(self) -> str:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, args=(lines,), name="bench-serve-stdout", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S * self.patience
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            match = re.search(r"ready at (http://\S+)", line or "")
            if match:
                return match.group(1)
            if line is None:
                stopped = self.stop()
                raise ServiceFailed(f"{' '.join(self.argv[1:])} gave no ready line ({stopped}): "
                                    f"{self.stderr_tail()}")

    def _read_stdout(self, lines: queue.Queue) -> None:
        for line in self.proc.stdout:
            lines.put(line)
        lines.put(None)

    def stderr_tail(self, chars: int = 2000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace").strip()[-chars:]

    def stop(self) -> dict:
        """SIGTERM, then wait (bounded); SIGKILL if it is still there."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        killed = False
        try:
            code = self.proc.wait(STOP_TIMEOUT_S * self.patience)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            killed = True
        return {"exit_code": code, "killed": killed, "stop_s": round(time.perf_counter() - t0, 3)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_server_pids() -> tuple:
    """The processes of this machine's Ray that serve a request: Ray Serve's
    proxies and replicas, the raylets and the GCS (not the replicas' pools,
    whose jobs are the work itself)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if line.startswith(("ray::ProxyActor", "ray::ServeReplica")) or "/raylet/raylet " in line \
                or "/gcs/gcs_server " in line:
            found.append(process.pid)
    return tuple(found)


# --- the sides: what sends one request ---------------------------------------------------


class HttpSide:
    """SandboxFusion's ``POST /run_code``, to execpool serve or to SandboxFusion.

    Each of the C clients has an ``httpx.AsyncClient`` of its own, with one
    keep-alive connection, as C separate callers would. One AsyncClient
    with C connections would measure httpx instead: its pool's bookkeeping
    grows with the connections, and 256 concurrent ``GET /healthz`` cost
    8.5 ms of this process's CPU each and 3.7 s in all that way, against
    1.2 ms and 0.5 s with a client each (2 CPUs, 2026-12).
    """

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        # One for every client: each would load the CA certificates again
        # (30 ms a client here).
        self.tls = ssl.create_default_context()

    @contextlib.asynccontextmanager
    async def open(self, workload: Workload, concurrency: int):
        body = workload.body()
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with contextlib.AsyncExitStack() as stack:
            # trust_env=False: a proxy from the environment must not sit
            # between the client and a loopback server.
            clients = [await stack.enter_async_context(httpx.AsyncClient(
                base_url=self.url, limits=limits, timeout=self.timeout, verify=self.tls, trust_env=False))
                for _ in range(concurrency)]
            yield [functools.partial(self._send, client, body, workload.expected) for client in clients]

    @staticmethod
    async def _send(client: httpx.AsyncClient, body: bytes, expected: str) -> tuple[str, str]:
        try:
            response = await client.post("/run_code", content=body, headers=JSON_HEADERS)
        except httpx.HTTPError as exc:  # the client timeout included: no answer
            return LOST, f"{type(exc).__name__}: {exc}"
        return judged(response.status_code, response.content, expected)


class LeanHttpSide:
    """The same requests through the standard library's ``http.client``:
    one keep-alive connection and one thread per client. httpx spends
    2.3-3 ms of CPU a request here, more than the target for the whole
    HTTP cost and, at 150 requests a second, a third of this machine's two
    CPUs, taken from the server it measures; this client spends 0.8 ms, so
    what is measured through it is mostly the server's own. The default
    client of every level (``--client httpx`` for the other)."""

    def __init__(self, url: str, timeout: float) -> None:
        parsed = httpx.URL(url)
        self.host, self.port = parsed.host, parsed.port
        self.timeout = timeout

    @contextlib.asynccontextmanager
    async def open(self, workload: Workload, concurrency: int):
        body = workload.body()
        connections = [http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                       for _ in range(concurrency)]
        # A thread per client: asyncio's default executor has a handful,
        # and would cap the concurrency at that.
        threads = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="client")
        try:
            yield [functools.partial(self._send, threads, connection, body, workload.expected)
                   for connection in connections]
        finally:
            threads.shutdown()
            for connection in connections:
                connection.close()

    @staticmethod
    def _post(connection: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
        connection.request("POST", "/run_code", body=body, headers=JSON_HEADERS)
        response = connection.getresponse()
        return response.status, response.read()

    async def _send(self, threads: ThreadPoolExecutor, connection: http.client.HTTPConnection, body: bytes,
                    expected: str) -> tuple[str, str]:
        try:
            status, content = await asyncio.get_running_loop().run_in_executor(threads, self._post, connection, body)
        except (OSError, http.client.HTTPException) as exc:
            connection.close()  # the next request opens a new connection
            return LOST, f"{type(exc).__name__}: {exc}"
        return judged(status, content, expected)


def judged(status: int, content: bytes, expected: str) -> tuple[str, str]:
    """The outcome of one ``/run_code`` answer."""
    if status == 504:
        return BUSY, ""
    if status == 200:
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        run = answer.get("run_result") if isinstance(answer, dict) else None
        if isinstance(run, dict) and answer["status"] == "Success" and run.get("stdout") == expected:
            return OK, ""
    return WRONG, f"HTTP {status}: {content[:200]!r}"


class LibrarySide:
    """``pool.submit`` in this process, awaited as the service awaits it."""

    def __init__(self, pool: ExecPool, warm: bool, timeout: float) -> None:
        self.pool = pool
        self.warm = warm
        self.timeout = timeout

    @contextlib.asynccontextmanager
    async def open(self, workload: Workload, concurrency: int):
        yield [functools.partial(self._send, workload.job(self.warm), workload.expected)] * concurrency

    async def _send(self, job: PythonJob | ShellJob, expected: str) -> tuple[str, str]:
        try:
            # Cancelling the asyncio wrapper cancels the job (its tree dies).
            result = await asyncio.wait_for(asyncio.wrap_future(self.pool.submit(job)), self.timeout)
        except asyncio.TimeoutError:
            return LOST, f"no Result within {self.timeout:g} s"
        if result.ok and result.output == expected:
            return OK, ""
        return WRONG, f"{result.status.value}: {result.text[:200]}"


# --- levels --------------------------------------------------------------------------------


def rotated(names: list[str], i: int) -> list[str]:
    """The sides in turn, the first one changing with ``i``."""
    return names[i % len(names):] + names[:i % len(names)]


def summarise(records: list[tuple[float, str, str]], wall_s: float, cpu_s: tuple[float, float]) -> dict:
    """One side at one level; ``cpu_s``: the CPU seconds of this process and
    of the service while it ran."""
    latencies = [seconds for seconds, _, _ in records]
    counts = collections.Counter(outcome for _, outcome, _ in records)
    per_request = max(1, len(records))
    return {
        "n": len(records),
        "ok": counts[OK],
        "busy_504": counts[BUSY],
        "wrong": counts[WRONG],
        "lost": counts[LOST],
        "ok_per_s": round(counts[OK] / wall_s, 1) if wall_s > 0 else None,
        "wall_s": round(wall_s, 3),
        "ms_median": C.ms(C.median(latencies)),
        "ms_p99": C.ms(C.quantile(latencies, 0.99)),
        "ms_max": C.ms(max(latencies)) if latencies else None,
        "caller_cpu_ms_per_request": C.ms(cpu_s[0] / per_request),
        "service_cpu_ms_per_request": C.ms(cpu_s[1] / per_request),
        "ray_cpu_ms_per_request": C.ms(cpu_s[2] / per_request) if len(cpu_s) > 2 else None,
        "examples": [f"{outcome}: {detail}" for _, outcome, detail in records if outcome in (WRONG, LOST)][:3],
    }


async def timed(send: Send) -> tuple[float, str, str]:
    t0 = time.perf_counter()
    outcome, detail = await send()
    return time.perf_counter() - t0, outcome, detail


async def run_level(sends: list[Send], n: int, meter: CpuMeter) -> dict:
    """One client per send, in a closed loop until ``n`` requests are
    answered; the answers per second are over the level's wall time."""
    records: list[tuple[float, str, str]] = []
    todo = iter(range(n))

    async def client(send: Send) -> None:
        for _ in todo:  # shared: each request is taken by one client
            records.append(await timed(send))

    before = meter.read()
    t0 = time.perf_counter()
    await asyncio.gather(*(client(send) for send in sends))
    wall_s = time.perf_counter() - t0
    return summarise(records, wall_s, tuple(b - a for a, b in zip(before, meter.read())))


async def run_pairs(sends: dict[str, Send], n: int, meter: CpuMeter) -> tuple[dict[str, dict], dict[str, list]]:
    """One request per side in turn, ``n`` times, the first side rotating:
    each side's summary (its rate over its own time, its CPU read around
    each of its requests) and, per side but the library, the per-pair
    differences side - library (s)."""
    names = list(sends)
    records: dict[str, list] = {name: [] for name in names}
    cpu = {name: [0.0, 0.0, 0.0] for name in names}
    for i in range(n):
        for name in rotated(names, i):
            before = meter.read()
            records[name].append(await timed(sends[name]))
            for k, (a, b) in enumerate(zip(before, meter.read())):
                cpu[name][k] += b - a
    summaries = {name: summarise(recs, sum(r[0] for r in recs), tuple(cpu[name])) for name, recs in records.items()}
    return summaries, {name: [h[0] - l[0] for h, l in zip(records[name], records["library"])]
                       for name in names if name != "library"}


async def measure(workload: Workload, sides: dict, levels: list[int], requests: int, warmup: int,
                  meter: CpuMeter) -> dict:
    """Every level for one workload, all sides; after ``warmup`` unmeasured pairs."""
    figures = {}
    async with contextlib.AsyncExitStack() as stack:
        singles = {name: (await stack.enter_async_context(side.open(workload, 1)))[0]
                   for name, side in sides.items()}
        if warmup:
            await run_pairs(singles, warmup, meter)
        for index, concurrency in enumerate(levels):
            if concurrency == 1:
                level, diffs = await run_pairs(singles, requests, meter)
                for name in ("http", "http_other"):
                    level[f"{name}_cost_ms_median"] = C.ms(C.median(diffs[name]))
                    level[f"{name}_minus_library_medians_ms"] = round(
                        level[name]["ms_median"] - level["library"]["ms_median"], 3)
            else:
                level = {}
                for name in rotated([name for name in sides if name != "http_other"], index):
                    async with sides[name].open(workload, concurrency) as sends:
                        level[name] = await run_level(sends, max(requests, concurrency), meter)
            http_rate, library_rate = level["http"]["ok_per_s"], level["library"]["ok_per_s"]
            level["http_over_library_ok_per_s"] = round(http_rate / library_rate, 3) if library_rate else None
            figures[str(concurrency)] = level
    return figures


# --- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cpus = os.cpu_count() or 2
    parser.add_argument("--concurrency", type=C.positive_ints, default=[1, 16, 64, 256],
                        help="comma-separated levels (default 1,16,64,256)")
    parser.add_argument("--requests", type=int, default=96,
                        help="requests per side and level, at least the level's concurrency (default 96)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured pairs per workload first (default 4)")
    parser.add_argument("--workers", type=int, default=cpus, help="workers of both pools (default: the CPUs)")
    parser.add_argument("--max-in-flight", type=int, default=2 * cpus,
                        help="the service's jobs at once (default: two per CPU, as the service's)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help=f"the service's waiting requests (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT_S,
                        help=f"seconds a request may wait for a slot (default {DEFAULT_QUEUE_TIMEOUT_S:g})")
    parser.add_argument("--cpu-ms", type=float, default=100.0, help="the CPU-bound loop's run time (default 100)")
    parser.add_argument("--client", choices=("lean", "httpx"), default="lean",
                        help="the client of every level: http.client on a thread per client (default), or "
                             "httpx.AsyncClient; the other one is compared at concurrency 1 too")
    parser.add_argument("--cold", dest="warm", action="store_false",
                        help="cold Python on both sides (serve --cold; warm is the service's default)")
    parser.add_argument("--sandbox-fusion", metavar="URL", help="also send the requests to this SandboxFusion")
    P.add_option(parser)
    parser.add_argument("--ray", metavar="ADDRESS", help="also execpool serve --ray ADDRESS (a running cluster), "
                                                          "the same options per replica, as the side 'ray'")
    parser.add_argument("--ray-replicas", type=int, default=None,
                        help="with --ray: its --replicas (default: one per node)")
    args = C.parse_args(parser, argv, smoke={"concurrency": [1, 4], "requests": 4, "warmup": 1, "workers": 2,
                                             "max_in_flight": 4, "cpu_ms": 10.0})
    for name in ("requests", "workers", "max_in_flight", "max_queue"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.queue_timeout <= 0 or args.cpu_ms <= 0:
        parser.error("--warmup must not be negative; --queue-timeout and --cpu-ms must be positive")

    load_before = C.load()
    started = time.perf_counter()
    # Client sockets here, the service's sockets and every job's pipes.
    nofile = C.raise_nofile(4 * max(args.concurrency) + 256)
    loop_n, loop_s = calibrate_loop(args.cpu_ms / 1000.0)
    workloads = [
        Workload("hi", "print('hi')", "print('hi')", "hi\n"),
        Workload("echo", "echo hi", "echo hi", "hi\n", language="bash"),
        Workload("cpu", f"cpu loop {C.ms(loop_s):g} ms", CPU_LOOP.format(n=loop_n) + "print(total)\n",
                 f"{loop_n * (loop_n - 1) // 2}\n"),
    ]
    client_timeout = args.queue_timeout + RUN_TIMEOUT_S + CLIENT_MARGIN_S
    options = ["--workers", str(args.workers), "--max-in-flight", str(args.max_in_flight),
               "--max-queue", str(args.max_queue), "--queue-timeout", f"{args.queue_timeout:g}"]
    if not args.warm:
        options.append("--cold")
    # The service runs its jobs in the sandbox where the machine has one (its
    # default); the library side does the same, so the two differ by HTTP only.
    has_sandbox, sandbox = _sandbox()
    if has_sandbox and sandbox is None:
        options += ["--sandbox", "off"]
    ray_service = service = None
    try:
        service = Service(options)
        if args.ray:
            replicas = [] if args.ray_replicas is None else ["--replicas", str(args.ray_replicas)]
            ray_service = Service([*options, "--ray", args.ray, "--port", str(_free_port()), *replicas], patience=5.0)
    except ServiceFailed as exc:
        if service is not None:
            service.stop()  # the one already running goes too
        print(f"execpool serve benchmark: {exc}")
        C.emit_json({"benchmark": "serve", "error": str(exc), "load": {"before": load_before, "after": C.load()}})
        return 2
    try:
        with ExecPool(workers=args.workers, **({} if sandbox is None else {"sandbox": sandbox})) as pool:
            client, other = (LeanHttpSide, HttpSide) if args.client == "lean" else (HttpSide, LeanHttpSide)
            sides = {"http": client(service.url, client_timeout),
                     "http_other": other(service.url, client_timeout),
                     "library": LibrarySide(pool, args.warm, client_timeout)}
            if args.sandbox_fusion:
                sides["sandbox_fusion"] = client(args.sandbox_fusion.rstrip("/"), client_timeout)
            if ray_service is not None:
                sides["ray"] = client(ray_service.url, client_timeout)
            meter = CpuMeter(service.proc.pid, _ray_server_pids() if ray_service is not None else ())
            figures = {w.name: asyncio.run(measure(w, sides, args.concurrency, args.requests, args.warmup, meter))
                       for w in workloads}
    finally:
        stopped = service.stop()
        ray_stopped = ray_service.stop() if ray_service is not None else None
    elapsed = time.perf_counter() - started

    targets = {}
    for w in workloads:
        levels = figures[w.name]
        if "1" in levels and w.name == "hi":
            for name in ("http", "http_other"):
                targets[f"hi_c1_{name}_cost_ms"] = C.target(levels["1"][f"{name}_cost_ms_median"],
                                                            TARGET_HTTP_COST_MS, "<=", "ms")
        if "64" in levels:
            targets[f"{w.name}_c64_throughput_ratio"] = C.target(levels["64"]["http_over_library_ok_per_s"],
                                                                 TARGET_THROUGHPUT_RATIO[w.name], ">=", "x")
        if "16" in levels and "64" in levels:
            c16, c64 = levels["16"]["http"]["ok_per_s"], levels["64"]["http"]["ok_per_s"]
            targets[f"{w.name}_c64_over_c16"] = C.target(round(c64 / c16, 3) if c16 else None,
                                                         TARGET_NO_COLLAPSE, ">=", "x")
        if w.name in TARGET_OVER_SANDBOX_FUSION and args.sandbox_fusion:
            for level_name in ("16", "64"):
                if level_name in levels:
                    ours, theirs = levels[level_name]["http"]["ok_per_s"], levels[level_name]["sandbox_fusion"]["ok_per_s"]
                    targets[f"{w.name}_c{level_name}_over_sandbox_fusion"] = C.target(
                        round(ours / theirs, 2) if theirs else None, TARGET_OVER_SANDBOX_FUSION[w.name], ">=", "x")
        if "256" in levels and "1" in levels:
            # The job's run time when --max-in-flight jobs share the CPUs.
            run_s = levels["1"]["library"]["ms_median"] / 1000.0 * max(1.0, args.max_in_flight / cpus)
            targets[f"{w.name}_c256_p99_s"] = C.target(round(levels["256"]["http"]["ms_p99"] / 1000.0, 3),
                                                       round(args.queue_timeout + run_s, 3), "<=", "s")
    wrong_or_lost = sum(level[name]["wrong"] + level[name]["lost"] for levels in figures.values()
                        for level in levels.values() for name in ("http", "http_other") if name in level)
    targets["http_wrong_or_lost"] = C.target(wrong_or_lost, 0, "<=")

    print(f"execpool serve vs library: {args.workers} workers, max-in-flight {args.max_in_flight}, max-queue "
          f"{args.max_queue}, queue-timeout {args.queue_timeout:g} s, {'warm' if args.warm else 'cold'} python, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, load {load_before}, {elapsed:.1f} s")
    print(f"  cpu loop: {loop_n} iterations, {C.ms(loop_s)} ms here; client timeout {client_timeout:g} s; "
          f"service stopped with exit code {stopped['exit_code']}{' (killed)' if stopped['killed'] else ''}")
    print()
    has_sf = "sandbox_fusion" in sides
    header = ["workload", "C", "n", "http ok/s", "lib ok/s", "http/lib", "http med", "lib med", "http p99",
              "lib p99", "http 504", "wrong+lost http/lib"]
    if has_sf:
        header += ["SF ok/s", "SF med", "SF p99", "SF 504", "SF wrong+lost"]
    rows = []
    for w in workloads:
        for concurrency, level in figures[w.name].items():
            http, lib = level["http"], level["library"]
            row = [w.label, concurrency, http["n"], http["ok_per_s"], lib["ok_per_s"],
                   level["http_over_library_ok_per_s"], http["ms_median"], lib["ms_median"], http["ms_p99"],
                   lib["ms_p99"], http["busy_504"], f"{http['wrong'] + http['lost']}/{lib['wrong'] + lib['lost']}"]
            if has_sf:
                sf = level["sandbox_fusion"]
                row += [sf["ok_per_s"], sf["ms_median"], sf["ms_p99"], sf["busy_504"], sf["wrong"] + sf["lost"]]
            rows.append(row)
    C.print_table("POST /run_code to execpool serve vs pool.submit in-process (ok/s: correct answers per second; "
                  "ms over every request; C=1: interleaved pairs)", header, rows)
    if ray_service is not None:
        C.print_table(f"execpool serve --ray ({args.ray_replicas or 'one per node'} replicas) against execpool serve, "
                      "same run (ok/s; CPU ms per request: the Ray processes -- proxies, replicas, raylets, GCS -- "
                      "and the single service's process, jobs not included)",
                      ["workload", "C", "ray ok/s", "serve ok/s", "ray/serve", "ray med", "serve med",
                       "ray CPU/req", "serve CPU/req", "ray 504", "ray wrong+lost"],
                      [[w.label, concurrency, level["ray"]["ok_per_s"], level["http"]["ok_per_s"],
                        round(level["ray"]["ok_per_s"] / level["http"]["ok_per_s"], 3)
                        if level["http"]["ok_per_s"] else None,
                        level["ray"]["ms_median"], level["http"]["ms_median"],
                        level["ray"]["ray_cpu_ms_per_request"], level["http"]["service_cpu_ms_per_request"],
                        level["ray"]["busy_504"], level["ray"]["wrong"] + level["ray"]["lost"]]
                       for w in workloads for concurrency, level in figures[w.name].items()])
    C.print_table("CPU per request (ms; the jobs' own processes not included)",
                  ["workload", "C", "serve process", "http client (here)", "library caller (here)"],
                  [[w.label, concurrency, level["http"]["service_cpu_ms_per_request"],
                    level["http"]["caller_cpu_ms_per_request"], level["library"]["caller_cpu_ms_per_request"]]
                   for w in workloads for concurrency, level in figures[w.name].items()])
    if "1" in figures["hi"]:
        names = {"lean": "http.client", "httpx": "httpx"}
        this, that = names[args.client], names["httpx" if args.client == "lean" else "lean"]
        C.print_table("HTTP cost at concurrency 1 (ms over the library; median of per-pair differences, and of "
                      f"the medians; {this} client, and {that})",
                      ["workload", "pairs", f"{this} per pair", f"{this} medians", "serve CPU",
                       f"{that} per pair", f"{that} medians"],
                      [[w.label, level["http"]["n"], level["http_cost_ms_median"], level["http_minus_library_medians_ms"],
                        level["http"]["service_cpu_ms_per_request"], level["http_other_cost_ms_median"],
                        level["http_other_minus_library_medians_ms"]]
                       for w in workloads for level in [figures[w.name]["1"]]])
    examples = [f"{w.name} C={c} {side}: {example}" for w in workloads for c, level in figures[w.name].items()
                for side, s in level.items() if isinstance(s, dict) for example in s["examples"]]
    for example in examples[:6]:
        print(f"  {example}")
    if examples:
        print()
    C.print_targets(targets)
    result = {
        "benchmark": "serve",
        "workers": args.workers,
        "max_in_flight": args.max_in_flight,
        "max_queue": args.max_queue,
        "queue_timeout_s": args.queue_timeout,
        "warm": args.warm,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "client_timeout_s": client_timeout,
        "cpu_loop": {"iterations": loop_n, "ms": C.ms(loop_s)},
        "sandbox_fusion": args.sandbox_fusion,
        "skipped": {} if args.sandbox_fusion else {"sandbox_fusion": "no --sandbox-fusion URL"},
        "service": {"argv": service.argv[1:], **stopped},
        "ray": None if ray_service is None else {"argv": ray_service.argv[1:], "replicas": args.ray_replicas,
                                                 **(ray_stopped or {})},
        "nofile": nofile,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "workloads": {w.name: {"label": w.label, "levels": figures[w.name]} for w in workloads},
        "targets": targets,
    }
    C.emit_json(result)
    plot(args.plot, result)
    return 0


#: The workloads in the order they run, which a plot keeps.
_PLOT_ORDER = ("hi", "echo", "cpu")
#: The sides a plot shows: (key in a level's figures, label, colour).
_PLOTTED_SIDES = (("http", "execpool serve", "tab:blue"), ("library", "library, in-process", "tab:green"),
                  ("sandbox_fusion", "SandboxFusion", "tab:red"))


def plot(path: str | None, result: dict) -> None:
    """Latency against concurrency, one panel per workload: each side's
    median (solid) and p99 (dashed) per request, SandboxFusion's beside
    execpool's where it was asked."""
    if path is None:  # no --plot
        return
    workloads = result["workloads"]
    with P.figure(path, "POST /run_code: latency against concurrency", result, panels=len(workloads)) as axes:
        # The JSON line sorts its keys; the plot keeps the run's order of workloads.
        names = sorted(workloads, key=lambda name: (_PLOT_ORDER + (name,)).index(name))
        for ax, workload in zip(axes, [workloads[name] for name in names], strict=True):
            levels = sorted(workload["levels"].items(), key=lambda item: int(item[0]))
            for side, label, colour in _PLOTTED_SIDES:
                points = [(int(c), level[side]) for c, level in levels if side in level]
                if not points:
                    continue
                xs = [c for c, _ in points]
                ax.plot(xs, [f["ms_median"] for _, f in points], "o-", color=colour, label=f"{label}, median")
                ax.plot(xs, [f["ms_p99"] for _, f in points], "--", color=colour, alpha=0.6, label=f"{label}, p99")
            P.log_scales(ax, x_base=2)
            ax.set_xticks([int(c) for c, _ in levels])
            ax.set_title(workload["label"])
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("ms per request")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
