"""One exception type for expected, user-facing errors.

The CLI prints ``orbitrl: error: <message>`` and exits 2 for these, without a traceback.
Messages are one line and name the file, key or request at fault.
"""


class OrbitError(Exception):
    """An expected error caused by bad input (a file, a config key, a request)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): how a
    library's error is quoted inside an OrbitError."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
