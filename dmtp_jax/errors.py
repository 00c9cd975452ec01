"""Our own error types: the only exceptions the CLIs print as one `error:` line (exit status 2).
Bad input derives from `UserError` (most also from `ValueError`); any other exception keeps its
traceback. `str(error)` is the line, `error.hint` an optional second. Imports nothing of ours.

Example:
    >>> print(format_user_error(UserError("--steps must be >= 1, got 0", hint="e.g. --steps 100")))
    error: --steps must be >= 1, got 0
    hint: e.g. --steps 100
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an expected, explained failure: one line (plus an optional hint), no traceback."""

    def __init__(self, message: str = "", *args, hint: str | None = None):
        super().__init__(message, *args)
        self.hint = hint


class InputError(UserError, ValueError):
    """A bad value given on the command line or in a config / data file."""


class ConfigError(UserError, ValueError):
    """A model config that cannot be used; the message names the offending key."""


class RequestError(UserError, ValueError):
    """Bad generation input: an option out of range, an empty prompt, a token outside the vocabulary, a
    request too long for the model."""


class DataError(UserError, ValueError):
    """A training data file that cannot be trained on (missing, empty, no valid record)."""


class WorkloadError(UserError, ValueError):
    """A missing workload file, an unknown workload name or a malformed record (one line)."""


class TrainingStopped(UserError, RuntimeError):
    """Training stopped on purpose with a clear reason (non-finite losses, a full disk)."""


class InexactBackendError(UserError, RuntimeError):
    """`--strict`: the exactness probe found that a verify block differs from single-token decoding."""


def one_line(text: str) -> str:
    """`text` on one line: its first non-empty line (tracebacks and tables never reach the user).

    Example:
        >>> one_line("bad thing\\n  details")
        'bad thing'
    """
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def format_user_error(error: BaseException) -> str:
    """`error: <message>` and, when the error has one, `hint: <hint>`."""
    out = f"error: {one_line(error) or type(error).__name__}"
    hint = getattr(error, "hint", None)
    return out + (f"\nhint: {one_line(hint)}" if hint else "")
