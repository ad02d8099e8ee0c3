"""Verdicts, named as judges name them, and what a verdict of one test
carries.

Runs in the caller's process (execpool/eval/run.py and the fronts that
write records). A verdict is data: the sample's (Accepted, Wrong Answer,
Time Limit Exceeded, Memory Limit Exceeded, Runtime Error, Compilation
Error) or execpool's own failure (Internal Error), which is retried and
never scored as the sample's.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Optional

#: What a test cost, in every test's entry.
COST = ("time_s", "cpu_s", "memory_bytes")

#: Characters of an input, an expected or an actual output kept in a record.
SHOWN_CHARS = 1000


class ProblemsError(ValueError):
    """Problems or samples that cannot be evaluated; the message says where."""


class Verdict(str, enum.Enum):
    ACCEPTED = "Accepted"
    WRONG_ANSWER = "Wrong Answer"
    TIME_LIMIT_EXCEEDED = "Time Limit Exceeded"
    MEMORY_LIMIT_EXCEEDED = "Memory Limit Exceeded"
    RUNTIME_ERROR = "Runtime Error"
    COMPILATION_ERROR = "Compilation Error"
    #: execpool failed (a worker died, the judge could not run): not the sample's.
    INTERNAL_ERROR = "Internal Error"

    def __str__(self) -> str:
        return self.value

    @property
    def scored(self) -> bool:
        """Whether the verdict says something of the sample (pass@k counts it)."""
        return self is not Verdict.INTERNAL_ERROR


def cut(text: Optional[str], limit: int = SHOWN_CHARS) -> Optional[str]:
    """``text`` kept to ``limit`` characters, saying how long it was."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def test_entry(verdict: Verdict, **details: Any) -> Dict[str, Any]:
    """One test's part of a record: its verdict, what it cost (``time_s``,
    ``cpu_s``, ``memory_bytes``: None where not measured), and the
    ``details`` given (test, input, expected, actual, message, exit_code,
    signal), texts cut."""
    entry: Dict[str, Any] = {"verdict": verdict.value, **{key: details.pop(key, None) for key in COST}}
    entry.update({key: cut(value) if isinstance(value, str) else value
                  for key, value in details.items() if value is not None})
    return entry
