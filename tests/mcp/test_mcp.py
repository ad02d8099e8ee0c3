"""``execpool mcp`` and ``/mcp``: the code tools as an MCP server, driven by
the official SDK's own client -- over stdio to a real ``execpool mcp``
process, and over Streamable HTTP to a real ``execpool serve``."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import threading
from typing import Any, AsyncIterator, Callable, List, Union

import anyio
import httpx
import httpx2
import psutil
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from execpool.mcp.stdio import LINE_LIMIT
from execpool.tools import MAX_OUTPUT_CHARS
from tests.support.helpers import REPO, Gates, all_dead, pids_in, remember, wait_for
from tests.support.hostile import SETSID_DAEMON
from tests.support.servers import DEADLINE_S, Server, metric, raw, read_all, sessionless_call

TOKEN = "mcp-test-token"

#: A call that announces the pids of its tree (one a setsid daemon), then
#: waits to be cancelled; and the same as a bash command.
DAEMON_THEN_WAIT = SETSID_DAEMON + "print('PIDS', os.getpid(), flush=True)\ntime.sleep(100)\n"
BASH_DAEMON_THEN_WAIT = f"python3 -c {shlex.quote(DAEMON_THEN_WAIT)}"


def run(main: Callable[[], Any]) -> Any:
    """An async test body, with a deadline: a hang is a failure, not a stall."""
    async def bounded() -> Any:
        with anyio.fail_after(DEADLINE_S * 2):
            return await main()
    return anyio.run(bounded)


@contextlib.asynccontextmanager
async def stdio(*args: str, env: dict | None = None) -> AsyncIterator[ClientSession]:
    """A real ``execpool mcp`` on the other end of the SDK's stdio client."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "execpool", "mcp", "--workers", "2", *args],
                                   cwd=REPO, env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def http(server: Server, token: str = TOKEN) -> AsyncIterator[ClientSession]:
    client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=DEADLINE_S)
    async with client, streamable_http_client(server.url + "/mcp", http_client=client) as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            await session.initialize()
            yield session


def text(result: Any) -> str:
    return result.content[0].text


class Printed:
    """A call's progress notifications, and a way to wait until what they
    say so far is enough. The SDK's client runs each progress callback as a
    task of its own, so they may run out of order, and after the call's
    result: the server's ``progress`` (the characters sent so far) orders
    the messages again."""

    def __init__(self) -> None:
        self.received: List[tuple] = []
        self._changed = anyio.Event()

    async def __call__(self, progress: float, total: Any, message: Any) -> None:
        self.received.append((progress, message))
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def text(self) -> str:
        return "".join(message for _, message in sorted(self.received))

    async def until(self, ready: Union[str, Callable[[str], bool]]) -> None:
        while not (ready in self.text if isinstance(ready, str) else ready(self.text)):
            await self._changed.wait()

    async def pids(self, count: int) -> list:
        await self.until(lambda printed: len(pids_in(printed)) >= count)
        return pids_in(self.text)


@pytest.fixture(scope="module")
def server():
    s = Server("--workers", "2", "--max-in-flight", "8", env={"EXECPOOL_TOKEN": TOKEN})
    s.client.headers["Authorization"] = f"Bearer {TOKEN}"
    yield s
    assert s.stop() == 0


# -- stdio ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stdio_lists_the_tools_with_their_schemas_and_runs_each(tmp_path):
    async def main() -> None:
        async with stdio() as s:
            tools = {tool.name: tool for tool in (await s.list_tools()).tools}
            assert set(tools) == {"python", "bash", "run_code", "reset"}
            assert tools["python"].input_schema["required"] == ["code"]
            assert tools["bash"].input_schema["required"] == ["command"]
            assert tools["run_code"].input_schema["required"] == ["language", "code"]
            assert "c" in tools["run_code"].input_schema["properties"]["language"]["enum"]
            assert "relative paths" in tools["bash"].description and "/mnt/data" in tools["python"].description
            assert text(await s.call_tool("python", {"code": "x = 'héllo ✓ 🐍'\nprint(x)\nlen(x)"})) == "héllo ✓ 🐍\n9"
            bash = await s.call_tool("bash", {"command": "echo ünï > f.txt; cat f.txt; exit 3"})
            assert text(bash) == "Exit code 3:\nünï\n" and bash.is_error
            c = await s.call_tool("run_code", {"language": "c", "code": '#include <stdio.h>\nint main(){puts("c!");}'})
            assert text(c) == "c!\n" and not c.is_error
            assert text(await s.call_tool("python", {"code": "open('f.txt').read()"})) == "'ünï\\n'"
    run(main)


