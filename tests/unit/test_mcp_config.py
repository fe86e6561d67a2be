"""The ``mcpServers`` configuration (kvserve/tools/mcp.py: parse_mcp_config, load_mcp_configs), the
MCP tool's ``/tools`` entry, and the manager's answers for a server that cannot start, without a
kvserve process (tests/api/test_mcp_api.py runs the servers through kvserve)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from kvserve.tools.mcp import (
    McpConfigError,
    McpManager,
    McpServerConfig,
    McpTool,
    McpToolDef,
    load_mcp_configs,
    parse_mcp_config,
)


def test_parse_stdio_and_http_entries():
    cfgs = parse_mcp_config(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "srv"], "env": {"K": "V", "N": 3}, "cwd": "/srv",
                  "timeout_ms": 500},
        "search": {"url": "https://example.test/mcp", "headers": {"Authorization": "Bearer t"}},
    }}))
    assert cfgs == [
        McpServerConfig(name="files", command="npx", args=["-y", "srv"], env={"K": "V", "N": "3"}, cwd="/srv",
                        timeout_ms=500),
        McpServerConfig(name="search", url="https://example.test/mcp", headers={"Authorization": "Bearer t"},
                        timeout_ms=30000),
    ]
    assert cfgs[0].timeout_s == 0.5


def test_entries_without_command_or_url_are_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.tools.mcp"):
        assert parse_mcp_config('{"mcpServers": {"a": {"args": ["x"]}}}') == []
    assert "MCP server 'a' has no command, skipping" in caplog.text
    assert parse_mcp_config('{"other": 1}') == []
    assert parse_mcp_config('[1, 2]') == []


@pytest.mark.parametrize("text, message", [
    ("not valid json", "failed to parse MCP config JSON: Expecting value: line 1 column 1 (char 0)"),
    ('{"mcpServers": {"a": 1}}', "failed to parse MCP config JSON: server 'a' must be an object"),
    ('{"mcpServers": {"a": {"command": 1}}}', "failed to parse MCP config JSON: 'a'.command must be a string"),
    ('{"mcpServers": {"a": {"command": "x", "args": [1]}}}',
     "failed to parse MCP config JSON: 'a'.args must be a list of strings"),
    ('{"mcpServers": {"a": {"command": "x", "env": []}}}', "failed to parse MCP config JSON: 'a'.env must be an object"),
    ('{"mcpServers": {"a": {"command": "x", "timeout_ms": 0}}}',
     "failed to parse MCP config JSON: 'a'.timeout_ms must be a positive number"),
    ('{"mcpServers": {"a": {"command": "x", "timeout_ms": true}}}',
     "failed to parse MCP config JSON: 'a'.timeout_ms must be a positive number"),
    ('{"mcpServers": {"a": {"url": "ftp://h/x"}}}', "failed to parse MCP config JSON: 'a'.url must be an http(s) URL"),
])
def test_bad_config_texts(text, message):
    with pytest.raises(McpConfigError) as e:
        parse_mcp_config(text)
    assert str(e.value) == message


def test_file_then_json_duplicates_skipped(tmp_path, caplog):
    f = tmp_path / "mcp.json"
    f.write_text(json.dumps({"mcpServers": {"a": {"command": "one"}, "b": {"command": "two"}}}))
    with caplog.at_level(logging.WARNING, logger="kvserve.tools.mcp"):
        cfgs = load_mcp_configs(str(f), json.dumps({"mcpServers": {"a": {"command": "three"}, "c": {"url": "http://h/"}}}))
    assert [(c.name, c.command or c.url) for c in cfgs] == [("a", "one"), ("b", "two"), ("c", "http://h/")]
    assert "MCP config: duplicate server name 'a', skipping" in caplog.text
    with pytest.raises(McpConfigError) as e:
        load_mcp_configs(str(tmp_path / "missing.json"), None)
    assert str(e.value) == f"failed to open MCP config file: {tmp_path / 'missing.json'}"


def test_tool_entry_and_definition():
    tool = McpTool(McpToolDef("srv", "look", "Look it up", {}), McpManager([]))
    assert tool.entry() == {"display_name": "srv_look", "tool": "srv_look", "type": "mcp",
                            "permissions": {"write": False}, "uses_cwd": False,
                            "definition": {"type": "function", "function": {"name": "srv_look",
                                                                             "description": "Look it up",
                                                                             "parameters": {}}}}


def test_server_that_cannot_start():
    """Warm-up finds no tools; a call answers ``MCP server unavailable`` and, during the cooldown,
    does not try to start the program again."""
    async def run():
        m = McpManager([McpServerConfig("nope", command="/nonexistent/mcp-12345")])
        assert await m.warm_up() == []
        first = await m.call_tool("nope", "x", {})
        second = await m.call_tool("nope", "x", {})
        await m.aclose()
        after_stop = await m.call_tool("nope", "x", {})
        return first, second, after_stop, m.pids()

    first, second, after_stop, pids = asyncio.run(run())
    assert first == second == after_stop == {"error": "MCP server unavailable: nope"}
    assert pids == []
