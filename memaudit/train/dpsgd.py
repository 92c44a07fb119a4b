"""DP-SGD (Abadi et al. 2016): clip each example's gradient, add Gaussian noise, average.

For a Poisson-sampled batch S of one step,

    ĝ = ( Σ_{i∈S} min(1, C/||∇ℓ_i||) ∇ℓ_i  +  N(0, σ²C² I) ) / E[|S|]

is written into each parameter's `.grad`, and the trainer then calls `optimizer.step()`.
The denominator is the expected batch size q·N, a constant, as the accounting assumes
(dividing by the realised |S| would leak it). ℓ_i is example i's mean token loss.

One `DPSGD` serves every layout; what depends on the layout is its `PerExampleClipping`:
the per-example norms, the clipped sum and the noise of the layout's parameters. In one
process (`SerialClipping`) they come from `memaudit.train.ghost` (ghost norms and
book-keeping: one forward and one backward pass per micro-batch) or from the `vmap`
reference; on the tensor-parallel grid (`memaudit.parallel.dp.TensorParallelClipping`) each
rank's layers return partial squared norms that are all-reduced. Step t's noise of parameter
i is drawn in fixed tiles from generators keyed by the run's secret randomness at (t, i, tile)
(`memaudit.train.noise`; `memaudit.privacy.randomness`, HKDF over an OS-entropy secret), the
same bits in every layout, and cannot be recomputed from the seed; a gradient on a GPU in one
process gets one device draw keyed at ("dpsgd-noise", t, i) instead. `state_dict()` holds the
secret and the step counter for an exact resume. `mechanism` declares what this adds (the ledger records
`mechanism.dp_event()` per step).

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
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from memaudit.models.keyed_dropout import dropout_rows
from memaudit.privacy.randomness import DPRandomness
from memaudit.train.ghost import ClippedGrads, GhostClipper, vmap_clipped_sum
from memaudit.train.noise import Apply, add_tiled_noise_, for_each_draw, parameter_key


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
    # lazy: dp_accounting (~1.5 s) and numpy (~0.4 s) only when called
    from memaudit.privacy.mechanisms import SampledGaussian

    if dp.population is None:
        raise ValueError(f"{type(dp).__name__} was built without population=N; pass the number of "
                         "training examples")
    return SampledGaussian(name="DP-SGD", unit="example", noise_multiplier=dp.noise_multiplier,
                           population=int(dp.population), expected=dp.expected_batch_size)


@dataclass(frozen=True)
class ClipStats:
    """What one clipped pass over a step's batch reports (besides the sum it leaves in `.grad`)."""

    norms: torch.Tensor  # (B_local,) this process's units' gradient norms, before clipping
    clipped: int  # units of the whole batch whose norm exceeded the clip norm
    loss_sum: float  # the sum of the whole batch's per-example losses (before clipping)
    examples: int  # rows of the whole batch that are examples (a layout's padding rows are not)
    units: int | None = None  # clipped units (users) when rows were grouped; None: the examples


class PerExampleClipping(Protocol):
    """The layout-dependent part of DP-SGD: per-example norms, the clipped sum and the noise.

    `params` are the (name, parameter) pairs that receive gradients, in the order that keys
    their noise; `clipped_sum_` leaves Σ_i min(1, C/||∇_i||) ∇_i of the whole batch in each
    parameter's `.grad` (replacing what was there) and returns the `ClipStats`; `add_noise_`
    adds N(0, std²) to every logical gradient element, parameter i's from its tiles at step
    (`memaudit.train.noise`);
    `share` makes a fresh secret the same on every process of the layout.
    """

    params: list[tuple[str, nn.Parameter]]

    def clipped_sum_(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     clip: float, *, micro_batch_size: int | None, right_padded: bool) -> ClipStats: ...

    def add_noise_(self, std: float, randomness: Any, step: int) -> None: ...

    def share(self, randomness: Any) -> Any: ...


