"""Sharded checkpoints of the centralized backend's grid, in RUN_DIR/state/.

    state/
      trainer.json      step and scalars, with "format": "sharded" and "grid": [data, x, y, z]
      layout.json       the grid and each parameter's full shape and slicing (row/col axis, z-flat)
      optimizer.pt      the optimizer's param_groups (hyper-parameters; read with weights_only)
      extra.pt, privacy.json    as in the single-process checkpoint (`memaudit.train.checkpoint`)
      shards/tp-00001-of-00004.safetensors
                        one per tensor-parallel rank, written by its data-parallel replica 0:
                        "param/NAME" (the local shard) and "optim/NAME/KEY" (AdamW's moments,
                        sliced like the parameter, and its step)
      rng/rank-00003.safetensors    each rank's torch generator state

Every rank writes only its own piece, so no rank ever holds the whole model or optimizer.
Rank 0 makes a temporary directory beside state/, all ranks write into it, and after a
barrier rank 0 writes trainer.json and hands it to the run lifecycle, which seals it with its
commit marker and swaps it in (`memaudit.run.lifecycle`): a kill at any moment leaves a complete
checkpoint that the next start recovers.
The run directory must be on a file system every rank sees (as the prepared data already is).

Loading on the same x*y*z grid reads only the rank's own shard file: resume is exact, and the
data-parallel degree may differ. On any other grid, or in one process, every tensor is
assembled from the shards by their saved layout (`memaudit.parallel.layers.assemble`) and
sliced for the new grid.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from memaudit.errors import RunDirError
from memaudit.io import atomic_write_json, read_json
from memaudit.parallel.dims import MeshAxis, ParallelDims
from memaudit.parallel.layers import ShardSpec, assemble
from memaudit.train import checkpoint as ckpt

if TYPE_CHECKING:
    from memaudit.parallel.parallelize import ParallelLlama
    from memaudit.rundir import RunDir

FORMAT = "sharded"


def shard_file(rank: int, tp_size: int) -> str:
    return f"tp-{rank:05d}-of-{tp_size:05d}.safetensors"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _optimizer_names(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> list[str]:
    """The parameter name of each optimizer index (the order of `optimizer.state_dict()`)."""
    by_id = {id(p): n for n, p in params.items()}
    names = [by_id.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    if None in names:
        raise ValueError("the optimizer holds a parameter the model does not name; build it from model.parameters()")
    return names  # type: ignore[return-value]


def save_sharded(tmp: Path, model: ParallelLlama, optimizer: torch.optim.Optimizer, *,
                 scalars: dict[str, Any], extra: dict[str, Any] | None, files: dict[str, Any] | None,
                 commit: Callable[[], None]) -> None:
    """Write a sharded checkpoint into the directory `tmp` (collective: every rank calls it);
    rank 0 then calls `commit` (the run lifecycle seals it and swaps it in for state/)."""
    pg = model.pg
    dims, rank = pg.dims, pg.rank
    if rank == 0:
        (tmp / "shards").mkdir(parents=True, exist_ok=True)
        (tmp / "rng").mkdir(exist_ok=True)
    _barrier()
    params = dict(model.hf.named_parameters())
    osd = optimizer.state_dict()
    if pg.index(MeshAxis.DATA) == 0:  # data replicas hold identical shards
        tensors = {f"param/{n}": p.detach().cpu().contiguous() for n, p in params.items()}
        names = _optimizer_names(optimizer, params)
        for i, st in osd["state"].items():
            for k, v in st.items():
                if not torch.is_tensor(v):
                    raise TypeError(f"optimizer state {k!r} is not a tensor; the sharded checkpoint "
                                    "stores tensors only")
                tensors[f"optim/{names[i]}/{k}"] = v.detach().cpu().contiguous()
        save_file(tensors, str(tmp / "shards" / shard_file(rank, dims.tp_size)))
    save_file(ckpt.rng_state(), str(tmp / "rng" / f"rank-{rank:05d}.safetensors"))
    _barrier()
    if rank == 0:
        layout = {"grid": list(dims.grid()), "params": {n: p.shard_spec.to_json() for n, p in params.items()}}
        atomic_write_json(tmp / "layout.json", layout)
        torch.save(osd["param_groups"], tmp / "optimizer.pt")
        ckpt.write_common(tmp, scalars={**scalars, "format": FORMAT, "grid": list(dims.grid())},
                          extra=extra, files=files)
        commit()
    _barrier()  # nobody reads or re-saves before the swap


class ShardReader:
    """The shard files of a saved grid, opened lazily; assembles full tensors by name."""

    def __init__(self, state_dir: Path) -> None:
        with ckpt.checkpoint_file(state_dir / "layout.json"):
            layout = read_json(state_dir / "layout.json", what="checkpoint layout")
        g = layout["grid"]
        self.dims = ParallelDims(data=g[0], x=g[1], y=g[2], z=g[3])
        self.specs = {n: ShardSpec.from_json(s) for n, s in layout["params"].items()}
        self.files = []
        for r in range(self.dims.tp_size):
            path = state_dir / "shards" / shard_file(r, self.dims.tp_size)
            if not path.is_file():
                raise RunDirError(f"checkpoint in '{state_dir}' lacks {path.name}; it is incomplete, "
                                  "start a new run")
            with ckpt.checkpoint_file(path):
                self.files.append(safe_open(str(path), framework="pt"))

    def keys(self) -> set[str]:
        return set(self.files[0].keys())

    def own(self, rank: int, key: str) -> torch.Tensor:
        return self.files[rank].get_tensor(key)

    def full(self, name: str, key: str) -> torch.Tensor:
        """The whole tensor of `key`, which is sharded like parameter `name` (or replicated)."""
        first = self.files[0].get_tensor(key)
        if tuple(first.shape) != tuple(self.files[0].get_slice(f"param/{name}").get_shape()):
            return first  # a scalar (the step) or other replicated state
        spec = self.specs[name]
        return assemble(spec, self.dims, {r: f.get_tensor(key) for r, f in enumerate(self.files)})


def load_sharded(run: RunDir, *, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 local: Callable[[str, torch.Tensor], torch.Tensor] | None,
                 own_rank: int | None = None) -> None:
    """Restore parameters and optimizer state in place from a sharded checkpoint.

    Args:
      params: the model's parameters by (Hugging Face) name: shards of a parallel model, or
        the full tensors of a single-process one.
      local: cuts this rank's piece from a full tensor for parameter `name` (None: keep it whole).
      own_rank: this rank's tensor-parallel rank when the saved x*y*z grid is the current one;
        then only that shard file is read and nothing is re-sliced (exact).
    """
    d = run.state_dir
    reader = ShardReader(d)
    if set(reader.specs) != set(params):
        extra = sorted(set(reader.specs) ^ set(params))
        raise RunDirError(f"checkpoint in '{d}' does not match the model ({extra[0]} differs); "
                          "resume with the run's own config")

    def get(name: str, key: str) -> torch.Tensor:
        if own_rank is not None:
            return reader.own(own_rank, key)
        full = reader.full(name, key)
        return full if local is None or full.dim() == 0 else local(name, full)

    with torch.no_grad():
        for n, p in params.items():
            v = get(n, f"param/{n}")
            if v.shape != p.shape:
                raise RunDirError(f"checkpoint tensor {n} has shape {tuple(v.shape)}, the model "
                                  f"{tuple(p.shape)}; resume with the run's own config")
            p.copy_(v)
    names = _optimizer_names(optimizer, params)
    keys = reader.keys()
    state = {}
    for i, n in enumerate(names):
        prefix = f"optim/{n}/"
        st = {k[len(prefix):]: get(n, k) for k in keys if k.startswith(prefix)}
        if st:
            state[i] = {k: (v.to(params[n].device) if v.dim() else v) for k, v in st.items()}
    groups = ckpt.torch_load(d / "optimizer.pt")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def restore_rng(run: RunDir, rank: int) -> bool:
    """Set this rank's torch generators from the checkpoint (False if it has no file for it)."""
    path = run.state_dir / "rng" / f"rank-{rank:05d}.safetensors"
    if not path.is_file():
        return False
    with ckpt.checkpoint_file(path):
        ckpt.set_rng_state(load_file(str(path)))
    return True


def load_any(run: RunDir, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint of either layout into a single-process (full) model and optimizer: a grid's
    sharded checkpoint is merged (`load_sharded`), a single-process one loaded as it is; returns
    (scalars, extra)."""
    scalars = ckpt.read_scalars(run)
    if scalars.get("format") == "sharded":
        # a peft model's names carry its wrapper's prefix; the grid saved the Llama's own names
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        load_sharded(run, params=dict(inner.named_parameters()), optimizer=optimizer, local=None)
        return scalars, ckpt.read_extra(run)
    return ckpt.load_state(run, model=model, optimizer=optimizer, device=device)
