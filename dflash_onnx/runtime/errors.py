"""One exception type for everything a user can fix (bad paths, mismatched pairs, bad flags).

The CLI prints these as one line and exits 2; anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """A problem with the user's input, stated so that they can act on it."""


class Cancelled(Exception):
    """A request's caller gave up (a server's client left): raised between a long prefill's chunks, so the engine
    is free again within one chunk's time rather than after the whole prompt."""
