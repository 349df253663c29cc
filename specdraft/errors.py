"""One exception type for every user-facing error.

The CLI prints ``error: <message>`` and exits non-zero for it; anything else is a bug and
keeps its traceback.
"""


class SpecdraftError(Exception):
    """A problem with the user's input or environment, explained in one line."""
