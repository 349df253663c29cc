"""One exception type for every user-facing error.

The CLI prints ``error: <message>`` and exits with code 2 for it; anything else is a bug and
keeps its traceback.
"""


class SpecdraftError(Exception):
    """A problem with the user's input or environment, explained in one line: text embedded from
    another library's error (often several lines) is folded onto it; other spacing is kept."""

    def __str__(self) -> str:
        return " ".join(part.strip() for part in super().__str__().splitlines() if part.strip())


class SpecdraftNote(UserWarning):
    """Something the user should know that needs nothing done (e.g. a drafter trained on another
    quantization of the same model): the CLI prints it as one ``note:`` line."""
