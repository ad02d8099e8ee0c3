"""The page (shared/SERVE.md §6) in a real headless Chromium: Debian's
``chromium`` driven by Playwright, against the real ``execpool serve`` in a
process of its own. Elements are found the way a person using a screen
reader finds them: by role and accessible name.

One server (guarded by a token, so every run also proves the page sends it)
and one browser serve the whole module; each test gets a fresh browser
context. Waits are on conditions with deadlines, never fixed sleeps; a job that
must hold still until the test has looked waits on a file the test creates.

Under ``CI=true`` a missing browser fails the module instead of skipping
it: CI installs chromium, so its absence there is a broken setup.
A run saves a screenshot of the page after a job to ``artifacts/page.png``
(or the folder ``EXECPOOL_ARTIFACTS`` names) for a person to look at."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect, sync_playwright

from execpool.shared.output import STREAM_CAP_NOTICE, TOOL_OUTPUT_STREAM_MAX_CHARS
from tests.support.helpers import REPO, alive, all_dead, pids_in, remember, wait_for
from tests.support.hostile import SETSID_DAEMON
from tests.support.servers import Server

CHROMIUM = shutil.which("chromium")
NO_CHROMIUM = "Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)"
IN_CI = os.environ.get("CI") == "true"

pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None and not IN_CI, reason=NO_CHROMIUM)]

#: Nothing the browser is asked for may leave the machine: every host name
#: but the loopback ones fails to resolve. Root (as in CI containers) needs
#: --no-sandbox.
CHROMIUM_ARGS = ["--no-sandbox", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"]

#: How long any one thing the page shows may take to appear.
DEADLINE_MS = 20_000
#: How long the page may take to list the languages of a fresh server.
LANGUAGES_DEADLINE_MS = 120_000
#: How long a stopped job's processes may take to be gone.
TREE_DEADLINE_S = 10.0
TOKEN = "page-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: How long a session the page closed may take to leave the server's list.
SESSION_DEADLINE_S = 10.0

#: The longest the page may stay busy while a flood comes in (a browser
#: "long task"), and the longest it may take to answer the test. Measured
#: here: about 0.1 s with output put on the page once a frame; from 0.15 to
#: 2 s, run to run, when each event is laid out as it comes (chunks that
#: arrive together are read in one task). Loose, for a machine other work
#: shares: it catches a page that freezes, not every slower one.
RESPONSIVE_MS = 1_000
#: A flood of 5 MB (ASCII) in lines of 64 characters, each flushed on its
#: own, so the server streams it in many events.
FLOOD_CHARS, FLOOD_LINES = 5_000_000, 78_125
FLOOD = f"for _ in range({FLOOD_LINES}):\n    print('flood ' + 'x' * 57, flush=True)\n"

#: A job whose tree is three processes deep, plus a daemon that left the
#: job's session (tests/support/hostile.py): it prints all four pids, then waits on
#: its child, which waits on its own.
TREE = SETSID_DAEMON + """import os, subprocess
child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
print("PIDS", os.getpid(), child.pid, child.stdout.readline().strip(), flush=True)
print("ready", flush=True)
child.wait()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("page") / "token"
    token_file.write_text(TOKEN + "\n")
    # Off: a test shows that nothing ran by a mark a job would leave outside its directory.
    s = Server("--workers", "2", "--max-in-flight", "4", "--heartbeat", "0.05", "--token-file", str(token_file),
               "--sandbox", "off")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def browser(server):
    """Closed (and Playwright's driver with it) before the server stops."""
    if CHROMIUM is None:  # only under CI=true: elsewhere the module is skipped
        pytest.fail(f"{NO_CHROMIUM}; CI=true, so the page tests fail", pytrace=False)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
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
        self.keep_state = page.get_by_role("checkbox", name="Keep state", exact=True)

    def run(self, code: str, language: str = "Python", timeout: str = "") -> None:
        self.code.fill(code)
        self.language.select_option(label=language)
        self.timeout.fill(timeout)
        self.run_button.click()

    def expect_status(self, text: str) -> None:
        expect(self.status).to_have_text(text, timeout=DEADLINE_MS)

    def expect_output(self, text) -> None:
        expect(self.output).to_contain_text(text, timeout=DEADLINE_MS)

    def text(self) -> str:
        """The output exactly as the page holds it."""
        return self.output.text_content()

    def output_js(self, body: str):
        """Runs ``body`` in the page with ``o``, the output element; it may
        await. Answers once the page has drawn a frame after it, so the
        page has seen any scroll it made."""
        return self.page.evaluate(f"""async () => {{
            const o = document.getElementById("output");
            const answer = await (async () => {{ {body} }})();
            await new Promise((drawn) => requestAnimationFrame(() => requestAnimationFrame(drawn)));
            return answer;
        }}""")

    def below_view(self) -> float:
        """How far the output extends below what its box shows, in pixels."""
        return self.output_js("return o.scrollHeight - o.scrollTop - o.clientHeight;")

    def start_tree(self, doomed: list) -> list[int]:
        """Runs TREE; its pids once all four processes are up."""
        self.run(TREE, timeout="600")
        self.expect_output("ready")
        pids = pids_in(self.text())
        remember(doomed, pids)
        assert len(pids) == 4 and all(alive(pid) for pid in pids)
        daemon, job = pids[:2]
        assert os.getsid(daemon) != os.getsid(job), "the daemon did not leave the job's session"
        self.expect_status("running")
        return pids


