"""The chat page as an agent (issue 36, item 5), in a real browser: the model's tool calls run
through ``POST /tools`` of a real kvserve started with ``--tools all``, shown collapsed with their
results (and a shell command's exit code), answered with role "tool" messages until the model
answers in words; writes and shell commands wait for the user's confirmation unless allowed for the
conversation; a tool the user switched off is not offered, and a call to it (or to a tool the server
does not list) is answered with an error, never run; the tool rounds per answer are bounded; and a
server without tools gets exactly the requests it got before.

The model is :mod:`chat_standin` (a scripted stand-in: a tiny random model cannot be made to call a
tool); the page and the tools are real.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from chat_standin import MODEL, ChatStandIn, tool_call
from test_webui_browser import ask, js, open_fresh, wait_for, wait_ready

MCP_TOOLS = [  # stand-ins for an MCP server's tools: one that writes, one marked read-only
    {"entry": {"display_name": "notes_append", "tool": "notes_append", "type": "mcp", "permissions": {"write": False},
               "uses_cwd": False, "definition": {"type": "function", "function": {
                   "name": "notes_append", "description": "Append a note",
                   "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}},
     "answer": "appended"},
    {"entry": {"display_name": "notes_list", "tool": "notes_list", "type": "mcp", "permissions": {"write": False},
               "uses_cwd": False, "annotations": {"readOnlyHint": True}, "definition": {"type": "function", "function": {
                   "name": "notes_list", "description": "List the notes",
                   "parameters": {"type": "object", "properties": {}}}}},
     "answer": "note 1\nnote 2"},
]


@pytest.fixture(scope="module")
def tools_server(browser, tiny_server):  # browser first: without one, skip before starting servers
    return tiny_server("-np", "1", "-c", "512", "--tools", "all")


@pytest.fixture(scope="module")
def standin(tools_server):
    s = ChatStandIn(upstream=tools_server.base_url, extra_tools=MCP_TOOLS).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bare_standin(browser):
    s = ChatStandIn(upstream=None).start()
    yield s
    s.stop()


def messages(browser) -> list[dict]:
    """What the page shows: each message's kind, status and, for tool blocks, the tool, whether the
    block is open, its status and exit badges, its result and whether a confirmation is shown."""
    return js(browser, """
        return [...document.querySelectorAll('#messages .msg')].map(m => {
          const kind = m.classList.contains('tool') ? 'tool' : m.classList.contains('user') ? 'user' : 'assistant';
          const out = {kind, status: m.dataset.status || ''};
          if (kind === 'tool') {
            Object.assign(out, {tool: m.dataset.tool, open: m.querySelector('details').open,
              name: m.querySelector('.tool-name').textContent, brief: m.querySelector('.tool-brief').textContent,
              badge: m.querySelector('.tool-status').textContent,
              exit: m.querySelector('.tool-exit').hidden ? null : m.querySelector('.tool-exit').dataset.value,
              result: m.querySelector('.tool-result').textContent, confirm: !!m.querySelector('.tool-confirm')});
          } else {
            out.text = m.querySelector('.content').textContent;
          }
          return out;
        });""")


def wait_turn_done(browser, n_assistant: int, timeout=30.0) -> list[dict]:
    """Wait until the page is idle with ``n_assistant`` assistant messages, the last one done."""
    def done():
        ms = messages(browser)
        a = [m for m in ms if m["kind"] == "assistant"]
        idle = js(browser, "return document.body.dataset.busy") == ""
        return idle and len(a) == n_assistant and a[-1]["status"] == "done" and ms
    return wait_for(done, timeout, f"{n_assistant} answers, the last one done")


def open_tools(browser, server) -> None:
    open_fresh(browser, server)
    wait_ready(browser)
    assert js(browser, "return document.body.dataset.tools") != "0"


def offered(chat: dict) -> list[str]:
    return [t["function"]["name"] for t in chat.get("tools", [])]


def upstream_answer(tools_server, tool: str, params: dict, cwd: str) -> dict:
    r = httpx.post(tools_server.url("/tools"), json={"tool": tool, "params": params}, headers={"x-tool-cwd": cwd},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_read_file_is_run_shown_collapsed_and_answered(standin, tools_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    (tmp_path / "notes.txt").write_text("alpha\nbeta\n")
    listed = [t["tool"] for t in httpx.get(tools_server.url("/tools")).json()]
    assert {"read_file", "write_file", "edit_file", "exec_shell_command"} <= set(listed)
    open_tools(browser, standin)
    # the tool settings show when the server has tools; the working directory is typed in
    browser.find_element(By.ID, "settings-toggle").click()
    assert browser.find_element(By.ID, "set-tool-rounds").get_attribute("placeholder") == "10"
    browser.find_element(By.ID, "set-cwd").send_keys(str(tmp_path))
    browser.find_element(By.ID, "settings-toggle").click()
    standin.script([tool_call("read_file", {"path": "notes.txt"}, "call_1")], "The file says alpha and beta.")
    ask(browser, "What is in notes.txt?")
    shown = wait_turn_done(browser, 2)

    # offered: every tool the server lists, as OpenAI tool definitions
    first = standin.chats[0]
    assert offered(first) == listed + ["notes_append", "notes_list"]
    assert first["tools"][0]["type"] == "function" and first["tools"][0]["function"]["parameters"]["type"] == "object"
    assert first["messages"] == [{"role": "user", "content": "What is in notes.txt?"}]
    # run through POST /tools with the working directory from the settings, not streamed
    assert [c["body"] for c in standin.tool_calls] == [{"tool": "read_file", "params": {"path": "notes.txt"}}]
    assert standin.tool_calls[0]["headers"]["x-tool-cwd"] == str(tmp_path)
    # answered: the next request carries the call and the file's content as a tool message
    expected = upstream_answer(tools_server, "read_file", {"path": "notes.txt"}, str(tmp_path))["plain_text_response"]
    assert "alpha\nbeta" in expected
    second = standin.chats[1]
    assert second["messages"] == [
        {"role": "user", "content": "What is in notes.txt?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": expected}]
    assert offered(second) == offered(first)
    # shown: the call as a collapsed block with its result, then the answer
    assert [m["kind"] for m in shown] == ["user", "assistant", "tool", "assistant"]
    block = shown[2]
    assert block == {"kind": "tool", "status": "done", "tool": "read_file", "open": False, "name": "Read file",
                     "brief": "notes.txt", "badge": "done", "exit": None, "result": expected, "confirm": False}
    assert shown[3]["text"] == "The file says alpha and beta."
    details = browser.find_element(By.CSS_SELECTOR, ".msg.tool details")
    result = browser.find_element(By.CSS_SELECTOR, ".msg.tool .tool-result")
    assert not result.is_displayed()
    details.find_element(By.TAG_NAME, "summary").click()
    assert result.is_displayed() and "alpha" in result.text
    browser.save_screenshot(str(tmp_path / "read-file.png"))

    # kept: a reload shows the same blocks, and the next turn sends the same history
    browser.refresh()
    wait_ready(browser)
    assert [m["kind"] for m in messages(browser)] == ["user", "assistant", "tool", "assistant"]
    standin.script("Nothing more.")
    ask(browser, "Thanks")
    wait_turn_done(browser, 3)
    assert standin.chats[0]["messages"][:3] == second["messages"]
    assert standin.chats[0]["messages"][3:] == [{"role": "assistant", "content": "The file says alpha and beta."},
                                                {"role": "user", "content": "Thanks"}]


def confirm_box(browser):
    from selenium.webdriver.common.by import By

    return wait_for(lambda: (b := browser.find_elements(By.CSS_SELECTOR, ".tool-confirm")) and b[0].is_displayed()
                    and b[0], what="the confirmation")


def test_shell_command_waits_for_confirmation_and_always_allow(standin, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_tools(browser, standin)
    cmd = "echo one-$((6*7)); echo two >&2; exit 3"
    standin.script([tool_call("exec_shell_command", {"command": cmd}, "sh1")], "It printed one-42.")
    ask(browser, "Run it")
    box = confirm_box(browser)
    assert "exec_shell_command" in box.text and cmd in box.find_element(By.CSS_SELECTOR, ".tool-confirm-args").text
    browser.save_screenshot(str(tmp_path / "confirm.png"))
    time.sleep(0.5)
    # nothing runs until the user says so, and the turn waits
    assert standin.tool_calls == [] and len(standin.chats) == 1
    assert messages(browser)[-1]["status"] == "pending" and messages(browser)[-1]["badge"] == "waiting for you"
    box.find_element(By.CSS_SELECTOR, ".tool-run").click()
    shown = wait_turn_done(browser, 2)
    # streamed, with no x-tool-cwd: the settings name no directory
    assert standin.tool_calls == [{"body": {"tool": "exec_shell_command", "params": {"command": cmd}, "stream": True},
                                   "headers": {"content-type": "application/json"}}]
    block = shown[2]
    assert block["status"] == "done" and block["exit"] == "3" and not block["confirm"] and not block["open"]
    assert "one-42" in block["result"] and "two" in block["result"] and block["result"].endswith("[exit code: 3]")
    tool_msg = standin.chats[1]["messages"][2]
    assert tool_msg == {"role": "tool", "tool_call_id": "sh1", "content": block["result"]}
    assert browser.find_element(By.CSS_SELECTOR, ".msg.tool .tool-exit").text == "exit 3"

    # the same tool again asks again; ticking "always allow" runs it and skips later prompts
    standin.script([tool_call("exec_shell_command", {"command": "echo second"})], "Second done.")
    ask(browser, "Again")
    box = confirm_box(browser)
    assert standin.tool_calls == []
    box.find_element(By.CSS_SELECTOR, ".tool-confirm-always").click()
    box.find_element(By.CSS_SELECTOR, ".tool-run").click()
    wait_turn_done(browser, 4)
    assert [c["body"]["params"]["command"] for c in standin.tool_calls] == ["echo second"]
    standin.script([tool_call("exec_shell_command", {"command": "echo third"})], "Third done.")
    ask(browser, "Once more")
    shown = wait_turn_done(browser, 6)
    assert [c["body"]["params"]["command"] for c in standin.tool_calls] == ["echo third"]
    assert not any(m.get("confirm") for m in shown) and shown[-2]["result"] == "third\n\n[exit code: 0]"
    # the allowance shows (and can be taken back) in the conversation's tool panel
    browser.find_element(By.ID, "tools-toggle").click()
    allow = browser.find_element(By.CSS_SELECTOR, '.tool-row[data-tool="exec_shell_command"] .tool-always')
    assert allow.is_selected()
    assert not browser.find_element(By.CSS_SELECTOR, '.tool-row[data-tool="write_file"] .tool-always').is_selected()
    # another conversation starts without it
    browser.find_element(By.ID, "new-chat").click()
    assert not browser.find_element(
        By.CSS_SELECTOR, '.tool-row[data-tool="exec_shell_command"] .tool-always').is_selected()
    browser.find_element(By.ID, "tools-toggle").click()


def test_denied_and_stopped_calls_never_run(standin, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_tools(browser, standin)
    js(browser, "const c = document.getElementById('set-cwd'); c.value = arguments[0];"
                "c.dispatchEvent(new Event('input'));", str(tmp_path))
    standin.script([tool_call("write_file", {"path": "out.txt", "content": "x"}, "w1"),
                    tool_call("notes_append", {"text": "hi"}, "m1"), tool_call("notes_list", {}, "m2")],
                   "Fine, I will not.")
    ask(browser, "Write it")
    confirm_box(browser).find_element(By.CSS_SELECTOR, ".tool-deny").click()
    # an MCP tool that is not read-only asks too; the read-only one runs without asking
    box = wait_for(lambda: (b := browser.find_elements(By.CSS_SELECTOR, ".tool-confirm")) and "notes_append" in b[0].text
                   and b[0], what="the MCP tool's confirmation")
    assert standin.tool_calls == []
    box.find_element(By.CSS_SELECTOR, ".tool-run").click()
    wait_turn_done(browser, 2)
    assert [c["body"] for c in standin.tool_calls] == [{"tool": "notes_append", "params": {"text": "hi"}},
                                                       {"tool": "notes_list", "params": {}}]
    assert not (tmp_path / "out.txt").exists()
    assert standin.chats[1]["messages"][2:] == [
        {"role": "tool", "tool_call_id": "w1", "content": "The user denied this tool call."},
        {"role": "tool", "tool_call_id": "m1", "content": "appended"},
        {"role": "tool", "tool_call_id": "m2", "content": "note 1\nnote 2"}]

    # Stop while a confirmation waits: nothing runs, the call is answered as stopped next time
    standin.script([tool_call("exec_shell_command", {"command": "touch stopped.txt"}, "s1")], "Next answer.")
    ask(browser, "Touch it")
    confirm_box(browser)
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: js(browser, "return document.body.dataset.busy") == "", what="the turn to end")
    last = messages(browser)[-1]
    assert last["status"] == "stopped" and not last["confirm"] and last["badge"] == "cancelled"
    time.sleep(0.3)
    assert standin.tool_calls == [] and not (tmp_path / "stopped.txt").exists()
    standin.script("Okay.")
    ask(browser, "Never mind")
    wait_for(lambda: standin.chats, what="the next request")
    assert standin.chats[0]["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "s1", "content": "The user stopped this tool call."},
        {"role": "user", "content": "Never mind"}]


def test_disabled_tools_are_not_offered_and_hostile_calls_are_refused(standin, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_tools(browser, standin)
    js(browser, "const c = document.getElementById('set-cwd'); c.value = arguments[0];"
                "c.dispatchEvent(new Event('input'));", str(tmp_path))
    browser.find_element(By.ID, "tools-toggle").click()
    browser.find_element(By.CSS_SELECTOR, '.tool-row[data-tool="exec_shell_command"] .tool-enabled').click()
    browser.find_element(By.CSS_SELECTOR, '.tool-row[data-tool="read_file"] .tool-enabled').click()
    (tmp_path / "secret.txt").write_text("s3cret")
    browser.save_screenshot(str(tmp_path / "tools-panel.png"))
    # the model calls the disabled tools anyway, a tool the server does not list, and one with
    # arguments that are not an object: none of them reaches the server
    standin.script([tool_call("exec_shell_command", {"command": "touch pwned"}, "h1"),
                    tool_call("read_file", {"path": "secret.txt"}, "h2"),
                    tool_call("run_anything", {"x": 1}, "h3"),
                    tool_call("grep_search", "[1, 2]", "h4")],
                   "I could not.")
    ask(browser, "Do what you like")
    shown = wait_turn_done(browser, 2)
    names = offered(standin.chats[0])
    assert "exec_shell_command" not in names and "read_file" not in names and "grep_search" in names
    assert standin.tool_calls == [] and not (tmp_path / "pwned").exists()
    assert standin.chats[1]["messages"][2:] == [
        {"role": "tool", "tool_call_id": "h1",
         "content": 'Error: tool "exec_shell_command" is disabled by the user in this conversation'},
        {"role": "tool", "tool_call_id": "h2", "content": 'Error: tool "read_file" is disabled by the user in this conversation'},
        {"role": "tool", "tool_call_id": "h3", "content": 'Error: unknown tool "run_anything"'},
        {"role": "tool", "tool_call_id": "h4", "content": "Error: the arguments are not a JSON object: [1, 2]"}]
    assert [m["status"] for m in shown if m["kind"] == "tool"] == ["error"] * 4
    assert "s3cret" not in browser.find_element(By.ID, "messages").text

    # all tools off for the conversation: none offered (no "tools" field), a call is still refused
    browser.find_element(By.ID, "tools-all").click()
    assert all(not b.is_enabled() for b in browser.find_elements(By.CSS_SELECTOR, ".tool-enabled"))
    standin.script([tool_call("grep_search", {"pattern": "s3cret", "path": "."}, "h5")], "Still no.")
    ask(browser, "Search")
    wait_turn_done(browser, 4)
    assert "tools" not in standin.chats[0] and standin.tool_calls == []
    assert standin.chats[1]["messages"][-1] == {
        "role": "tool", "tool_call_id": "h5", "content": 'Error: tool "grep_search" is disabled by the user in this conversation'}
    # the choices belong to the conversation: a new one offers every tool again
    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_element(By.ID, "tools-all").is_selected()
    standin.script("Hi.")
    ask(browser, "Hello")
    wait_turn_done(browser, 1)
    assert "exec_shell_command" in offered(standin.chats[0]) and "read_file" in offered(standin.chats[0])


def test_tool_rounds_per_answer_are_bounded(standin, browser, tmp_path):
    (tmp_path / "a.txt").write_text("a")
    open_tools(browser, standin)
    js(browser, "for (const [id, v] of [['set-cwd', arguments[0]], ['set-tool-rounds', '2']]) {"
                "const c = document.getElementById(id); c.value = v; c.dispatchEvent(new Event('input')); }", str(tmp_path))
    loop = [tool_call("read_file", {"path": "a.txt"})]
    standin.script(loop, loop, loop, "never reached")
    ask(browser, "Loop forever")
    shown = wait_turn_done(browser, 3)
    # two rounds ran; the third request offered no tools, and its call was refused, ending the turn
    assert len(standin.tool_calls) == 2 and len(standin.chats) == 3
    assert offered(standin.chats[0]) and offered(standin.chats[1]) and "tools" not in standin.chats[2]
    assert [m["kind"] for m in shown] == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]
    tools_shown = [m for m in shown if m["kind"] == "tool"]
    assert [m["status"] for m in tools_shown] == ["done", "done", "error"]
    assert tools_shown[-1]["result"] == "Error: the limit of 2 tool rounds per answer was reached"
    # generated ids when the model sends none, one per call
    stored = js(browser, "return JSON.parse(localStorage.getItem('kvserve.conversations'))[0].messages")
    ids = [m["tool_call_id"] for m in stored if m["role"] == "tool"]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)


def test_calls_of_an_answer_cut_at_max_tokens_are_not_run(standin, browser, tmp_path):
    (tmp_path / "a.txt").write_text("a")
    open_tools(browser, standin)
    js(browser, "const c = document.getElementById('set-cwd'); c.value = arguments[0];"
                "c.dispatchEvent(new Event('input'));", str(tmp_path))
    standin.script(("length", [tool_call("read_file", {"path": "a.txt"}, "cut1")]), "never reached")
    ask(browser, "Read a.txt")
    shown = wait_turn_done(browser, 1)
    assert standin.tool_calls == [] and len(standin.chats) == 1
    assert shown[-1]["kind"] == "tool" and shown[-1]["status"] == "error"
    assert shown[-1]["result"] == "Error: the answer reached max tokens before its tool calls were complete"


@pytest.mark.parametrize("status", [404, 403])
def test_without_tools_the_page_sends_what_it_sent_before(bare_standin, browser, status):
    from selenium.webdriver.common.by import By

    bare_standin.no_tools_status = status
    assert httpx.get(bare_standin.url("/tools")).status_code == status
    open_fresh(browser, bare_standin)
    wait_ready(browser)
    assert js(browser, "return document.body.dataset.tools") == "0"
    assert not browser.find_element(By.ID, "tools-toggle").is_displayed()
    browser.find_element(By.ID, "settings-toggle").click()
    assert not browser.find_element(By.ID, "set-cwd").is_displayed()
    browser.find_element(By.ID, "settings-toggle").click()
    # even an answer with tool calls is shown as before: nothing runs, nothing more is asked
    bare_standin.script([tool_call("exec_shell_command", {"command": "true"})])
    ask(browser, "Hello")
    shown = wait_turn_done(browser, 1)
    assert bare_standin.chats == [{"messages": [{"role": "user", "content": "Hello"}], "stream": True,
                                   "stream_options": {"include_usage": True}, "model": MODEL}]
    assert [m["kind"] for m in shown] == ["user", "assistant"] and bare_standin.tool_calls == []
    bare_standin.script("Plain.")
    ask(browser, "Again")
    wait_turn_done(browser, 2)
    assert bare_standin.chats[0]["messages"] == [{"role": "user", "content": "Hello"},
                                                 {"role": "assistant", "content": ""},
                                                 {"role": "user", "content": "Again"}]


def test_shell_output_streams_and_stop_ends_the_running_command(standin, browser):
    from selenium.webdriver.common.by import By

    open_tools(browser, standin)
    # allowed ahead, from the conversation's tool panel: no confirmation for this conversation
    browser.find_element(By.ID, "tools-toggle").click()
    browser.find_element(By.CSS_SELECTOR, '.tool-row[data-tool="exec_shell_command"] .tool-always').click()
    browser.find_element(By.ID, "tools-toggle").click()
    cmd = "echo started; sleep 27.25; echo never"
    standin.script([tool_call("exec_shell_command", {"command": cmd}, "long1")], "Not reached.")
    ask(browser, "Run the long one")
    # the output shows while the command still runs
    running = wait_for(lambda: (m := messages(browser)[-1]) and m["kind"] == "tool" and m["status"] == "running"
                       and m["result"] == "started\n" and m, what="streamed output")
    assert running["badge"] == "running\u2026" and not running["confirm"]
    assert _sleepers("sleep 27.25")
    t0 = time.monotonic()
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: js(browser, "return document.body.dataset.busy") == "", timeout=5, what="the turn to end")
    assert time.monotonic() - t0 < 5
    last = messages(browser)[-1]
    assert last["status"] == "stopped" and last["result"] == "started\n\nThe user stopped this tool call."
    assert len(standin.chats) == 1  # no completion after a stop
    # the server ended the command with the request (its process group)
    wait_for(lambda: not _sleepers("sleep 27.25"), timeout=10, what="the command's process to end")
    standin.script("Ok.")
    ask(browser, "Next")
    wait_for(lambda: standin.chats, what="the next request")
    assert standin.chats[0]["messages"][-2] == {"role": "tool", "tool_call_id": "long1",
                                                "content": "started\n\nThe user stopped this tool call."}
    wait_turn_done(browser, 2)


def _sleepers(marker: str) -> list[str]:
    """Command lines of this machine's processes that contain ``marker`` (the test's unique command)."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "args="], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_real_kvserve_takes_the_tools_and_the_history_with_the_key(tiny_server, browser):
    """Against kvserve itself (the tiny random model answers; it calls no tool): the page lists
    the tools with the API key, and kvserve accepts its requests with tool definitions and a history
    holding a tool call and its result."""
    from selenium.webdriver.common.by import By

    # the tools' definitions take about 5,700 of the tiny model's (byte-level) tokens
    srv = tiny_server("-np", "1", "-c", "8192", "--tools", "all", "--api-key", "tool-key")
    listed = httpx.get(srv.url("/tools"), headers={"Authorization": "Bearer tool-key"}).json()
    open_fresh(browser, srv)
    wait_for(lambda: browser.find_element(By.ID, "key-overlay").is_displayed(), what="the key form")
    browser.find_element(By.ID, "key-input").send_keys("tool-key")
    browser.find_element(By.ID, "key-submit").click()
    wait_ready(browser)
    assert js(browser, "return document.body.dataset.tools") == str(len(listed)) and len(listed) >= 6
    history = [{"role": "user", "content": "Read a.txt"},
               {"role": "assistant", "content": "", "status": "done", "stats": {},
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "name": "read_file", "arguments": '{"path": "a.txt"}',
                "content": "a", "status": "done"},
               {"role": "assistant", "content": "It says a.", "status": "done", "stats": {}}]
    conv = {"id": "t", "title": "t", "messages": history, "updated": 1}
    js(browser, "localStorage.setItem('kvserve.conversations', arguments[0]);"
                "localStorage.setItem('kvserve.current', JSON.stringify('t'));", json.dumps([conv]))
    browser.refresh()
    wait_ready(browser)
    assert [m["kind"] for m in messages(browser)] == ["user", "assistant", "tool", "assistant"]
    js(browser, "const c = document.getElementById('set-max-tokens'); c.value = '4';"
                "c.dispatchEvent(new Event('input'));")
    ask(browser, "And now?")
    shown = wait_turn_done(browser, 3)
    assert [m["kind"] for m in shown] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    stored = js(browser, "return JSON.parse(localStorage.getItem('kvserve.conversations'))[0].messages")
    # 4 tokens generated (the random model's text may be blank), after a prompt that holds the tools
    assert stored[-1]["status"] == "done" and stored[-1]["stats"]["completion_tokens"] == 4
    assert stored[-1]["stats"]["prompt_tokens"] > 5000
