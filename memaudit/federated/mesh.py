"""The federated device mesh: ``clients`` x ``model`` axes over the visible JAX devices.

A bottom module: the checks made before anything is written (`memaudit.run.checks`) and the
federated trainer both build the mesh from here. jax is imported inside `build_mesh` (an
import-time cost of seconds that `memaudit --help` and the config checks must not pay).
"""

from __future__ import annotations

from typing import Any

import jax

from memaudit.errors import MemauditError
from memaudit.federated.sharding import MeshAxis
from memaudit.models.presets import get_preset


def build_mesh(mesh_clients: int | None, mesh_model: int = 1, preset: Any = None) -> Any:
    """The federated device mesh: ``clients`` x ``model`` (None on one device).

    ``mesh_model`` devices split each client's attention and MLP weights (tensor parallel,
    `memaudit.models.flax_llama.PARTITION_RULES`); ``mesh_clients`` (default: all devices /
    mesh_model) share the clients. With mesh_model 1 the mesh is the 1-D ``clients`` one. A
    mesh larger than the visible devices, or a model axis that does not divide the preset's
    heads, kv heads or intermediate size, is a one-line error.
    """
    devices = jax.devices()
    if mesh_model < 1:
        raise MemauditError(f"federated.mesh_model={mesh_model} must be >= 1")
    k = max(len(devices) // mesh_model, 1) if mesh_clients is None else mesh_clients
    if k * mesh_model > len(devices):
        raise MemauditError(
            f"federated.mesh_clients={k} x federated.mesh_model={mesh_model} = {k * mesh_model} "
            f"devices exceeds the {len(devices)} visible devices; make the product at most "
            f"{len(devices)}")
    if preset is not None and mesh_model > 1:  # a preset name, or a shape (`LlamaPreset`)
        from memaudit.models.flax_llama import check_model_axis  # lazy: flax (~2.5 s) only here

        shape = get_preset(preset) if isinstance(preset, str) else preset
        what = f"model.preset={preset}" if isinstance(preset, str) else "the model.init_from checkpoint"
        try:
            check_model_axis(shape, mesh_model)
        except ValueError as e:
            raise MemauditError(f"{e} ({what})") from None
    if k * mesh_model <= 1:
        return None
    auto = jax.sharding.AxisType.Auto
    if mesh_model == 1:
        return jax.make_mesh((k,), (MeshAxis.CLIENTS,), axis_types=(auto,), devices=devices[:k])
    return jax.make_mesh((k, mesh_model), (MeshAxis.CLIENTS, MeshAxis.MODEL), axis_types=(auto, auto),
                         devices=devices[: k * mesh_model])
