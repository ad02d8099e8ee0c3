"""MkDocs hook: the service's reference pages, made from the service itself
at build time, so that a route, flag or metric added in the code is in the
site with no edit here and none can be described that is not there.

- ``service/reference.md``: every route the app declares, every flag of
  ``execpool serve --help`` (its own text), every metric ``GET /metrics``
  exposes;
- ``service/openapi.md`` and ``service/openapi.json``: the app's
  ``GET /openapi.json``, rendered and as served.

The app is built in-process around a one-worker pool and asked over ASGI,
as a client would ask it; a job, a session and a cell run first so that
the labelled metrics show their labels.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

from mkdocs.structure.files import File, Files

from execpool.serve.admission import Reason


def on_files(files: Files, config: Any) -> Files:
    served = _ask_the_service()
    pages = {
        "service/reference.md": _reference(served),
        "service/openapi.md": _openapi_page(served["openapi"]),
        "service/openapi.json": json.dumps(served["openapi"], indent=2) + "\n",
    }
    for path, content in pages.items():
        files.append(File.generated(config, path, content=content))
    return files


# -- asking the service ------------------------------------------------------

def _ask_the_service() -> Dict[str, Any]:
    from execpool import ExecPool
    from execpool.serve import create_app

    with ExecPool(workers=1) as pool:
        app = create_app(pool)

        async def ask() -> Dict[str, Any]:
            await _call(app, "POST", "/v1/run", {"id": "docs", "shell": "true"})
            status, body = await _call(app, "POST", "/v1/sessions", {"language": "bash"})
            if status == 201:
                ident = json.loads(body)["id"]
                await _call(app, "POST", f"/v1/sessions/{ident}/run", {"code": "true"})
                await _call(app, "DELETE", f"/v1/sessions/{ident}", None)
            status, openapi = await _call(app, "GET", "/openapi.json", None)
            assert status == 200, openapi
            status, metrics = await _call(app, "GET", "/metrics", None)
            assert status == 200, metrics
            return {"openapi": json.loads(openapi), "metrics": metrics.decode()}

        served = asyncio.run(ask())
        served["routes"] = [(route.path, sorted(route.methods or ())) for route in app.routes]
    served["help"] = subprocess.run(
        [sys.executable, "-m", "execpool", "serve", "--help"], check=True, capture_output=True, text=True,
        env={**os.environ, "COLUMNS": "100"}).stdout
    return served


async def _call(app: Any, method: str, path: str, body: Optional[dict]) -> Tuple[int, bytes]:
    """One request to the ASGI app, as a loopback client makes it."""
    data = b"" if body is None else json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    sent = False
    answered = asyncio.Event()
    status: List[int] = []
    chunks: List[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    await app(scope, receive, send)
    return status[0], b"".join(chunks)


# -- the reference page ------------------------------------------------------

#: The routes the OpenAPI document does not describe, and why they are there.
_NOT_IN_OPENAPI = {
    "/favicon.ico": "no icon: 204, so that a browser stops asking",
    "/openapi.json": "the OpenAPI document ([rendered](openapi.md))",
    "/mcp": "the MCP server over Streamable HTTP ([MCP](../mcp.md)); 501 without the `mcp` extra",
}

def _reference(served: Dict[str, Any]) -> str:
    paths = served["openapi"].get("paths", {})
    out = ["# Routes, flags and metrics", "",
           "Made when this site was built, from the service itself: the routes its app declares, "
           "`execpool serve --help`, and what `GET /metrics` exposes. The prose is in "
           "[The service](index.md); the bodies and answers in [OpenAPI](openapi.md).", "",
           "## Routes", "", "| method | path | what it does |", "|---|---|---|"]
    for path, methods in served["routes"]:
        for method in [m for m in methods if m != "HEAD"] or ["any"]:
            operation = paths.get(path, {}).get(method.lower(), {})
            summary = operation.get("summary") or _NOT_IN_OPENAPI.get(path, "")
            out.append(f"| {method} | `{path}` | {_cell(summary)} |")
    out += ["", "## Flags", "", "`execpool serve --help`, as this version prints it:", "",
            "```text", served["help"].rstrip(), "```", "", "## Metrics", "",
            "`GET /metrics`, in Prometheus's text format. Labels are those the metric carries "
            "(a labelled metric shows its series once something has counted in them).", "",
            "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, meaning in _metrics(served["metrics"]):
        out.append(f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels)} | {_cell(meaning)} |")
    out += ["", "`reason` of `execpool_rejected_total` is one of "
            + ", ".join(f"`{reason.value}`" for reason in Reason) + "."]
    return "\n".join(out) + "\n"


def _metrics(text: str) -> List[Tuple[str, str, List[str], str]]:
    """(name, type, labels, help) of each family of an exposition, its
    ``_created`` companions (the time a series began) left out."""
    families: Dict[str, List[Any]] = {}
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            name, _, rest = line[7:].partition(" ")
            family = families.setdefault(name, [name, "", set(), ""])
            family[1 if line.startswith("# TYPE ") else 3] = rest
        elif line and not line.startswith("#") and "{" in line:
            sample, _, rest = line.partition("{")
            family = max((f for f in families if sample.startswith(f)), key=len, default=None)
            if family is not None:
                labels = {pair.split("=", 1)[0] for pair in rest.partition("}")[0].split(",") if pair}
                families[family][2] |= labels - {"le", "quantile"}
    if "execpool_rejected_total" in families:
        families["execpool_rejected_total"][2].add("reason")
    return sorted((name, kind, sorted(labels), meaning) for name, kind, labels, meaning in families.values()
                  if not name.endswith("_created"))


# -- the OpenAPI page --------------------------------------------------------

def _openapi_page(document: Dict[str, Any]) -> str:
    info = document.get("info", {})
    out = ["# OpenAPI", "",
           f"The service's own description of itself, `GET /openapi.json` (OpenAPI {document.get('openapi')}), "
           "fetched from the app when this site was built and rendered here. "
           "[openapi.json](openapi.json) is the document as served.", "",
           f"> {info.get('description', '')}", ""]
    schemas = document.get("components", {}).get("schemas", {})
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            out += [f"## {method.upper()} `{path}`", ""]
            for key in ("summary", "description"):
                if operation.get(key):
                    out += [operation[key], ""]
            body = operation.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                out += [f"**Body** (`{media}`):", ""] + _schema(content.get("schema", {}), schemas) + [""]
            responses = operation.get("responses", {})
            if responses:
                out += ["| answer | meaning |", "|---|---|"]
                for code, response in responses.items():
                    media = ", ".join(f"`{m}`" for m in response.get("content", {}))
                    out.append(f"| {code} | {_cell(response.get('description', ''))}"
                               f"{' (' + media + ')' if media else ''} |")
                out.append("")
    if schemas:
        out += ["## Schemas", ""]
        for name, schema in schemas.items():
            out += [f"### {name}", ""] + _schema(schema, {}) + [""]
    return "\n".join(out) + "\n"


def _schema(schema: Dict[str, Any], schemas: Dict[str, Any]) -> List[str]:
    """An object's fields as a table; a reference by name; anything else as JSON."""
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[-1]
        return [f"[{name}](#{name.lower()})"]
    properties = schema.get("properties")
    if not properties:
        return ["```json", json.dumps(schema, indent=2), "```"]
    required = set(schema.get("required", ()))
    rows = ["| field | type | required | meaning |", "|---|---|---|---|"]
    for field, spec in properties.items():
        rows.append(f"| `{field}` | {_cell(_type(spec))} | {'yes' if field in required else ''} | "
                    f"{_cell(spec.get('description', ''))} |")
    return rows


def _type(spec: Dict[str, Any]) -> str:
    if "$ref" in spec:
        return spec["$ref"].rsplit("/", 1)[-1]
    for union in ("oneOf", "anyOf"):
        if union in spec:
            return " or ".join(_type(s) for s in spec[union])
    kind = spec.get("type", "any")
    kind = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array" and "items" in spec:
        kind = f"array of {_type(spec['items'])}"
    if "enum" in spec:
        kind += ": " + ", ".join(json.dumps(v) for v in spec["enum"])
    return kind


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
