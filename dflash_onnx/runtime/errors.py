"""One exception type for everything a user can fix (bad paths, mismatched pairs, bad flags).

The CLI prints these as one line and exits 2; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """A problem with the user's input, stated so that they can act on it."""
