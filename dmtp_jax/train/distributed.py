"""`jax.distributed` initialisation: flags, else `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` /
`JAX_PROCESS_ID`, else JAX's cluster detection (SLURM, Open MPI, TPU pods); gloo on CPU.

Example:
    >>> initialize_distributed()          # single process: does nothing
    False
"""

from __future__ import annotations

import os

import jax

from dmtp_jax.errors import InputError

ENV_KEYS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _cluster_detected() -> bool:
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return True
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return True
    return bool(os.environ.get("TPU_WORKER_HOSTNAMES", "").count(","))


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Initialises `jax.distributed` when flags, environment or a cluster ask for several processes;
    returns whether it did. Must run before any JAX computation."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit:
        missing = [n for n, v in (("--coordinator", coordinator), ("--num-processes", num_processes),
                                  ("--process-id", process_id)) if v is None]
        if missing:
            raise InputError(f"multi-process training needs {', '.join(missing)} "
                             f"(flags or {', '.join(ENV_KEYS)})")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise InputError(f"--process-id {process_id} is outside [0, --num-processes {num_processes})")
        if num_processes == 1:
            return False
    elif not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # only affects the CPU backend
    if explicit:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)
    else:
        jax.distributed.initialize()
    return True

