"""Typed, validated run configuration. YAML is only the file format.

Each section is a frozen, keyword-only pydantic model that rejects unknown keys,
so a typo is an error naming the key instead of a silently ignored setting.

>>> cfg = load_config(None, overrides=["train.lr=3e-4", "model.preset=small"])
>>> cfg.train.lr, cfg.model.preset
(0.0003, 'small')
"""

from __future__ import annotations

import math
import os
import string
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from memaudit.backends import backend_name
from memaudit.errors import ConfigError

Backend = Literal["centralized", "federated"]  # `parallel` is read as centralized
OwnerKind = Literal["user", "spread"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # fields where inf means something (e.g. privacy.clip=inf: no clipping); NaN never does
    _may_be_infinite: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, v: Any, info: Any) -> Any:
        for x in v if isinstance(v, list | tuple) else (v,):
            if isinstance(x, float) and not math.isfinite(x):
                if math.isinf(x) and info.field_name in cls._may_be_infinite:
                    continue
                raise ValueError(f"{x} is not a finite number; give a finite value")
        return v


# ----------------------------------------------------------------------------- data
class SynthConfig(_Section):
    """The embedded synthetic corpus used when `data.path` is not set."""

    users: int = Field(64, ge=2)
    docs_per_user: int = Field(8, ge=1)
    seed: int = 0
    repeat_every: int = Field(
        4, ge=0, description="every k-th user also repeats a signature message (0: never)"
    )
    repeat_counts: list[int] = Field(
        default_factory=lambda: [2, 4, 8], description="copies of a repeated signature message"
    )
    paragraph_sentences: int = Field(
        6, ge=0, description="extra sentences closing each message and signature (document "
        "length): 6 makes ~98% of documents >= 101 tokens, what discoverable extraction at "
        "k = 50 with a 50-token suffix needs; tests that do not extract may set 2"
    )
    kind: Literal["private", "public"] = Field(
        "private", description="private: users writing messages with their own PII, topics and "
        "facts; public: the public corpus a base model is pretrained on (no PII, no private "
        "topic or fact; memaudit.data.synth.synthesize_public)")
    topics: int = Field(
        4, ge=0, description="private topics, each with its own invented vocabulary; user u "
        "writes about topic u mod topics (0: no topic sentences)")
    facts_per_user: int = Field(
        3, ge=0, description="facts each private user states (code names, numbers, places), "
        "one of them in every message")
    language_seed: int | None = Field(
        None, description="kind public only: the seed of the private corpus whose users' language "
        "(topics, kinds of message, formats) the public corpus writes in, with its own authors, "
        "facts and values; none: faker English without any private topic word")


class CanaryConfig(_Section):
    """Secret Sharer canaries (Carlini et al. 2019): a template with a random secret."""

    repetitions: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    owners: list[OwnerKind] = Field(default_factory=lambda: ["user", "spread"])
    per_setting: int = Field(1, ge=0, description="canaries per (repetition, owner kind)")
    template: str = "my account pin is {secret}"
    secret_length: int = Field(6, ge=1, le=32, description="digits in the secret")
    references: int | None = Field(
        None, ge=0, description="never-inserted references; default: as many as inserted"
    )
    audit_secret_length: int = Field(
        12, ge=4, le=64, description="digits in an audit canary's secret (long, so unique)"
    )
    audit_kind: Literal["secret", "document"] = Field(
        "secret", description="audit canaries: 'secret' (the template with a long random secret, "
        "scored by its log-likelihood) or 'document' (a synthetic message of its own new user, with "
        "that user's PII and facts, scored by Min-K%: in-distribution text that one copy already "
        "marks, where a random digit string leaves no trace in a small model)"
    )

    @field_validator("repetitions")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(r < 1 for r in v):
            raise ValueError("every repetition count must be >= 1")
        return v

    @field_validator("template")
    @classmethod
    def _has_slot(cls, v: str) -> str:
        fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None] if _parses(v) else None
        if fields is None or fields != ["secret"]:
            raise ValueError("the template must contain '{secret}' exactly once and no other "
                             "{...} placeholder (write a literal brace as {{ or }})")
        return v


