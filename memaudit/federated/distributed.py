"""Multi-host start-up for the federated backend: `jax.distributed.initialize` when asked to.

A federated run on several hosts (or several processes on one host) runs the same command in
every process. Each process calls `maybe_initialize()` before touching a JAX device; it joins
the cluster when the environment says so, and is a no-op otherwise:

    JAX_COORDINATOR_ADDRESS=host0:1234   address of process 0's coordinator service
    JAX_NUM_PROCESSES=2                  number of processes
    JAX_PROCESS_ID=0                     this process (0 .. N-1)
    JAX_LOCAL_DEVICE_IDS=0,1             optional: devices this process owns

or, with none of these set, any cluster JAX detects by itself (SLURM, Open MPI, Cloud TPU,
Kubernetes via `jax.distributed.initialize()` auto-detection) when `MEMAUDIT_DISTRIBUTED=1`.
On CPU, cross-process collectives use gloo (`jax_cpu_collectives_implementation`).

After start-up, `jax.devices()` lists every process's devices; the trainer builds its clients
mesh over all of them, every process loads the same prepared data and samples the same cohort
(sampling is a pure function of seed and round), and only process 0 writes the run directory.

Example (two processes on one machine, two CPU devices each)::

    export XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu
    export JAX_COORDINATOR_ADDRESS=localhost:12355 JAX_NUM_PROCESSES=2
    JAX_PROCESS_ID=0 memaudit train configs/federated-tiny.yaml --out runs/fed &
    JAX_PROCESS_ID=1 memaudit train configs/federated-tiny.yaml --out runs/fed

References:
    JAX documentation, "Running JAX on multiple hosts" (`jax.distributed.initialize`).
"""

from __future__ import annotations

import os

import jax
from jax._src import distributed as jdist
from jax.experimental import multihost_utils

from memaudit.errors import MemauditError

_ENV_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_STARTED = {"done": False}


def requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for a multi-process start."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in _ENV_VARS) or env.get("MEMAUDIT_DISTRIBUTED") == "1"


def _int_env(env: dict[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise MemauditError(f"{name}={raw!r} is not an integer; set it to a process count or id") from None


def maybe_initialize(environ: dict[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` once when the environment asks for it.

    Returns True when this process is part of a multi-process cluster.
    """
    env = dict(os.environ if environ is None else environ)
    if _STARTED["done"]:
        return True
    if not requested(env):
        return False

    if jax.config.jax_platforms in (None, "", "cpu") or env.get("JAX_PLATFORMS", "") == "cpu":
        # CPU collectives across processes need gloo (the default has none).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    n, pid = _int_env(env, "JAX_NUM_PROCESSES"), _int_env(env, "JAX_PROCESS_ID")
    if n is not None:
        kwargs["num_processes"] = n
    if pid is not None:
        if n is not None and not 0 <= pid < n:
            raise MemauditError(f"JAX_PROCESS_ID={pid} is outside 0..{n - 1}; set it per process")
        kwargs["process_id"] = pid
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        kwargs["local_device_ids"] = [int(x) for x in env["JAX_LOCAL_DEVICE_IDS"].split(",")]
    jax.distributed.initialize(**kwargs)
    _STARTED["done"] = True
    return True


def barrier(name: str, *, timeout_s: float = 1800.0) -> None:
    """Wait until every process reaches `name` (the coordination service's barrier).

    Unlike a collective (`multihost_utils.sync_global_devices`), this tolerates one process
    being busy for minutes (process 0 preparing the data) without a gloo connect timeout.
    """
    client = getattr(jdist.global_state, "client", None)
    if client is None:
        multihost_utils.sync_global_devices(name)
        return
    client.wait_at_barrier(name, int(timeout_s * 1000))


def is_primary() -> bool:
    """True in the process that writes the run directory (process 0)."""
    return jax.process_index() == 0