def gated(gates: Path, body: str) -> str:
    """Python code ``body`` that can call ``wait(name)``: it returns once the
    test has created the file ``gates/name``."""
    return (f"import os, time\ndef wait(name):\n    while not os.path.exists(os.path.join({str(gates)!r}, name)):\n"
            f"        time.sleep(0.005)\n{body}")


def artifact(name: str) -> Path:
    """Where the run keeps a file for people to look at: never committed."""
    folder = Path(os.environ.get("EXECPOOL_ARTIFACTS") or Path(REPO) / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.fixture
def ui(browser, server):
    context = browser.new_context()
    try:
        ui = Ui(context.new_page(), server.url)
        ui.token.fill(TOKEN)
        yield ui
    finally:
        context.close()


def test_python_output_exit_0_and_duration_and_a_screenshot(ui):
    ui.run("print('hello from python')\nprint(6 * 7)\nfor n in range(1, 4):\n    print(f'line {n} of 3')")
    ui.expect_status("exit 0")
    ui.expect_output("hello from python\n42\nline 1 of 3")
    assert ui.page.get_by_text(re.compile(r"^in \d+\.\d\d s$")).is_visible()
    shot = artifact("page.png")
    ui.page.screenshot(path=shot, full_page=True)
    assert shot.read_bytes().startswith(b"\x89PNG"), shot


@pytest.mark.slow
def test_a_nonzero_exit_shows_its_code(ui):
    ui.run("import sys\nprint('about to fail')\nsys.exit(3)")
    ui.expect_status("exit 3")
    ui.expect_output("about to fail")


@pytest.mark.slow
def test_bash_runs_and_ctrl_enter_starts_it(ui):
    ui.language.select_option(label="Bash")
    ui.code.fill('echo "bash ${BASH_VERSION:+yes}"; echo to-stderr >&2')
    ui.code.press("Control+Enter")
    ui.expect_status("exit 0")
    ui.expect_output("bash yes\nto-stderr")


@pytest.mark.slow
def test_a_compiled_language_from_the_menu_runs_and_its_compile_error_shows(ui):
    ui.token.blur()  # the server asks for a token: the page lists its languages once it has one
    # A fresh server asks every toolchain its version first (javac, scalac,
    # kotlinc...): at a load of 15 on two CPUs that took over 30 s.
    expect(ui.language.locator('option[value="cpp"]')).to_have_count(1, timeout=LANGUAGES_DEADLINE_MS)
    ui.run('#include <cstdio>\nint main() { std::puts("from c++"); return 4; }', language="cpp")
    ui.expect_status("exit 4")
    ui.expect_output("from c++")
    ui.run("int main() { nope(); }", language="cpp")
    ui.expect_status("exit 1")
    ui.expect_output("Compilation failed (exit code 1):")
    ui.expect_output("nope")


@pytest.mark.slow
def test_output_shows_while_the_job_runs(ui, tmp_path):
    ui.run(gated(tmp_path, "print('first', flush=True)\nwait('gate')\nprint('second')"))
    ui.expect_output("first")
    ui.expect_status("running")
    expect(ui.run_button).to_be_disabled()
    assert "second" not in ui.text()
    (tmp_path / "gate").touch()  # the job could not end before its first line was on the page
    ui.expect_status("exit 0")
    ui.expect_output("first\nsecond")
    expect(ui.run_button).to_be_enabled()


@pytest.mark.slow
def test_the_log_follows_the_newest_line_unless_scrolled_up(ui, tmp_path):
    burst = "def burst(name):\n    print('\\n'.join(f'{name} {i}' for i in range(100)), flush=True)\n"
    ui.run(gated(tmp_path, f"{burst}burst('first')\nwait('a')\nburst('second')\nwait('b')\nburst('third')"))
    ui.expect_output("first 99")
    assert ui.output_js("return o.scrollHeight > 2 * o.clientHeight;"), "the output does not overflow its box"
    assert ui.below_view() < 2, "the log did not follow the output"

    up = ui.output_js("o.scrollTop = 50; return o.scrollTop;")
    assert up == 50
    (tmp_path / "a").touch()
    ui.expect_output("second 99")
    assert ui.output_js("return o.scrollTop;") == up, "the log scrolled away from where the person put it"
    assert ui.below_view() > 100

    ui.output_js("o.scrollTop = o.scrollHeight;")  # back at the bottom: following again
    (tmp_path / "b").touch()
    ui.expect_output("third 99")
    assert ui.below_view() < 2, "the log did not follow the output again"
    ui.expect_status("exit 0")


@pytest.mark.slow
def test_a_syntax_error_shows_the_error_and_exit_1(ui):
    ui.run("print('never printed')\ndef broken(:\n    pass")
    ui.expect_status("exit 1")
    ui.expect_output(re.compile(r'File ".+", line 2\n\s*def broken\(:\n\s*\^\nSyntaxError: '))
    assert "never printed" not in ui.text()


@pytest.mark.parametrize("language, code", [
    ("Python", 'print("héllo ✓ 日本語 🙂")'),
    ("Bash", "printf '%s\\n' 'héllo ✓ 日本語 🙂'"),
], ids=["Python", "Bash"])
@pytest.mark.slow
def test_unicode_output_shows_exactly(ui, language, code):
    ui.run(code, language)
    ui.expect_status("exit 0")
    assert ui.text() == "héllo ✓ 日本語 🙂\n"


@pytest.mark.slow
def test_a_5_mb_flood_keeps_the_page_responsive_and_shows_the_cap(ui, tmp_path):
    ui.page.evaluate("""() => {
        window.longestTaskMs = 0;
        new PerformanceObserver((list) => {
            for (const task of list.getEntries()) window.longestTaskMs = Math.max(window.longestTaskMs, task.duration);
        }).observe({ type: "longtask" });
    }""")
    ui.run(gated(tmp_path, FLOOD + "wait('end')"), timeout="60")
    ui.expect_output(STREAM_CAP_NOTICE.strip())  # while the job still runs
    ui.expect_status("running")
    started = time.monotonic()
    shown = ui.output_js("return o.textContent.length;")
    answered_ms = (time.monotonic() - started) * 1000
    assert shown == TOOL_OUTPUT_STREAM_MAX_CHARS + len(STREAM_CAP_NOTICE)  # all that was streamed, and no more
    assert answered_ms < RESPONSIVE_MS
    (tmp_path / "end").touch()
    ui.expect_status("exit 0")
    ui.expect_output(f"The job printed {FLOOD_CHARS:,} characters in all.")
    assert ui.page.evaluate("window.longestTaskMs") < RESPONSIVE_MS

    # Run and Stop still answer: the next job replaces the flood.
    ui.run("import time\nprint('after the flood', flush=True)\ntime.sleep(60)")
    ui.expect_output("after the flood")
    ui.stop_button.click()
    ui.expect_status("cancelled")
    assert "flood x" not in ui.text()


@pytest.mark.slow
def test_a_timeout_shows_timeout_and_the_output_before_it(ui):
    ui.run("import time\nprint('before', flush=True)\ntime.sleep(30)", timeout="0.5")
    ui.expect_status("timeout")
    ui.expect_output("before")
    ui.expect_output("timed out after 0.5 seconds")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["Stop button", "Escape key"])
