"""Argument types shared by the command-line tools (`infer.py`, `train.py`)."""

import argparse


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
