"""Placement of the clients axis on a device mesh.

A clients-placed value has a leading clients dim. With a mesh that has a ``clients`` axis, that
dim is pinned to the axis and every other dim keeps the sharding it had; when the number of
clients does not divide the axis size, the program pads the clients dim with zero-weight entries
(`padded_clients`). Works for both ``AxisType.Auto`` meshes (``with_sharding_constraint``) and
``AxisType.Explicit`` meshes (``jax.sharding.reshard``; the constraint is refused there).
Without a mesh, or a mesh without the axis, everything stays unsharded.

References:
    Rush et al. 2024, "DrJAX: Scalable and Differentiable MapReduce Primitives in JAX".
"""

from __future__ import annotations

import enum
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

P = PartitionSpec


class MeshAxis(enum.StrEnum):
    """Named mesh axes of the federated backend."""

    CLIENTS = "clients"
    MODEL = "model"


def clients_axis(mesh: Any) -> str | None:
    """The mesh axis the clients dim is sharded over, or None (no mesh / no such axis)."""
    if mesh is None or MeshAxis.CLIENTS not in tuple(mesh.axis_names):
        return None
    return str(MeshAxis.CLIENTS)


def clients_axis_size(mesh: Any) -> int:
    """Devices on the clients mesh axis (1 without a mesh or without the axis)."""
    axis = clients_axis(mesh)
    return 1 if axis is None else int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis])


def padded_clients(n: int, mesh: Any) -> int:
    """n rounded up to a multiple of the clients axis size.

    >>> padded_clients(7, None)
    7
    """
    if n < 1:
        raise ValueError(f"clients must be >= 1, got {n}; pass clients=<number of clients>")
    k = clients_axis_size(mesh)
    return -(-n // k) * k


def is_explicit(mesh: Any, axis: str | None) -> bool:
    """Whether ``axis`` of ``mesh`` is an Explicit axis (sharding lives in the types)."""
    if mesh is None or axis is None:
        return False
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    return types[axis] == jax.sharding.AxisType.Explicit


def abstract(mesh: Any) -> Any:
    """The AbstractMesh of a Mesh (an AbstractMesh is returned as is)."""
    return mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh


def _spec_of(x: jax.Array) -> tuple:
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()) or ())
    return spec + (None,) * (x.ndim - len(spec))


def constrain_leading(x: jax.Array, mesh: Any, axis: str | None) -> jax.Array:
    """Pin dim 0 of ``x`` to the clients axis; other dims keep their sharding.

    Explicit mesh: ``reshard`` to ``P(axis, *spec_of_the_rest)``. Auto mesh:
    ``with_sharding_constraint`` with the other dims unconstrained, so the partitioner
    keeps what it propagated (e.g. a ``model``-sharded feature dim).
    """
    if axis is None:
        return x
    if is_explicit(mesh, axis):
        rest = tuple(s for s in _spec_of(x)[1:])
        return jax.sharding.reshard(x, P(axis, *rest))
    spec = P(axis, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def unshard_leading(x: jax.Array) -> jax.Array:
    """Explicit mesh: gather dim 0 (other dims keep their sharding), e.g. before a ragged slice."""
    return jax.sharding.reshard(x, P(None, *_spec_of(x)[1:]))


def shard_clients_tree(tree: Any, mesh: Any) -> Any:
    """Apply `constrain_leading` to every leaf of a clients-placed pytree."""
    axis = clients_axis(mesh)
    return jax.tree.map(lambda x: constrain_leading(x, mesh, axis), tree)


def model_axis_size(mesh: Any) -> int:
    """Devices on the ``model`` mesh axis (1 without a mesh or without the axis)."""
    if mesh is None or MeshAxis.MODEL not in tuple(mesh.axis_names):
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[str(MeshAxis.MODEL)])


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def server_shardings(tree: Any, mesh: Any, axes_of: Any) -> Any:
    """A ``NamedSharding`` for every leaf of a server-placed pytree: the dims that
    ``axes_of(path)`` names (a tuple of mesh axis names or None per dim, ``path`` the leaf's key
    names) are split over those axes, the rest replicated.

    An axis the mesh lacks, a dim it does not divide, or ``axes_of`` returning None (or a
    tuple of the wrong length) leaves the dim replicated. With
    `memaudit.models.flax_llama.kernel_axes` this lays the attention and MLP kernels (and an
    optimizer state that mirrors them) over the ``model`` axis, Megatron-style.
    """
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

    def one(path, leaf):
        axes = axes_of(tuple(_key_name(k) for k in path))
        shape = getattr(leaf, "shape", ())
        if axes is None or len(axes) != len(shape):
            return NamedSharding(mesh, P())
        spec = [a if a in sizes and shape[i] % sizes[a] == 0 else None for i, a in enumerate(axes)]
        return NamedSharding(mesh, P(*spec))

    return jax.tree_util.tree_map_with_path(one, tree)
