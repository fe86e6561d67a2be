"""Moved to :mod:`kvserve.serving.chat_output` (the serving layer's chat planner needs
:class:`OutputMode`); this name stays for the faces and tests that import it."""

from kvserve.serving.chat_output import ChoiceOutput, OutputMode, marker_texts, preserved_token_ids

__all__ = ["ChoiceOutput", "OutputMode", "marker_texts", "preserved_token_ids"]
