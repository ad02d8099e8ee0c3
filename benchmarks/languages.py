"""Programs in other languages through ``POST /run_code``: execpool serve
against SandboxFusion, in the same run.

Run from the repository root::

    python benchmarks/languages.py --sandbox-fusion http://127.0.0.1:8180
    python benchmarks/languages.py --languages cpp,java --rounds 5

The service runs as a real subprocess with its defaults (the strict sandbox,
warm Python); the client is the standard library's ``http.client``, one
keep-alive connection per thread. Two parts:

- **hello world**, per language that runs on every side asked: ``--rounds``
  requests one after another (the same program each time, as a user
  retrying or a dataset repeating it sends), the first one's latency and the
  median of the rest. execpool compiles the program once (its compile
  cache); SandboxFusion compiles it every time.
- **codecontests-shaped**: a C++ and a Java solution with ``--tests`` tests
  each (20), sent as verl sends them -- one request per test, the same
  program in each -- at concurrency 16; the wall time of all of them (40)
  per side.
  Target: execpool at least 10x faster than SandboxFusion.

Every answer is checked (HTTP 200, "Success", the exact stdout); a wrong
one is counted, not hidden. The last line of stdout is one JSON object
with every figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks import _plot as P
from benchmarks.serve import Service

HELLO = {
    "python": 'print("hello")',
    "bash": 'echo hello',
    "cpp": '#include <cstdio>\nint main() { std::puts("hello"); }\n',
    "java": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n',
    "rust": 'fn main() { println!("hello"); }\n',
    "go": 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n',
    "nodejs": 'console.log("hello")',
    "php": 'echo "hello\\n";',
    "lua": 'print("hello")',
    "ruby": 'puts "hello"',
    "perl": 'print "hello\\n";',
    "R": 'cat("hello\\n")',
}

#: The codecontests-shaped programs: the sum of n numbers read from stdin.
SOLUTIONS = {
    "cpp": ("#include <bits/stdc++.h>\nusing namespace std;\nint main() { ios::sync_with_stdio(false); int n; "
            "cin >> n; long long s = 0; for (int i = 0; i < n; i++) { long long x; cin >> x; s += x; } "
            "cout << s << \"\\n\"; }\n"),
    "java": ("import java.util.*;\nimport java.io.*;\npublic class Main { public static void main(String[] a) "
             "throws IOException { BufferedReader r = new BufferedReader(new InputStreamReader(System.in)); "
             "int n = Integer.parseInt(r.readLine().trim()); StringTokenizer t = new StringTokenizer(r.readLine()); "
             "long s = 0; for (int i = 0; i < n; i++) s += Long.parseLong(t.nextToken()); "
             "System.out.println(s); } }\n"),
}
TESTS_PER_PROGRAM = 20
CONCURRENCY = 16
TARGET_OVER_SANDBOX_FUSION = 10.0
CLIENT_TIMEOUT_S = 120.0


class Client:
    """``POST /run_code`` over a keep-alive connection per thread."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.local = threading.local()

    def run_code(self, body: dict) -> tuple[float, dict | None, str]:
        """(seconds, answer or None, what went wrong or ""). A connection
        the server closed while it sat idle (its keep-alive timeout, while
        the other side was measured) is opened again, once, as a browser or
        requests' pool would: the request never reached the server."""
        payload = json.dumps(body).encode()
        started = time.perf_counter()
        for attempt in (1, 2):
            connection = getattr(self.local, "connection", None)
            fresh = connection is None
            if fresh:
                connection = self.local.connection = http.client.HTTPConnection(self.host, self.port,
                                                                                timeout=CLIENT_TIMEOUT_S)
            started = time.perf_counter()
            try:
                connection.request("POST", "/run_code", body=payload, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                content = response.read()
                break
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected) as exc:
                connection.close()
                self.local.connection = None
                if fresh or attempt == 2:
                    return time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}"
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                self.local.connection = None
                return time.perf_counter() - started, None, f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        if response.status != 200:
            return seconds, None, f"HTTP {response.status}"
        return seconds, json.loads(content), ""


def judged(answer: dict | None, problem: str, expected: str) -> str:
    """"" for a right answer, else what was wrong."""
    if answer is None:
        return problem
    stdout = (answer.get("run_result") or {}).get("stdout")
    if answer.get("status") != "Success" or stdout != expected:
        return f"{answer.get('status')}: {answer.get('message', '')[:120]} stdout={stdout!r}"[:300]
    return ""


def hello(client: Client, language: str, rounds: int) -> dict:
    seconds, wrong = [], []
    for _ in range(rounds):
        took, answer, problem = client.run_code({"code": HELLO[language], "language": language,
                                                 "compile_timeout": 60, "run_timeout": 30})
        seconds.append(took)
        if fault := judged(answer, problem, "hello\n"):
            wrong.append(fault)
    return {"first_ms": C.ms(seconds[0]), "median_ms": C.ms(C.median(seconds[1:] or seconds)),
            "wrong": len(wrong), "example_wrong": wrong[:1]}