@pytest.mark.slow
def test_bad_calls_are_tool_errors_and_the_server_stays_up():
    async def main() -> None:
        async with stdio() as s:
            for name, arguments, says in [
                ("nope", {}, "Unknown tool 'nope'"),
                ("python", {}, "'code' must be a string, got nothing"),
                ("python", {"code": 3}, "'code' must be a string, got int"),
                ("python", {"code": "1", "extra": 1}, "unexpected 'extra'"),
                ("python", {"code": "   "}, "No code provided."),
                ("bash", {"command": ""}, "No command provided."),
                ("bash", {"command": "true", "timeout": -1}, "'timeout' must be a positive number"),
                ("bash", {"command": "true", "timeout": 1e9}, "'timeout' may be at most"),
                ("run_code", {"language": "cobol", "code": "x"}, "unknown language 'cobol'"),
                ("reset", {"x": 1}, "it takes none"),
            ]:
                result = await s.call_tool(name, arguments)
                assert result.is_error and says in text(result), (name, arguments, text(result))
            crash = await s.call_tool("python", {"code": "import os\nos.kill(os.getpid(), 9)"})
            assert crash.is_error
            assert text(await s.call_tool("bash", {"command": "echo still here"})) == "still here\n"
    run(main)


@pytest.mark.slow
def test_a_timeout_and_a_big_output_read_as_the_tool_layer_writes_them():
    async def main() -> None:
        async with stdio() as s:
            for tool, field, code in [("python", "code", "while True: pass"), ("bash", "command", "sleep 30")]:
                result = await s.call_tool(tool, {field: code, "timeout": 0.5})
                assert text(result) == "Execution timed out after 0.5 seconds." and result.is_error
            big = text(await s.call_tool("bash", {"command": "python3 -c \"print('é' * 5_000_000)\""}))
            assert big.startswith("é" * 1000) and "5000001 chars total" in big and "truncated" in big
            assert len(big) < MAX_OUTPUT_CHARS + 400
            cell = text(await s.call_tool("python", {"code": "print('é' * 5_000_000)"}))
            assert cell.startswith("é" * 1000) and "truncated" in cell and len(cell) < MAX_OUTPUT_CHARS + 400
    run(main)


@pytest.mark.slow
def test_python_keeps_its_state_across_calls_until_reset_and_shows_images():
    async def main() -> None:
        async with stdio() as s:
            await s.call_tool("python", {"code": "import math\nx = 41"})
            assert text(await s.call_tool("python", {"code": "x + 1"})) == "42"
            # The interpreter speaks IPython: the figure a cell leaves open is
            # shown at its end (matplotlib's inline backend), as a kernel shows it.
            figure = await s.call_tool("python", {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2]);"})
            assert [block.type for block in figure.content] == ["text", "image"]
            assert figure.content[1].mime_type == "image/png" and figure.content[1].data.startswith("iVBOR")
            photo = await s.call_tool("python", {"code": "import io\nfrom PIL import Image as Picture\n"
                                                          "from IPython.display import Image\nb = io.BytesIO()\n"
                                                          "Picture.new('RGB', (2, 2)).save(b, 'JPEG')\n"
                                                          "Image(data=b.getvalue(), format='jpeg')"})
            assert [(block.type, getattr(block, "mime_type", None)) for block in photo.content] == [
                ("text", None), ("image", "image/jpeg")]
            assert photo.content[1].data.startswith("/9j/")  # a JPEG's first bytes, base64
            assert text(await s.call_tool("python", {"code": "!echo from bash\n%time _ = 1"})).startswith(
                "from bash\nCPU times:")
            assert not (await s.call_tool("reset", {})).is_error
            gone = await s.call_tool("python", {"code": "x"})
            assert gone.is_error and "NameError" in text(gone)
    run(main)


