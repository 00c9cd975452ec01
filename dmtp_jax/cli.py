"""What the command-line tools (`infer.py`, `train.py`) share: argument types, an argparse parser
whose errors are one line, and the one place that turns our error types into exit status 2.

Every CLI error is one `error:` line plus at most one `hint:` line on stderr, exit status 2, and
nothing on stdout before it. Only `dmtp_jax.errors.UserError` (and argparse's own errors) get
this treatment; any other exception is a bug and keeps its traceback.

Example:
    >>> parser = ArgumentParser(prog="tool")
    >>> _ = parser.add_argument("--n", type=int)
    >>> parser.parse_args(["--n", "3"]).n
    3
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from dmtp_jax.errors import UserError, format_user_error, one_line


def int_list(text: str) -> list[int]:
    """`"1, 2,3"` -> `[1, 2, 3]`; anything else is a one-line argparse error.

    Example:
        >>> int_list("1, 2,3")
        [1, 2, 3]
    """
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are `error: ...` and `hint: run '<prog> --help' ...`
    (two lines, exit status 2) instead of the whole usage. Subparsers inherit the class.

    Example:
        >>> ArgumentParser(prog="infer.py").parse_args(["--bogus"])  # doctest: +SKIP
        error: unrecognized arguments: --bogus
        hint: run 'infer.py --help' for the options
    """

    def error(self, message: str):
        sys.stderr.write(f"error: {one_line(message)}\nhint: run '{self.prog} --help' for the options\n")
        sys.exit(2)


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`handler(args)`; a `UserError` becomes its one-line message on stderr and exit status 2,
    Ctrl-C exit status 130. Every other exception propagates with its traceback.

    Example:
        >>> def bad(args):
        ...     raise UserError("--steps must be >= 1")
        >>> run_command(bad, argparse.Namespace())  # prints "error: --steps must be >= 1" to stderr
        2
    """
    try:
        return handler(args)
    except UserError as e:
        sys.stdout.flush()
        print(format_user_error(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("error: interrupted", file=sys.stderr)
        return 130