def contests(client: Client, salt: str, tests: int) -> dict:
    """Both solutions, each against its tests, one request per test, at
    CONCURRENCY; a comment makes the programs this run's own (no earlier
    run's compile is reused)."""
    requests = []
    for language, program in SOLUTIONS.items():
        marked = program + f"// {salt}\n"
        for test in range(tests):
            numbers = list(range(test, test + 50 + test))
            stdin = f"{len(numbers)}\n{' '.join(map(str, numbers))}\n"
            requests.append(({"code": marked, "language": language, "stdin": stdin, "compile_timeout": 60,
                              "run_timeout": 30}, f"{sum(numbers)}\n"))
    started = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY, thread_name_prefix="contest") as threads:
        outcomes = list(threads.map(lambda item: (client.run_code(item[0]), item[1]), requests))
    wall = time.perf_counter() - started
    wrong = [fault for (took, answer, problem), expected in outcomes if (fault := judged(answer, problem, expected))]
    return {"requests": len(requests), "wall_s": round(wall, 3), "wrong": len(wrong), "example_wrong": wrong[:1],
            "median_ms": C.ms(C.median([took for (took, _, _), _ in outcomes]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sandbox-fusion", metavar="URL", help="a SandboxFusion server to compare against")
    parser.add_argument("--languages", default=",".join(HELLO), help="hello-world languages (comma-separated)")
    parser.add_argument("--rounds", type=int, default=8, help="hello-world requests per language and side")
    parser.add_argument("--tests", type=int, default=TESTS_PER_PROGRAM,
                        help=f"codecontests-shaped tests per program (default {TESTS_PER_PROGRAM})")
    P.add_option(parser)
    args = C.parse_args(parser, argv, smoke={"languages": "python,bash", "rounds": 2, "tests": 2})
    languages = [name for name in args.languages.split(",") if name]
    unknown = sorted(set(languages) - set(HELLO))
    if unknown:
        parser.error(f"no hello world for {', '.join(unknown)}; known: {', '.join(HELLO)}")
    if args.rounds < 1 or args.tests < 1:
        parser.error("--rounds and --tests must be at least 1")
    load_before = C.load()
    service = Service([])
    try:
        sides = {"execpool": Client(service.url)}
        if args.sandbox_fusion:
            sides["sandbox_fusion"] = Client(args.sandbox_fusion)
        salt = str(time.time_ns())
        figures: dict = {"benchmark": "languages", "machine": C.machine(), "hello": {}, "contests": {},
                         "skipped": {} if args.sandbox_fusion else {"sandbox_fusion": "no --sandbox-fusion URL"}}
        for language in languages:
            figures["hello"][language] = {side: hello(client, language, args.rounds) for side, client in sides.items()}
        for side, client in sides.items():
            figures["contests"][side] = contests(client, salt, args.tests)
    finally:
        figures_stop = service.stop()
    figures["service_stop"] = figures_stop
    figures["load"] = {"before": load_before, "after": C.load()}

    header = ["language", *(f"{side} {what}" for side in sides for what in ("first ms", "median ms", "wrong"))]
    C.print_table("Hello world through /run_code, one request after another (the same program each time)", header,
                  [[language, *(figures["hello"][language][side][key] for side in sides
                                for key in ("first_ms", "median_ms", "wrong"))] for language in languages])
    C.print_table(f"Codecontests-shaped: {len(SOLUTIONS)} programs x {args.tests} tests, one request per "
                  f"test, concurrency {CONCURRENCY}", ["side", "wall s", "median ms", "wrong"],
                  [[side, f["wall_s"], f["median_ms"], f["wrong"]] for side, f in figures["contests"].items()])
    targets = {}
    if "sandbox_fusion" in sides:
        ratio = figures["contests"]["sandbox_fusion"]["wall_s"] / figures["contests"]["execpool"]["wall_s"]
        figures["contests"]["speedup_over_sandbox_fusion"] = round(ratio, 2)
        targets["contests_over_sandbox_fusion"] = C.target(ratio, TARGET_OVER_SANDBOX_FUSION, ">=", "x")
    targets["no_wrong_answers"] = C.target(
        sum(f["execpool"]["wrong"] for f in figures["hello"].values()) + figures["contests"]["execpool"]["wrong"],
        0, "<=")
    C.print_targets(targets)
    figures["targets"] = targets
    C.emit_json(figures)
    plot(args.plot, figures)
    return 0


#: The sides a plot shows: (key, label, colour).
_PLOTTED_SIDES = (("execpool", "execpool serve", "tab:blue"), ("sandbox_fusion", "SandboxFusion", "tab:red"))


def plot(path: str | None, figures: dict) -> None:
    """Per language: requests per second one after another (the same
    program each time: execpool compiles it once), and the first request's
    latency (a compile where the language compiles), side by side. A side
    that answered any request wrong has no bar there, and an x under it."""
    if path is None:  # no --plot
        return
    languages = list(figures["hello"])
    sides = [side for side in _PLOTTED_SIDES if any(side[0] in f for f in figures["hello"].values())]
    with P.figure(path, "Hello world through /run_code, per language", figures, panels=2) as axes:
        width = 0.8 / max(1, len(sides))
        for n, (side, label, colour) in enumerate(sides):
            xs = [i + (n - (len(sides) - 1) / 2) * width for i in range(len(languages))]
            answers = [figures["hello"][language].get(side) for language in languages]
            right = [bool(a) and not a["wrong"] and bool(a["median_ms"]) for a in answers]
            axes[0].bar(xs, [1000.0 / a["median_ms"] if ok else 0.0 for a, ok in zip(answers, right, strict=True)],
                        width, color=colour, label=label)
            axes[1].bar(xs, [a["first_ms"] if ok else 0.0 for a, ok in zip(answers, right, strict=True)], width,
                        color=colour, label=label)
            for ax in axes:
                for x, a, ok in zip(xs, answers, right, strict=True):
                    if a and not ok:
                        ax.annotate("x", (x, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                                    color=colour, fontweight="bold")
        for ax, title, unit in ((axes[0], "throughput, after the first request", "requests per second"),
                                (axes[1], "the first request", "ms")):
            ax.set_xticks(range(len(languages)), languages, rotation=45, ha="right")
            P.log_scales(ax, x_base=None)
            ax.set_title(title)
            ax.set_ylabel(unit)
            ax.grid(True, axis="y", which="both", alpha=0.3)
        axes[0].legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(main())