class DataConfig(_Section):
    path: str | None = Field(None, description="JSONL/CSV/Parquet/text file, directory or dataset name")
    text_field: str = "text"
    user_field: str = "user"
    text_unit: Literal["line", "file"] = Field(
        "line", description="plain text files: one document per line or per file"
    )
    pseudo_users: int | None = Field(
        None, ge=2, description="users assigned to documents without a user field; default: N/8"
    )
    split_name: str = "train"
    synth: SynthConfig = SynthConfig()
    canaries: CanaryConfig = CanaryConfig()
    audit_canaries: int = Field(0, ge=0)
    heldout_users: float = Field(0.2, gt=0, lt=1, description="fraction of users never trained on")
    holdout_fraction: float = Field(
        0.2, gt=0, lt=1, description="IID fraction of training users' documents held out"
    )
    seq_len: int = Field(128, ge=8)
    tokenizer: str | None = Field(None, description="HF tokenizer directory; default: train a BPE")
    tokenizer_corpus: str | None = Field(
        None, description="public text file for the tokenizer; default: held-out users' documents"
    )
    seed: int = 0


# ----------------------------------------------------------------------------- model
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(_Section):
    """LoRA adapters (Hu et al. 2021) on the named linear layers; the base stays frozen.

    The rank is checked against each targeted layer's smaller dimension once the model's shape is
    known (`memaudit.models.lora.check_lora`, before anything is written).
    """

    rank: int = Field(8, description="r: the adapters' inner dimension (1 <= r <= min(d_in, d_out))")
    alpha: float = Field(16.0, gt=0, description="scaling alpha / r of the adapters' update")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: tuple[str, ...] = Field(("q_proj", "v_proj"), description="Llama linear layers "
                                            f"that get adapters, of {', '.join(LORA_TARGETS)}")

    @field_validator("rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"model.lora.rank={v} must be >= 1; use e.g. 8")
        return v

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in v if t not in LORA_TARGETS]
        if bad or not v:
            raise ValueError(f"the model has no module '{bad[0] if bad else ''}' to adapt; choose "
                             f"target_modules from {', '.join(LORA_TARGETS)}")
        return tuple(dict.fromkeys(v))


class ModelConfig(_Section):
    """The model a run trains: a preset's seeded initialisation, or a checkpoint to start from.

    With `init_from` the model's shape, weights and tokenizer come from that checkpoint
    (`memaudit.models.init`); `preset` may then be left out (null), and if given must have the
    checkpoint's shape. `name_or_path` is accepted as the old name of `init_from`.
    """

    preset: Literal["tiny", "tiny2x", "small", "125m", "350m", "1b", "8b"] | None = Field(
        None, description="model shape and seeded initialisation; default tiny (with init_from: "
        "the checkpoint's shape)")
    init_seed: int = 0
    init_from: str | None = Field(
        None, validation_alias=AliasChoices("init_from", "name_or_path"),
        description="start from this Hugging Face LlamaForCausalLM directory (config.json, "
        "safetensors weights, tokenizer) on either backend; the run adopts its tokenizer")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only (null: full weights)")

    @model_validator(mode="after")
    def _default_preset(self) -> ModelConfig:
        if self.preset is None and self.init_from is None:
            object.__setattr__(self, "preset", "tiny")
        return self

    @property
    def name_or_path(self) -> str | None:
        """The old name of `init_from` (read by code written before it)."""
        return self.init_from


# ----------------------------------------------------------------------------- train
class GoldfishConfig(_Section):
    """Goldfish loss (Hans et al. 2024): drop ~1/k of target tokens, chosen by a hash of h ids."""

    enabled: bool = False
    k: int = Field(4, description="drop one in k tokens; k >= 2")
    h: int = Field(13, ge=1, description="context width of the hash")

    @field_validator("k")
    @classmethod
    def _k(cls, v: int) -> int:
        if v < 2:
            raise ValueError("goldfish k must be >= 2 (k=1 would drop every token); use k=4")
        return v


