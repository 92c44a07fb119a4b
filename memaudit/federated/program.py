"""`@federated_program`: the context in which the federated primitives may be used.

A federated program is a function over server-placed values (plain arrays) and clients-placed
values (pytrees whose leaves have a leading clients dim of size ``clients``). The decorator
fixes the number of clients n and the optional mesh, checks the leading size of the
clients-placed arguments (one-line ``ValueError``), pads them with zero rows when n does not
divide the ``clients`` mesh axis, and strips the padding from clients-placed outputs.
Every aggregation masks the padding, so results equal the unpadded run.

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX"
    (now DrJAX).

>>> import jax.numpy as jnp
>>> from memaudit.federated import federated_broadcast, federated_mean
>>> @federated_program(clients=3)
... def twice(x):
...     return federated_mean(federated_broadcast(x) * 2.0)
>>> float(twice(jnp.float32(1.5)))
3.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from memaudit.federated import sharding as shd


class ClientsCountError(ValueError):
    """A clients-placed value whose leading size is not the program's number of clients (a
    program declared with ``clients=N`` called, or traced, with another count)."""


@dataclasses.dataclass(frozen=True)
class ProgramContext:
    """The static facts a federated primitive needs: real and padded client counts, mesh."""

    n: int  # real clients
    n_pad: int  # clients dim as laid out (n rounded up to the clients axis size)
    mesh: Any  # jax.sharding.Mesh | AbstractMesh | None
    axis: str | None  # clients mesh axis or None
    map_strategy: str = "auto"  # default execution strategy of federated_map
    clients_per_step: int = 1  # clients per step of the scan strategy's loop (vmapped within it)
    # id(clients-placed value) -> (that value, the server value it was broadcast from): lets
    # the scan strategy of federated_map read the server value instead of a per-client copy
    broadcasts: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


_LOCAL = threading.local()


def _stack() -> list[ProgramContext]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


def current_context(what: str = "a federated primitive") -> ProgramContext:
    """The innermost program context; a clear error outside any program."""
    stack = _stack()
    if not stack:
        raise RuntimeError(
            f"{what} was called outside a federated program; decorate the calling function "
            "with @federated_program(clients=n) (from memaudit.federated)"
        )
    return stack[-1]


def _check_strategy(map_strategy: str) -> None:
    if map_strategy not in ("vmap", "scan", "auto"):
        raise ValueError(
            f"map_strategy must be 'vmap', 'scan' or 'auto', got {map_strategy!r}"
        )


def check_clients_per_step(clients_per_step: Any) -> None:
    """One-line ValueError unless ``clients_per_step`` is a positive int."""
    if not isinstance(clients_per_step, int) or isinstance(clients_per_step, bool) or clients_per_step < 1:
        raise ValueError(f"clients_per_step must be a positive int, got {clients_per_step!r}; "
                         "set federated.clients_per_step to 1 or more")


@contextlib.contextmanager
def program_context(clients: int, mesh: Any = None, map_strategy: str = "auto",
                    clients_per_step: int = 1):
    """Enter a federated program context directly (the decorator does this for you)."""
    if not isinstance(clients, int) or isinstance(clients, bool) or clients < 1:
        raise ValueError(f"clients must be a positive int, got {clients!r}")
    _check_strategy(map_strategy)
    check_clients_per_step(clients_per_step)
    ctx = ProgramContext(clients, shd.padded_clients(clients, mesh), mesh, shd.clients_axis(mesh),
                         map_strategy, clients_per_step)
    _stack().append(ctx)
    try:
        with contextlib.ExitStack() as stack:
            if isinstance(mesh, jax.sharding.Mesh) and ctx.axis is not None:
                with contextlib.suppress(ValueError):  # refused under jit: the caller sets it
                    stack.enter_context(jax.set_mesh(mesh))
            if mesh is not None and shd.is_explicit(mesh, ctx.axis):
                stack.enter_context(jax.sharding.use_abstract_mesh(shd.abstract(mesh)))
            yield ctx
    finally:
        _stack().pop()


def check_leading(tree: Any, n: int, what: str) -> None:
    """Raise a one-line ValueError unless every leaf of ``tree`` has leading size n."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = jnp.shape(leaf)
        if len(shape) == 0 or shape[0] != n:
            where = jax.tree_util.keystr(path) or "value"
            raise ClientsCountError(
                f"{what}{where} has shape {tuple(shape)} but a clients-placed value needs leading "
                f"size {n} (one row per client); pass an array of shape ({n}, ...)"
            )


