"""The service's OpenAPI document (``GET /openapi.json``), generated from
the same declarations that parse its bodies and build its answers
(execpool/formats): a field added there is described here with no second
edit.

Runs in the service's process, once per app.
"""

from __future__ import annotations

from ..eval import request as evaluation
from ..formats import records, request, sandbox_fusion

#: One entry of ``GET /v1/languages``.
LANGUAGE_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "runs": {"type": "boolean"}, "toolchain": {"type": ["string", "null"]},
    "compiles": {"type": "boolean"}, "why_not": {"type": ["string", "null"]},
    "checking": {"type": "boolean", "description": "its hello-world is being compiled and run in the service's "
                 "sandbox: runs is false until it is known"}}}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def document() -> dict:
    job = {"$ref": "#/components/schemas/Job"}
    record = {"$ref": "#/components/schemas/Record"}
    refused = {"400": {"description": "a field is wrong; the message names it"},
               "401": {"description": "token missing or wrong"},
               "413": {"description": "body too large"},
               "503": {"description": "overloaded or no worker right now; see Retry-After"}}
    tests = request.schema(request.TESTS)
    tests["properties"]["tests"] = {"type": "array", "maxItems": request.MAX_BATCH_JOBS, "items": {
        "type": "object", "required": ["expected"], "additionalProperties": False,
        "properties": {"stdin": {"type": ["string", "null"]}, "expected": {"type": "string"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "execpool serve", "version": "1",
                 "description": "Run Python, shell and programs in the languages of /v1/languages in isolated "
                                "processes (execpool's own routes and SandboxFusion's /run_code)."},
        "paths": {
            "/v1/run": {"post": {"summary": "Run one job; answer its record",
                                 "requestBody": _json(job),
                                 "responses": {"200": {"description": "the job's record", **_json(record)},
                                               **refused}}},
            "/v1/stream": {"post": {"summary": "Run one job; answer Server-Sent Events: data lines with tool_output "
                                               "events, ': keep-alive' comments, then 'event: result' with the "
                                               "record",
                                    "requestBody": _json(job),
                                    "responses": {"200": {"description": "text/event-stream"}, **refused}}},
            "/v1/batch": {"post": {"summary": "Run NDJSON jobs (each a Job), or one program against its tests; "
                                              "answer NDJSON records as jobs finish",
                                   "requestBody": {"content": {
                                       "application/x-ndjson": {"schema": job},
                                       "application/json": {"schema": {"$ref": "#/components/schemas/Tests"}}}},
                                   "responses": {"200": {"description": "application/x-ndjson: one record per "
                                                                        "line (with stderr and passed for tests)"},
                                                 **refused}}},
            "/v1/eval": {"post": {"summary": "Judge samples against problems' tests (HumanEval-, MBPP- or "
                                             "CommonOJ-style) as `execpool eval` does; answer NDJSON: one "
                                             "EvalRecord per sample as its judging ends (the sample's own "
                                             "fields, then the verdict's), then {\"summary\": {pass@k..., "
                                             "samples, problems, passed, verdicts, per_problem}}",
                                  "requestBody": _json({"$ref": "#/components/schemas/EvalRequest"}),
                                  "responses": {"200": {"description": "application/x-ndjson: EvalRecord lines, then "
                                                                       "the summary"}, **refused}}},
            "/run_code": {"post": {"summary": "SandboxFusion's run_code",
                                   "requestBody": _json({"$ref": "#/components/schemas/RunCodeRequest"}),
                                   "responses": {"200": {"description": "RunCodeResponse",
                                                         **_json({"$ref": "#/components/schemas/RunCodeResponse"})},
                                                 "504": {"description": "overloaded: retry"}}}},
            "/": {"get": {"summary": "a page to run code by hand (it talks to /v1/stream)"}},
            "/v1/ping": {"get": {"summary": "SandboxFusion's ping: \"pong\""}},
            "/v1/languages": {"get": {"summary": "Each language of the table: whether its hello-world ran in the "
                                                 "service's sandbox, its toolchain's version, or why not",
                                      "responses": {"200": {"description": "the languages", **_json({
                                          "type": "array", "items": LANGUAGE_SCHEMA})}}}},
            "/v1/sessions": {
                "post": {"summary": "Open a session (a Python interpreter or a bash shell that keeps its state); "
                                    "answer its unguessable id",
                         "requestBody": _json({"$ref": "#/components/schemas/Session"}),
                         "responses": {"201": {"description": "{id, language, created, last_used, alive}"},
                                       **refused}},
                "get": {"summary": "The open sessions: id, language, created, last_used, alive"}},
            "/v1/sessions/{ident}": {"delete": {"summary": "Close a session: its whole tree dies",
                                                "responses": {"204": {"description": "closed"},
                                                              "404": {"description": "no such session"}}}},
            "/v1/sessions/{ident}/run": {"post": {"summary": "Run a cell; answer its record (status, stdout, stderr, "
                                                             "value, data, display, error, exit_code, alive, ...)",
                                                  "requestBody": _json({"$ref": "#/components/schemas/Cell"}),
                                                  "responses": {"200": {"description": "the cell's record"},
                                                                "404": {"description": "no such session"},
                                                                **refused}}},
            "/v1/sessions/{ident}/stream": {"post": {"summary": "Run a cell; answer Server-Sent Events as "
                                                                "/v1/stream, ending with 'event: result' and the "
                                                                "cell's record",
                                                     "requestBody": _json({"$ref": "#/components/schemas/Cell"}),
                                                     "responses": {"200": {"description": "text/event-stream"},
                                                                   "404": {"description": "no such session"},
                                                                   **refused}}},
            "/v1/sessions/{ident}/fork": {"post": {
                "summary": "Fork a Python session: a new session holding a copy of its state (its interpreter, "
                           "copy-on-write, and its directory's files), independent from then on",
                "responses": {"201": {"description": "the copy: {id, language, created, last_used, alive}"},
                              "404": {"description": "no such session"},
                              "409": {"description": "this session cannot be forked (a bash session, a "
                                                     "sandboxed family that used its forks); the detail says why"},
                              **refused}}},
            "/run_jupyter": {"post": {"summary": "SandboxFusion's run_jupyter: the cells in one session of their own",
                                      "requestBody": _json({"$ref": "#/components/schemas/RunJupyterRequest"}),
                                      "responses": {"200": {"description": "RunJupyterResponse"},
                                                    "504": {"description": "overloaded: retry"}}}},
            "/healthz": {"get": {"summary": "the process answers"}},
            "/readyz": {"get": {"summary": "workers are alive and the queue is not full (else 503)"}},
            "/metrics": {"get": {"summary": "Prometheus metrics"}},
        },
        "components": {"schemas": {
            "Job": request.schema(request.HTTP_JOB),
            "Tests": tests,
            "RunCodeRequest": request.schema(request.RUN_CODE),
            "Record": records.schema({**records.FILES_KEYS, **records.TEST_KEYS}),
            "RunCodeResponse": sandbox_fusion.RESPONSE_SCHEMA,
            "Session": request.schema(request.SESSION),
            "Cell": request.schema(request.CELL),
            "RunJupyterRequest": request.schema(request.RUN_JUPYTER),
            "EvalRequest": evaluation.schema(),
            "EvalRecord": evaluation.record_schema(),
        }},
    }
