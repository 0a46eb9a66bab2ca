"""The one exception type a user's mistake turns into.

`ColibriError` is a ValueError so that API callers can catch the usual type; the CLI turns it
into one line on stderr and exit status 2. Messages name the file or value at fault, say what was
expected and what was found, and what to do about it.
"""


class ColibriError(ValueError):
    """A problem with the user's input: a path, a model directory, a flag, a token id."""
