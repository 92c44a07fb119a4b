"""Apply the AxoNN layout to a `transformers` `LlamaForCausalLM` by module swaps.

Residual stream (B/(data*z), S, H/x), replicated over y. q/k/v/gate/up are normal layers
(heads and MLP columns split over y), o/down transposed (back to the x split), RMSNorm
all-reduces its statistic over x, the embedding and LM head split the vocabulary over y and
the hidden dim over x, and the loss is the vocabulary-parallel cross-entropy. HF attention
reshapes with `-1` heads, so it runs unchanged on the local heads.

References: Singh et al., AxoNN (SC'24); torchtitan's `parallelize_llama`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memaudit.parallel.comm import Comm, GradSync, all_gather_into_tensor
from memaudit.parallel.dims import MeshAxis, ParallelDims, ProcessGroups, build_groups
from memaudit.parallel.ghost import GhostNorms
from memaudit.parallel.layers import (
    ParallelEmbedding,
    TPLinear,
    assemble,
    vocab_parallel_cross_entropy,
)
from memaudit.parallel.lora import TPLoraLinear, is_lora_layer
from memaudit.parallel.norm import ParallelRMSNorm

_NORMAL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_TRANSPOSED = ("o_proj", "down_proj")


class ParallelLlama(nn.Module):
    """A parallelised `LlamaForCausalLM` (held as `.hf`) with a loss-returning forward.

    `named_parameters()` of `.hf` keep the Hugging Face names; each tensor is this rank's
    shard and carries a `shard_spec`.
    """

    def __init__(self, hf: nn.Module, comm: Comm, sync: GradSync | None = None,
                 norms: GhostNorms | None = None) -> None:
        super().__init__()
        self.hf, self.comm = hf, comm
        self.__dict__["grad_sync"] = sync
        self.__dict__["ghost"] = norms if norms is not None else GhostNorms()  # its layers' collector
        self.vstart = comm.index(MeshAxis.Y) * (hf.config.vocab_size // comm.size(MeshAxis.Y))

    @property
    def pg(self) -> ProcessGroups:
        return self.comm.pg

    def shard_batch(self, t: torch.Tensor) -> torch.Tensor:
        return self.pg.batch_shard(t)

    def token_losses(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     ) -> torch.Tensor:
        """Token losses (B_l, S-1) of this rank's batch shard (every target, unmasked)."""
        hidden = self.hf.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.hf.lm_head(hidden[:, :-1])  # (B_l, S-1, V/y)
        b, s1, v = logits.shape
        tok = vocab_parallel_cross_entropy(logits.reshape(-1, v), input_ids[:, 1:].reshape(-1),
                                           vstart=self.vstart, comm=self.comm)
        return tok.view(b, s1)

    def forward(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, token-mean loss of the global batch for logging).

        Inputs are this rank's shard. The backward loss is the local token sum divided by the
        global target count, so summing gradients over z and data gives the global mean.
        """
        tok = self.token_losses(input_ids, attention_mask)
        mask = loss_mask[:, 1:].to(tok.dtype)
        stats = self._global_sums(tok.detach(), mask)
        count = stats[1].clamp(min=1.0)
        loss = (tok * mask).sum() / count.to(tok.dtype)
        return loss, (stats[0] / count).float()

    def _global_sums(self, tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        stats = torch.stack([(tok * mask).sum(), mask.sum()]).double()  # (loss sum, targets)
        for axis in (MeshAxis.Z, MeshAxis.DATA):
            self.comm.all_reduce(stats, axis)
        return stats

    @torch.no_grad()
    def loss_sums(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(token-loss sum, target count) of the global batch, float64 (for evaluation)."""
        tok = self.token_losses(input_ids, attention_mask)
        return self._global_sums(tok, loss_mask[:, 1:].to(tok.dtype))

    def per_example_losses(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                           attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean token loss of each local example (B_l,), as `causal_lm_loss_per_example`."""
        tok = self.token_losses(input_ids, attention_mask)
        mask = loss_mask[:, 1:].to(tok.dtype)
        return (tok * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    def finish_grad_sync(self) -> None:
        sync_grads(self)

    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        load_full_state_dict(self, sd)

    def full_state_dict(self, *, grads: bool = False, dst: int | None = None) -> dict[str, torch.Tensor]:
        return full_state_dict(self, grads=grads, dst=dst)


def overlap_options(pc: Any) -> dict[str, Any]:
    """`parallelize_llama` keywords from a `ParallelConfig`: the overlaps it switches on."""
    return {"overlap": pc.overlap, "overlap_reduce_scatter": pc.overlap_reduce_scatter,
            "overlap_all_gather": pc.overlap_all_gather,
            "bucket_mb": pc.bucket_mb if pc.bucket_data_sync else None}


def parallelize_llama(model: nn.Module, *, dims: ParallelDims, pg: ProcessGroups | None = None,
                      overlap: bool = True, overlap_reduce_scatter: bool = False,
                      overlap_all_gather: bool = False, bucket_mb: float | None = None) -> ParallelLlama:
    """Swap the layers of a full `LlamaForCausalLM` for AxoNN's; every rank slices its shard.

    Args:
      model: a `LlamaForCausalLM` with the full weights (the same on every rank), or one wrapped
        by peft (`memaudit.models.lora.apply_lora`): its LoRA layers become `TPLoraLinear`s whose
        adapters follow the base weight's split, and frozen parameters stay frozen.
      dims: the grid; checked against the world size and the model's dimensions.
      pg: process groups from `build_groups(dims)` (built here when omitted; collective).
      overlap: overlap the input-gradient all-reduce with the weight-gradient matmul (OAR).
      overlap_reduce_scatter: issue the z reduce-scatter of each weight gradient asynchronously
        and wait for them all at the end of backward (ORS).
      overlap_all_gather: prefetch the next layer's z all-gather one layer ahead, in forward
        and in backward (OAG).
      bucket_mb: all-reduce weight gradients over data in buckets of about this many MB,
        issued during backward (as torch DDP does); None: one blocking bucket after backward.

    Returns: a `ParallelLlama` (the HF module, modified in place, is `.hf`).

    References: Singh et al., AxoNN (SC'24), Section IV-B (OAR, ORS, OAG).
    """
    if hasattr(model, "get_base_model"):  # peft's wrapper: parallelize the Llama inside it
        model = model.get_base_model()
    dims.check_model(model.config)
    pg = pg if pg is not None else build_groups(dims)
    if pg.dims != dims:
        raise ValueError(f"process groups were built for {pg.dims}, not {dims}; pass matching dims")
    if bucket_mb is not None and not bucket_mb > 0:
        raise ValueError(f"parallel.bucket_mb={bucket_mb} must be > 0")
    comm = Comm(pg)
    norms = GhostNorms()  # this model's per-example norms (DP-SGD), opened per call
    sync = GradSync(comm, async_reduce_scatter=overlap_reduce_scatter,
                    bucket_bytes=None if bucket_mb is None else int(bucket_mb * 2**20), norms=norms)
    kw = {"prefetch": overlap_all_gather, "sync": sync, "norms": norms}
    inner = model.model
    inner.embed_tokens = ParallelEmbedding(inner.embed_tokens, comm, **kw)
    chain = [inner.embed_tokens.gathered]
    for layer in inner.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in _NORMAL + _TRANSPOSED:
                if hasattr(parent, name):
                    src = getattr(parent, name)
                    cls = TPLoraLinear if is_lora_layer(src) else TPLinear
                    lin = cls(src, comm, transpose=name in _TRANSPOSED, overlap=overlap, **kw)
                    setattr(parent, name, lin)
                    chain.append(lin.gathered)
        layer.input_layernorm = ParallelRMSNorm(layer.input_layernorm, comm, norms=norms)
        layer.post_attention_layernorm = ParallelRMSNorm(layer.post_attention_layernorm, comm, norms=norms)
    inner.norm = ParallelRMSNorm(inner.norm, comm, norms=norms)
    model.lm_head = TPLinear(model.lm_head, comm, transpose=False, overlap=overlap, **kw)
    chain.append(model.lm_head.gathered)
    for a, b in itertools.pairwise(chain):  # forward order (q, k, v, o, gate, up, down)
        a.next, b.prev = b, a
    chain[1].prev = None  # the embedding's backward gathers nothing
    return ParallelLlama(model, comm, sync, norms)


# ----------------------------------------------------------------------------- gradients
def _flat_sync(params: list[nn.Parameter], comm: Comm, axis: str) -> None:
    if comm.size(axis) == 1 or not params:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket per axis
    comm.all_reduce(flat, axis)
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def sync_grads(model: ParallelLlama) -> None:
    """Sum gradients over the batch axes each parameter is replicated on (z for replicated
    parameters, whose z-sum is not done by a reduce-scatter, then data for all), skipping the
    data all-reduce of parameters whose buckets were all-reduced during backward."""
    sync = model.grad_sync
    done = sync.take_synced() if sync is not None else set()
    sync_param_grads(list(model.hf.parameters()), model.comm, skip_data=done)


def sync_param_grads(params: list[nn.Parameter], comm: Comm, *, skip_data: set[int] = frozenset()) -> None:
    """`sync_grads` for any parameters carrying a `shard_spec` (one bucket per axis)."""
    params = [p for p in params if p.grad is not None]
    _flat_sync([p for p in params if MeshAxis.Z in p.shard_spec.sync_axes], comm, MeshAxis.Z)
    _flat_sync([p for p in params if MeshAxis.DATA in p.shard_spec.sync_axes and id(p) not in skip_data], comm, MeshAxis.DATA)


# ----------------------------------------------------------------------------- state dicts
def load_full_state_dict(model: ParallelLlama, sd: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every full (Hugging Face-named) tensor into its shard."""
    params = dict(model.hf.named_parameters())
    missing = sorted(set(params) - set(sd))
    if missing:
        raise ValueError(f"state dict lacks {missing[0]} (and {len(missing) - 1} more); pass a full "
                         "Hugging Face LlamaForCausalLM state dict")
    with torch.no_grad():
        for name, p in params.items():
            full = sd[name].to(p.dtype)
            if tuple(full.shape) != p.shard_spec.full_shape:
                raise ValueError(f"{name} has shape {tuple(full.shape)}, expected {p.shard_spec.full_shape}; "
                                 "load a checkpoint of the same model preset")
            p.copy_(p.shard_spec.local(full, model.comm))


def full_state_dict(model: ParallelLlama, *, grads: bool = False, dst: int | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Merge the shards into full Hugging Face-named tensors (a collective over the world).

    `grads=True` merges the gradients instead. With `dst`, only rank `dst` receives the
    tensors (the others get {}); otherwise every rank does.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.hf.named_parameters():
        src = p.grad if grads else p
        full = merge_tensor(model, p, torch.zeros_like(p) if src is None else src, dst=dst)
        if full is not None:
            out[name] = full
    return out


def merge_tensor(model: ParallelLlama, p: nn.Parameter, local: torch.Tensor, *,
                 dst: int | None = None) -> torch.Tensor | None:
    """The full tensor of which `local` is this rank's shard, laid out like parameter `p`
    (its value, gradient or an optimizer moment). A collective over the world: the shards
    are gathered in their own dtype and placed by each rank's slice of the layout; with
    `dst`, only that rank gets the result (None elsewhere)."""
    dims = model.pg.dims
    vals = local.detach().reshape(-1).contiguous()
    n = vals.numel()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        pieces = {0: vals}
    elif dst is None:
        allv = torch.empty(world * n, dtype=vals.dtype, device=vals.device)
        all_gather_into_tensor(allv, vals)  # gloo wants flat tensors
        pieces = {r: allv[r * n:(r + 1) * n] for r in range(dims.tp_size)}
    else:
        rank = dist.get_rank()
        bufs = [torch.empty_like(vals) for _ in range(world)] if rank == dst else None
        dist.gather(vals, bufs, dst=dst)
        if bufs is None:
            return None
        pieces = dict(enumerate(bufs[:dims.tp_size]))
    return assemble(p.shard_spec, dims, pieces).to(dtype=p.dtype, device=p.device)
