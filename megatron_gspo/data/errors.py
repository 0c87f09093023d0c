"""The one error type of the prompt data: raised at open time, before any training process group starts."""


class DataError(ValueError):
    """A prompt file that cannot be used; the message names the file, the row (0-based) and the key."""
