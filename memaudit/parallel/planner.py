"""AxoNN's communication model: per-kind wire volume, an AxoNN-style time model, memory, grid ranking.

`predict_collectives` mirrors exactly what `memaudit.parallel` hands to each collective in one
training step, per (axis, kind): z all-gathers of every weight block in forward and again in
backward, z reduce-scatters of weight gradients, activation all-reduces over x (normal-layer
outputs, transposed-layer input gradients) and over y (the converse), norm statistics over x,
the embedding's vocabulary all-reduce over y, the vocabulary-parallel loss over y, the loss
statistics over z and data, the gradient sync of replicated parameters over z and of all
parameters over data, optional clipping norms. Activation recomputation replays each decoder
layer's forward collectives (z all-gathers, in-axis all-reduces, norm statistics); DP-SGD with
ghost clipping runs two forward+backward passes per micro-batch plus the per-example norm
all-reduces over x and y.

Under LoRA (`LoraShape`, `memaudit.parallel.lora.TPLoraLinear`) the base is frozen: no weight
gradient is reduce-scattered, the adapters (replicated over z) are the only gradients synced over
z and data, each adapter all-reduces its (tokens x r) projection over the layer's in axis in
forward and its gradient over the out axis in backward, and a collective of the backward runs
only where autograd needs it: the frozen embedding's output needs no gradient, so in the first
decoder layer the backward of each frozen layer before the first adapter on the path is skipped
(`_layer_grads`). That holds with recomputation as the Trainer switches it on (non-reentrant,
before the layout: Hugging Face's hook that makes the embedding's output require a gradient stays
on the `nn.Embedding` the grid replaces), and every layer's forward is replayed whole (the last
tensor it saves for backward is down_proj's input). `wire_bytes` turns payloads into bytes on the wire (ring costs,
`comm.wire_factor`); `comm_time` divides them by each group's bandwidth, which follows from
the group's size and stride on the machine (`Machine.bandwidth`).

References: Singh et al., "A 4D Hybrid Algorithm to Scale Parallel Training to Thousands of
GPUs" (AxoNN, SC'24), Sections IV-V; Chen et al., "Training Deep Nets with Sublinear Memory
Cost", 2016 (activation checkpointing); Li et al., ghost clipping, ICLR 2022.

>>> from memaudit.parallel.dims import ParallelDims
>>> p = predict_payload(ModelShape.from_preset("tiny"), ParallelDims(), batch=4, seq=16)
>>> sum(p.values())
0
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Literal, NamedTuple

from memaudit.models.presets import PRESETS
from memaudit.parallel.comm import wire_factor
from memaudit.parallel.dims import MeshAxis, ParallelDims

ORDER = (MeshAxis.X, MeshAxis.Y, MeshAxis.Z, MeshAxis.DATA)  # rank order, fastest first (dims.py)


# ----------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only transformer.

    `mlp="swiglu"` is Llama's gate/up/down; `"gelu"` the GPT MLP (h -> intermediate -> h).
    `norm="rms"` all-reduces one statistic per token over x, `"layer"` two (mean and mean
    square) and has a bias. GPT shapes here are untied and leave out the position table.
    `min_tp` is the smallest x*y*z the shape is planned on: AxoNN's for its GPT shapes (its run
    scripts' `min_tp`), 1 elsewhere (memory alone decides).
    """

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    norm: Literal["rms", "layer"] = "rms"
    min_tp: int = 1

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        if name in SHAPES:
            return SHAPES[name]

        if name not in PRESETS:
            raise ValueError(f"unknown model preset '{name}'; choose one of "
                             f"{', '.join([*PRESETS, *SHAPES])}")
        p = PRESETS[name]
        return cls(p.vocab_size, p.hidden_size, p.intermediate_size, p.num_hidden_layers,
                   p.num_attention_heads, p.num_key_value_heads)

    @classmethod
    def from_config(cls, c: Any) -> ModelShape:
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                   c.num_attention_heads, c.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_names(self) -> tuple[str, ...]:
        """The Hugging Face module names of `linears()`, in that order (the LoRA targets)."""
        attn = ("q_proj", "k_proj", "v_proj", "o_proj")
        return attn + (("gate_proj", "up_proj", "down_proj") if self.mlp == "swiglu" else ("fc_in", "fc_out"))

    def linears(self) -> list[tuple[int, int, bool]]:
        """(out, in, transposed) of every linear of one decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = [(q, h, False), (kv, h, False), (kv, h, False), (h, q, True)]
        mlp = [(i, h, False), (i, h, False), (h, i, True)] if self.mlp == "swiglu" else [(i, h, False), (h, i, True)]
        return attn + mlp

    @property
    def norm_stats(self) -> int:
        return 1 if self.norm == "rms" else 2

    def params(self) -> int:
        lin = sum(o * i for o, i, _ in self.linears())
        return self.layers * lin + 2 * self.vocab * self.hidden + (2 * self.layers + 1) * self.hidden * self.norm_stats

    def y_divisors_of(self) -> int:
        """Every y must divide this (heads, kv heads, MLP width and vocabulary are split over y)."""
        return math.gcd(self.heads, self.kv_heads, self.intermediate, self.vocab)


def _gpt(layers: int, hidden: int, min_tp: int) -> ModelShape:
    return ModelShape(51200, hidden, 4 * hidden, layers, hidden // 128, hidden // 128, "gelu", "layer", min_tp)


SHAPES: dict[str, ModelShape] = {
    # AxoNN's GPT shapes (layers x hidden), head dim 128, GPT-2 vocabulary padded to 51200, and the
    # smallest tensor-parallel size AxoNN runs each on (Megatron-AxoNN, branch gordon-bell-perlmutter,
    # examples/launch_per_comm_model.py, commit 6920ac0: `min_tp`)
    "gpt-5b": _gpt(24, 4096, 4), "gpt-10b": _gpt(32, 5120, 8), "gpt-20b": _gpt(32, 7168, 16),
    "gpt-40b": _gpt(38, 9216, 32), "gpt-60b": _gpt(56, 9216, 64), "gpt-80b": _gpt(42, 12288, 64),
    "gpt-160b": _gpt(84, 12288, 128), "gpt-320b": _gpt(96, 16384, 256), "gpt-640b": _gpt(192, 16384, 512),
    # Llama 3.1 (Meta, 2024)
    "llama-8b": ModelShape(128256, 4096, 14336, 32, 32, 8),
    "llama-70b": ModelShape(128256, 8192, 28672, 80, 64, 8),
    "llama-405b": ModelShape(128256, 16384, 53248, 126, 128, 8),
}


@dataclass(frozen=True)
class LoraShape:
    """What the cost model needs of LoRA: the adapters' rank and the linear layers they sit on
    (Hugging Face module names, `ModelShape.linear_names`, e.g. "q_proj")."""

    rank: int
    targets: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(dict.fromkeys(self.targets)))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank!r} must be an integer >= 1")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module (e.g. q_proj)")

    @classmethod
    def from_config(cls, lora: Any) -> LoraShape | None:
        """From a `model.lora` section (`memaudit.config.LoraConfig`; None: full training)."""
        return None if lora is None else cls(int(lora.rank), tuple(lora.target_modules))

    def check(self, m: ModelShape) -> None:
        bad = [t for t in self.targets if t not in m.linear_names()]
        if bad:
            raise ValueError(f"LoRA target '{bad[0]}' is not a linear layer of the model; choose from "
                             f"{', '.join(m.linear_names())}")

    def adapter_elements(self, m: ModelShape, d: ParallelDims) -> int:
        """Adapter elements on one rank: A_l (r x in_l) and B_l (out_l x r) of every target, where a
        normal layer splits in over x and out over y, a transposed one the converse (not over z)."""
        per_layer = 0
        for name, (o, i, t) in zip(m.linear_names(), m.linears(), strict=True):
            if name in self.targets:
                o_l, i_l = (o // d.x, i // d.y) if t else (o // d.y, i // d.x)
                per_layer += self.rank * (i_l + o_l)
        return m.layers * per_layer


# ----------------------------------------------------------------------------- volume
Key = tuple[str, str]  # (axis, kind)


def _zshard(numel: int, z: int) -> int:
    return math.ceil(numel / z)


class _Acc:
    """Payload bytes per (axis, kind); collectives over a size-1 axis add nothing."""

    def __init__(self, d: ParallelDims) -> None:
        self.d, self.out, self.scale = d, defaultdict(int), 1
        self.n = {a: d.size(a) for a in ORDER}

    def add(self, axis: str, kind: str, nbytes: int, times: int = 1) -> None:
        if self.n[axis] > 1 and nbytes:
            self.out[(axis, kind)] += int(nbytes) * times * self.scale


class _Grads(NamedTuple):
    """Which backward collectives one linear runs: `base` (its input needs a gradient, or its
    weight: the backward z all-gather and out-axis all-reduce), `weight` (the weight trains: the z
    reduce-scatter), `rank` (a LoRA adapter of that rank, else 0)."""

    base: bool = True
    weight: bool = True
    rank: int = 0


_FULL = _Grads()  # a trained linear: every backward collective


class _LayerGrads(NamedTuple):
    linears: tuple[_Grads, ...]  # in `ModelShape.linears()` order
    norms: tuple[bool, bool]  # the two norms' statistics have a backward (their input needs a gradient)
    out: bool  # the layer's output needs a gradient


def _layer_grads(m: ModelShape, lora: LoraShape | None, inp: bool) -> _LayerGrads:
    """Autograd runs a backward only where a gradient is needed: below a frozen layer that is where
    its input requires one. Attention's output requires a gradient if q, k or v's does, the
    residual after attention if that or o's does, the MLP's last (transposed) layer's input if one
    of the MLP's first layers' outputs does; a target's output always does."""
    names = m.linear_names()
    if lora is None:
        return _LayerGrads((_FULL,) * len(names), (True, True), True)
    out: list[_Grads] = []

    def lin(name: str, needs: bool) -> bool:
        target = name in lora.targets
        out.append(_Grads(needs, False, lora.rank if target else 0))
        return needs or target

    qkv = [lin(name, inp) for name in names[:3]]  # q, k, v take the normed layer input (all recorded)
    o = lin(names[3], any(qkv))
    resid = inp or o  # the residual stream after attention
    ups = [lin(name, resid) for name in names[4:-1]]  # gate, up (or fc_in)
    down = lin(names[-1], any(ups))
    return _LayerGrads(tuple(out), (inp, resid), resid or down)