def _parses(template: str) -> bool:
    try:
        list(string.Formatter().parse(template))
    except ValueError:
        return False
    return True


MAX_BATCH = 1 << 20  # sequences; beyond this no step fits in memory


class TrainConfig(_Section):
    steps: int = Field(200, ge=1, le=10**9)
    batch_size: int = Field(16, ge=1, le=MAX_BATCH, description="sequences per step (expected size under DP)")
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_BATCH, description="gradient accumulation chunk")
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = Field(1.0, gt=0, description="global-norm clipping (non-private)")
    seed: int = 0
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(4, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    layers: Literal["auto", "scan", "unroll"] = Field(
        "auto", description="the federated backend's decoder layers in JAX: scan (one scanned layer, "
        "compile time flat in depth) or unroll (faster steps; on a TPU v5e a 125m round of 32 clients ran "
        "1.6x faster unrolled and compiled in 52 s instead of 16 s); auto: scan on an accelerator, unroll "
        "on the CPU")
    activation_checkpointing: bool | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    goldfish: GoldfishConfig = GoldfishConfig()
    engine: Literal["auto", "torch", "jax"] = Field(
        "auto", description="the centralized backend's engine: torch (CPU and GPU; the 4D grid) or jax "
        "(the federated side's Flax Llama on a device mesh, DP-SGD by jax-privacy); auto: jax where a "
        "TPU runtime (libtpu) is installed, else torch")
    mesh_model: int = Field(1, ge=1, description="engine=jax: devices on the model (tensor-parallel) mesh "
                            "axis; the other devices form the data axis")
    clipping: Literal["auto", "ghost", "vmap"] = Field(
        "auto", description="engine=jax, DP-SGD: how the clipped sum is computed; ghost: book-keeping "
        "ghost clipping (one forward and one backward, no per-example gradients); vmap: jax-privacy's "
        "per-example gradients; auto: ghost, vmap under LoRA with adapter dropout and for ULS on an "
        "accelerator (measured faster there)")


# ----------------------------------------------------------------------------- privacy
class AdaptiveClipConfig(_Section):
    """Adaptive clipping (Andrew et al. 2021), federated backend."""

    enabled: bool = False
    target_quantile: float = Field(0.5, gt=0, lt=1)
    lr: float = Field(0.2, gt=0)
    initial_clip: float = Field(0.1, gt=0)
    count_noise: float | None = Field(None, ge=0, description="default: cohort / 20")


class SecAggConfig(_Section):
    """Secure aggregation (Bonawitz et al. 2017; SecAgg+ of Bell et al. 2020).

    Threat model (docs/secure-aggregation.md): by default (``mode: malicious``) a server that
    deviates from the protocol (forks survivor lists, shows different cohorts, substitutes keys)
    colluding with at most ``colluding_clients`` clients; ``mode: honest_but_curious`` drops the
    signatures and holds only against a server that follows the protocol. The threshold must
    exceed (holders + colluding_clients)/2 of each client's holders in both modes; checked here
    as a fraction and again per round with the real holder counts.
    """

    enabled: bool = False
    threshold: float = Field(0.6, gt=0, le=1, description="Shamir t as a fraction of each client's "
                             "holders (its neighbours and itself); must exceed 1/2")
    neighbours: Literal["full", "sparse", "auto"] = "auto"
    bits: int = Field(20, ge=4, le=30, description="quantisation bits per coordinate; bits too few "
                      "for the model are refused at the first round")
    dropout: float = Field(0.0, ge=0, lt=1, description="simulated client dropout rate")
    mode: Literal["malicious", "honest_but_curious"] = Field(
        "malicious", description="server threat model: malicious (Ed25519 signatures on keys, views "
        "and the survivor list; holds against a server that deviates) or honest_but_curious (no "
        "signatures; not safe against a server that sends different survivor lists)")
    colluding_clients: int = Field(0, ge=0, description="n_C: clients that may collude with the server; "
                                   "0 = the simulated clients all run memaudit's code")
    min_survivors: int = Field(3, ge=2, description="a round with fewer survivors aborts (releases "
                               "nothing); at least colluding_clients + 2")
    verification_keys: str | None = Field(None, description="malicious mode: directory of per-client "
                                          "Ed25519 key files client-<id>.pub/.key (a PKI stand-in); "
                                          "default: keys generated per run on the clients' side")

    @model_validator(mode="after")
    def _bounds(self) -> SecAggConfig:
        mal = self.mode == "malicious"
        if self.threshold <= 1 / 2:
            raise ValueError(f"privacy.secure_aggregation.threshold={self.threshold} is too low: a server "
                             f"that shows different survivor lists unmasks one client unless t exceeds "
                             f"1/2 of the holders (plus colluding clients); set threshold > 0.5, e.g. 0.6")
        if self.min_survivors < self.colluding_clients + 2:
            raise ValueError(f"privacy.secure_aggregation.min_survivors={self.min_survivors} lets "
                             f"{self.colluding_clients} colluding clients isolate one honest input; set "
                             f"min_survivors >= {self.colluding_clients + 2}")
        if self.verification_keys is not None and not mal:
            raise ValueError("privacy.secure_aggregation.verification_keys is used only with "
                             "mode=malicious; set mode: malicious or remove it")
        return self


class PrivacyConfig(_Section):
    _may_be_infinite: ClassVar[frozenset[str]] = frozenset({"clip"})
    noise_multiplier: float | None = Field(None, description="sigma; privacy is off unless set")
    clip: float = Field(1.0, description="L2 clip norm C; 'inf' disables clipping")
    target_epsilon: float | None = Field(None, gt=0, description="calibrate sigma to this epsilon")
    delta: float | None = Field(None, description="default: largest power of ten <= 1/(10 N)")
    accountant: Literal["rdp", "pld", "both"] = "both"
    reproducible_randomness: bool = Field(
        False, description="derive the DP sampling and noise keys from train.seed (tests, debugging); "
        "the ledger marks those epsilons void against anyone who knows the seed. Default: a secret "
        "from OS entropy, kept in state/")
    mechanism: Literal["central", "distributed"] = "central"
    unit: Literal["example", "user"] | None = Field(
        None, description="what the guarantee protects on the centralized backend: one training "
        "sequence (example, the default) or a user's whole contribution of up to "
        "max_examples_per_user sequences (user); the federated backend is always user-level")
    user_sampling: Literal["els", "uls"] = Field(
        "uls", description="unit=user, centralized: els = Poisson sampling of the capped examples, "
        "per-example clipping, accounted by a mixture of Gaussians; uls = Poisson sampling of users, "
        "each user's gradient over its capped sequences clipped as one (Charles et al. 2024)")
    max_examples_per_user: int | None = Field(
        None, description="the contribution bound k: training uses at most k sequences of each user "
        "(chosen by train.seed when the sampler is built); required with unit=user")
    adaptive_clipping: AdaptiveClipConfig = AdaptiveClipConfig()
    secure_aggregation: SecAggConfig = SecAggConfig()

    @field_validator("noise_multiplier")
    @classmethod
    def _sigma(cls, v: float | None) -> float | None:
        if v is not None and (v < 0 or math.isnan(v)):
            raise ValueError(f"noise multiplier must be >= 0, got {v}")
        return v

    @field_validator("clip")
    @classmethod
    def _clip(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"clip norm must be > 0 (or 'inf' for no clipping), got {v}")
        return v

    @field_validator("delta")
    @classmethod
    def _delta(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v < 1:
            raise ValueError(f"delta must be in (0, 1), got {v}")
        return v

    @field_validator("max_examples_per_user")
    @classmethod
    def _k(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"privacy.max_examples_per_user must be >= 1 (sequences per user), got {v}")
        return v

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier is not None or self.target_epsilon is not None


# ----------------------------------------------------------------------------- backends
class ParallelConfig(_Section):
    """4D grid: data x (x, y, z) tensor parallelism (AxoNN). World size = product."""

    data: int = Field(1, ge=1)
    x: int = Field(1, ge=1)
    y: int = Field(1, ge=1)
    z: int = Field(1, ge=1)
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    overlap: bool = Field(True, description="OAR: overlap the input-gradient all-reduce with the weight-gradient matmul")
    overlap_reduce_scatter: bool = Field(
        False, description="ORS: asynchronous z reduce-scatter of weight gradients, waited on at the end of backward")
    overlap_all_gather: bool = Field(
        False, description="OAG: prefetch the next layer's z all-gather one layer ahead in forward and backward")
    bucket_data_sync: bool = Field(
        False, description="all-reduce weight gradients over data in buckets issued during backward (as DDP)")
    bucket_mb: float = Field(25.0, gt=0, description="bucket size in MB for bucket_data_sync")

    @property
    def world_size(self) -> int:
        return self.data * self.x * self.y * self.z


_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class FlowerConfig(_Section):
    """Where the Flower runtime finds its federation (``federated.runtime: flower``)."""

    superlink: str = Field("127.0.0.1:9091", description="host:port of the SuperLink's HTTP API "
                           "(flower-superlink --port)")
    insecure: bool = Field(False, description="plain HTTP to the SuperLink; allowed on localhost only")
    root_certificates: str | None = Field(None, description="CA certificate (PEM) of the "
                                          "SuperLink's TLS certificate")
    min_nodes: int = Field(2, ge=1, description="SuperNodes to wait for before the first round")
    connect_timeout: float = Field(120.0, gt=0, description="seconds to wait for them")
    stage_timeout: float = Field(600.0, gt=0, description="seconds a round waits for a node's "
                                 "reply; a node that has not answered is dropped, with its users")

    @model_validator(mode="after")
    def _tls(self) -> FlowerConfig:
        host, sep, port = self.superlink.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"federated.flower.superlink={self.superlink!r} is not host:port; "
                             "give e.g. 127.0.0.1:9091")
        if self.insecure and host not in _LOCAL_HOSTS:
            raise ValueError(f"federated.flower.insecure=true with the SuperLink on {host}: plain "
                             "HTTP is allowed on localhost only; give "
                             "federated.flower.root_certificates (TLS) instead")
        return self


class FederatedConfig(_Section):
    runtime: Literal["jax", "flower"] = Field(
        "jax", description="jax: the program in this process; flower: its client computation on "
        "Flower SuperNodes (memaudit.federated.flower)")
    flower: FlowerConfig = FlowerConfig()
    rounds: int = Field(50, ge=1)
    cohort: int = Field(8, ge=1, description="expected (Poisson) or exact (fixed) cohort size")
    sampling: Literal["poisson", "fixed"] = "poisson"
    algorithm: Literal["fedavg", "fedsgd"] = "fedavg"
    local_steps: int = Field(4, description="client optimizer steps per round")
    local_batch_size: int = Field(4, ge=1)
    clients_per_step: int = Field(1, ge=1, description="clients each step of the loop over the cohort "
                                  "runs, vmapped within the step (FedAvg on federated.runtime=jax): "
                                  "memory for that many clients' training at once, in fewer steps")
    client_optimizer: Literal["sgd", "adam"] = "sgd"
    client_lr: float = Field(0.1, gt=0)
    server_optimizer: Literal["fedavg", "fedadam", "sgd"] = "fedadam"
    server_lr: float = Field(3e-3, gt=0)
    mesh_clients: int | None = Field(None, ge=1, description="devices on the clients mesh axis "
                                     "(default: all devices / mesh_model)")
    mesh_model: int = Field(1, ge=1, description="devices on the model mesh axis: each client's "
                            "attention and MLP weights are split over them (tensor parallel); it "
                            "must divide the heads, kv heads and intermediate size")
    eval_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(10, ge=1)

    @field_validator("local_steps")
    @classmethod
    def _local(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"local_steps must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _clients_per_step(self) -> FederatedConfig:
        # Flower's client stages are traced one client per step (the nodes' manifests list
        # those modules); FedSGD's gradient loop runs one client per step (a batched JVP of an
        # absent slot's lax.cond cannot be transposed)
        k = self.clients_per_step
        if k > 1 and self.runtime == "flower":
            raise ValueError(f"clients_per_step={k} runs on federated.runtime=jax only; set "
                             "federated.clients_per_step=1 on Flower")
        if k > 1 and self.algorithm == "fedsgd":
            raise ValueError(f"clients_per_step={k} applies to FedAvg's local training; set "
                             "federated.clients_per_step=1 with federated.algorithm=fedsgd")
        return self


# ----------------------------------------------------------------------------- probe
PROBE_NAMES = ("exposure", "extraction", "goldfish_extraction", "membership", "user_inference",
               "pii", "audit")


class ProbeConfig(_Section):
    """What `memaudit probe` (and each sweep point) measures, and how (memaudit.probes)."""

    probes: tuple[str, ...] = Field(PROBE_NAMES, description="probes to run, in this order")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = Field(32, ge=1, description="sequences of 128 tokens per forward pass")
    reference: str | None = Field(None, description="reference HF model directory (calibration)")
    reference_models: tuple[str, ...] = Field(
        (), description="k reference models trained without the candidates (offline LiRA, RMIA)")
    seed: int = Field(0, description="seed of bootstraps, permutations, sampling and candidates")
    n_boot: int = Field(1000, ge=10, description="bootstrap resamples per interval")
    fprs: tuple[float, ...] = Field((0.01, 0.001), description="FPRs of the TPR-at-FPR cells")
    max_tokens: int = Field(1024, ge=2, description="tokens per forward pass when a document is "
                            "scored; a longer one is scored in windows of this many tokens")
    window_stride: int | None = Field(None, ge=1, description="tokens between the starts of a "
                                      "long document's windows (default max_tokens // 2); each "
                                      "token is scored once, in the first window that reaches it")
    min_k: float = Field(0.2, gt=0, le=1, description="k of Min-K% and Min-K%++")
    exposure_enumerate_max: int = Field(
        10_000, ge=1, description="score every secret (exact exposure) when |R| <= this; "
        "cost ~4 s per 10^4 candidates with a 2-layer, 64-wide model on one CPU thread, so "
        "10^6 (6 digits) takes ~7 min; above it exposure is sampled (a bound at the ceiling)")
    exposure_samples: int = Field(10_000, ge=100, description="sampled candidates beyond it "
                                  "(the ceiling is log2|R| - log2(1 + |R| 3/n) bits)")
    extraction_ks: tuple[int, ...] = Field((32, 50), description="prefix tokens k")
    extraction_m: int = Field(50, ge=1, description="suffix tokens compared")
    extraction_max_docs: int = Field(1000, ge=1, description="member documents prompted")
    goldfish_m: int = Field(50, ge=1, description="goldfish_extraction: the last m tokens of a "
                            "document are decoded and compared (Hans et al. 2024: 50)")
    goldfish_min_prompt: int = Field(32, ge=1, description="goldfish_extraction: documents with "
                                     "fewer than this many tokens before their last m are skipped")
    top_k: int = Field(40, ge=1, description="top-k of unprompted sampling")
    nd_samples: int = Field(256, ge=0, description="unprompted samples (0: skip)")
    nd_length: int = Field(64, ge=1, description="tokens per unprompted sample")
    nd_top_n: int = Field(100, ge=1, description="top-ranked samples checked per metric")
    nd_ngram: int = Field(50, ge=2, description="training window that counts as memorised")
    pii_candidates: int = Field(9, ge=1, description="decoys per PII item")
    pii_max_items: int = Field(200, ge=1, description="PII items per group")
    user_docs: int | None = Field(
        None, ge=1, description="documents per user on both sides of user inference; "
        "default: the most every compared user has"
    )
    audit_r: tuple[int, ...] = Field((), description="guesses r tried (default m/20..m/2)")
    audit_p: float = Field(0.05, gt=0, lt=1, description="1 - confidence of the audit bound")
    audit_delta: float | None = Field(None, ge=0, description="δ of the audit; default: the run's")

    @field_validator("probes")
    @classmethod
    def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [n for n in v if n not in PROBE_NAMES]
        if bad or not v:
            raise ValueError(
                f"unknown probe '{bad[0] if bad else ''}'; choose from {', '.join(PROBE_NAMES)}"
            )
        return tuple(dict.fromkeys(v))

    @field_validator("fprs")
    @classmethod
    def _fprs(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < f < 1 for f in v):
            raise ValueError(f"every FPR must be in (0, 1), got {list(v)}")
        return v


class Config(_Section):
    backend: Backend = "centralized"
    output_dir: str | None = None
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    parallel: ParallelConfig = ParallelConfig()
    federated: FederatedConfig = FederatedConfig()

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_alias(cls, v: Any) -> Any:
        return backend_name(v)  # configs written before the rename say `parallel`

    @model_validator(mode="after")
    def _cross(self) -> Config:
        if self.backend == "federated" and self.train.goldfish.enabled:
            raise ValueError(
                "train.goldfish is a centralized-only mitigation; set train.goldfish.enabled=false "
                "or backend=centralized"
            )
        if self.train.layers == "scan" and (self.backend != "federated" or self.model.lora is not None):
            raise ValueError("train.layers=scan applies to the federated backend's full fine-tuning (the "
                             "centralized engines and LoRA's per-layer adapters keep unrolled layers); set "
                             "train.layers to auto or unroll")
        if self.backend == "federated":
            _check_federated_unit(self.privacy)
        elif self.privacy.unit == "user" and self.privacy.enabled and self.privacy.max_examples_per_user is None:
            raise ValueError("privacy.unit=user needs the contribution bound: set "
                             "privacy.max_examples_per_user=k (sequences per user)")
        return self


def _check_federated_unit(p: PrivacyConfig) -> None:
    """The federated backend samples and clips users: an example-level setting is refused."""
    fields = p.model_fields_set
    if p.unit == "example" and p.enabled:
        raise ValueError("privacy.unit=example on the federated backend: DP-FedAvg protects a user's "
                         "whole contribution; drop privacy.unit or set it to user")
    if "user_sampling" in fields and p.user_sampling == "els":
        raise ValueError("privacy.user_sampling=els is centralized example-level sampling; the federated "
                         "backend samples users: drop privacy.user_sampling or use backend=centralized")
    if p.max_examples_per_user is not None:
        raise ValueError("privacy.max_examples_per_user is the centralized contribution bound; the "
                         "federated backend trains on each user's own data: drop it or use backend=centralized")


# ----------------------------------------------------------------------------- loading
def format_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "<root>"
    if e["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'; check the spelling (see configs/tiny.yaml)"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{source}: invalid value for '{key}': {msg}"


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value


def set_leaves(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """`dotted` = `value` where `value` is a mapping and a section is already there: merged key by
    key (an override changes the keys it names and keeps the rest of the section); any other
    value is set as it is (`set_dotted`)."""
    node: Any = tree
    for p in dotted.split("."):
        node = node.get(p) if isinstance(node, dict) else None
    if isinstance(value, dict) and isinstance(node, dict):
        for k, v in value.items():
            set_leaves(tree, f"{dotted}.{k}", v)
        return
    set_dotted(tree, dotted, value)


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value), the value parsed as a YAML scalar or list."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def load_raw(path: str | os.PathLike | None) -> dict[str, Any]:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' not found; pass a YAML file such as configs/tiny.yaml")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{p}' is not UTF-8 text") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file '{p}' is not valid YAML{where}; fix the syntax") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_error(e, source)) from None


def load_config(
    path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load YAML (or defaults when `path` is None), apply `key=value` overrides, validate."""
    raw = load_raw(path)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return config_from_dict(raw, source=str(path) if path is not None else "config")


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """A new config with dotted-key overrides applied and re-validated."""
    raw = cfg.model_dump(mode="json")
    for key, value in overrides.items():
        set_dotted(raw, key, value)
    return config_from_dict(raw)


def dump_config(cfg: Config) -> dict[str, Any]:
    """JSON-ready resolved config (inf written as the string 'inf')."""
    return _json_safe(cfg.model_dump(mode="python"))


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj
