"""One output policy: how much of a tool's output each consumer gets, and
the words said where it was cut.

Shared: the worker keeps a Result's head and caps what it sends live, the
caller's pool and streams deliver live output up to the same cap, the tool
layer and the command line cut what they show. Each cap is named here once,
and every cut says so in the same words (``truncation_notice``), so a
model, a person and a parser see one wording wherever they meet it.
"""

from __future__ import annotations

#: Characters of output a Result keeps by default (``PoolConfig.max_output_chars``);
#: its ``output_chars`` always counts the whole.
RESULT_HEAD_CHARS = 1_000_000

#: Characters an ``execpool batch`` record keeps by default
#: (``--max-output-chars``): OUT is a data file scanned on every resume.
BATCH_RECORD_CHARS = 100_000

#: Characters a model-facing tool result shows by default (the tool layer
#: reads ``EXECPOOL_TOOL_RESULT_MAX_CHARS`` to change it).
TOOL_RESULT_CHARS = 16_000

#: Characters of live output delivered per job (events, streams, SSE); past
#: them, STREAM_CAP_NOTICE once. A job's Result keeps its output regardless.
TOOL_OUTPUT_STREAM_MAX_CHARS = 400_000

#: Said once, in the live output, after TOOL_OUTPUT_STREAM_MAX_CHARS characters.
STREAM_CAP_NOTICE = "\n... (further live output not streamed)\n"

#: What the tool layer adds to a cut: files are how a model keeps the rest.
FILES_ADVICE = ("Files persist in the working directory: write long output to a file and read the parts "
                "you need.")


def truncation_notice(total: int, kept: int, advice: str = "") -> str:
    """Appended to the first ``kept`` characters of an output of ``total``.
    It says what was kept, never that anything was shown: whoever reads
    the notice may be the only one who read the output at all."""
    return f"\n... [output truncated: {total} chars total, the first {kept} kept" + (
        f". {advice}]" if advice else "]")


class LiveBudget:
    """How much of one job's live output may still go out: every place that
    forwards live output (the worker, the pool's job handle, a stream of a
    wrapped callable) counts against one of these, so the cap is one rule.

    ``slack`` lets a producer send one character past the cap, so that
    whoever receives it knows the cap was exceeded and can say so."""

    __slots__ = ("room", "sent", "capped")

    def __init__(self, cap: int = TOOL_OUTPUT_STREAM_MAX_CHARS, slack: int = 0) -> None:
        self.room = cap + slack
        self.sent = 0
        self.capped = False

    def take(self, text: str) -> str:
        """The part of ``text`` that still fits (all of it, a prefix, or
        ""); once a piece does not fit whole, ``capped`` is set."""
        piece = text if len(text) <= self.room else text[:self.room]
        self.capped = self.capped or len(piece) < len(text)
        self.room -= len(piece)
        self.sent += len(piece)
        return piece