def _linear(acc: _Acc, o: int, i: int, transposed: bool, tokens: int, e: int, we: int, *, times: int,
            replay: bool, g: _Grads = _FULL) -> None:
    d = acc.d
    in_ax, out_ax = (MeshAxis.Y, MeshAxis.X) if transposed else (MeshAxis.X, MeshAxis.Y)
    o_l, i_l = o // d.size(out_ax), i // d.size(in_ax)
    shard = _zshard(o_l * i_l, d.z)
    fwd = 2 if replay else 1  # recomputation replays the forward
    acc.add(MeshAxis.Z, "all_gather", shard * we, times * (fwd + g.base))  # forward (+ replay) and backward
    acc.add(in_ax, "all_reduce", tokens * o_l * e, times * fwd)  # partial outputs
    if g.base:
        acc.add(out_ax, "all_reduce", tokens * i_l * e, times)  # partial input gradients
    if g.weight:
        acc.add(MeshAxis.Z, "reduce_scatter", shard * d.z * we, times)  # the (padded) weight gradient
    if g.rank:  # LoRA: h = a A_l^T over the in axis, its gradient over the out axis
        acc.add(in_ax, "all_reduce", tokens * g.rank * e, times * fwd)
        acc.add(out_ax, "all_reduce", tokens * g.rank * e, times)


