"""User-facing errors.

    from specdec_runtime.errors import SpecdecError
    raise SpecdecError("prompt 'q3' has 9000 tokens but the target's context is 8192: shorten it")

Anything a user can cause (a wrong model name, a tokenizer mismatch, a prompt longer than the
context, a bad option) is raised as `SpecdecError` before expensive work starts; the CLI prints
its message without a traceback.
"""


class SpecdecError(Exception):
    """A mistake the user can fix; the message says how."""
