"""Analytic model of AxoNN's per-step communication and per-device memory; grid ranking.

`predict_payload` mirrors exactly what `memaudit.parallel` passes to each collective in one
training step (bytes each rank hands in, per axis): z all-gathers of every weight block in
forward and again in backward, z reduce-scatters of weight gradients, activation
all-reduces over x (normal-layer outputs, transposed-layer input gradients) and over y
(the converse), RMSNorm statistics over x, the embedding's vocabulary all-reduce over y, the
vocabulary-parallel loss over y, the loss statistics over z and data, the gradient sync of
replicated parameters over z and of all parameters over data, and optional clipping norms.

References: Singh et al., AxoNN (SC'24), Section IV (communication model).

>>> from memaudit.parallel.dims import ParallelDims
>>> p = predict_payload(ModelShape.from_preset("tiny"), ParallelDims(), batch=4, seq=16)
>>> sum(p.values())
0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from memaudit.parallel.dims import MeshAxis, ParallelDims


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        from memaudit.models.presets import get_preset

        p = get_preset(name)
        return cls(p.vocab_size, p.hidden_size, p.intermediate_size, p.num_hidden_layers,
                   p.num_attention_heads, p.num_key_value_heads)

    @classmethod
    def from_config(cls, c: Any) -> ModelShape:
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                   c.num_attention_heads, c.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linears(self) -> list[tuple[int, int, bool]]:
        """(out, in, transposed) of every layer's linears, per decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q, h, False), (kv, h, False), (kv, h, False), (h, q, True),
                (i, h, False), (i, h, False), (h, i, True)]


def _add(out: dict[str, int], dims: ParallelDims, axis: str, nbytes: int) -> None:
    if dims.size(axis) > 1:
        out[axis] += int(nbytes)


def _zshard(numel: int, z: int) -> int:
    return math.ceil(numel / z)


def _linear(out: dict[str, int], d: ParallelDims, o: int, i: int, transposed: bool, tokens: int, e: int) -> int:
    in_ax, out_ax = ("y", "x") if transposed else ("x", "y")
    o_l, i_l = o // d.size(out_ax), i // d.size(in_ax)
    shard = _zshard(o_l * i_l, d.z)
    _add(out, d, "z", 2 * shard * e)  # all-gather in forward and again in backward
    _add(out, d, "z", shard * d.z * e)  # reduce-scatter of the (padded) weight gradient
    _add(out, d, in_ax, tokens * o_l * e)  # forward: partial outputs
    _add(out, d, out_ax, tokens * i_l * e)  # backward: partial input gradients
    return shard


def predict_payload(m: ModelShape, d: ParallelDims, *, batch: int, seq: int, dtype_bytes: int = 4,
                    clip: bool = False) -> dict[str, int]:
    """Bytes each rank passes to collectives in one step, per axis (global batch `batch`)."""
    out = {a.value: 0 for a in MeshAxis}
    e = dtype_bytes
    b = batch // (d.data * d.z)
    n, n1 = b * seq, b * (seq - 1)  # tokens through the stack, and through the LM head
    weights = 0
    for _ in range(m.layers):
        for o, i, t in m.linears():
            weights += _linear(out, d, o, i, t, n, e)
    norms = 2 * m.layers + 1
    _add(out, d, "x", norms * 2 * n * 4)  # fp32 mean square, forward and backward
    v_l, h_l = m.vocab // d.y, m.hidden // d.x
    emb = _zshard(v_l * h_l, d.z)
    _add(out, d, "z", emb * e + emb * d.z * e)  # all-gather forward, reduce-scatter backward
    _add(out, d, "y", n * h_l * e)  # vocabulary-partial embeddings
    weights += emb + _linear(out, d, m.vocab, m.hidden, False, n1, e)
    _add(out, d, "y", 3 * n1 * 4)  # loss: max, sum-exp, target logit (fp32)
    for axis in ("z", "data"):
        _add(out, d, axis, 16)  # loss sum and target count (fp64)
    norm_params = norms * h_l
    _add(out, d, "z", norm_params * 4)  # replicated-parameter gradients
    _add(out, d, "data", (weights + norm_params) * 4)
    if clip:
        for axis in ("x", "y", "z"):
            _add(out, d, axis, 8)
    return out


