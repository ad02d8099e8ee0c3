"""The model-facing layer over the pool, run in an LLM server's process: the
tools (tools.py) and the tool-calling loop (loop.py). The shim it puts on
a Python tool's path runs inside the tool: execpool/tool/shim/. Public as
``execpool.tools`` and ``execpool.loop``."""
