"""Many hosts: the flags every launcher takes, and `jax.distributed` start-up.

    --coordinator_address=HOST:PORT --num_processes=N --process_id=i     explicit
    --distributed                                                       jax's own detection
                                                                        (SLURM, Open MPI, TPU)
    initialize()      call once, first thing after the flags are read, before jax is used
    is_writer()       process 0: the one that writes outputs, summaries and logs results
    barrier(name)     every process waits here for every other one

One SPMD program over every process's devices: each process runs the same host loop over the same
inputs (the scheduler decides from arrival order and token counts only, never from wall-clock time
or set order, `core/data_parallel.py`), so their plans agree step for step and each feeds its own
devices the same global arrays. That is what jax's multi-controller model asks, and it needs no
broadcast of plans (a plan per step to every process would put a host round trip on the hot
path). A process that dies makes the others fail in their next collective or at the coordinator's
heartbeat (`--heartbeat_timeout_s`), with jax's error naming the lost task.
"""

from __future__ import annotations

import logging

from absl import flags

log = logging.getLogger(__name__)

flags.DEFINE_string(
    "coordinator_address",
    None,
    "host:port of process 0's coordination service, for a run over many processes (hosts); "
    "with --num_processes and --process_id. Default: one process.",
)
flags.DEFINE_integer(
    "num_processes", None, "Processes in a multi-host run (with --coordinator_address)."
)
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes - 1.")
flags.DEFINE_bool(
    "distributed",
    False,
    "Start jax.distributed with its own cluster detection (SLURM, Open MPI, Cloud TPU) instead "
    "of the three explicit flags. Default: False.",
)
flags.DEFINE_integer(
    "heartbeat_timeout_s",
    30,
    "Seconds after which the coordinator declares a silent process dead (and the run fails "
    "with an error naming it) in a multi-host run. Default: 30.",
)

FLAGS = flags.FLAGS


def wanted(fv: flags.FlagValues = FLAGS) -> bool:
    """Whether the flags ask for a multi-process run; ValueError naming what is missing."""
    explicit = [fv.coordinator_address, fv.num_processes, fv.process_id]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError(
                "--coordinator_address, --num_processes and --process_id go together; got "
                f"coordinator_address={fv.coordinator_address!r}, "
                f"num_processes={fv.num_processes!r}, process_id={fv.process_id!r}"
            )
        if not 0 <= fv.process_id < fv.num_processes:
            raise ValueError(
                f"--process_id={fv.process_id} must be in [0, --num_processes={fv.num_processes})"
            )
        return True
    return bool(fv.distributed)


def initialize(fv: flags.FlagValues = FLAGS) -> None:
    """Starts jax.distributed when the flags ask for it (a no-op otherwise). On CPU the
    cross-process collectives go over gloo (TCP)."""
    if not wanted(fv):
        return
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {"heartbeat_timeout_seconds": fv.heartbeat_timeout_s}
    if fv.coordinator_address is not None:
        kwargs.update(
            coordinator_address=fv.coordinator_address,
            num_processes=fv.num_processes,
            process_id=fv.process_id,
        )
    jax.distributed.initialize(**kwargs)
    log.info(
        "process %d of %d: %d local, %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_writer() -> bool:
    """Process 0 (or the only one) writes outputs and summaries."""
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op in a one-process run)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def agree(value: int) -> int:
    """Process 0's `value` in every process (a one-process run returns `value`)."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
