"""Ollama-specific formats: the Modelfile (:mod:`kvserve.ollama.modelfile`).

The Go chat templates that Modelfiles carry are rendered by the chat layer
(:mod:`kvserve.chat.go_template`); the store in Ollama's layout is :mod:`kvserve.store`.
"""

from kvserve.ollama.modelfile import (CreateRequest, FromSource, Message, Modelfile, ModelfileError,
                                      parse_modelfile, show_modelfile, show_parameters)

__all__ = ["CreateRequest", "FromSource", "Message", "Modelfile", "ModelfileError", "parse_modelfile",
           "show_modelfile", "show_parameters"]
