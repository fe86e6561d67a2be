"""llama-server's chat details its own test suite checks: the ``__verbose`` object (``--verbose`` or
``"verbose": true``) and the 400 for two trailing assistant messages."""

from __future__ import annotations


def test_verbose_prompt_and_two_trailing_assistant_messages(smollm2_server):
    import httpx

    msgs = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    for verbose in (True, False):
        r = httpx.post(smollm2_server.url("/chat/completions"), json={"messages": msgs, "max_tokens": 2,
                                                                       "verbose": verbose}, timeout=60)
        assert r.status_code == 200
        if verbose:
            assert r.json()["__verbose"] == {"prompt": "<|im_start|>system\nBook<|im_end|>\n<|im_start|>user\nWhat "
                                                       "is the best book<|im_end|>\n<|im_start|>assistant\n"}
        else:
            assert "__verbose" not in r.json()
    two = [*msgs, {"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}]
    r = httpx.post(smollm2_server.url("/chat/completions"), json={"messages": two, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Cannot have 2 or more assistant messages at the end of the list."
