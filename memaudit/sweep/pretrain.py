"""Public pretraining, then private fine-tuning: the base model every sweep point starts from.

A sweep file with a `pretrain:` section first trains one model, centralized and without DP, on
a public corpus that holds no training user's text (`memaudit.data.synth.synthesize_public`, or
a corpus file at `pretrain.path`), checked by `memaudit.data.overlap.require_disjoint` against
every point's private corpus before anything is written. The base is an ordinary run directory,
`OUT/base/` (manifest `role: "public-pretrain"`, and `pretrain_key`: a hash of its resolved
config), so a re-run with the same settings reuses it and a changed setting retrains it. Every
point then gets `model.init_from: OUT/base/model` (the checkpoint and its tokenizer).

The base is also the zero-fine-tuning reference point: `OUT/runs/public-base/` holds the private
data prepared exactly as the points' (same fingerprint), the base model unchanged, its holdout
loss on the private holdout set (`result`, evaluated like the trainers do) and probes.json; its
manifest says `"role": "public-base"` so the report can draw it as the origin rather than as a
centralized non-DP point.

References:
    Li et al., "Large Language Models Can Be Strong Differentially Private Learners", ICLR 2022;
    Yu et al., "Differentially Private Fine-tuning of Language Models", ICLR 2022;
    Thakkar et al., "Understanding Unintended Memorization in Federated Learning", 2020.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from memaudit import __version__
from memaudit.backends import CENTRALIZED
from memaudit.config import config_from_dict, dump_config, set_dotted, set_leaves, with_overrides
from memaudit.data.overlap import require_disjoint
from memaudit.data.prepare import private_documents
from memaudit.errors import RunDirError
from memaudit.io import atomic_write_json, read_jsonl
from memaudit.models.init import initial_model
from memaudit.run import dispatch as switch
from memaudit.run import timebox
from memaudit.run.checks import check_before_disk
from memaudit.run.lifecycle import RunSession
from memaudit.rundir import RunDir, prepare_new_run
from memaudit.sweep.config import PretrainConfig, deep_copy, plan_points, point_config
from memaudit.sweep.point import config_as_written, stale_reason, stored_config
from memaudit.sweep.probing import probe_if_stale
from memaudit.train.evaluate import holdout_loss

Progress = Callable[[int, int, dict], None] | None
BASE_DIR = "base"
REFERENCE_RUN = "public-base"
ROLE_PRETRAIN = "public-pretrain"
ROLE_REFERENCE = "public-base"


# ----------------------------------------------------------------------------- configs
def public_base_config(cfg: Any, *, size: str | None = None, tokenizer: str | None = None) -> Any:
    """The run config of the public pretraining: the sweep's base config, centralized on one
    process, without DP, Goldfish, canaries or a starting checkpoint, on the public corpus.

    `size`: the model-size axis' preset this base is for (None: the base config's model);
    `tokenizer`: a tokenizer another size's base trained, so that every size shares it."""
    p: PretrainConfig = cfg.pretrain
    raw = deep_copy(cfg.base)
    for key in ("parallel", "federated", "privacy"):
        raw.pop(key, None)
    synth = dict(raw.get("data", {}).get("synth", {}))
    sentences = p.paragraph_sentences if p.paragraph_sentences is not None else synth.get("paragraph_sentences")
    public_synth = {"kind": "public", "users": p.users, "docs_per_user": p.docs_per_user, "seed": p.seed}
    if p.shared_language:  # the private users' topics and vocabulary, not their facts or PII
        public_synth.update(language_seed=synth.get("seed", 0), topics=synth.get("topics", 4),
                            facts_per_user=synth.get("facts_per_user", 3))
    if sentences is not None:
        public_synth["paragraph_sentences"] = sentences
    for key, value in {
        # every weight: base.model.lora (grid.finetune's LoRA settings) is the fine-tunes' choice
        "backend": CENTRALIZED, "model.init_from": None, "model.lora": None, "train.steps": p.steps,
        "train.goldfish.enabled": False, "data.path": p.path, "data.synth": public_synth,
        # no canary of any kind: the base does not depend on the private side's canary settings
        "data.canaries": {"per_setting": 0, "references": 0}, "data.audit_canaries": 0,
        "data.tokenizer": tokenizer, "data.tokenizer_corpus": None,
        **({"model.preset": size} if size is not None else {}),
    }.items():
        set_dotted(raw, key, value)
    for key, value in {**p.overrides, **p.per_model.get(size or "", {})}.items():
        set_leaves(raw, key, value)
    return config_from_dict(raw, source="sweep pretrain")