@pytest.mark.slow
def test_plain_python_is_a_flag_away():
    async def main() -> None:
        async with stdio("--plain-python") as s:
            magic = await s.call_tool("python", {"code": "%time 1"})
            assert magic.is_error and "SyntaxError" in text(magic)
    run(main)


@pytest.mark.slow
def test_live_output_arrives_in_order_as_progress_and_the_result_is_the_same_without_it():
    async def main() -> None:
        async with stdio() as s:
            for tool, field, shaped in [("python", "code", lambda c: c),
                                        ("bash", "command", lambda c: f"python3 -c {shlex.quote(c)}")]:
                with Gates() as gates:
                    code = (gates.python() + "for i in range(3):\n    print('line', i, flush=True)\n"
                            "wait()\nprint('done')")
                    printed = Printed()
                    results: list = []
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_call_into, results, s, tool, {field: shaped(code)}, printed)
                        await printed.until("line 2\n")  # live: the call still waits for the gate
                        assert not results
                        gates.open()
                    (result,) = results
                    assert text(result) == "line 0\nline 1\nline 2\ndone\n"
                    await printed.until(lambda streamed: streamed == text(result))
                    sent = [progress for progress, _ in sorted(printed.received)]
                    assert sent == list(itertools.accumulate(len(message) for _, message in sorted(printed.received)))
                    assert text(await s.call_tool(tool, {field: shaped(code)})) == text(result)  # the gate is open
    run(main)


async def _call_into(results: list, session: ClientSession, tool: str, arguments: dict, printed: Printed) -> None:
    results.append(await session.call_tool(tool, arguments, progress_callback=printed))


@pytest.mark.slow
def test_a_cancel_kills_the_calls_whole_tree_at_once(doomed):
    async def main() -> None:
        async with stdio("--stateless") as s:
            for tool, field, source in [("python", "code", DAEMON_THEN_WAIT),
                                        ("bash", "command", BASH_DAEMON_THEN_WAIT)]:
                printed = Printed()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: s.call_tool(tool, {field: source}, progress_callback=printed))
                    pids = await printed.pids(2)
                    remember(doomed, pids)
                    tg.cancel_scope.cancel()  # the SDK sends notifications/cancelled
                assert await anyio.to_thread.run_sync(all_dead, pids, 5.0), (tool, pids)
            assert text(await s.call_tool("bash", {"command": "echo next"})) == "next\n"
    run(main)


@pytest.mark.slow
def test_a_cancelled_python_cell_dies_with_its_tree_and_the_state_is_kept(doomed):
    async def main() -> None:
        async with stdio() as s:
            await s.call_tool("python", {"code": "kept = 7"})
            printed = Printed()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: s.call_tool("python", {"code": DAEMON_THEN_WAIT}, progress_callback=printed))
                daemon, interpreter = await printed.pids(2)
                remember(doomed, [daemon])
                tg.cancel_scope.cancel()
            assert await anyio.to_thread.run_sync(all_dead, [daemon], 5.0)
            assert text(await s.call_tool("python", {"code": "import os\nkept, os.getpid()"})) == f"(7, {interpreter})"
    run(main)


@pytest.mark.slow
def test_a_client_that_goes_away_takes_everything_with_it(doomed):
    """Its stdin closed with calls running: the server cancels them, ends
    the interpreter (and what it started) and exits."""
    pids: list = []

    async def call(session: ClientSession, tool: str, arguments: dict, printed: Printed) -> None:
        with contextlib.suppress(Exception):  # the connection closes under it
            await session.call_tool(tool, arguments, progress_callback=printed)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            async with stdio() as s:
                pids.append(_mcp_server_process().pid)
                first, second = Printed(), Printed()
                await s.call_tool("python", {"code": "import subprocess\nsleeper = subprocess.Popen(['sleep', '100'])\n"
                                                     "print('PIDS', sleeper.pid)"}, progress_callback=first)
                tg.start_soon(call, s, "bash", {"command": BASH_DAEMON_THEN_WAIT}, second)
                pids.extend(await first.pids(1) + await second.pids(2))
                remember(doomed, pids)

    run(main)
    assert all_dead(pids, 5.0), pids


