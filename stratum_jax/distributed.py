"""Multi-host start-up: `--coordinator HOST:PORT --num-processes P --process-id I` -> jax.distributed.

Every process of the job runs the same command with its own --process-id; after `initialize`,
jax.devices() lists the devices of all processes and the tensor-parallel mesh spans them
(stratum_jax/tensor_parallel.py). JAX is multi-controller: each process runs the whole engine (scheduler,
page pool, sampling bookkeeping) on the same requests, and issues the same device programs, whose
collectives cross hosts. RuntimeConfig refuses the settings whose host-side choices depend on each
process's own timing (HAB, the DMLP).

It must run before anything touches a jax backend (jax.devices(), an array): the entry points call it
right after parsing their flags.
"""
from __future__ import annotations

import logging

import jax

from stratum_jax.config import RuntimeConfig

log = logging.getLogger(__name__)


def init_distributed(config: RuntimeConfig) -> None:
    """Joins the job described by config's multi-host flags (nothing with --num-processes 1)."""
    if config.num_processes == 1:
        return
    # On CPU (tests, a laptop) the processes' collectives go through gloo over TCP.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=config.coordinator, num_processes=config.num_processes,
                               process_id=config.process_id)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