class SerialClipping:
    """`PerExampleClipping` of a model in one process: ghost norms (or the vmap reference)."""

    def __init__(self, model: nn.Module, mode: Literal["ghost", "vmap"] = "ghost") -> None:
        if mode not in ("ghost", "vmap"):
            raise ValueError(f"unknown DP-SGD mode '{mode}'; use 'ghost' or 'vmap'")
        self.model, self.mode = model, mode
        self._ghost = GhostClipper(model) if mode == "ghost" else None
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.device = self.params[0][1].device if self.params else torch.device("cpu")

    def _clipped(self, ids: torch.Tensor, attn: torch.Tensor, lmask: torch.Tensor, clip: float,
                 group_size: int = 1) -> ClippedGrads:
        if self._ghost is not None:
            return self._ghost.clipped_sum(ids, attn, lmask, clip, group_size=group_size)
        return vmap_clipped_sum(self.model, ids, attn, lmask, clip, group_size=group_size)

    def clipped_sum_(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     clip: float, *, micro_batch_size: int | None, right_padded: bool = False,
                     group_size: int = 1) -> ClipStats:
        """Micro-batches of `micro_batch_size` rows (whole groups of `group_size` rows: one
        user's sequences, clipped as one unit), each one clipped pass; sums accumulated."""
        if self.params and self.params[0][1].device != self.device:
            raise ValueError(f"the model moved to {self.params[0][1].device} after DPSGD was built on "
                             f"{self.device}; build DPSGD after model.to(device)")
        b = int(input_ids.shape[0])
        sums = {n: torch.zeros_like(p) for n, p in self.params}
        loss_sum, clipped, chunk, norms = 0.0, 0, micro_batch_size or max(b, 1), []
        chunk = max(group_size, chunk // group_size * group_size)
        for start in range(0, b, chunk):
            sl = slice(start, start + chunk)
            with dropout_rows(self.model, start):  # adapter dropout: these rows' masks
                res = self._clipped(input_ids[sl], attention_mask[sl], loss_mask[sl], clip, group_size)
            for n, g in res.grads.items():
                sums[n] += g
            loss_sum += float(res.losses.sum())
            if not math.isinf(clip):
                clipped += int((res.norms > clip).sum())
            norms.append(res.norms)
        for n, p in self.params:
            p.grad = sums[n]
        all_norms = torch.cat(norms) if norms else torch.zeros(0, device=self.device)
        if group_size == 1:
            return ClipStats(all_norms, clipped, loss_sum, b)
        real = int(loss_mask[:, 1:].any(1).sum())  # a group's padding rows have no target
        return ClipStats(all_norms, clipped, loss_sum, real, units=b // group_size)

    def add_noise_(self, std: float, randomness: Any, step: int) -> None:
        grads = [p.grad for _, p in self.params]

        def draw(i: int) -> Apply | None:
            g = grads[i]
            if g.device.type == "cpu":  # the tiles every layout draws (`memaudit.train.noise`)
                add_tiled_noise_(g, parameter_key(randomness, step, i), std)
                return None

            def on_device() -> None:  # one draw of the whole tensor, on the caller's thread
                gen = randomness.torch_generator("dpsgd-noise", step, i, device=g.device)
                g.add_(torch.normal(0.0, std, size=g.shape, generator=gen, device=g.device, dtype=g.dtype))

            return on_device

        with torch.no_grad():
            for_each_draw(draw, grads)

    def share(self, randomness: Any) -> Any:
        return randomness


class DPSGD:
    """Per-example clipping + Gaussian noise for one model, in any layout; see the module docstring."""

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
        clipping: PerExampleClipping | None = None,
    ) -> None:
        """See the module docstring.

        Args:
          randomness: the run's `DPRandomness` (None: a fresh secret from OS entropy, made the
            same on every process of the layout).
          population: N, the number of training examples sampled from (for `mechanism`).
          micro_batch_size: rows of the (global) batch per clipped pass (None: all at once).
          clipping: the layout's per-example clipping (None: `SerialClipping(model, mode)`;
            the tensor-parallel layout passes `TensorParallelClipping`).
        """
        check_dp_args(clip, noise_multiplier, expected_batch_size)
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {micro_batch_size}")
        self.model = model
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.mode = mode
        self.micro_batch_size = micro_batch_size
        self.clipping = clipping if clipping is not None else SerialClipping(model, mode)
        if randomness is not None and not isinstance(randomness, DPRandomness):
            raise TypeError(f"randomness must be a DPRandomness, got {type(randomness).__name__}")
        self.randomness = randomness if randomness is not None else self.clipping.share(DPRandomness.fresh())
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

    def step_gradients(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        *,
        step: int | None = None,
        right_padded: bool = False,
        group_size: int = 1,
    ) -> dict[str, Any]:
        """Write the privatised mean gradient of this batch into every parameter's `.grad`.

        Args:
          input_ids: (B, L) the Poisson-sampled batch (on a grid, every rank passes all of
            it); B may be 0 or exceed the micro batch.
          attention_mask: (B, L), 1 = real token (None: all real).
          loss_mask: (B, L) bool, True = the target at that position counts (None: the
            attention mask). It is combined with the attention mask.
          step: the step index that keys the noise (None: the internal counter, which
            advances by one per call and is saved in `state_dict()`).
          right_padded: every row's padding is at its end (a layout may then run the model
            without the mask).
          group_size: g > 1 clips per user (ULS): the rows are consecutive groups of g, one
            user's sequences each (padded with rows without targets), and a group's summed
            gradient is the clipped unit; `expected_batch_size` then counts users.

        Returns:
          {"loss": mean per-example loss (nan for an empty batch), "clip_fraction",
          "batch_size", "noise_std"}.
        """
        b = int(input_ids.shape[0])
        t = self.step if step is None else int(step)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lmask = attention_mask.bool() if loss_mask is None else loss_mask.bool() & attention_mask.bool()
        grouped = {"group_size": group_size} if group_size != 1 else {}
        st = self.clipping.clipped_sum_(input_ids, attention_mask, lmask, self.clip,
                                        micro_batch_size=self.micro_batch_size, right_padded=right_padded,
                                        **grouped)
        std = self.noise_multiplier * self.clip
        if std > 0:
            self.clipping.add_noise_(std, self.randomness, t)
        with torch.no_grad():
            for _, p in self.clipping.params:
                p.grad /= self.expected_batch_size
        self.step = t + 1
        n = max(st.examples, 1)
        units = st.examples if st.units is None else st.units
        out = {
            "loss": st.loss_sum / n if b else math.nan,
            "clip_fraction": st.clipped / max(units, 1) if b else 0.0,
            "batch_size": b if st.units is None else st.units,
            "noise_std": self.noise_std,
        }
        if st.units is not None:
            out["sequences"] = st.examples
        return out

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
        self.step = int(state.get("step", self.step))