@pytest.mark.slow
def test_nothing_outlives_a_sigkilled_server(doomed):
    async def main() -> list:
        async with stdio() as s:
            printed = Printed()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: s.call_tool("bash", {"command": BASH_DAEMON_THEN_WAIT},
                                                  progress_callback=printed))
                pids = await printed.pids(2)
                server = _mcp_server_process()
                pids += [server.pid] + [child.pid for child in server.children(recursive=True)]
                remember(doomed, pids)
                server.send_signal(signal.SIGKILL)
                tg.cancel_scope.cancel()
            return pids

    assert all_dead(run(main), 10.0)


@pytest.mark.slow
def test_a_client_that_closes_the_server_s_stdout_has_gone_too(doomed):
    """Its stdin left open: the first message the server cannot send ends
    it as a closed stdin does -- its calls killed, exit 0 -- not a broken
    pipe's traceback."""
    server = subprocess.Popen([sys.executable, "-m", "execpool", "mcp", "--workers", "1", "--stateless"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def send(message: dict) -> None:
            server.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())
            server.stdin.flush()

        send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                          "clientInfo": {"name": "t", "version": "0"}}})
        assert json.loads(server.stdout.readline())["id"] == 1
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {
            "name": "bash", "arguments": {"command": "echo PIDS $$; sleep 1; echo tick; sleep 300"},
            "_meta": {"progressToken": "t"}}})
        first = json.loads(server.stdout.readline())  # a progress notification: the call runs
        assert first["method"] == "notifications/progress", first
        pids = pids_in(first["params"]["message"])
        remember(doomed, pids)
        server.stdout.close()  # the tick's notification will find nobody
        with contextlib.suppress(BrokenPipeError):  # and what the client still sends reaches nobody either
            for i in range(200):
                send({"id": 100 + i, "method": "ping"})
        assert server.wait(DEADLINE_S) == 0
        assert all_dead(pids, 5.0)
        said = server.stderr.read()
        assert b"Traceback" not in said and b"feed_data after feed_eof" not in said, said[-2000:]
    finally:
        server.kill()
        server.wait()
        for pipe in (server.stdin, server.stdout, server.stderr):
            with contextlib.suppress(BrokenPipeError):
                pipe.close()