def _stack(m: ModelShape, lora: LoraShape | None) -> tuple[list[tuple[_LayerGrads, int]], bool]:
    """The decoder layers' backward collectives, as (layer, how many consecutive layers run it),
    and whether the stack's output needs a gradient."""
    out: list[tuple[_LayerGrads, int]] = []
    inp = lora is None  # the embedding's output needs a gradient only if the embedding trains
    for _ in range(m.layers):
        g = _layer_grads(m, lora, inp)
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1] + 1)
        else:
            out.append((g, 1))
        inp = g.out
    return out, inp


def _pass(acc: _Acc, m: ModelShape, rows: int, seq: int, e: int, we: int, *, recompute: bool,
          loss_stats: bool, lora: LoraShape | None = None) -> None:
    """One forward + backward over `rows` local sequences."""
    d = acc.d
    n, n1 = rows * seq, rows * (seq - 1)  # tokens through the stack, and through the LM head
    stat = n * 4 * m.norm_stats  # fp32 statistics per token
    fwd = 2 if recompute else 1
    layers, inp = _stack(m, lora)
    for layer, times in layers:
        for (o, i, t), g in zip(m.linears(), layer.linears, strict=True):
            _linear(acc, o, i, t, n, e, we, times=times, replay=recompute, g=g)
        acc.add(MeshAxis.X, "all_reduce", stat, times * (2 * fwd + sum(layer.norms)))  # fwd (+ replay) + bwd
    acc.add(MeshAxis.X, "all_reduce", stat, 1 + inp)  # final norm
    v_l, h_l = m.vocab // d.y, m.hidden // d.x
    emb = _zshard(v_l * h_l, d.z)
    acc.add(MeshAxis.Z, "all_gather", emb * we)
    acc.add(MeshAxis.Y, "all_reduce", n * h_l * e)  # vocabulary-partial embeddings
    if lora is None:
        acc.add(MeshAxis.Z, "reduce_scatter", emb * d.z * we)
    _linear(acc, m.vocab, m.hidden, False, n1, e, we, times=1, replay=False,
            g=_Grads(inp, lora is None))  # LM head
    acc.add(MeshAxis.Y, "all_reduce", 3 * n1 * 4)  # loss: max, sum-exp, target logit (fp32)
    if loss_stats:
        for axis in (MeshAxis.Z, MeshAxis.DATA):
            acc.add(axis, "all_reduce", 16)  # loss sum and target count (fp64)


