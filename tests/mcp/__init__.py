"""The MCP server (execpool/mcp/), over stdio and over HTTP."""