@pytest.mark.slow
def test_a_message_over_the_limit_is_dropped_and_the_server_reads_on():
    """Red team: a line past the reader's limit crashed the server with a
    traceback (after holding a gigabyte of it)."""
    server = subprocess.Popen([sys.executable, "-m", "execpool", "mcp", "--workers", "1"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        chunk = b"x" * (1 << 20)
        for _ in range((LINE_LIMIT >> 20) + 1):
            server.stdin.write(chunk)
        server.stdin.write(b"\n" + json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"}}}).encode() + b"\n")
        server.stdin.flush()
        assert json.loads(server.stdout.readline())["id"] == 1
        server.stdin.close()
        assert server.wait(DEADLINE_S) == 0
        said = server.stderr.read()
        assert b"a message over 64 MiB was dropped" in said and b"Traceback" not in said, said[-2000:]
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_a_client_that_does_not_read_its_answers_has_its_requests_wait():
    """Red team: a client that sent requests and read no answer had the
    server read them all and hold every answer (100 000 of them took it
    past a gigabyte). Now the server reads no further while its answers
    wait, and every one is there once the client reads."""
    server = subprocess.Popen([sys.executable, "-m", "execpool", "mcp", "--workers", "1"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def message(body: dict) -> bytes:
            return (json.dumps({"jsonrpc": "2.0", **body}) + "\n").encode()

        server.stdin.write(message({"id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}))
        server.stdin.write(message({"method": "notifications/initialized"}))
        server.stdin.flush()
        assert json.loads(server.stdout.readline())["id"] == 0
        count = 20000
        flood = b"".join(message({"id": i, "method": "tools/list"}) for i in range(1, count + 1))
        fd = server.stdin.fileno()
        os.set_blocking(fd, False)
        sent = 0
        while sent < len(flood) and select.select([], [fd], [], 2.0)[1]:
            with contextlib.suppress(BlockingIOError):
                sent += os.write(fd, flood[sent:])
        assert sent < len(flood) // 2, f"the server took {sent} of {len(flood)} bytes of requests unanswered"
        os.set_blocking(fd, True)
        rest = threading.Thread(target=lambda: (server.stdin.write(flood[sent:]), server.stdin.flush()))
        rest.start()
        answered = {json.loads(server.stdout.readline())["id"] for _ in range(count)}
        rest.join(DEADLINE_S)
        assert answered == set(range(1, count + 1))
        server.stdin.close()
        assert server.wait(DEADLINE_S) == 0
    finally:
        server.kill()
        server.wait()
        for pipe in (server.stdin, server.stdout, server.stderr):
            pipe.close()


@pytest.mark.slow
def test_fifty_concurrent_calls_from_one_client():
    async def main() -> None:
        async with stdio() as s:
            results: dict = {}

            async def one(i: int) -> None:
                tool, field = ("bash", "command") if i % 2 else ("python", "code")
                source = f"echo {i}" if i % 2 else f"print({i})"
                results[i] = text(await s.call_tool(tool, {field: source}))

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
            assert results == {i: f"{i}\n" for i in range(50)}
    run(main)


def test_mcp_without_its_extra_says_what_to_install():
    code = ("import sys\nsys.modules['mcp'] = None\nfrom execpool.cli.main import main\n"
            "sys.exit(main(['mcp']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "pip install 'execpool[mcp]'" in done.stderr and "Traceback" not in done.stderr


def _mcp_server_process() -> psutil.Process:
    """This test's ``execpool mcp`` process (the SDK's client started it),
    among this process's children -- some of which may be zombies whose
    command line cannot be read (ZombieProcess failed a whole run)."""
    def command(child: psutil.Process) -> list:
        try:
            return child.cmdline()
        except psutil.Error:
            return []

    (found,) = [child for child in psutil.Process().children() if command(child)[1:4] == ["-m", "execpool", "mcp"]]
    return found


# -- Streamable HTTP in execpool serve --------------------------------------------------------


@pytest.mark.slow
def test_http_runs_the_tools_with_state_per_session_and_many_clients(server):
    async def main() -> None:
        async with http(server) as a, http(server) as b:
            assert {tool.name for tool in (await a.list_tools()).tools} == {"python", "bash", "run_code", "reset"}
            await a.call_tool("python", {"code": "who = 'a'"})
            await b.call_tool("python", {"code": "who = 'b'"})
            assert text(await a.call_tool("python", {"code": "who"})) == "'a'"
            printed = Printed()
            result = await b.call_tool("bash", {"command": "echo ✓; exit 2"}, progress_callback=printed)
            assert text(result) == "Exit code 2:\n✓\n" and result.is_error
            await printed.until("✓\n")
            assert (await a.call_tool("nope", {})).is_error
            results: dict = {}

            async def one(session: ClientSession, i: int) -> None:
                results[i] = text(await session.call_tool("bash", {"command": f"echo {i}"}))

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, (a, b)[i % 2], i)
            assert results == {i: f"{i}\n" for i in range(50)}
    run(main)


def test_http_mcp_is_behind_the_services_token_host_and_origin_rules(server):
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as client:
        assert client.post("/mcp", json=body, headers=headers).status_code == 401
        auth = {**headers, "Authorization": f"Bearer {TOKEN}"}
        assert client.post("/mcp", json=body, headers={**auth, "Origin": "http://evil.example"}).status_code == 403
        assert client.post("/mcp", json=body, headers={**auth, "Host": "evil.example"}).status_code == 421
        assert client.post("/mcp", json=body, headers=auth).status_code == 200


def test_http_a_dropped_stream_kills_its_call(server, doomed):
    """The SDK's client never drops a call's stream by itself, so this one
    speaks the wire: initialize, then a call whose stream it drops."""
    base = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {TOKEN}",
            "MCP-Protocol-Version": "2025-11-25"}
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as client:
        opened = client.post("/mcp", headers=base, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        headers = {**base, "Mcp-Session-Id": opened.headers["mcp-session-id"]}
        client.post("/mcp", headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "bash", "arguments": {"command": BASH_DAEMON_THEN_WAIT},
                           "_meta": {"progressToken": "t"}}}
        seen = ""
        with client.stream("POST", "/mcp", headers=headers, json=call) as stream:
            for line in stream.iter_lines():
                if line.startswith("data:"):
                    seen += json.loads(line[5:]).get("params", {}).get("message", "")
                if len(pids_in(seen)) >= 2:
                    break
        pids = pids_in(seen)
        remember(doomed, pids)
        assert all_dead(pids, 5.0), pids
        client.delete("/mcp", headers=headers)


@pytest.mark.slow
def test_http_a_call_takes_a_slot_and_a_full_service_says_busy():
    busy = Server("--workers", "1", "--max-in-flight", "1", "--max-queue", "1", "--queue-timeout", "0.3",
                  env={"EXECPOOL_TOKEN": TOKEN})
    try:
        async def main() -> None:
            async with http(busy) as s:
                printed = Printed()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: s.call_tool("bash", {"command": "echo holding; sleep 100"},
                                                      progress_callback=printed))
                    await printed.until("holding")
                    refused = await s.call_tool("bash", {"command": "echo never"})
                    assert refused.is_error and "execpool is busy (queue_timeout)" in text(refused)
                    tg.cancel_scope.cancel()
                assert text(await s.call_tool("bash", {"command": "echo after"})) == "after\n"
        run(main)
    finally:
        assert busy.stop() == 0


@pytest.mark.slow
def test_http_interpreters_count_with_the_service_s_sessions_against_max_sessions():
    """/mcp's interpreters and /v1/sessions share --max-sessions (each door
    once had its own, so a client could open twice as many)."""
    full = Server("--workers", "2", "--max-sessions", "2", env={"EXECPOOL_TOKEN": TOKEN})
    full.client.headers["Authorization"] = f"Bearer {TOKEN}"
    try:
        opened = full.client.post("/v1/sessions", json={"language": "python"})
        assert opened.status_code == 201, opened.text

        async def main() -> None:
            async with http(full) as first, http(full) as second:
                assert text(await first.call_tool("python", {"code": "print('one')"})) == "one\n"
                refused = await second.call_tool("python", {"code": "print('two')"})
                assert refused.is_error and "execpool is busy (sessions_full)" in text(refused)
                assert await anyio.to_thread.run_sync(
                    lambda: full.client.post("/v1/sessions", json={"language": "python"}).status_code) == 503
                assert text(await second.call_tool("bash", {"command": "echo stateless"})) == "stateless\n"
                await first.call_tool("reset", {})
                assert await anyio.to_thread.run_sync(
                    wait_for, lambda: metric(full, "execpool_sessions_open") == 1, DEADLINE_S)
                assert text(await second.call_tool("python", {"code": "print('two')"})) == "two\n"
            # The clients gone, their interpreters went, and so did their places.
            assert await anyio.to_thread.run_sync(
                wait_for, lambda: metric(full, "execpool_sessions_open") == 1, DEADLINE_S)
            again = await anyio.to_thread.run_sync(
                lambda: full.client.post("/v1/sessions", json={"language": "python"}))
            assert again.status_code == 201, again.text
        run(main)
    finally:
        assert full.stop() == 0


@pytest.mark.slow
def test_http_mcp_bodies_follow_the_service_s_size_and_time_limits():
    """A 5 MB program is within --max-body-mb (the SDK's own 4 MiB bound
    once answered it 413); a body over the limit is 413, and one that
    trickles is 408 after --read-timeout (the SDK waited for it for ever)."""
    s = Server("--workers", "1", "--max-body-mb", "8", "--read-timeout", "0.5", env={"EXECPOOL_TOKEN": TOKEN})
    try:
        size = 5 << 20

        async def main() -> str:
            async with http(s) as session:
                return text(await session.call_tool("python", {"code": f"x = '{'a' * size}'\nprint(len(x))"}))
        assert run(main) == f"{size}\n"
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
                   "Accept": "application/json, text/event-stream"}
        big = httpx.post(s.url + "/mcp", content=b" " * (9 << 20), headers=headers, timeout=DEADLINE_S)
        assert big.status_code == 413 and "8 MiB" in big.text, big.text
        with raw(s, f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"jsonrpc".encode()) as trickle:
            answer = read_all(trickle)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    finally:
        assert s.stop() == 0


def test_http_a_made_up_session_id_keeps_no_interpreter(server):
    """An id the server never gave out names no lasting workspace: each such
    call gets a fresh interpreter, closed after it (made-up ids once kept an
    interpreter each, past --max-sessions, until their idle timeout)."""
    made_up = "made-up-" + secrets.token_hex(8)
    assert sessionless_call(server.url, "kept = 1", made_up, TOKEN)["isError"] is False
    second = sessionless_call(server.url, "kept", made_up, TOKEN)
    assert second["isError"] is True and "NameError" in second["content"][0]["text"]


def test_each_http_client_has_a_workspace_of_its_own_and_no_path_on_the_server(server):
    """A client's files are in a workspace of the pool's (bounded, gone
    with the pool), not in a directory of the server's disk: not in its
    home (which its user may not write, and which a SIGKILLed server would
    leave holding its clients' files), and not beside another client's."""
    async def main() -> list:
        async with http(server) as first, http(server) as second:
            wrote = await first.call_tool("bash", {"command": "pwd; echo mine > mine.txt; ls"})
            looked = await second.call_tool("bash", {"command": "pwd; ls -A"})
            return [text(wrote).split(), text(looked).split()]
    wrote, looked = run(main)
    assert wrote == ["/home/user", "mine.txt"] and looked == ["/home/user"], (wrote, looked)


def test_a_deleted_http_session_has_ended_its_interpreter_when_the_delete_is_answered(server):
    """A session's workspace -- its interpreter, its disk bound -- used to
    end after the DELETE was answered, so a client quick enough found it
    still held (a whole run's next test was once refused for the disk
    budget it held)."""
    async def main() -> List[int]:
        still_open = []
        for turn in range(3):
            async with http(server) as client:
                assert text(await client.call_tool("python", {"code": f"print({turn})"})) == f"{turn}\n"
            still_open.append(await anyio.to_thread.run_sync(metric, server, "execpool_sessions_open"))
        return still_open
    assert run(main) == [0, 0, 0]


@pytest.mark.slow
def test_the_call_after_a_cancelled_cell_that_ignored_it_runs_in_a_new_interpreter():
    """A cell that ignores its interrupt is killed with its interpreter; the
    next call, sent at once, waited behind it and once failed with that
    interpreter's end. It runs in a fresh one instead, and says so."""
    async def main() -> None:
        async with stdio() as s:
            printed = Printed()
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: s.call_tool("python", {
                    "code": "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                            "print('in', flush=True)\ntime.sleep(100)"}, progress_callback=printed))
                await printed.until("in\n")
                tg.cancel_scope.cancel()
            after = await s.call_tool("python", {"code": "1 + 1"})
            assert not after.is_error and text(after).startswith("2"), text(after)
    run(main)


@pytest.mark.slow
@pytest.mark.hostile
def test_a_python_call_swapping_names_for_links_cannot_make_run_code_change_a_host_file(tmp_path):
    """Red team, at the defaults: one python call started a thread that
    swapped the compiled program for a link to a host file, and one
    run_code C call then had the server chmod that file to 0755."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    target = private / "host-file"
    target.write_text("host")
    target.chmod(0o600)
    swapper = ("import os, stat, threading\n"
               "def swap():\n"
               "    while True:\n"
               "        try:\n"
               "            if stat.S_ISREG(os.lstat('test').st_mode):\n"
               "                os.unlink('test')\n"
               f"                os.symlink({str(target)!r}, 'test')\n"
               "        except OSError:\n"
               "            pass\n"
               "threading.Thread(target=swap, daemon=True).start()\n"
               "print('swapping')")
    program = ('#include <stdio.h>\nstatic volatile char big[48 << 20] = {1};\n'
               'int main(void) { puts(big[0] ? "ran" : "?"); return 0; }\n')

    async def main() -> None:
        async with stdio() as s:
            assert text(await s.call_tool("python", {"code": swapper})).strip() == "swapping"
            for n in range(4):
                await s.call_tool("run_code", {"language": "c", "code": program + f"/* {n % 2} */"})
    run(main)
    assert oct(target.stat().st_mode & 0o7777) == oct(0o600) and target.read_text() == "host"