def test_stop_shows_cancelled_and_kills_the_whole_tree(ui, doomed, how):
    pids = ui.start_tree(doomed)
    if how == "Stop button":
        ui.stop_button.click()
    else:
        ui.code.press("Escape")
    ui.expect_status("cancelled")
    assert all_dead(pids, TREE_DEADLINE_S), "the job's tree outlived Stop"


@pytest.mark.slow
def test_closing_the_page_kills_the_whole_tree(ui, doomed):
    pids = ui.start_tree(doomed)
    ui.page.close()
    assert all_dead(pids, TREE_DEADLINE_S), "the job's tree outlived its page"


@pytest.mark.slow
def test_a_400_answer_shows_its_detail_and_error(ui):
    ui.run("print('never')", timeout="1000000")
    ui.expect_status("error")
    ui.expect_output(re.compile(r"HTTP 400: .*timeout.*limit"))


@pytest.mark.slow
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


@pytest.mark.slow
def test_tool_output_is_text_not_html(ui):
    hostile = '<img src=x onerror="document.title=\'pwned\'"><b>bold</b><script>document.title="pwned"</script>'
    ui.run(f"print({hostile!r})")
    ui.expect_status("exit 0")
    ui.expect_output(hostile)
    assert ui.output.locator("img, b, script").count() == 0
    assert ui.page.get_by_role("img").count() == 0
    assert ui.page.title() == "execpool"


