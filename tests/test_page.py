"""The page (shared/SERVE.md §6) in a real headless Chromium: Debian's
``chromium`` driven by Playwright, against the real ``execpool serve`` in a
process of its own. Elements are found the way a person using a screen
reader finds them: by role and accessible name.

One server (guarded by a token, so every run also proves the page sends it)
and one browser serve the whole module; each test gets a fresh browser
context. Waits are on conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

import re
import shutil
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect, sync_playwright

from helpers import alive, all_dead, pids_in, remember
from test_serve import Server

CHROMIUM = shutil.which("chromium")

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")

#: How long any one thing the page shows may take to appear.
DEADLINE_MS = 20_000
#: How long a stopped job's processes may take to be gone.
TREE_DEADLINE_S = 10.0
TOKEN = "page-test-token"

#: A job whose tree is three processes deep: it prints their pids, then
#: waits on its child, which waits on its own.
TREE = """import os, subprocess
child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
print("PIDS", os.getpid(), child.pid, child.stdout.readline().strip(), flush=True)
print("ready", flush=True)
child.wait()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("page") / "token"
    token_file.write_text(TOKEN + "\n")
    s = Server("--workers", "2", "--max-in-flight", "4", "--heartbeat", "0.05", "--token-file", str(token_file))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def browser(server):
    """Closed (and Playwright's driver with it) before the server stops."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            yield browser
        finally:
            browser.close()


class Ui:
    """The page as its accessible names describe it, and every request it made."""

    def __init__(self, page, url: str) -> None:
        self.page = page
        self.requests: list[str] = []
        self.console: list[str] = []
        page.on("request", lambda request: self.requests.append(request.url))
        page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        page.goto(url)
        self.code = page.get_by_role("textbox", name="Code", exact=True)
        self.language = page.get_by_role("combobox", name="Language", exact=True)
        self.timeout = page.get_by_role("spinbutton", name="Timeout", exact=True)
        self.token = page.get_by_label("Token", exact=True)  # a password box has no role
        self.run_button = page.get_by_role("button", name="Run", exact=True)
        self.stop_button = page.get_by_role("button", name="Stop", exact=True)
        self.output = page.get_by_role("log", name="Output", exact=True)
        self.status = page.get_by_role("status", name="Status", exact=True)

    def run(self, code: str, language: str = "Python", timeout: str = "") -> None:
        self.code.fill(code)
        self.language.select_option(label=language)
        self.timeout.fill(timeout)
        self.run_button.click()

    def expect_status(self, text: str) -> None:
        expect(self.status).to_have_text(text, timeout=DEADLINE_MS)

    def expect_output(self, text) -> None:
        expect(self.output).to_contain_text(text, timeout=DEADLINE_MS)

    def start_tree(self, doomed: list) -> list[int]:
        """Runs TREE; its pids once all three processes are up."""
        self.run(TREE, timeout="600")
        self.expect_output("ready")
        pids = pids_in(self.output.inner_text())
        remember(doomed, pids)
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        self.expect_status("running")
        return pids


@pytest.fixture
def ui(browser, server):
    context = browser.new_context()
    try:
        ui = Ui(context.new_page(), server.url)
        ui.token.fill(TOKEN)
        yield ui
    finally:
        context.close()


def test_python_output_exit_0_and_duration(ui):
    ui.run("print('hello from python')\nprint(6 * 7)")
    ui.expect_status("exit 0")
    ui.expect_output("hello from python\n42")
    assert ui.page.get_by_text(re.compile(r"^in \d+\.\d\d s$")).is_visible()


def test_a_nonzero_exit_shows_its_code(ui):
    ui.run("import sys\nprint('about to fail')\nsys.exit(3)")
    ui.expect_status("exit 3")
    ui.expect_output("about to fail")


def test_bash_runs_and_ctrl_enter_starts_it(ui):
    ui.language.select_option(label="Bash")
    ui.code.fill('echo "bash ${BASH_VERSION:+yes}"; echo to-stderr >&2')
    ui.code.press("Control+Enter")
    ui.expect_status("exit 0")
    ui.expect_output("bash yes\nto-stderr")


def test_output_shows_while_the_job_runs(ui, tmp_path):
    gate = tmp_path / "gate"
    ui.run(f"import os, time\nprint('first', flush=True)\nwhile not os.path.exists({str(gate)!r}):\n"
           "    time.sleep(0.01)\nprint('second')")
    ui.expect_output("first")
    ui.expect_status("running")
    expect(ui.run_button).to_be_disabled()
    assert "second" not in ui.output.inner_text()
    gate.touch()  # the job could not end before its first line was on the page
    ui.expect_status("exit 0")
    ui.expect_output("first\nsecond")
    expect(ui.run_button).to_be_enabled()


def test_a_timeout_shows_timeout_and_the_output_before_it(ui):
    ui.run("import time\nprint('before', flush=True)\ntime.sleep(30)", timeout="0.5")
    ui.expect_status("timeout")
    ui.expect_output("before")
    ui.expect_output("timed out after 0.5 seconds")


@pytest.mark.parametrize("how", ["Stop button", "Escape key"])
def test_stop_shows_cancelled_and_kills_the_whole_tree(ui, doomed, how):
    pids = ui.start_tree(doomed)
    if how == "Stop button":
        ui.stop_button.click()
    else:
        ui.code.press("Escape")
    ui.expect_status("cancelled")
    assert all_dead(pids, TREE_DEADLINE_S), "the job's tree outlived Stop"


def test_closing_the_page_kills_the_whole_tree(ui, doomed):
    pids = ui.start_tree(doomed)
    ui.page.close()
    assert all_dead(pids, TREE_DEADLINE_S), "the job's tree outlived its page"


def test_a_400_answer_shows_its_detail_and_error(ui):
    ui.run("print('never')", timeout="1000000")
    ui.expect_status("error")
    ui.expect_output(re.compile(r"HTTP 400: .*timeout.*limit"))


def test_without_the_token_the_page_shows_401_and_nothing_runs(ui, tmp_path):
    marker = tmp_path / "ran"
    ui.token.fill("")
    ui.run(f"open({str(marker)!r}, 'w').close()")
    ui.expect_status("error")
    ui.expect_output("HTTP 401")
    assert not marker.exists()
    ui.token.fill(TOKEN)  # the same code, with the token, does run
    ui.run_button.click()
    ui.expect_status("exit 0")
    assert marker.exists()


def test_tool_output_is_text_not_html(ui):
    hostile = '<img src=x onerror="document.title=\'pwned\'"><b>bold</b><script>document.title="pwned"</script>'
    ui.run(f"print({hostile!r})")
    ui.expect_status("exit 0")
    ui.expect_output(hostile)
    assert ui.output.locator("img, b, script").count() == 0
    assert ui.page.get_by_role("img").count() == 0
    assert ui.page.title() == "execpool"


def test_the_page_loads_nothing_from_elsewhere(ui, server):
    ui.run("print('ok')")
    ui.expect_status("exit 0")
    origin = urlsplit(server.url)
    elsewhere = [url for url in ui.requests if urlsplit(url)[:2] != origin[:2]]
    assert ui.requests and not elsewhere, elsewhere
    assert not [line for line in ui.console if "Content Security Policy" in line], ui.console