def pretrain_key(base_cfg: Any) -> str:
    """sha256 of the base's resolved config: what decides whether a cached base is reused."""
    raw = json.dumps({"config": dump_config(base_cfg), "memaudit": __version__}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()


def _private_configs(cfg: Any) -> list[Any]:
    """The distinct run configs' data sections of the sweep's points (usually one)."""
    seen, out = set(), []
    for p in plan_points(cfg):
        data = point_config(cfg, p).data
        key = json.dumps(data.model_dump(mode="json"), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(data)
    return out


def check_public_corpus(cfg: Any, base_cfg: Any | None = None) -> dict[str, Any]:
    """Refuse (one line, nothing written) a public corpus that shares a document, a canary
    secret or a PII value with any point's private data; returns the overlap counts."""
    base_cfg = base_cfg if base_cfg is not None else public_base_config(cfg)
    public, _, _ = private_documents(base_cfg.data)
    report: dict[str, Any] = {}
    for data in _private_configs(cfg):
        docs, _, canaries = private_documents(data)
        secrets = [c.secret for c in (*canaries.inserted, *canaries.references, *canaries.audit)]
        report = require_disjoint(public, docs, secrets=secrets).to_json()
    return report


# ----------------------------------------------------------------------------- the base
def _complete_with(rd: Any, **fields: Any) -> bool:
    if not rd.is_run() or rd.status() != "complete" or not (rd.model_dir / "config.json").is_file():
        return False
    m = rd.read_manifest()
    return all(m.get(k) == v for k, v in fields.items())


def _train(run_cfg: Any, rd: Any, progress: Progress, *, overwrite: bool = False) -> None:
    """Train (or resume an interrupted) run through the normal lifecycle; a complete base is
    pretrained again only with `overwrite` (every point fine-tuned from it is then stale)."""
    if rd.is_run() and rd.status() in ("interrupted", "failed") and rd.state_dir.is_dir() \
            and any(rd.state_dir.iterdir()) and stored_config(rd.read_manifest()) == config_as_written(run_cfg):
        switch.dispatch(run_cfg, rd, resume=True, progress=progress)
        return
    if not overwrite and rd.is_run() and rd.status() == "complete":
        raise RunDirError(f"the public base '{rd.path}' is complete and was pretrained under other "
                          "settings; pass --overwrite to pretrain it again (and retrain the points "
                          "fine-tuned from it), or choose another --out")
    rd = prepare_new_run(rd.path, overwrite=True)
    switch.dispatch(run_cfg, rd, resume=False, progress=progress, overwrite=True)


def base_dir_name(size: str | None) -> str:
    """`base` for the sweep's one model; `base-<preset>` for each size of a model-size axis."""
    return BASE_DIR if size is None else f"{BASE_DIR}-{size}"


def ensure_public_base(cfg: Any, out_dir: str | Path, progress: Progress = None, *,
                       size: str | None = None, tokenizer: str | None = None,
                       overwrite: bool = False) -> Path:
    """The public base model of sweep `cfg` under `out_dir/base/` (`base-<size>/` for one size
    of a model-size axis), trained once.

    Checks the public corpus against the private one first (one-line DataError, nothing
    written), then reuses a complete base whose `pretrain_key` matches or trains one
    (centralized, no DP) through the normal run lifecycle. Returns the Hugging Face model
    directory (weights + tokenizer) every point starts from.
    """
    base_cfg = public_base_config(cfg, size=size, tokenizer=tokenizer)
    check_before_disk(base_cfg)
    key = pretrain_key(base_cfg)
    out = Path(out_dir)
    rd = RunDir(out / base_dir_name(size))
    if not _complete_with(rd, pretrain_key=key):
        overlap = check_public_corpus(cfg, base_cfg)
        _mark_sweep(out)
        _train(base_cfg, rd, None if progress is None else
               (lambda d, t, info: progress(d, t, {"stage": "pretrain", **info})), overwrite=overwrite)
        rd.update_manifest(role=ROLE_PRETRAIN, pretrain_key=key, public_private_overlap=overlap)
    line = memorised_line(rd)
    if line is not None and progress is not None:
        progress(0, 0, {"warning": line})
    return rd.model_dir


MEMORISED_NATS = 0.1
"""How far above its best the public base's final holdout loss may end (nats a token, about 10%
in perplexity) before the sweep says the base memorised its corpus."""


def memorised_line(rd: Any) -> str | None:
    """One line when the public base ended with a holdout loss (on public authors it never saw)
    more than MEMORISED_NATS above its best evaluation: it memorised its corpus, and every point
    fine-tunes a base that knows the language less than it did earlier in its run. None when it
    did not, or with fewer than two evaluations.

    The study's base of 2026-12-05 (192 public authors x 8 messages, 400 steps of 32: 8 epochs)
    went from 5.00 at step 100 to 7.22 at step 400."""
    evals = [(r["step"], r["holdout_loss"]) for r in read_jsonl(rd.metrics_path)
             if r.get("holdout_loss") is not None and "step" in r]
    if len(evals) < 2:
        return None
    best, last = min(evals, key=lambda e: e[1]), evals[-1]
    if last[1] <= best[1] + MEMORISED_NATS:
        return None
    return (f"warning: the public base ({rd.path.name}/) memorised its corpus: its holdout loss on public "
            f"authors it never saw rose from {best[1]:.2f} (step {best[0]}) to {last[1]:.2f} (step {last[0]}); "
            "give pretrain more documents (pretrain.users, pretrain.docs_per_user) or fewer steps")


def _mark_sweep(out: Path) -> None:
    """A sweep folder killed while pretraining must still read as a sweep on the re-run."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "sweep.json").is_file():
        atomic_write_json(out / "sweep.json", {"plan": None, "outcomes": [], "status": "pretraining"})


# ----------------------------------------------------------------------------- the reference point
def reference_config(cfg: Any, points: list[Any], base_model: Path) -> Any:
    """The run config of the zero-fine-tuning reference: the first point's data and evaluation
    settings, the base as its model, centralized on one process, no DP."""
    first = point_config(cfg, points[0])
    return with_overrides(first, {
        "backend": CENTRALIZED, "model.init_from": str(base_model), "privacy.noise_multiplier": None,
        "privacy.target_epsilon": None, "train.goldfish.enabled": False,
        "parallel": {}, "data.audit_canaries": 0,
    })


def ensure_base_reference(cfg: Any, out_dir: str | Path, base_model: Path, points: list[Any],
                          progress: Progress = None, *, size: str | None = None) -> Path:
    """`out_dir/runs/public-base/` (`public-base-<size>/` per size of a model-size axis): the
    base model on the private data, evaluated and probed."""
    run_cfg = reference_config(cfg, points, base_model)
    name = REFERENCE_RUN if size is None else f"{REFERENCE_RUN}-{size}"
    rd = RunDir(Path(out_dir) / "runs" / name)
    if not _complete_with(rd, role=ROLE_REFERENCE) or stale_reason(rd, run_cfg) is not None:  # base retrained too
        _write_reference(run_cfg, prepare_new_run(rd.path, overwrite=True))
    # its scores of the documents are its fine-tunes' reference scores: kept for them
    probe_if_stale(cfg, rd, None if progress is None else
                   (lambda d, t, info: progress(d, t, {"point": name, "stage": "probe", **info})),
                   keep_target_scores=True)
    return rd.path


def _write_reference(run_cfg: Any, rd: Any) -> None:
    """The reference run through the run lifecycle: data staged, no step, the base exported."""
    # lazy: torch (~2 s) only when called; this module imports without it
    import torch


    check_before_disk(run_cfg)
    t = run_cfg.train
    with RunSession(rd, run_cfg, backend=CENTRALIZED, resume=False, overwrite=True) as s:
        prepared = s.data()
        s.start(0)
        model = initial_model(run_cfg.model, prepared.vocab_size)
        h = prepared.holdout
        loss, ppl = holdout_loss(model, h.input_ids, h.attention_mask,
                                 batch_size=t.micro_batch_size or t.batch_size,
                                 max_batches=t.eval_batches, device=torch.device("cpu"))
        s.export_hf(model, tokenizer=prepared.tokenizer(), tokenizer_dir=prepared.tokenizer_dir)
        s.complete({"steps": 0, "final_holdout_loss": loss, "final_holdout_perplexity": ppl,
                    "initial_holdout_loss": loss, "initial_holdout_perplexity": ppl,
                    "final_train_loss": None, "train_sequences": len(prepared.train),
                    "parameters": int(sum(p.numel() for p in model.parameters())),
                    "fine_tuned": False})
    rd.update_manifest(role=ROLE_REFERENCE)


# ----------------------------------------------------------------------------- the runner's call
def base_models(out_dir: str | Path, points: list[Any]) -> dict[str | None, Path]:
    """Each model size's base model directory (resolved: points may run elsewhere)."""
    sizes = list(dict.fromkeys(p.model for p in points))
    return {size: (Path(out_dir) / base_dir_name(size) / "model").resolve() for size in sizes}


def with_bases(out_dir: str | Path, points: list[Any]) -> list[Any]:
    """The points with `model.init_from` set to their size's base."""
    bases = base_models(out_dir, points)
    return [replace(p, overrides={**p.overrides, "model.init_from": str(bases[p.model])}) for p in points]


def pretrained_sizes(cfg: Any, points: list[Any]) -> list[str | None]:
    """The sizes whose bases are pretrained, the tokenizer's first: the grid's first size trains
    the tokenizer every size reads, also when `grid.only` or `select` leave none of its points
    (its base is then pretrained for the tokenizer alone)."""
    first = cfg.grid.models[0] if cfg.grid.models else None
    return [first, *[s for s in dict.fromkeys(p.model for p in points) if s != first]]


def _pretrained_sizes(cfg: Any, out_dir: str | Path, points: list[Any]) -> dict[str | None, Path]:
    """`pretrained_sizes` with each one's model directory."""
    return {size: (Path(out_dir) / base_dir_name(size) / "model").resolve()
            for size in pretrained_sizes(cfg, points)}


def stale_bases(cfg: Any, out_dir: str | Path, points: list[Any]) -> list[str]:
    """The complete bases under `out_dir` that `ensure_public_base` would pretrain again (their
    `pretrain_key` is not the sweep's now): what a sweep without --overwrite refuses."""
    bases, stale = _pretrained_sizes(cfg, out_dir, points), []
    sizes = list(bases)
    for size in sizes:
        rd = RunDir(Path(out_dir) / base_dir_name(size))
        if not rd.is_run() or rd.status() != "complete":
            continue
        shared = str(bases[sizes[0]]) if size != sizes[0] else None
        if rd.read_manifest().get("pretrain_key") != pretrain_key(
                public_base_config(cfg, size=size, tokenizer=shared)):
            stale.append(base_dir_name(size))
    return stale


def pretrain_bases(cfg: Any, out_dir: str | Path, points: list[Any], progress: Progress = None, *,
                   overwrite: bool = False) -> list[Any]:
    """Every size's base (trained or reused), and the points with `model.init_from` set to it.

    With a model-size axis each size gets its own base, pretrained on the same public corpus;
    the first size's trained tokenizer is given to the others, so every size (and so every
    fine-tune, which adopts its base's tokenizer) reads the same tokens."""
    bases = _pretrained_sizes(cfg, out_dir, points)
    sizes = list(bases)
    for size in sizes:
        if timebox.should_stop():  # --stop-after: the next base waits for the next invocation
            raise timebox.TimeUp("time box ended before a public base")
        shared = str(bases[sizes[0]]) if size != sizes[0] else None
        ensure_public_base(cfg, out_dir, progress, size=size, tokenizer=shared, overwrite=overwrite)
    return with_bases(out_dir, points)


def base_references(cfg: Any, out_dir: str | Path, points: list[Any], progress: Progress = None) -> list[Path]:
    """Each size's zero-fine-tuning reference run (`points`: with their bases)."""
    bases = base_models(out_dir, points)
    return [ensure_base_reference(cfg, out_dir, bases[size], [p for p in points if p.model == size],
                                  progress, size=size) for size in bases]


def pretrain_stage(cfg: Any, out_dir: str | Path, points: list[Any], progress: Progress = None, *,
                   overwrite: bool = False) -> tuple[list[Any], list[Path]]:
    """The base (trained or reused), each point with `model.init_from` set to it, and the
    reference run to report (`pretrain_bases`, then `base_references`)."""
    points = pretrain_bases(cfg, out_dir, points, progress, overwrite=overwrite)
    return points, base_references(cfg, out_dir, points, progress)