def predict_memory(m: ModelShape, d: ParallelDims, *, batch: int, seq: int, dtype_bytes: int = 4
                   ) -> dict[str, int]:
    """Per-device bytes: fp32 weights, grads, AdamW moments, transient gathered block, activations.

    Activations are an estimate (no activation checkpointing): per layer the saved inputs of
    the linears, attention and MLP intermediates, and the fp32 logits and softmax of the head.
    """
    weights = 0
    blocks = []
    for o, i, t in m.linears():
        o_l, i_l = (o // d.x, i // d.y) if t else (o // d.y, i // d.x)
        weights += m.layers * _zshard(o_l * i_l, d.z)
        blocks.append(o_l * i_l)
    vh = (m.vocab // d.y) * (m.hidden // d.x)
    weights += 2 * _zshard(vh, d.z) + (2 * m.layers + 1) * (m.hidden // d.x)
    b = max(1, batch // (d.data * d.z))
    n = b * seq
    h_x, q_y, i_y = m.hidden // d.x, m.heads * m.head_dim // d.y, m.intermediate // d.y
    kv_y = m.kv_heads * m.head_dim // d.y
    per_layer = n * (4 * h_x + 3 * q_y + 2 * kv_y + 4 * i_y) * dtype_bytes
    attn = b * (m.heads // d.y) * seq * seq * dtype_bytes  # sdpa math path may keep scores
    logits = 3 * n * (m.vocab // d.y) * 4
    mem = {
        "weights": weights * 4,
        "grads": weights * 4,
        "optimizer": 2 * weights * 4,
        "gathered": max(max(blocks), vh) * dtype_bytes * 2,
        "activations": m.layers * (per_layer + attn) + logits,
    }
    mem["total"] = sum(mem.values())
    return mem


def _time(payload: dict[str, int], d: ParallelDims, gpus_per_node: int, intra_gbs: float, inter_gbs: float) -> float:
    """Bandwidth-only estimate: an axis is intra-node when its ranks fit in one node."""
    stride = 1
    t = 0.0
    for axis in ("x", "y", "z", "data"):
        n = d.size(axis)
        bw = intra_gbs if stride * n <= gpus_per_node else inter_gbs
        t += payload[axis] * 2 * (n - 1) / max(n, 1) / (bw * 1e9)
        stride *= n
    return t


def factorisations(n: int) -> list[ParallelDims]:
    out = []
    for data in range(1, n + 1):
        if n % data:
            continue
        for x in range(1, n // data + 1):
            if (n // data) % x:
                continue
            for y in range(1, n // (data * x) + 1):
                if (n // (data * x)) % y:
                    continue
                out.append(ParallelDims(data=data, x=x, y=y, z=n // (data * x * y)))
    return out


def plan(m: ModelShape, *, gpus: int, batch: int, seq: int, mem_gib: float = 80.0, dtype_bytes: int = 4,
         gpus_per_node: int = 8, intra_gbs: float = 300.0, inter_gbs: float = 25.0) -> list[dict[str, Any]]:
    """Every valid grid for `gpus` devices, with payload, memory and estimated comm time, best first.

    Grids whose model dimensions do not divide, whose batch does not divide by data*z, or
    whose memory exceeds `mem_gib` are kept with `fits=false` and a `reason`, ranked last.
    """
    if gpus < 1 or batch < 1 or seq < 2:
        raise ValueError(f"need gpus>=1, batch>=1, seq>=2 (got {gpus}, {batch}, {seq})")
    rows = []
    for d in factorisations(gpus):
        reason = None
        for name, v, ax in (("heads", m.heads, "y"), ("kv_heads", m.kv_heads, "y"), ("hidden", m.hidden, "x"),
                            ("intermediate", m.intermediate, "y"), ("vocab", m.vocab, "y")):
            if v % d.size(ax):
                reason = f"{name}={v} not divisible by {ax}={d.size(ax)}"
                break
        if reason is None and batch % (d.data * d.z):
            reason = f"batch={batch} not divisible by data*z={d.data * d.z}"
        row: dict[str, Any] = {"grid": asdict(d)}
        if reason is None:
            pay = predict_payload(m, d, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
            mem = predict_memory(m, d, batch=batch, seq=seq, dtype_bytes=dtype_bytes)
            if mem["total"] > mem_gib * 2**30:
                reason = f"memory {mem['total'] / 2**30:.1f} GiB > {mem_gib} GiB"
            row |= {"payload_bytes": pay, "memory_bytes": mem,
                    "comm_time_s": _time(pay, d, gpus_per_node, intra_gbs, inter_gbs)}
        row["fits"] = reason is None
        row["reason"] = reason
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], r.get("comm_time_s", math.inf)))
    return rows
