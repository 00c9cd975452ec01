"""Where dmtp-jax keeps its files: one cache directory for the compilation cache, auto's verdicts
and the built-in tiny checkpoint."""

from __future__ import annotations

import os

CACHE_ENV = "DMTP_JAX_CACHE"


def cache_root() -> str:
    """dmtp-jax's cache directory: `$DMTP_JAX_CACHE`, else `~/.cache/dmtp-jax`."""
    return os.path.expanduser(os.environ.get(CACHE_ENV, "~/.cache/dmtp-jax"))
