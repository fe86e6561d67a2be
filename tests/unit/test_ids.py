"""One id helper (kvserve.serving.ids.new_id) writing each dialect's id format."""

from __future__ import annotations

import re

from kvserve.faces.anthropic import _anthropic_id
from kvserve.faces.responses import _responses_id
from kvserve.serving.ids import ALNUM, HEX, new_id


def test_each_dialects_format():
    assert re.fullmatch(r"chatcmpl-[A-Za-z0-9]{32}", new_id("chatcmpl-"))
    assert re.fullmatch(r"cmpl-[A-Za-z0-9]{32}", new_id("cmpl-"))
    assert re.fullmatch(r"msg_[A-Za-z0-9]{24}", _anthropic_id("msg_"))
    assert re.fullmatch(r"toolu_[A-Za-z0-9]{24}", _anthropic_id("toolu_"))
    for prefix in ("resp_", "msg_", "rs_", "fc_", "call_"):
        assert re.fullmatch(prefix + r"[0-9a-f]{48}", _responses_id(prefix))


def test_ids_use_the_whole_alphabet_and_differ():
    ids = {new_id("x-", 64) for _ in range(200)}
    assert len(ids) == 200
    assert set("".join(i[2:] for i in ids)) == set(ALNUM)  # 12,800 draws over 62 characters
    assert set("".join(new_id("", 64, HEX) for _ in range(50))) == set(HEX)
    assert new_id("p", 0) == "p"
