"""One compute policy for memaudit's JAX engines: which dtype a model computes in, which its
weights are kept in, and how its decoder layers run.

Mixed precision as Flax's ``dtype`` / ``param_dtype`` (and torch's autocast) do it: matmuls and
activations in the compute dtype (bfloat16 on an accelerator), master weights, optimizer state
and every reduction that needs the range in float32 (RMSNorm's mean square, attention's softmax,
the loss's log-softmax, DP clipping norms, the sums of client deltas). The federated backend
and the centralized JAX engine resolve ``train.dtype`` through `resolve_policy` once, so that
both sides of a comparison compute alike.

``train.dtype: auto`` is bfloat16 on TPU and GPU and float32 on the CPU (where every test runs,
so that CPU results stay exact and comparable across versions). Decoder layers run as one
scanned layer over stacked weights (``scan_layers``, the default on accelerators: the compiled
program no longer grows with depth), optionally rematerialised (``remat``: activations of a
layer recomputed in the backward pass instead of stored).

References:
    Micikevicius et al. 2018, "Mixed Precision Training".
    Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training".

>>> p = resolve_policy("auto", backend="cpu")
>>> p.compute_dtype, p.param_dtype, p.scan_layers
('float32', 'float32', False)
>>> resolve_policy("auto", backend="tpu").compute_dtype
'bfloat16'
>>> resolve_policy("float32", backend="tpu").compute_dtype
'float32'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

ComputeDtype = Literal["float32", "bfloat16"]
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
ACCELERATORS = frozenset({"tpu", "gpu", "cuda", "rocm"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComputePolicy:
    """How a JAX engine computes.

    Attributes:
        compute_dtype: the dtype of matmuls and activations (Flax's ``dtype``).
        param_dtype: master weights and optimizer state (Flax's ``param_dtype``); always float32.
        reduce_dtype: norms, softmax, loss and aggregation sums; always float32.
        scan_layers: the decoder layers as one ``nn.scan`` over stacked weights.
        remat: rematerialise each decoder layer in the backward pass (``nn.remat``).
    """

    compute_dtype: ComputeDtype = "float32"
    param_dtype: Literal["float32"] = "float32"
    reduce_dtype: Literal["float32"] = "float32"
    scan_layers: bool = False
    remat: bool = False

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {self.compute_dtype!r} is not one of {COMPUTE_DTYPES}; "
                             "set train.dtype to float32, bfloat16 or auto")
        if self.remat and not self.scan_layers:
            raise ValueError("remat=True applies to scanned decoder layers; set scan_layers=True as well")

    @property
    def compute(self) -> Any:
        """The compute dtype as a JAX dtype (``jnp.bfloat16``)."""
        # lazy: jax.numpy (~1 s) only where a JAX engine builds its model
        import jax.numpy as jnp

        return jnp.dtype(self.compute_dtype)

    @property
    def param(self) -> Any:
        """The master weights' dtype as a JAX dtype (float32)."""
        # lazy: jax.numpy only where a JAX engine builds its model
        import jax.numpy as jnp

        return jnp.dtype(self.param_dtype)

    @property
    def mixed(self) -> bool:
        """Whether compute runs below the master weights' precision."""
        return self.compute_dtype != self.param_dtype


def default_backend() -> str:
    """The JAX backend this process computes on (``cpu``, ``tpu``, ``gpu``)."""
    # lazy: jax (~1 s) only when a policy is resolved without naming the backend
    import jax

    return jax.default_backend()


def resolve_policy(dtype: str = "auto", backend: str | None = None, *, scan_layers: bool | None = None,
                   remat: bool = False) -> ComputePolicy:
    """The policy of ``train.dtype`` on ``backend`` (default: JAX's default backend).

    Args:
        dtype: ``"auto"`` (bfloat16 on an accelerator, float32 on the CPU), ``"float32"`` or
            ``"bfloat16"``.
        backend: a JAX platform name; None asks JAX.
        scan_layers: scan the decoder layers; None: on an accelerator only (CPU programs keep
            the unrolled layers, and with them their exact values).
        remat: rematerialise the scanned layers.

    Returns:
        A `ComputePolicy`.
    """
    if dtype not in ("auto", *COMPUTE_DTYPES):
        raise ValueError(f"train.dtype={dtype!r} is not one of auto, float32, bfloat16 for a JAX engine; "
                         "set one of them")
    backend = default_backend() if backend is None else backend
    accelerator = backend.lower() in ACCELERATORS
    compute = ("bfloat16" if accelerator else "float32") if dtype == "auto" else dtype
    scan = accelerator if scan_layers is None else bool(scan_layers)
    return ComputePolicy(compute_dtype=compute, scan_layers=scan, remat=remat and scan)


def policy_of_config(cfg: Any, backend: str | None = None) -> ComputePolicy:
    """The policy of a run's config (``cfg.train.dtype`` and ``cfg.train.layers``: scan, unroll, or
    auto: scanned on an accelerator); LoRA keeps the unrolled layers (its adapters are addressed per
    layer)."""
    lora = getattr(getattr(cfg, "model", None), "lora", None)
    scan = {"scan": True, "unroll": False}.get(getattr(cfg.train, "layers", "auto"))
    return resolve_policy(cfg.train.dtype, backend, scan_layers=False if lora is not None else scan)


__all__ = ["COMPUTE_DTYPES", "ComputePolicy", "policy_of_config", "resolve_policy"]
