"""Random ids for responses and their parts, in each dialect's format (:func:`new_id`).

One helper, the formats as each API writes them (the prefix and the characters after it):

============================  ========================================  ==================
dialect                       ids                                       after the prefix
============================  ========================================  ==================
OpenAI chat / completions     ``chatcmpl-``, ``cmpl-`` (llama-server's   32 letters/digits
                              and vLLM's too)
Anthropic messages            ``msg_``, ``toolu_``                      24 letters/digits
OpenAI Responses              ``resp_``, ``msg_``, ``rs_``, ``fc_``,     48 hex digits
                              ``call_``
============================  ========================================  ==================
"""

from __future__ import annotations

import secrets
import string

__all__ = ["ALNUM", "HEX", "new_id"]

#: letters and digits (OpenAI's chat ids, Anthropic's)
ALNUM = string.ascii_letters + string.digits
#: lower-case hex digits (the Responses API's ids)
HEX = "0123456789abcdef"


def new_id(prefix: str, length: int = 32, alphabet: str = ALNUM) -> str:
    """``prefix`` + ``length`` characters drawn from ``alphabet`` with :mod:`secrets`
    (``new_id("chatcmpl-")``: 32 letters and digits; ``new_id("msg_", 24)``: Anthropic's;
    ``new_id("resp_", 48, HEX)``: the Responses API's)."""
    return prefix + "".join(secrets.choice(alphabet) for _ in range(length))
