"""How a stdin/stdout test's output is compared with the expected one.

Runs in the caller's process. Four checkers, given as a problem's
``checker`` field:

- ``"exact"`` (the default, as SandboxFusion's): equal once each line's
  trailing whitespace and the trailing blank lines are dropped;
- ``"tokens"``: equal as whitespace-separated tokens;
- ``{"type": "float", "abs": 1e-6, "rel": 1e-6}``: the same tokens, where
  a pair that are both numbers may differ by the absolute or the relative
  tolerance;
- ``{"type": "special", "language": L, "code": C}``: a judge program in
  any language of the table, run as testlib runs a checker --
  ``checker input.txt output.txt answer.txt``, the test's input, the
  sample's output, the expected one -- accepting by exit code 0 (1 and 2:
  wrong answer; anything else: the judge itself failed, Internal Error).
  execpool/eval/harness.py runs it as a CodeJob with those files.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from .verdicts import ProblemsError

#: testlib's default tolerance for floats.
DEFAULT_TOLERANCE = 1e-6

#: The file names a special judge gets, in testlib's argument order.
JUDGE_FILES = ("input.txt", "output.txt", "answer.txt")


@dataclasses.dataclass(frozen=True)
class Checker:
    kind: str  # "exact", "tokens", "float" or "special"
    abs_tol: float = DEFAULT_TOLERANCE
    rel_tol: float = DEFAULT_TOLERANCE
    language: str = ""
    code: str = ""

    def accepts(self, expected: str, actual: str) -> bool:
        """Whether ``actual`` is right (for every kind but ``special``,
        which runs a program)."""
        if self.kind == "exact":
            return _normalized(expected) == _normalized(actual)
        if self.kind == "tokens":
            return expected.split() == actual.split()
        if self.kind == "float":
            wanted, got = expected.split(), actual.split()
            return len(wanted) == len(got) and all(self._close(w, g) for w, g in zip(wanted, got, strict=True))
        raise ValueError(f"a {self.kind} checker runs a program: see execpool/eval/harness.py")

    def _close(self, wanted: str, got: str) -> bool:
        if wanted == got:
            return True
        try:
            w, g = float(wanted), float(got)
        except ValueError:
            return False
        if not (math.isfinite(w) and math.isfinite(g)):
            return w == g
        return abs(w - g) <= self.abs_tol or abs(w - g) <= self.rel_tol * abs(w)


EXACT = Checker("exact")


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().split("\n"))


def _tolerance(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number >= 0")
    return float(value)


def parse_checker(obj: object, where: str = "checker") -> Checker:
    """A checker from a problem's field (or ``--checker``'s JSON)."""
    if isinstance(obj, str):
        obj = {"type": obj}
    if not isinstance(obj, dict) or obj.get("type") not in ("exact", "tokens", "float", "special"):
        raise ProblemsError(f'{where} must be "exact", "tokens", {{"type": "float", "abs", "rel"}} or '
                            '{"type": "special", "language", "code"}')
    kind = obj["type"]
    try:
        if kind == "float":
            return Checker(kind, _tolerance(f"{where}.abs", obj.get("abs", DEFAULT_TOLERANCE)),
                           _tolerance(f"{where}.rel", obj.get("rel", DEFAULT_TOLERANCE)))
    except ValueError as exc:
        raise ProblemsError(str(exc)) from None
    if kind == "special":
        language: Optional[object] = obj.get("language", "python")
        code = obj.get("code")
        if not isinstance(language, str) or not isinstance(code, str) or not code:
            raise ProblemsError(f"{where}: a special judge needs 'language' and 'code' strings")
        return Checker(kind, language=language, code=code)
    return Checker(kind)
