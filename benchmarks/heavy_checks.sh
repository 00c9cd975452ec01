#!/usr/bin/env bash
# The checks the default `python -m pytest -q` leaves out (pytest marker `heavy`): the same contracts
# on more families, meshes and variants, multi-process training, real signals and kills. About as long
# as the default suite on 2 CPU cores. Extra arguments go to pytest (e.g. `-n 0 -k sharding`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -m heavy "$@"