def local_weights(m: ModelShape, d: ParallelDims) -> tuple[int, int]:
    """(z-sharded elements of linears and embeddings, replicated norm elements) on one rank."""
    sharded = 0
    for o, i, t in m.linears():
        o_l, i_l = (o // d.x, i // d.y) if t else (o // d.y, i // d.x)
        sharded += m.layers * _zshard(o_l * i_l, d.z)
    sharded += 2 * _zshard((m.vocab // d.y) * (m.hidden // d.x), d.z)
    return sharded, (2 * m.layers + 1) * (m.hidden // d.x) * m.norm_stats


def predict_collectives(m: ModelShape, d: ParallelDims, *, batch: int, seq: int, dtype_bytes: int = 4,
                        weight_bytes: int = 4, recompute: bool = False, dp: bool = False,
                        micro_batches: int = 1, clip: bool = False, data_in_backward: bool = False,
                        lora: LoraShape | None = None, user_group: int = 1) -> dict[Key, int]:
    """Payload bytes each rank hands to collectives in one step, per (axis, kind).

    Args:
      batch: global batch (sequences), split over data x z. seq: tokens per sequence.
      dtype_bytes: activation element size; weight_bytes: parameter/gradient element size.
      recompute: activation checkpointing of every decoder layer.
      dp: DP-SGD with ghost clipping (`parallel.dp.TensorParallelClipping`): per micro-batch a norm
        pass and a clipped pass, the per-example squared norms (fp64) all-reduced over x and y,
        the clip statistics (3 x fp64) over z and data.
      micro_batches: passes per step over local chunks as equal as possible (gradients
        accumulate; one sync).
      clip: global-norm clipping after the sync (one fp64 over x, y and z).
      data_in_backward: the sharded weights' data all-reduce runs in buckets during each
        backward that keeps its gradients (every micro-batch; DP: the clipped pass only),
        the replicated parameters' once after backward.
      lora: LoRA adapters on a frozen base (`LoraShape`): no weight gradient is reduce-scattered,
        the adapters (replicated over z, so never in the backward's buckets) are all-reduced over
        z and data once after backward, and the first layer skips the backward of the frozen
        layers whose input needs no gradient.
      user_group: with `dp`, per-user clipping (ULS) of groups of this many rows (one user's
        sequences): the batch is padded with empty users to a multiple of user_group x data x z,
        passes hold whole users, and one squared norm per user is all-reduced.
    """
    if lora is not None:
        lora.check(m)
    if user_group < 1 or (user_group > 1 and not dp):
        raise ValueError(f"user_group={user_group} needs dp=True and must be >= 1")
    acc = _Acc(d)
    g, shards = user_group, d.data * d.z
    units = -(-batch // (g * shards)) if g > 1 else batch // shards  # local users (rows when g = 1)
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    q, r = divmod(units, micro_batches)  # chunks as equal as possible: r of q + 1 units, the rest of q
    for chunk, count in ((q + 1, r), (q, micro_batches - r)):
        if count == 0 or chunk == 0:
            continue
        acc.scale = count * (2 if dp else 1)
        _pass(acc, m, chunk * g, seq, dtype_bytes, weight_bytes, recompute=recompute, loss_stats=not dp,
              lora=lora)
        acc.scale = count
        if dp:
            for axis in (MeshAxis.X, MeshAxis.Y):
                acc.add(axis, "all_reduce", chunk * 8)  # one squared norm per example (user)
    acc.scale = 1
    if dp:
        for axis in (MeshAxis.Z, MeshAxis.DATA):
            acc.add(axis, "all_reduce", 24)
    if lora is not None:
        sharded, norms = 0, lora.adapter_elements(m, d)  # only the adapters have gradients
    else:
        sharded, norms = local_weights(m, d)
    acc.add(MeshAxis.Z, "all_reduce", norms * weight_bytes)  # replicated-parameter gradients
    if data_in_backward:
        acc.add(MeshAxis.DATA, "all_reduce", sharded * weight_bytes, micro_batches)
        acc.add(MeshAxis.DATA, "all_reduce", norms * weight_bytes)
    else:
        acc.add(MeshAxis.DATA, "all_reduce", (sharded + norms) * weight_bytes)
    if clip:
        for axis in (MeshAxis.X, MeshAxis.Y, MeshAxis.Z):
            acc.add(axis, "all_reduce", 8)
    return dict(acc.out)


def predict_payload(m: ModelShape, d: ParallelDims, **kw: Any) -> dict[str, int]:
    """`predict_collectives` summed per axis."""
    out = {a.value: 0 for a in MeshAxis}
    for (axis, _), b in predict_collectives(m, d, **kw).items():
        out[axis] += b
    return out


def wire_bytes(payload: dict[Key, int], d: ParallelDims) -> dict[Key, Fraction]:
    """Bytes each rank sends per (axis, kind): the payload times the ring factor of the group."""
    return {(a, k): wire_factor(k, d.size(a)) * b for (a, k), b in payload.items()}


# ----------------------------------------------------------------------------- memory
def predict_memory(m: ModelShape, d: ParallelDims, *, batch: int, seq: int, dtype_bytes: int = 4,
                   recompute: bool = False, micro_batch: int | None = None, flash: bool = False,
                   dp: bool = False, lora: LoraShape | None = None) -> dict[str, int]:
    """Per-device bytes: fp32 weights, grads, AdamW moments, transient gathered block, activations.

    Under `lora` the frozen base keeps its fp32 weights and the adapters alone have gradients and
    AdamW moments (activations and ghost norms are the full model's: an upper bound).

    Activations of one pass over `micro_batch` local rows (all rows when None): per layer the
    saved inputs of the linears, attention and MLP intermediates (with `recompute`, only each
    layer's input is kept and one layer's intermediates live at a time), attention scores
    unless `flash`, and the fp32 logits, softmax and gradient of the head. `dp` adds the
    per-example ghost-norm Gram matrices of the largest linear (fp64).
    """
    sharded, norms = local_weights(m, d)
    weights = trained = sharded + norms
    if lora is not None:
        trained = lora.adapter_elements(m, d)
        weights += trained
    blocks = [(o // d.x) * (i // d.y) if t else (o // d.y) * (i // d.x) for o, i, t in m.linears()]
    vh = (m.vocab // d.y) * (m.hidden // d.x)
    local_rows = max(1, batch // (d.data * d.z))
    b = min(micro_batch or local_rows, local_rows)
    n = b * seq
    h_x, q_y, i_y = m.hidden // d.x, m.heads * m.head_dim // d.y, m.intermediate // d.y
    kv_y = m.kv_heads * m.head_dim // d.y
    mlp = 4 if m.mlp == "swiglu" else 2
    per_layer = n * (4 * h_x + 3 * q_y + 2 * kv_y + mlp * i_y) * dtype_bytes
    attn = 0 if flash else b * (m.heads // d.y) * seq * seq * dtype_bytes  # sdpa math path keeps scores
    if recompute:
        acts = m.layers * n * h_x * dtype_bytes + per_layer + attn
    else:
        acts = m.layers * (per_layer + attn)
    mem = {
        "weights": weights * 4,
        "grads": trained * 4,
        "optimizer": 2 * trained * 4,
        "gathered": max(max(blocks), vh) * dtype_bytes * 2,
        "activations": acts + 3 * n * (m.vocab // d.y) * 4,
        "ghost": 2 * b * min(seq * seq, max(blocks)) * 8 if dp else 0,
    }
    mem["total"] = sum(mem.values())
    return mem


# ----------------------------------------------------------------------------- machines
@dataclass(frozen=True)
class Machine:
    """A cluster for the time model. Bandwidths in GB/s per GPU (intra) and per node (inter).

    `table` maps (stride, group size) to a measured bandwidth (GB/s) that wins over the
    formula, as AxoNN's planner used a table of measured collectives. `gemm_efficiency` is the
    fraction of `peak_tflops` the matrix multiplies sustain (compute time); `source` says where
    the numbers come from.
    """

    name: str
    gpus_per_node: int
    intra_gbs: float
    inter_gbs: float
    mem_gib: float
    peak_tflops: float = 0.0
    flash: bool = True
    table: dict[tuple[int, int], float] = field(default_factory=dict)
    gemm_efficiency: float = 0.5  # assumed where no measured rate is cited (see MACHINES)
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node!r} must be a positive integer")
        for flag, v in (("--intra-bw", self.intra_gbs), ("--inter-bw", self.inter_gbs),
                        ("--mem-gib", self.mem_gib)):
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{flag} {v} must be a finite number > 0")
        if not 0 < self.gemm_efficiency <= 1:
            raise ValueError(f"gemm_efficiency {self.gemm_efficiency} must be in (0, 1]")
        for (s, n), v in self.table.items():
            if not (math.isfinite(v) and v > 0 and s >= 1 and n >= 2):
                raise ValueError(f"bandwidth table entry (stride={s}, size={n}) = {v} must be a finite "
                                 "GB/s > 0 with stride >= 1 and size >= 2")

    def bandwidth(self, stride: int, n: int) -> float:
        """GB/s of a group of `n` GPUs whose members are `stride` ranks apart.

        Inside a node (stride x n <= GPUs per node, and the groups tile the node) at the
        intra-node rate; otherwise at the node's network bandwidth times the share of the
        node's GPUs that belong to the group (each GPU of a node owns 1/G of its network),
        and never above the intra-node rate (a ring is as fast as its slowest link).
        """
        if (stride, n) in self.table:
            return self.table[(stride, n)]
        g = self.gpus_per_node
        if stride * n <= g and g % (stride * n) == 0:
            return self.intra_gbs
        on_node = min(n, max(1, g // stride))
        return min(self.intra_gbs, self.inter_gbs * on_node / g)


# The bandwidths AxoNN's planner used (GB/s), measured on Perlmutter and Frontier: Megatron-AxoNN,
# branch gordon-bell-perlmutter, examples/comm_model.py (`get_bw`, commit 8a4ae24, 2024-03-23). Inside
# a node a table per (stride, group size); across nodes 80 GB/s per Perlmutter node and 40 per Frontier
# node ("80 / 2 # 34.031": 34.0 measured, 40 used), shared by the node's GPUs as in
# `Machine.bandwidth` (every power-of-two group has AxoNN's number, tests/parallel/test_planner_efficiency.py).
# Frontier's 40 is 2.5x below the nominal 4 x 25 GB/s Slingshot-11 per node (memaudit issue 34: the
# 320B model's communication on 8,192 GCDs, 24.8 s nominal vs 62.1 s measured).
AXONN_PERLMUTTER_INTRA: dict[tuple[int, int], float] = {(1, 2): 76.0, (1, 4): 225.0, (2, 2): 76.0}
AXONN_FRONTIER_INTRA: dict[tuple[int, int], float] = {(1, 2): 129.0, (1, 4): 52.0, (1, 8): 135.0, (2, 2): 50.0,
                                                      (2, 4): 72.0, (4, 2): 36.0}
PERLMUTTER_MEASURED_INTER_GBS = 80.0
FRONTIER_MEASURED_INTER_GBS = 40.0
_AXONN_SOURCE = "Megatron-AxoNN examples/comm_model.py get_bw (8a4ae24)"

MACHINES: dict[str, Machine] = {
    # nominal per-direction link rates; network = 4 x 25 GB/s Slingshot-11 NICs per node
    # GEMM rate: AxoNN's measured 182 PFLOP/s for GPT-80B on 1,024 GPUs, 57% of peak end to end
    # (Singh et al., arXiv:2305.13525), a lower bound of what its matrix multiplies sustain
    "perlmutter": Machine("perlmutter", 4, 100.0, 100.0, 40.0, 312.0, gemm_efficiency=0.57,
                          source="nominal: A100-40GB, 4 NVLink3 per pair, 4 x 25 GB/s NICs; GEMM "
                                 "at 57% of peak (AxoNN's measured rate, arXiv:2305.13525)"),
    "perlmutter-measured": Machine(
        "perlmutter-measured", 4, 100.0, PERLMUTTER_MEASURED_INTER_GBS, 40.0, 312.0, gemm_efficiency=0.57,
        table=AXONN_PERLMUTTER_INTRA,
        source=f"AxoNN's measured bandwidths ({_AXONN_SOURCE}); peak nominal, GEMM at 57% of peak "
               "(arXiv:2305.13525)"),
    "frontier": Machine("frontier", 8, 50.0, 100.0, 64.0, 191.5,
                        source="nominal: MI250X GCDs, Infinity Fabric, 4 x 25 GB/s NICs"),
    "frontier-measured": Machine(
        "frontier-measured", 8, 50.0, FRONTIER_MEASURED_INTER_GBS, 64.0, 191.5, table=AXONN_FRONTIER_INTRA,
        source=f"AxoNN's measured bandwidths ({_AXONN_SOURCE}; inter-node 2.5x below nominal); "
               "peak nominal, GEMM efficiency assumed"),
    "alps": Machine("alps", 4, 150.0, 100.0, 96.0, 989.0,
                    source="nominal: GH200, 6 NVLink4 per pair, 4 x 25 GB/s NICs"),
    "generic": Machine("generic", 8, 300.0, 25.0, 80.0, 0.0, flash=False, source="a placeholder"),
}

# Collectives AxoNN runs asynchronously, hidden behind computation (SC'24, Section IV-B): the
# z all-gathers of the next layer's weights (prefetched), the z reduce-scatters of weight
# gradients, and the data-parallel gradient all-reduce (bucketed during backward). The x / y
# activation all-reduces sit on the critical path.
OVERLAPPED: frozenset[Key] = frozenset({(MeshAxis.Z.value, "all_gather"), (MeshAxis.Z.value, "reduce_scatter"),
                                        (MeshAxis.DATA.value, "all_reduce")})


def strides(d: ParallelDims) -> dict[str, int]:
    """The product of the group sizes placed inside each axis's group (order x, y, z, data)."""
    out, s = {}, 1
    for a in ORDER:
        out[a] = s
        s *= d.size(a)
    return out


def comm_times(wire: dict[Key, Fraction], d: ParallelDims, machine: Machine) -> dict[Key, float]:
    """Seconds per (axis, kind): wire bytes over the group's bandwidth (bandwidth term only)."""
    st = strides(d)
    return {(a, k): float(b) / (machine.bandwidth(st[a], d.size(a)) * 1e9) for (a, k), b in wire.items()}


def comm_time(wire: dict[Key, Fraction], d: ParallelDims, machine: Machine) -> dict[str, float]:
    """Seconds per axis (blocking collectives, bandwidth term only)."""
    out = {a: 0.0 for a in ORDER}
    for (a, _), t in comm_times(wire, d, machine).items():
        out[a] += t
    return out


def step_time(times: dict[Key, float], compute_s: float) -> dict[str, float]:
    """One step's seconds with AxoNN's overlap credited: computation, the blocking collectives,
    and whatever of the `OVERLAPPED` ones the computation does not hide."""
    hidden = sum(t for k, t in times.items() if k in OVERLAPPED)
    blocking = sum(times.values()) - hidden
    exposed = blocking + max(0.0, hidden - compute_s)
    return {"step_time_s": compute_s + exposed, "exposed_comm_s": exposed, "overlapped_comm_s": hidden}


def model_flops(m: ModelShape, *, batch: int, seq: int, recompute: bool = False, dp: bool = False,
                lora: LoraShape | None = None) -> float:
    """Floating-point operations of one step (6 per parameter and token; x 4/3 with
    recomputation, x 2 with DP-SGD's two passes). Under `lora` a frozen parameter costs 4 (6 with
    recomputation: no weight-gradient product) and an adapter's the full model's rate."""
    if lora is None:
        return 6 * m.params() * batch * seq * (2 if dp else 1) * (4 / 3 if recompute else 1)
    fwd = 4 if recompute else 2
    per_token = (fwd + 2) * m.params() + (fwd + 4) * lora.adapter_elements(m, ParallelDims())
    return per_token * batch * seq * (2 if dp else 1)


# ----------------------------------------------------------------------------- search
@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """Sorted divisors of n (trial division up to sqrt(n); cached: the search asks few distinct n)."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return tuple(small + large[::-1])


def factorisations(n: int) -> list[ParallelDims]:
    """Every ordered (data, x, y, z) with product n (small n only; `plan` searches a bounded set)."""
    return [ParallelDims(data=n // (x * y * z), x=x, y=y, z=z)
            for x in divisors(n) for y in divisors(n // x) for z in divisors(n // (x * y))]


def candidate_grids(m: ModelShape, gpus: int, batch: int) -> list[ParallelDims]:
    """Every grid of `gpus` devices the model and batch can run on, without factoring `gpus`:
    x divides the hidden size, y the heads, KV heads, MLP width and vocabulary, data x z the
    batch, so the search is bounded by the divisors of those (any GPU count answers fast)."""
    out = []
    for x in divisors(math.gcd(m.hidden, gpus)):
        for y in divisors(math.gcd(m.y_divisors_of(), gpus // x)):
            rest = gpus // (x * y)  # = data * z
            if batch % rest:
                continue
            out.extend(ParallelDims(data=rest // z, x=x, y=y, z=z) for z in divisors(rest))
    return out


def largest_admitted(m: ModelShape, gpus: int, batch: int) -> int:
    """The most devices, at most `gpus`, that some grid of `candidate_grids` admits: the largest
    x * y * (data * z) <= gpus with x | hidden, y | `y_divisors_of`, data * z | batch (1 always
    qualifies). What `memaudit parallel plan` names when --gpus admits no grid."""
    best = 1
    for x in divisors(m.hidden):
        for y in divisors(m.y_divisors_of()):
            for r in divisors(batch):
                if best < x * y * r <= gpus:
                    best = x * y * r
    return best


class PlanResult(NamedTuple):
    grids: list[dict[str, Any]]  # ranked by `rank_key`: fitting grids by communication time, then the rest
    considered: int  # grids the model dimensions and the batch admit
    below_floor: int  # of those, grids whose weights and optimizer alone exceed device memory
    below_min_tp: int = 0  # of the others, grids with x*y*z below the shape's `min_tp`


MAX_PLAN_BATCH = 1 << 30  # sequences; bounds the divisor search of data x z (any GPU count is fine)


def _check(gpus: int, batch: int, seq: int, micro_batch: int | None) -> None:
    for flag, v, lo in (("--gpus", gpus, 1), ("--batch", batch, 1), ("--seq", seq, 2)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{flag} {v} must be an integer >= {lo}")
    if batch > MAX_PLAN_BATCH:
        raise ValueError(f"--batch {batch} must be <= {MAX_PLAN_BATCH} sequences")
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch < 1):
        raise ValueError(f"--micro-batch {micro_batch} must be an integer >= 1 (local rows per pass)")


def _row(m: ModelShape, d: ParallelDims, machine: Machine, *, batch: int, seq: int, dtype_bytes: int,
         weight_bytes: int, recompute: bool, dp: bool, micro_batch: int | None, lora: LoraShape | None = None
         ) -> dict[str, Any]:
    rows = batch // (d.data * d.z)
    cap = machine.mem_gib * 2**30
    mem_kw = {"batch": batch, "seq": seq, "dtype_bytes": dtype_bytes, "recompute": recompute,
              "flash": machine.flash, "dp": dp, "lora": lora}
    if micro_batch is None:  # the largest chunk (fewest weight gathers) that fits; memory grows with it
        divs = divisors(rows)
        lo, hi = 0, len(divs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predict_memory(m, d, micro_batch=divs[mid], **mem_kw)["total"] <= cap:
                lo = mid
            else:
                hi = mid - 1
        mb = divs[lo]
    else:
        mb = min(micro_batch, rows)
    passes = math.ceil(rows / mb)
    mem = predict_memory(m, d, micro_batch=mb, **mem_kw)
    pay = predict_collectives(m, d, batch=batch, seq=seq, dtype_bytes=dtype_bytes, weight_bytes=weight_bytes,
                              recompute=recompute, dp=dp, micro_batches=passes, lora=lora)
    wire = wire_bytes(pay, d)
    times = comm_times(wire, d, machine)
    t = comm_time(wire, d, machine)
    per_axis = {a: 0 for a in ORDER}
    by_kind: dict[str, dict[str, float]] = {a: {} for a in ORDER}
    for (a, k), b in wire.items():
        per_axis[a] += float(b)
        by_kind[a][k] = float(b)
    st = strides(d)
    rate = d.world_size * machine.peak_tflops * machine.gemm_efficiency * 1e12
    compute = model_flops(m, batch=batch, seq=seq, recompute=recompute, dp=dp, lora=lora) / rate if rate else None
    row: dict[str, Any] = {
        "grid": asdict(d), "micro_batch": mb, "passes": passes,
        "payload_bytes": {a: sum(b for (ax, _), b in pay.items() if ax == a) for a in ORDER},
        "wire_bytes": per_axis, "wire_bytes_by_kind": by_kind, "memory_bytes": mem,
        "bandwidth_gbs": {a: machine.bandwidth(st[a], d.size(a)) for a in ORDER if d.size(a) > 1},
        "comm_time_s": sum(t.values()), "comm_time_by_axis_s": t,
        "compute_time_s": compute,
    }
    row.update(step_time(times, compute) if compute is not None else
               {"step_time_s": None, "exposed_comm_s": None, "overlapped_comm_s": None})
    over = mem["total"] > cap
    row["fits"] = not over
    row["reason"] = f"memory {mem['total'] / 2**30:.1f} GiB > {machine.mem_gib} GiB" if over else None
    return row


def rank_key(row: dict[str, Any]) -> tuple[bool, float, float, int]:
    """What `plan` ranks a grid by, as AxoNN's planner does: grids that fit first, then the time of
    all of their collectives (overlapped ones included), then the communication left exposed (the
    overlap credited against computation; the total where the machine has no peak rate), then memory.

    Communication times are compared to 12 significant digits, so that two grids moving the same
    bytes over the same bandwidths tie whatever order their terms were summed in. docs/planner.md
    argues the rule from AxoNN's published planner and measurements.

    References: Megatron-AxoNN, branch gordon-bell-perlmutter, examples/comm_model.py (8a4ae24)
    and examples/launch_per_comm_model.py (6920ac0): the configurations AxoNN times are the
    first 20 by the sum of every collective's time.
    """
    comm = row["comm_time_s"]
    exposed = comm if row["exposed_comm_s"] is None else row["exposed_comm_s"]
    return not row["fits"], float(f"{comm:.12g}"), float(f"{exposed:.12g}"), row["memory_bytes"]["total"]


def plan(m: ModelShape, *, gpus: int, batch: int, seq: int, machine: Machine | None = None,
         dtype_bytes: int = 4, weight_bytes: int = 4, recompute: bool = False, dp: bool = False,
         micro_batch: int | None = None, lora: LoraShape | None = None) -> PlanResult:
    """Rank every grid of `gpus` devices that the model and batch admit as AxoNN does (`rank_key`):
    by the predicted time of all of their collectives, ties broken by the communication the
    overlap leaves exposed. Each row also predicts the step time (computation plus exposed
    communication).

    Grids below the memory floor (fp32 weights, gradients and AdamW moments of the local
    shard exceed device memory) or below the shape's `min_tp` are counted, not evaluated; the
    others are evaluated with the largest micro-batch that fits (or `micro_batch` local rows per
    pass) and kept, those over the memory limit with `fits=false` and a `reason`, ranked last. With `lora`, the volume,
    memory and compute are LoRA training's (a frozen base: its weights alone set the floor).

    >>> r = plan(SHAPES["gpt-80b"], gpus=1024, batch=2048, seq=2048, machine=MACHINES["perlmutter"],
    ...          dtype_bytes=2, recompute=True)
    >>> r.grids[0]["fits"]
    True
    """
    _check(gpus, batch, seq, micro_batch)
    if lora is not None:
        lora.check(m)
    machine = machine or MACHINES["generic"]
    per_param = 16 if lora is None else 4  # fp32 weights (+ gradients and AdamW moments unless frozen)
    floor = per_param * m.params() / (machine.mem_gib * 2**30)  # x*y*z must be at least this
    rows, below, small = [], 0, 0
    for d in candidate_grids(m, gpus, batch):
        if d.tp_size < floor:
            below += 1
            continue
        if d.tp_size < m.min_tp:
            small += 1
            continue
        rows.append(_row(m, d, machine, batch=batch, seq=seq, dtype_bytes=dtype_bytes, weight_bytes=weight_bytes,
                         recompute=recompute, dp=dp, micro_batch=micro_batch, lora=lora))
    rows.sort(key=rank_key)
    return PlanResult(rows, len(rows) + below + small, below, small)
