"""The MCP server: execpool's code tools for Model Context Protocol clients,
run in the process of ``execpool mcp`` (stdio: command.py) or of
``execpool serve`` (Streamable HTTP at ``/mcp``: http.py, which the
service mounts). catalog.py says what the tools are and checks a call,
calls.py runs it on the pool for the connection that made it, server.py
puts both behind the official SDK's server; settings.py holds the defaults
and imports nothing of the SDK, so the command line can name them.

The SDK is the ``mcp`` extra: ``execpool mcp`` without it says what to
install, and ``execpool serve`` answers ``/mcp`` with the same advice.
"""
