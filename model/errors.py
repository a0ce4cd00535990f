"""The two failures callers must tell apart: a model that cannot load, and input that cannot run."""


class ModelLoadError(Exception):
    """A model could not be loaded. The message names the file and, where relevant, the key."""


class CorruptFileError(ModelLoadError):
    """A file is there but cannot be read (truncated, not JSON, not a tokenizer): fetching or
    copying it again is the fix, which `load` says for a file from the Hugging Face cache."""


class TooLongError(ValueError):
    """The input has more tokens than the model has positions, and truncation was not asked for."""

    def __init__(self, n_tokens: int, max_tokens: int):
        self.n_tokens = n_tokens
        self.max_tokens = max_tokens
        super().__init__(
            f"input is {n_tokens:,} tokens long but the model takes at most {max_tokens:,}; "
            "shorten it or ask for truncation"
        )

    def __reduce__(self):
        # An exception unpickles as cls(*args), and args holds only the message: raised in a worker
        # process, it failed to unpickle in the parent (multiprocessing.Pool then hung for good).
        return type(self), (self.n_tokens, self.max_tokens), self.__dict__
