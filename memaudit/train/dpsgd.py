"""DP-SGD (Abadi et al. 2016): clip each example's gradient, add Gaussian noise, average.

For a Poisson-sampled batch S of one step,

    ĝ = ( Σ_{i∈S} min(1, C/||∇ℓ_i||) ∇ℓ_i  +  N(0, σ²C² I) ) / E[|S|]

is written into each parameter's `.grad`, and the trainer then calls `optimizer.step()`.
The denominator is the expected batch size q·N, a constant, as the accounting assumes
(dividing by the realised |S| would leak it). ℓ_i is example i's mean token loss.

Per-example norms and the clipped sum come from `memaudit.train.ghost` (ghost norms and
book-keeping: one forward and one backward pass per micro-batch), or from the `vmap`
reference. Step t's noise of parameter i comes from a fresh `torch.Generator` keyed by the
run's secret randomness at ("dpsgd-noise", t, i) (`memaudit.privacy.randomness`, HKDF over
an OS-entropy secret), so it cannot be recomputed from the seed; `state_dict()` holds the
secret and the step counter for an exact resume. `mechanism` declares what this adds (the
ledger records `mechanism.dp_event()` per step).

References:
  Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  Li et al., ICLR 2022 (ghost clipping); Bu et al., ICML 2023 (book-keeping).

>>> import torch
>>> from memaudit.models.presets import build_model
>>> model = build_model("tiny", vocab_size=64, seed=0)
>>> dp = DPSGD(model, clip=1.0, noise_multiplier=1.0, expected_batch_size=4)
>>> ids = torch.randint(0, 64, (3, 12))
>>> stats = dp.step_gradients(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
>>> stats["batch_size"], stats["noise_std"]
(3, 0.25)
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from memaudit.train.ghost import ClippedGrads, GhostClipper, vmap_clipped_sum


def check_dp_args(clip: float, noise_multiplier: float, expected_batch_size: float) -> None:
    """The argument checks every DP-SGD layout (one process, the parallel grid) shares."""
    if not clip > 0:
        raise ValueError(f"clip norm must be > 0 (or inf for no clipping), got {clip}")
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be a finite number >= 0, got {noise_multiplier}")
    if not expected_batch_size > 0:
        raise ValueError(f"expected batch size must be > 0, got {expected_batch_size}")
    if noise_multiplier > 0 and math.isinf(clip):
        raise ValueError("noise needs a finite clip norm: set privacy.clip, or noise_multiplier=0")


def dpsgd_mechanism(dp: Any) -> Any:
    """The event one DP-SGD step adds, for any layout with `noise_multiplier`, `population`
    and `expected_batch_size`: a Poisson-sampled Gaussian, add/remove-one example adjacency."""
    from memaudit.privacy.mechanisms import SampledGaussian

    if dp.population is None:
        raise ValueError(f"{type(dp).__name__} was built without population=N; pass the number of "
                         "training examples")
    return SampledGaussian(name="DP-SGD", unit="example", noise_multiplier=dp.noise_multiplier,
                           population=int(dp.population), expected=dp.expected_batch_size)


class DPSGD:
    """Per-example clipping + Gaussian noise for one model; see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        *,
        clip: float,
        noise_multiplier: float,
        expected_batch_size: float,
        randomness: Any = None,
        population: int | None = None,
        mode: Literal["ghost", "vmap"] = "ghost",
        micro_batch_size: int | None = None,
    ) -> None:
        """See the module docstring.

        Args:
          randomness: the run's `DPRandomness` (None: a fresh secret from OS entropy).
          population: N, the number of training examples sampled from (for `mechanism`).
        """
        from memaudit.privacy.randomness import DPRandomness

        check_dp_args(clip, noise_multiplier, expected_batch_size)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
        if mode not in ("ghost", "vmap"):
            raise ValueError(f"unknown DP-SGD mode '{mode}'; use 'ghost' or 'vmap'")
        self.model = model
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.mode = mode
        self.micro_batch_size = micro_batch_size
        self._ghost = GhostClipper(model) if mode == "ghost" else None
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = self._params[0][1].device if self._params else torch.device("cpu")
        if randomness is not None and not isinstance(randomness, DPRandomness):
            raise TypeError(f"randomness must be a DPRandomness, got {type(randomness).__name__}")
        self.randomness = randomness if randomness is not None else DPRandomness.fresh()
        self.population = population
        self.step = 0  # the next step's index: selects its noise keys

    @property
    def mechanism(self) -> Any:
        """What one step adds: a Poisson-sampled Gaussian, add/remove-one example adjacency."""
        return dpsgd_mechanism(self)

    def dp_event(self) -> Any:
        """The DpEvent of one step: ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``."""
        return self.mechanism.dp_event()

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise in the averaged gradient, σC / E[|S|]."""
        if self.noise_multiplier == 0:
            return 0.0
        return self.noise_multiplier * self.clip / self.expected_batch_size

    def _clipped(self, ids, attn, lmask) -> ClippedGrads:
        if self._ghost is not None:
            return self._ghost.clipped_sum(ids, attn, lmask, self.clip)
        return vmap_clipped_sum(self.model, ids, attn, lmask, self.clip)

    def step_gradients(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        *,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Write the privatised mean gradient of this batch into every parameter's `.grad`.

        Args:
          input_ids: (B, L) the Poisson-sampled batch; B may be 0 or exceed the micro batch.
          attention_mask: (B, L), 1 = real token (None: all real).
          loss_mask: (B, L) bool, True = the target at that position counts (None: the
            attention mask). It is combined with the attention mask.
          step: the step index that keys the noise (None: the internal counter, which
            advances by one per call and is saved in `state_dict()`).

        Returns:
          {"loss": mean per-example loss (nan for an empty batch), "clip_fraction",
          "batch_size", "noise_std"}.
        """
        b = int(input_ids.shape[0])
        if self._params and self._params[0][1].device != self.device:
            raise ValueError(f"the model moved to {self._params[0][1].device} after DPSGD was built on "
                             f"{self.device}; build DPSGD after model.to(device)")
        t = self.step if step is None else int(step)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lmask = attention_mask.bool() if loss_mask is None else loss_mask.bool() & attention_mask.bool()
        sums = {n: torch.zeros_like(p) for n, p in self._params}
        loss_sum, clipped, chunk = 0.0, 0, self.micro_batch_size or max(b, 1)
        for start in range(0, b, chunk):
            sl = slice(start, start + chunk)
            res = self._clipped(input_ids[sl], attention_mask[sl], lmask[sl])
            for n, g in res.grads.items():
                sums[n] += g
            loss_sum += float(res.losses.sum())
            if not math.isinf(self.clip):
                clipped += int((res.norms > self.clip).sum())
        std = self.noise_multiplier * self.clip
        with torch.no_grad():
            for i, (n, p) in enumerate(self._params):
                g = sums[n]
                if std > 0:
                    gen = self.randomness.torch_generator("dpsgd-noise", t, i, device=g.device)
                    g += torch.normal(0.0, std, size=g.shape, generator=gen, device=g.device, dtype=g.dtype)
                g /= self.expected_batch_size
                p.grad = g
        self.step = t + 1
        return {
            "loss": loss_sum / b if b else math.nan,
            "clip_fraction": clipped / b if b else 0.0,
            "batch_size": b,
            "noise_std": self.noise_std,
        }

    def state_dict(self) -> dict[str, Any]:
        """The secret randomness and step counter (and settings, checked on load). Sensitive."""
        r = self.randomness.state_dict()
        return {"secret": r["secret"], "reproducible": r["reproducible"], "step": self.step,
                "clip": self.clip, "noise_multiplier": self.noise_multiplier,
                "expected_batch_size": self.expected_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("clip", "noise_multiplier", "expected_batch_size"):
            if key in state and float(state[key]) != getattr(self, key):
                raise ValueError(f"checkpoint has {key}={state[key]} but this run uses "
                                 f"{getattr(self, key)}; resume with the original privacy settings")
        if "secret" not in state:
            raise ValueError("this DP-SGD checkpoint predates secret randomness; restart the run")
        self.randomness.load_state_dict(state)  # in place: the sampler shares this object
        self.step = int(state["step"])