@pytest.mark.slow
def test_the_page_loads_nothing_from_elsewhere(ui, server):
    ui.run("print('ok')")
    ui.expect_status("exit 0")
    origin = urlsplit(server.url)
    elsewhere = [url for url in ui.requests if urlsplit(url)[:2] != origin[:2]]
    assert ui.requests and not elsewhere, elsewhere
    assert not [line for line in ui.console if "Content Security Policy" in line], ui.console


# -- "Keep state": cells of one session (shared/SERVE.md §8) ------------------------------------


@pytest.fixture
def sessions(server):
    """The server's open sessions, as ``GET /v1/sessions`` lists them. None
    at the start: a session an earlier test's page closed may take a moment
    to go."""
    def listed() -> list[dict]:
        answer = server.client.get("/v1/sessions", headers=AUTH)
        assert answer.status_code == 200, answer.text
        return answer.json()

    assert wait_for(lambda: not listed(), SESSION_DEADLINE_S), listed()
    return listed


@pytest.mark.slow
def test_the_controls_stay_put_as_languages_arrive(ui):
    """The menu grew with each language listed, moving the switch beside it:
    a click made as a listing came in (a loaded machine) landed where the
    switch had been, and Keep state stayed off."""
    before = ui.keep_state.bounding_box()
    ui.page.evaluate("""() => {
        const option = document.createElement("option");
        option.value = option.textContent = "a_language_with_a_long_name";
        document.getElementById("language").appendChild(option);
    }""")
    assert ui.keep_state.bounding_box() == before


@pytest.mark.slow
def test_keep_state_runs_python_cells_in_one_session_and_off_runs_jobs(ui, sessions):
    expect(ui.keep_state).not_to_be_checked()
    ui.keep_state.check()
    ui.run("x = 41")
    ui.expect_status("exit 0")
    [session] = sessions()
    assert session["language"] == "python"
    ui.run("x + 1")  # the last expression's value, as a notebook shows it
    ui.expect_output("42")
    ui.expect_status("exit 0")
    assert ui.text() == "42\n"
    ui.run("print('printed')\n'<b>value</b>'")
    ui.expect_status("exit 0")
    assert ui.text() == "printed\n'<b>value</b>'\n"
    assert ui.output.locator("b").count() == 0
    assert [s["id"] for s in sessions()] == [session["id"]]

    ui.keep_state.uncheck()  # closes the session; Run is a job again
    assert wait_for(lambda: not sessions(), SESSION_DEADLINE_S), sessions()
    ui.run("print(x)")
    ui.expect_status("exit 1")
    ui.expect_output("NameError: name 'x' is not defined")
    assert not sessions()


@pytest.mark.slow
def test_a_python_cell_that_raises_shows_its_traceback_and_error(ui, sessions):
    ui.keep_state.check()
    ui.run("print('before')\n1 / 0")
    ui.expect_status("error")
    # The session speaks IPython (tests/tool/test_jupyter.py): its traceback, as a notebook shows it.
    ui.expect_output(re.compile(r"^before\n-+\nZeroDivisionError +Traceback \(most recent call last\)\n(.|\n)*"
                                r"ZeroDivisionError: division by zero\n$"))
    ui.run("'still here'")  # an error leaves the session as it was
    ui.expect_output("'still here'")
    ui.expect_status("exit 0")
    assert len(sessions()) == 1


@pytest.mark.slow
def test_a_python_cell_s_figures_and_displays_show_in_a_notebook_s_order(ui, sessions):
    ui.keep_state.check()
    ui.run("import matplotlib.pyplot as plt\nfrom IPython.display import display\ndisplay('shown first')\n"
           "fig = plt.figure()\nplt.plot([1, 3, 2])\nfig")
    ui.expect_status("exit 0")
    # The displays, the value (the figure) and the figure left open, shown at the cell's end.
    images = ui.output.get_by_role("img", name="<Figure size 640x480 with 1 Axes>", exact=True)
    expect(images).to_have_count(2, timeout=DEADLINE_MS)
    assert ui.text().startswith("'shown first'\n")
    assert all(src.startswith("data:image/png;base64,iVBOR") for src in
               (images.nth(0).get_attribute("src"), images.nth(1).get_attribute("src")))
    assert images.nth(0).evaluate("image => image.naturalWidth") > 0  # drawn: the page's policy lets it


