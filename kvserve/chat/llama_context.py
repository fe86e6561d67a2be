"""The template variables llama-server adds to a Jinja chat template's context.

llama.cpp's chat layer (``common/chat.cpp``) renders every Jinja template with
``enable_thinking`` defined (true unless thinking is turned off) and, for two template
families it recognises by their text, the variables those templates read:

* Llama 3.x (the template writes an ``<|start_header_id|>ipython<|end_header_id|>`` turn):
  ``date_string``, today as ``%d %b %Y`` (e.g. ``06 Dec 2026``; without it the template
  writes its own fallback, "26 Jul 2024") and ``tools_in_user_message: false`` (the tools
  are described in the system turn);
* firefunction v2 (the template writes `` functools[``): ``functions``, the request's tools
  as JSON indented by 2 ("" without tools), and ``datetime``, now as ``%b %d %Y %H:%M:%S GMT``
  (the template concatenates both, so without them it cannot render at all).

Times are local, as llama.cpp's ``format_time`` takes them. These are what a server adds;
:class:`kvserve.chat.template.ChatTemplate` itself renders as transformers does (no
variables of its own), and a request's ``chat_template_kwargs`` still override them.
"""

from __future__ import annotations

import json
from datetime import datetime

__all__ = ["LLAMA3_MARKER", "FIREFUNCTION_MARKER", "family_context"]

#: the text llama.cpp recognises a Llama 3.1/3.2/3.3 template by
LLAMA3_MARKER = "<|start_header_id|>ipython<|end_header_id|>"
#: the text llama.cpp recognises a firefunction v2 template by
FIREFUNCTION_MARKER = " functools["


def family_context(source: str, tools: list | None, now: datetime | None = None) -> dict:
    """The family variables llama-server gives the template ``source`` (see the module docstring).

    Args:
        source: the Jinja template text.
        tools: the request's tool definitions (OpenAI JSON schemas) or None.
        now: the time to write (default: now, local time).

    Returns:
        A dict of template variables, empty for every other template.
    """
    if LLAMA3_MARKER in source:
        now = now or datetime.now()
        return {"date_string": now.strftime("%d %b %Y"), "tools_in_user_message": False}
    if FIREFUNCTION_MARKER in source:
        now = now or datetime.now()
        return {"functions": json.dumps(tools, indent=2, ensure_ascii=False) if tools else "",
                "datetime": now.strftime("%b %d %Y %H:%M:%S GMT")}
    return {}
