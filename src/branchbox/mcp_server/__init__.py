"""The MCP server (``branchbox mcp``): branchbox's sandboxes as tools for MCP clients.

``tools`` declares the tools (argument models, schemas, descriptions), ``calls``
carries each out through the SDK, ``holdings`` tracks which sandboxes a session
made (closed when it ends, unless kept), ``server`` builds the ``mcp`` SDK server
and serves it over stdio, ``http`` over streamable HTTP behind the API keys.
"""
