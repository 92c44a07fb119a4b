"""The 4D grid: `ParallelDims(data, x, y, z)`, named mesh axes and one process group per axis slice.

Rank layout: x varies fastest, then y, then z, then data:
``rank = x_i + X * (y_i + Y * (z_i + Z * d_i))``.

>>> d = ParallelDims(data=2, x=2, y=1, z=2)
>>> d.world_size, d.coords(5)
(8, {'data': 1, 'x': 1, 'y': 0, 'z': 0})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import LlamaConfig


class MeshAxis(StrEnum):
    DATA = "data"
    X = "x"
    Y = "y"
    Z = "z"


_ORDER = (MeshAxis.X, MeshAxis.Y, MeshAxis.Z, MeshAxis.DATA)  # fastest first


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of the grid. `world_size = data * x * y * z`.

    Args:
      data: data-parallel degree. x: splits a normal layer's in-features (the hidden dim of
        the residual stream). y: splits a normal layer's out-features (heads, MLP columns,
        vocabulary). z: shards each remaining weight block (FSDP-like); the batch is split
        over data x z.

    References: AxoNN (Singh et al., SC'24), Section III.
    """

    data: int = 1
    x: int = 1
    y: int = 1
    z: int = 1

    def __post_init__(self) -> None:
        for a in MeshAxis:
            v = getattr(self, a.value)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{a.value}={v!r} must be a positive integer; use 1 to disable that axis")

    @classmethod
    def from_config(cls, pc: Any) -> ParallelDims:
        return cls(data=pc.data, x=pc.x, y=pc.y, z=pc.z)

    @property
    def world_size(self) -> int:
        return self.data * self.x * self.y * self.z

    @property
    def tp_size(self) -> int:
        return self.x * self.y * self.z

    def size(self, axis: MeshAxis | str) -> int:
        return getattr(self, MeshAxis(axis).value)

    def grid(self) -> tuple[int, int, int, int]:
        return (self.data, self.x, self.y, self.z)

    def coords(self, rank: int) -> dict[str, int]:
        out, r = {}, rank
        for a in _ORDER:
            n = self.size(a)
            out[a.value] = r % n
            r //= n
        return {a.value: out[a.value] for a in MeshAxis}

    def rank_of(self, *, data: int = 0, x: int = 0, y: int = 0, z: int = 0) -> int:
        return x + self.x * (y + self.y * (z + self.z * data))

    def axis_slices(self, axis: MeshAxis | str) -> list[list[int]]:
        """Every slice of ranks along `axis` (the ranks that differ only in that coordinate)."""
        axis = MeshAxis(axis)
        others = [a for a in MeshAxis if a != axis]
        slices: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            slices.setdefault(tuple(c[a.value] for a in others), []).append(r)
        return list(slices.values())

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"parallel grid data*x*y*z = {self.data}*{self.x}*{self.y}*{self.z} = {self.world_size} "
                f"but {world_size} processes run; choose degrees whose product is {world_size}"
            )

    def check_model(self, cfg: LlamaConfig) -> None:
        """One-line ValueError when a model dimension does not divide by its axis."""
        checks = [
            ("num_attention_heads", cfg.num_attention_heads, MeshAxis.Y, self.y),
            ("num_key_value_heads", cfg.num_key_value_heads, MeshAxis.Y, self.y),
            ("hidden_size", cfg.hidden_size, MeshAxis.X, self.x),
            ("intermediate_size", cfg.intermediate_size, MeshAxis.Y, self.y),
            ("vocab_size", cfg.vocab_size, MeshAxis.Y, self.y),
        ]
        for name, value, axis, deg in checks:
            if value % deg:
                raise ValueError(
                    f"model {name}={value} is not divisible by parallel.{axis}={deg}; "
                    f"choose parallel.{axis} dividing {value}"
                )
        if getattr(cfg, "tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings=true is not supported by the tensor-parallel grid; untie the LM head")


@dataclass
class ProcessGroups:
    """This rank's coordinates and, per axis, the group of the slice it belongs to (None if size 1)."""

    dims: ParallelDims
    rank: int
    coords: dict[str, int]
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    def group(self, axis: MeshAxis | str) -> Any:
        return self.groups.get(MeshAxis(axis).value)

    def index(self, axis: MeshAxis | str) -> int:
        return self.coords[MeshAxis(axis).value]

    def size(self, axis: MeshAxis | str) -> int:
        return self.dims.size(axis)

    @property
    def batch_index(self) -> int:
        """Which of the data*z batch shards this rank holds (data-major)."""
        return self.index(MeshAxis.DATA) * self.dims.z + self.index(MeshAxis.Z)

    @property
    def batch_shards(self) -> int:
        return self.dims.data * self.dims.z

    def batch_shard(self, t: Any) -> Any:
        """This rank's rows of a global batch (dim 0 must divide by data*z)."""
        n = t.shape[0]
        if n % self.batch_shards:
            raise ValueError(
                f"global batch {n} does not divide by data*z = {self.batch_shards}; use a multiple of it"
            )
        k = n // self.batch_shards
        return t[self.batch_index * k:(self.batch_index + 1) * k]


def build_groups(dims: ParallelDims, *, backend: str | None = None) -> ProcessGroups:
    """Create one process group per axis slice, in the same order on every rank.

    Without an initialised process group only the 1x1x1x1 grid is allowed.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        dims.check_world(1)
        return ProcessGroups(dims=dims, rank=0, coords=dims.coords(0))
    dims.check_world(dist.get_world_size())
    rank = dist.get_rank()
    pg = ProcessGroups(dims=dims, rank=rank, coords=dims.coords(rank))
    for axis in MeshAxis:
        if dims.size(axis) == 1:
            continue
        for ranks in dims.axis_slices(axis):  # every rank creates every group (collective call)
            g = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                pg.groups[axis.value], pg.ranks[axis.value] = g, ranks
    return pg