@pytest.mark.slow
def test_keep_state_keeps_a_bash_sessions_directory_and_environment(ui, sessions):
    ui.keep_state.check()
    ui.run("cd /tmp && export A=1", language="Bash")
    ui.expect_status("exit 0")
    [session] = sessions()
    assert session["language"] == "bash"
    ui.run("pwd; echo $A", language="Bash")
    ui.expect_output("/tmp\n1\n")
    ui.expect_status("exit 0")
    ui.run("(exit 3)", language="Bash")
    ui.expect_status("exit 3")
    ui.run("exit 5", language="Bash")  # the session's shell itself ends: the page forgets it
    ui.expect_status("exit 5")
    ui.expect_output("The next Run opens a new session.")
    ui.run("echo \"${A:-unset} $PWD\"", language="Bash")
    ui.expect_output("unset ")
    ui.expect_status("exit 0")
    assert ui.text() != "unset /tmp\n"  # the new shell starts in its own directory
    [again] = sessions()
    assert again["id"] != session["id"]


@pytest.mark.slow
def test_stop_interrupts_a_cell_and_the_session_lives_on(ui, sessions):
    ui.keep_state.check()
    ui.run("x = 41")
    ui.expect_status("exit 0")
    [session] = sessions()
    ui.run("import time\nprint('looping', flush=True)\nwhile True: time.sleep(0.01)")
    ui.expect_output("looping")
    ui.expect_status("running")
    ui.stop_button.click()
    ui.expect_status("cancelled")
    ui.run("x + 1")
    ui.expect_output("42")
    ui.expect_status("exit 0")
    assert [s["id"] for s in sessions()] == [session["id"]]


@pytest.mark.slow
def test_a_cell_past_its_timeout_shows_timeout_and_the_session_lives_on(ui, sessions):
    ui.keep_state.check()
    ui.run("x = 41\nimport time\nprint('before', flush=True)\ntime.sleep(30)", timeout="0.5")
    ui.expect_status("timeout")
    ui.expect_output("before")
    ui.expect_output("timed out after 0.5 seconds")
    ui.run("x + 1", timeout="5")
    ui.expect_output("42")
    ui.expect_status("exit 0")
    assert len(sessions()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("how", ["switch off", "page closed", "another language"])
def test_the_page_closes_its_session(ui, sessions, how):
    ui.keep_state.check()
    ui.run("x = 1")
    ui.expect_status("exit 0")
    assert len(sessions()) == 1
    if how == "switch off":
        ui.keep_state.uncheck()
    elif how == "page closed":
        ui.page.close()
    else:
        ui.language.select_option(label="Bash")
    assert wait_for(lambda: not sessions(), SESSION_DEADLINE_S), sessions()
    if how == "another language":  # the next Run opens one in the language now chosen
        ui.run("echo $x", language="Bash")
        ui.expect_status("exit 0")
        assert [s["language"] for s in sessions()] == ["bash"]


@pytest.mark.slow
def test_a_session_gone_behind_the_pages_back_is_opened_again(ui, sessions, server):
    ui.keep_state.check()
    ui.run("x = 1")
    ui.expect_status("exit 0")
    [first] = sessions()
    assert server.client.delete(f"/v1/sessions/{first['id']}", headers=AUTH).status_code == 204
    ui.run("print('again')\nx")  # 404: a new session, and the cell runs in it
    ui.expect_status("error")
    ui.expect_output(re.compile(r"^again\n-+\nNameError +Traceback(.|\n)*NameError: name 'x' is not defined\n$"))
    [second] = sessions()
    assert second["id"] != first["id"]


@pytest.mark.slow
def test_keep_state_is_off_for_languages_without_sessions(ui, sessions):
    ui.token.blur()  # the server asks for a token: the page lists its languages once it has one
    ui.keep_state.check()
    ui.language.select_option(label="cpp")
    expect(ui.keep_state).to_be_disabled()
    ui.run('#include <cstdio>\nint main() { std::puts("a job"); }', language="cpp")
    ui.expect_status("exit 0")
    ui.expect_output("a job")
    assert not sessions()
    ui.language.select_option(label="Python")
    expect(ui.keep_state).to_be_enabled()
    expect(ui.keep_state).to_be_checked()
