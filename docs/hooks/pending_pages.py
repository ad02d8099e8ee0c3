"""MkDocs hook: the nav names pages that other branches bring (the service
on a Ray cluster, evaluating at scale, Jupyter sessions). Until one is
merged it is left out of the nav, so that the site has no link to a page it
lacks; any other page the nav names and ``docs/`` lacks still fails
``mkdocs build --strict``. Delete a name here once its page is merged."""

from __future__ import annotations

import os
from typing import Any, List

PENDING = {"service-on-ray.md", "eval.md", "jupyter.md"}


def on_config(config: Any) -> Any:
    config["nav"] = _present(config["nav"], config["docs_dir"])
    return config


def _present(nav: List[Any], docs_dir: str) -> List[Any]:
    kept = []
    for item in nav:
        (title, target), = item.items() if isinstance(item, dict) else ((None, item),)
        if isinstance(target, list):
            target = _present(target, docs_dir)
        elif target in PENDING and not os.path.exists(os.path.join(docs_dir, target)):
            continue
        kept.append(target if title is None else {title: target})
    return kept
