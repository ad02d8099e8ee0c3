"""``execpool eval``: samples of a model scored against problems' tests --
verdicts per test, pass@k -- on a pool (docs/batch/evaluation.md).

Runs in the caller's process (the library, the command, the service),
above the pool's public ``submit``: problems.py reads the problem formats
and the samples, harness.py turns a sample into jobs and their Results
into verdicts (verdicts.py, checkers.py), run.py schedules the jobs of
many samples and sums up (passk.py). What a function-style sample runs
as -- the judge, in a process apart from the sample's -- is the tool's:
execpool/tool/judge.py.
"""

from .harness import EvalOptions
from .passk import DEFAULT_KS, pass_at_k
from .problems import HUMANEVAL, Problem, Sample, load_problems, parse_sample, read_samples
from .run import Evaluation, evaluate, judge_samples, summarize
from .verdicts import ProblemsError, Verdict

__all__ = ["DEFAULT_KS", "HUMANEVAL", "EvalOptions", "Evaluation", "Problem", "ProblemsError", "Sample", "Verdict",
           "evaluate", "judge_samples", "load_problems", "parse_sample", "pass_at_k", "read_samples", "summarize"]
