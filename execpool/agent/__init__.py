"""The model-facing layer over the pool, run in an LLM server's process: the
tools (tools.py) and the tool-calling loop (loop.py); shim/ is put on a
Python tool's path and runs inside the tool itself. Public as
``execpool.tools`` and ``execpool.loop``."""
