"""The built-in tools (filled in by the next commit)."""


def builtin_tools() -> list:
    """Every built-in tool, in llama-server's order."""
    return []
