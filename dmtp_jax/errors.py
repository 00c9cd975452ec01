"""The exceptions that mean "bad input" (printed as one line by the CLIs, never a traceback)."""

from dmtp_jax.checkpoint.safetensors_io import CheckpointError
from dmtp_jax.config import ConfigError
from dmtp_jax.decode.batch import RequestError
from dmtp_jax.sharding import MeshError

USER_ERRORS = (ConfigError, CheckpointError, RequestError, MeshError, ValueError, FileNotFoundError)
