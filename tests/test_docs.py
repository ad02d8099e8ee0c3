"""The documentation site: it builds with ``mkdocs build --strict`` (no
broken link, anchor or reference), loads nothing from other sites, names
only metrics the service has, and every example it marks runnable prints
what the page says it prints.

A runnable example is a fenced block whose attributes hold ``.runnable``
(```` ```{.python .runnable} ```` or ```` ```{.sh .runnable} ````), followed by
a fenced block marked ``.output``: what the example must print on stdout,
exactly, except that ``...`` in a line stands for any text of that line
and a line that is only ``...`` for any lines, none included.
Each runs in a fresh directory holding a copy of ``examples/``: Python with
this interpreter, shell with ``bash -eu`` and this interpreter's ``bin``
first on ``PATH`` (docs/index.md, "Runnable examples", says the same).
"""

from __future__ import annotations

import html.parser
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest


ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLE_TIMEOUT_S = 120
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?:\{(?P<attrs>[^}]*)\}|(?P<lang>[\w+-]*))\s*$")


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str
    expected: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(text: str):
    """(line, classes, body) of each fenced block of a Markdown page."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, start = opening["fence"], i
        classes = [word[1:] for word in (opening["attrs"] or "").split() if word.startswith(".")]
        if opening["lang"]:
            classes = [opening["lang"]]
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        yield start + 1, classes, "\n".join(body)
        i += 1


def _examples() -> List[Example]:
    found = []
    for path in sorted(DOCS.rglob("*.md")):
        blocks = list(_blocks(path.read_text()))
        for n, (line, classes, body) in enumerate(blocks):
            if "runnable" not in classes:
                continue
            page = str(path.relative_to(DOCS))
            following = blocks[n + 1] if n + 1 < len(blocks) else None
            if following is None or "output" not in following[1]:
                raise AssertionError(f"{page}:{line}: a runnable example needs an .output block after it")
            found.append(Example(page, line, classes[0], body, following[2]))
    return found


EXAMPLES = _examples()


def matches(expected: str, printed: str) -> bool:
    """Whether ``printed`` is ``expected``, where ``...`` in a line stands
    for any text of that line and a line that is only ``...`` for any
    lines, none included; trailing newlines aside."""
    pattern = ""
    for line in expected.rstrip("\n").split("\n"):
        if line == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += "[^\n]*?".join(re.escape(part) for part in line.split("...")) + "\n"
    return re.fullmatch(pattern, printed.rstrip("\n") + "\n") is not None


def test_matching_is_exact_but_for_the_ellipsis():
    assert matches("a 1\nb", "a 1\nb\n")
    assert not matches("a 1\nb", "a 1\nbc")
    assert matches('{"id": 1, ...}', '{"id": 1, "x": [2]}')
    assert not matches('{"id": 1, ...}', '{"id": 2, "x": [2]}')
    assert matches("start\n...\nend", "start\nend")
    assert matches("start\n...\nend", "start\na\nb\nend")
    assert not matches("start ... end", "start a\nb end")


def test_the_pages_have_runnable_examples_of_both_kinds():
    assert {example.language for example in EXAMPLES} >= {"python", "sh"}
    assert len({example.page for example in EXAMPLES}) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_a_runnable_example_prints_what_its_page_says(example: Example, tmp_path: Path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    if example.language == "python":
        command = [sys.executable, "-c", example.code]
    else:
        assert example.language in ("sh", "bash"), f"{example}: no runner for {example.language}"
        command = ["bash", "-eu", "-c", example.code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=EXAMPLE_TIMEOUT_S)
    assert done.returncode == 0, f"{example} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert matches(example.expected, done.stdout), (
        f"{example} printed:\n{done.stdout}\nwhere its page says:\n{example.expected}\n(stderr: {done.stderr})")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out),
                           "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_the_site_builds_strict_with_every_part(site: Path):
    for page in ("index.html", "api/index.html", "service/reference/index.html", "service/openapi/index.html",
                 "service/openapi.json", "operating/index.html", "design/index.html", "benchmarks/index.html"):
        assert (site / page).is_file(), page
    api = (site / "api/index.html").read_text()
    for name in ("ExecPool", "submit", "PythonJob", "Result", "Status", "JobOutput", "Session", "RayPool"):
        assert f">{name}<" in api or f"<code>{name}</code>" in api or f'id="{name}' in api, name


class _Fetched(html.parser.HTMLParser):
    """What a page makes a browser fetch: scripts, style sheets, fonts, images."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: List[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("script", "img", "iframe", "source") and attrs.get("src"):
            self.urls.append(attrs["src"])
        if tag == "link" and attrs.get("href") and attrs.get("rel") not in ("canonical", "alternate"):
            self.urls.append(attrs["href"])


@pytest.mark.slow
def test_the_site_fetches_nothing_from_other_sites(site: Path):
    remote = re.compile(r"^(https?:)?//", re.I)
    fetched = []
    for page in site.rglob("*.html"):
        parser = _Fetched()
        parser.feed(page.read_text())
        fetched += [f"{page.relative_to(site)}: {url}" for url in parser.urls if remote.match(url)]
    for sheet in site.rglob("*.css"):
        text = sheet.read_text()
        fetched += [f"{sheet.relative_to(site)}: {url}" for url in
                    re.findall(r"(?:@import\s+|url\()\s*['\"]?((?:https?:)?//[^'\")\s]+)", text)]
    assert not fetched, fetched


@pytest.mark.slow
def test_every_metric_the_pages_name_is_one_the_service_has(site: Path):
    reference = (site / "service/reference/index.html").read_text()
    exposed = set(re.findall(r"<code>(execpool_\w+)</code></td>", reference))
    assert "execpool_jobs_total" in exposed
    named = set()
    for path in DOCS.rglob("*.md"):
        named |= set(re.findall(r"\bexecpool_[a-z_]+\b", path.read_text()))
    unknown = {name for name in named if re.sub(r"_(bucket|sum|count)$", "", name) not in exposed}
    assert not unknown, f"the pages name metrics /metrics does not have: {sorted(unknown)}"
