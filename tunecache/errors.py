"""Error text, bounded: how every message, log line and stored error of tunecache shortens one.

`short` keeps an error's start (what failed) and its end (the innermost cause) when it is too
long; `last_line` is a traceback's final line (the exception), for one table cell. No imports
beyond the standard library: the service and the isolated processes use it too.
"""

from __future__ import annotations


def short(error: BaseException | str, limit: int = 300) -> str:
    """`Type: message` for an exception (the text itself for a string), at most about `limit`
    characters: past it, its first and last halves around an elision mark."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    if len(text) <= limit:
        return text
    mark = "\n...\n" if "\n" in text else " ... "
    return text[: limit // 2] + mark + text[-(limit // 2) :]


def last_line(text: str, limit: int = 120) -> str:
    """The last non-blank line of `text` (a traceback's exception), at most `limit` characters."""
    lines = text.strip().splitlines()
    return lines[-1][:limit] if lines else ""