def _pad_rows(x: jax.Array, n_pad: int) -> jax.Array:
    extra = n_pad - x.shape[0]
    if extra == 0:
        return x
    return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)], axis=0)


def _strip(out: Any, ctx: ProgramContext, placed_out: Any) -> Any:
    if ctx.n_pad == ctx.n:
        return out

    def strip(x):
        if jnp.ndim(x) == 0 or jnp.shape(x)[0] != ctx.n_pad:
            return x
        if shd.is_explicit(ctx.mesh, ctx.axis):  # a ragged slice of a sharded dim is refused
            x = shd.unshard_leading(x)
        return x[: ctx.n]

    if placed_out is None:  # auto: leaves laid out over the padded clients dim
        return jax.tree.map(strip, out)
    if isinstance(placed_out, bool):
        return jax.tree.map(strip, out) if placed_out else out
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for i in placed_out:
        outs[i] = jax.tree.map(strip, outs[i])
    return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]


def federated_program(
    fn: Callable | None = None,
    *,
    clients: int,
    mesh: Any = None,
    placed: Sequence[int | str] = (),
    placed_out: bool | Sequence[int] | None = None,
    map_strategy: str = "auto",
    clients_per_step: int = 1,
) -> Callable:
    """Declare a federated program over ``clients`` clients.

    Args:
        fn: the program; the federated primitives may be called inside it.
        clients: number of clients n (static).
        mesh: optional ``jax.sharding.Mesh``; a ``clients`` axis shards the clients dim.
        placed: argument indices or names of clients-placed arguments (leading size n); they are
            checked, padded to the mesh and sharded over the clients axis.
        placed_out: which outputs are clients-placed, for stripping the padding: None (default)
            strips every output leaf whose leading size is the padded count, True/False all/none,
            or a sequence of output indices. Only matters when n does not divide the axis.
        map_strategy: default execution strategy of ``federated_map`` inside the program:
            ``"vmap"``, ``"scan"`` or ``"auto"`` (see `memaudit.federated.federated_map`).
        clients_per_step: under the scan strategy, the clients each step of the loop runs
            (vmapped within the step; the last step is filled with zero rows that count for
            nothing): memory for that many clients' work at once, in fewer, wider steps.

    Returns:
        The wrapped program; it composes with ``jax.jit``, ``jax.grad``, ``jax.vmap``. Called
        eagerly it sets ``mesh`` as the current mesh; under ``jax.jit`` set it around the call
        (``with jax.set_mesh(mesh): jax.jit(program)(...)``) or pass inputs already placed on
        the mesh, since ``jax.set_mesh`` is refused inside a trace.
    """
    if fn is None:
        return functools.partial(
            federated_program, clients=clients, mesh=mesh, placed=placed, placed_out=placed_out,
            map_strategy=map_strategy, clients_per_step=clients_per_step,
        )
    _check_strategy(map_strategy)
    check_clients_per_step(clients_per_step)
    sig = inspect.signature(fn)
    param_names = list(sig.parameters)

    @functools.wraps(fn)
    def program(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        with program_context(clients, mesh, map_strategy, clients_per_step) as ctx:
            for key in placed:
                name = param_names[key] if isinstance(key, int) else key
                if name not in bound.arguments:
                    continue
                value = bound.arguments[name]
                check_leading(value, ctx.n, f"argument {name!r} ")
                value = jax.tree.map(lambda x: _pad_rows(jnp.asarray(x), ctx.n_pad), value)
                bound.arguments[name] = shd.shard_clients_tree(value, ctx.mesh)
            out = fn(*bound.args, **bound.kwargs)
            return _strip(out, ctx, placed_out)

    program.clients = clients  # type: ignore[attr-defined]
    program.mesh = mesh  # type: ignore[attr-defined]
    return program
