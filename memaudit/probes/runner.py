"""Run the chosen probes on a resolved target and build the `probes.json` document.

>>> parse_probes("exposure, audit")
('exposure', 'audit')
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memaudit import __version__
from memaudit.config import ProbeConfig
from memaudit.errors import RunDirError
from memaudit.io import atomic_write_json, dumps
from memaudit.probes import PROBES, SCHEMA
from memaudit.probes import extraction as ex
from memaudit.probes.audit import run_audit
from memaudit.probes.context import (
    fit_to_context,
    fit_to_references,
    model_context,
    window_stride,
    windowed_counts,
)
from memaudit.probes.engines import choose_engine, model_reason
from memaudit.probes.exposure import run_exposure
from memaudit.probes.goldfish import goldfish_extraction
from memaudit.probes.loaders import AUDIT_SCORES
from memaudit.probes.membership import doc_scores, min_k, run_membership
from memaudit.probes.pii import run_pii
from memaudit.probes.reference import models_mean_logp, reference_attacks
from memaudit.probes.score_cache import ModelScores, ScoreCache
from memaudit.probes.shift import blind_check
from memaudit.probes.sources import (
    check_tokenizer_fits,
    config_folder,
    load_model,
    resolve_model,
    source_context,
)
from memaudit.probes.targets import Codec, Target, load_tokenizer
from memaudit.probes.user_inference import run_user_inference
from memaudit.probes.weights import weights_sha256

Progress = Callable[[int, int, dict], None] | None


@dataclass
class ProbeResult:
    document: dict  # what probes.json holds: no secrets, no raw text
    secrets: dict[str, str] = field(default_factory=dict)  # id -> secret, for --show-secrets only


def parse_probes(spec: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in PROBES]
    if bad or not names:
        raise ValueError(
            f"unknown probe '{bad[0] if bad else spec}'; choose from {', '.join(PROBES)}"
        )
    return tuple(dict.fromkeys(names))


def _skip(reason: str) -> dict:
    return {"summary": {"skipped": reason}, "scores": []}


def _stage(progress: Progress, name: str) -> Progress:
    if progress is None:
        return None
    return lambda done, total, info: progress(done, total, {**info, "stage": name})


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (same vocabulary)."""
    return a.get_vocab() == b.get_vocab()


def check_before_loading(target: Target, settings: ProbeConfig, tokenizer) -> None:
    """Every check that needs no weights, before the first model loads (each refused in one
    line): --user-docs against the users' document counts, the target's tokenizer fits its
    embedding (config.json), and every reference (--reference, --reference-models) resolves, has
    the target's tokenizer and fits its own embedding. Tokenizer files and configs only: seconds,
    where a refusal after the load came minutes into a probe."""
    check_user_docs(target, settings)
    folder = config_folder(target.source) if target.source is not None else target.model_path
    check_tokenizer_fits(tokenizer, folder, f"'{target.path}'")
    vocab = tokenizer.get_vocab()
    refs = (("--reference", (settings.reference,)), ("--reference-models", settings.reference_models))
    for flag, names in refs:
        for name in names:
            if not name:
                continue
            src = resolve_model(name)
            tok = load_tokenizer(src.tokenizer_path)
            if tok.get_vocab() != vocab:
                raise ValueError(
                    f"{flag} '{name}' uses another tokenizer than the target, so per-token scores "
                    f"cannot be compared; pass a reference with the target's tokenizer")
            check_tokenizer_fits(tok, config_folder(src), f"{flag} '{name}'")


def load_reference(settings: ProbeConfig, codec: Codec):
    """(model, codec) of --reference (a folder, cached hub id or adapter); refused in one line
    when its tokenizer differs."""
    src = resolve_model(settings.reference)
    tok = load_tokenizer(src.tokenizer_path)
    if not same_tokenizer(tok, codec.tok):
        raise ValueError(
            f"--reference '{settings.reference}' uses another tokenizer than the target, so "
            "per-token scores cannot be subtracted; pass a reference with the target's tokenizer"
        )
    model = load_model(src, device=settings.device, dtype=settings.dtype)
    return model, Codec(tok, start_id=codec.start[0] if codec.start else None)


def reference_cache(folder: Path, settings: ProbeConfig, model) -> ModelScores | None:
    """The membership reference's scores in the `ScoreCache` in `folder`, for `doc_scores`; None
    where the reference is not a model folder with safetensors (an adapter, a hub id resolved
    elsewhere: nothing fingerprints its weights here) and is scored every time."""
    src = resolve_model(settings.reference)
    weights = weights_sha256(src.path) if src.kind == "folder" else None
    return None if weights is None else model_scores(folder, weights, settings, model)


def model_scores(folder: Path, weights: str, settings: ProbeConfig, model) -> ModelScores:
    """A model's scores in the `ScoreCache` in `folder`: identified by its weights, and by the
    engine and precision that score it."""
    engine = "jax" if getattr(model, "is_jax", False) else "torch"
    return ScoreCache(folder).model({"weights": weights, "engine": engine,
                                     "dtype": f"{settings.dtype}@{settings.device}"})


def shift_check(target: Target, seed: int, cache: Path | None) -> dict:
    """`blind_check` of the target's members against its non-members, read from `cache` when a
    run on the same split computed it (a sweep's points share their data)."""
    members, nonmembers = [d.text for d in target.members], [d.text for d in target.nonmembers]
    if cache is None:
        return blind_check(members, nonmembers, seed=seed)
    store = ScoreCache(cache)
    key = store.check_key("distribution_shift", seed, members, nonmembers)
    found = store.get_check(key)
    if found is None:
        found = blind_check(members, nonmembers, seed=seed)
        store.put_check(key, found)
    return found


def fit_windows(target: Target, settings: ProbeConfig, model, codec: Codec) -> ProbeConfig:
    """`settings` with the scoring window every model of the run shares, and `target.counts`
    with what that did: an outside model's documents fit its context (`fit_to_context`), a
    reference with a shorter context shortens the window (`fit_to_references`), and a run's
    documents longer than the window are counted (`windowed_counts`)."""
    docs = target.members + target.nonmembers + target.heldout_user_docs
    lengths = [len(ids) for ids in codec.encode_all([d.text for d in docs])]
    if target.kind == "model":  # an outside model: every sequence within its context
        settings, counts = fit_to_context(settings, model_context(model), lengths)
        target.counts.update(counts)
        target.seq_len = target.seq_len or counts.get("context")
    references = {name: source_context(resolve_model(name))
                  for name in (settings.reference, *settings.reference_models) if name}
    settings, counts = fit_to_references(settings, dict(target.counts), references, lengths)
    target.counts.update(counts or windowed_counts(settings, lengths))
    return settings


def to_engine(engine: str, model, dtype: str):
    """`model` as the chosen engine runs it: the torch model itself, or a JaxLM of its weights."""
    if engine != "jax" or model is None or getattr(model, "is_jax", False):
        return model
    from memaudit.probes.jax_scoring import JaxLM  # lazy: jax only for the JAX engine

    return JaxLM.from_torch(model, dtype=dtype)


def run_probes(
    target: Target,
    settings: ProbeConfig,
    *,
    progress: Progress = None,
    model=None,
    tokenizer=None,
    engine: str = "auto",
    partial: Path | None = None,
    cache: Path | None = None,
    keep_target_scores: bool = False,
) -> ProbeResult:
    """Load the model (unless given), run each selected probe, return probes.json + secrets.

    `engine` (auto, jax, torch; `choose_engine`) picks who scores and generates; the model is
    loaded by torch either way and handed to JAX as arrays. `partial`: a file where each
    finished probe is kept (atomically, 0600: it holds what probes.json and the secrets hold), so
    that a probe stage stopped part-way (a time-boxed sweep piece ended by its hard limit) runs
    only the probes it had not finished when it is run again on the same weights with the same
    settings and engine; anything else in that file is ignored. `cache`: a folder where the
    membership reference's per-document scores and the shift check are kept
    (`memaudit.probes.score_cache`), so that the next probe run on the same documents reads them
    (a sweep's points); scores only for a model folder (its weights fingerprint the entry). With
    `keep_target_scores` (a sweep's public base, its fine-tunes' reference) the target's own
    scores are kept too, on torch.
    """
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import load_causal_lm, probe_threads

    window_stride(settings)  # a bad --window-stride is refused before any model is loaded
    tokenizer = tokenizer or load_tokenizer(target.tokenizer_path)
    check_before_loading(target, settings, tokenizer)
    # the weights measured, fingerprinted before they are loaded: a probes.json whose run was
    # trained again meanwhile then names other weights than the model's and is not used
    weights = weights_sha256(target.model_path) if model is None else None
    if model is None and target.source is not None:
        model = load_model(target.source, device=settings.device, dtype=settings.dtype)
    elif model is None:
        model = load_causal_lm(str(target.model_path), device=settings.device, dtype=settings.dtype)
    codec = Codec(tokenizer, start_id=target.eos_id)
    settings = fit_windows(target, settings, model, codec)
    checks = {}
    # before any attack, on an outside model's split and on a run's own member/holdout split alike
    if target.members and target.nonmembers:
        checks["distribution_shift"] = shift_check(target, settings.seed, cache)
    reference = load_reference(settings, codec) if settings.reference else None
    engine = choose_engine(engine, model)
    model = to_engine(engine, model, settings.dtype)
    if engine == "jax" and reference is not None and model_reason(reference[0]) is None:
        reference = (to_engine("jax", reference[0], settings.dtype), reference[1])
    probes, timings, secrets = {}, {}, {}
    ctx = _Context(target, settings, model, codec, reference, progress)
    if cache is not None and reference is not None:
        ctx.reference_cache = reference_cache(cache, settings, reference[0])
    if keep_target_scores and cache is not None and weights is not None and engine == "torch":
        # torch scores log p(target) alike with and without the stats: the target's means are,
        # bit for bit, what a run that takes these weights as its reference would compute
        ctx.target_cache = model_scores(cache, weights, settings, model)
    key = {"schema": SCHEMA, "weights_sha256": weights, "engine": engine, "checks": checks,
           "settings": settings.model_dump(mode="json")}
    partial = partial if weights is not None else None  # a model handed in has no weights to key on
    saved = _finished_probes(partial, key) if partial is not None else {}
    ctx.secrets.update(saved.get("secrets", {}))
    with probe_threads():
        for name in settings.probes:
            if name in saved.get("probes", {}):
                probes[name], timings[name] = saved["probes"][name], saved["timings"][name]
                continue
            t0 = time.perf_counter()
            probes[name] = REGISTRY[name](ctx)
            timings[name] = time.perf_counter() - t0
            if partial is not None:
                atomic_write_json(partial, {"key": key, "probes": probes, "timings": timings,
                                            "secrets": ctx.secrets})
    secrets.update(ctx.secrets)
    if weights is not None and weights_sha256(target.model_path) != weights:
        raise RunDirError(f"the model in '{target.model_path}' changed while it was probed (trained "
                          "again, e.g. --overwrite); nothing was written, probe it again once it is done")
    doc = {
        "schema": SCHEMA,
        "memaudit_version": __version__,
        "created": time.time(),
        "target": {
            "kind": target.kind,
            "path": str(target.path),
            "model": str(target.model_path),
            "reference": settings.reference,
            "source": None if target.source is None else target.source.kind,
            "base": target.base,
            "weights_sha256": weights,
        },
        "counts": dict(target.counts),
        "checks": checks,
        "settings": settings.model_dump(mode="json"),
        "seeds": {
            "bootstrap": settings.seed,
            "sampling": settings.seed,
            "exposure_candidates": settings.seed,
        },
        "probes": probes,
        "engine": engine,
        "timings": timings,
    }
    return ProbeResult(document=doc, secrets=secrets)


def _finished_probes(partial: Path, key: dict) -> dict:
    """The probes an earlier, interrupted run kept in `partial` under the same `key` (weights,
    settings, engine, checks), as JSON reads them back; {} when none or another key."""
    try:
        saved = json.loads(Path(partial).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("key") != json.loads(dumps(key)):
        return {}
    return saved


class _Context:
    """The shared state of one probe run: per-document scores are computed once."""

    def __init__(self, target, settings, model, codec, reference, progress) -> None:
        self.t, self.s, self.model, self.codec, self.ref, self.progress = (
            target,
            settings,
            model,
            codec,
            reference,
            progress,
        )
        self.secrets: dict[str, str] = {}
        self._doc_scores = None
        self.reference_cache: ModelScores | None = None  # `reference_cache`
        self.target_cache: ModelScores | None = None  # see `run_probes`

    def scores(self):
        if self._doc_scores is None:
            docs = self.t.members + self.t.nonmembers + self.t.heldout_user_docs
            self._doc_scores = doc_scores(
                self.model,
                self.codec,
                docs,
                batch_size=self.s.batch_size,
                k=self.s.min_k,
                max_tokens=self.s.max_tokens,
                stride=window_stride(self.s),
                reference=self.ref,
                progress=_stage(self.progress, "scoring"),
                reference_cache=self.reference_cache,
                target_cache=self.target_cache,
            )
        return self._doc_scores



def probe_exposure(ctx: _Context) -> dict:
    c = ctx.t.canaries
    if c is None or not (c.inserted or c.references):
        return _skip("no canaries: pass --canaries FILE" if ctx.t.kind == "model" else
                     "the run has no inserted or reference canaries (data.canaries)")
    for x in (*c.inserted, *c.references):
        ctx.secrets[x.id] = x.secret
    s = ctx.s
    return run_exposure(ctx.model, ctx.codec, c, batch_size=s.batch_size,
                        enumerate_max=s.exposure_enumerate_max, n_samples=s.exposure_samples,
                        seed=s.seed, n_boot=s.n_boot, progress=_stage(ctx.progress, "exposure"))


def probe_extraction(ctx: _Context) -> dict:
    s, out = ctx.s, {"summary": {}, "scores": {}}
    docs = ctx.t.members[: s.extraction_max_docs]
    if docs and s.extraction_ks:  # none fit a short context: counted in probes.json's counts
        r = ex.discoverable(ctx.model, ctx.codec, docs, ks=s.extraction_ks, m=s.extraction_m,
                            batch_size=s.batch_size, n_boot=s.n_boot, seed=s.seed,
                            progress=_stage(ctx.progress, "extraction"))
        out["summary"]["discoverable"], out["scores"]["discoverable"] = r["summary"], r["scores"]
    if ctx.t.canaries is not None and ctx.t.canaries.inserted:
        r, completions = ex.canary_completion(ctx.model, ctx.codec, ctx.t.canaries,
                                              batch_size=s.batch_size, n_boot=s.n_boot,
                                              seed=s.seed)
        out["summary"]["canaries"], out["scores"]["canaries"] = r["summary"], r["scores"]
        ctx.secrets.update({f"{k}:completion": v for k, v in completions.items()})
    if s.nd_samples > 0:
        train = ctx.codec.encode_all([d.text for d in ctx.t.members])
        if ctx.t.canaries is not None:
            train += [ctx.codec.encode(c.text) for c in ctx.t.canaries.inserted]
        r = ex.non_discoverable(ctx.model, ctx.codec, train, n_samples=s.nd_samples,
                                length=s.nd_length, top_k=s.top_k, top_n=s.nd_top_n,
                                ngram=s.nd_ngram, batch_size=s.batch_size, seed=s.seed,
                                reference=ctx.ref, n_boot=s.n_boot,
                                progress=_stage(ctx.progress, "sampling"))
        out["summary"]["non_discoverable"] = r["summary"]
        out["scores"]["non_discoverable"] = r["scores"]
    if not out["summary"]:
        return _skip("no member documents or canaries: pass --members FILE or --canaries FILE"
                     if ctx.t.kind == "model" else "the run has no member documents or canaries")
    return out


def probe_goldfish_extraction(ctx: _Context) -> dict:
    """Hans et al. 2024: the last goldfish_m tokens of member documents and inserted canaries."""
    s, t = ctx.s, ctx.t
    docs = t.members[: s.extraction_max_docs]
    canaries = t.canaries if t.canaries is not None and t.canaries.inserted else None
    if not docs and canaries is None:
        return _skip("no member documents or canaries: pass --members FILE or --canaries FILE"
                     if t.kind == "model" else "the run has no member documents or canaries")
    return goldfish_extraction(ctx.model, ctx.codec, docs, canaries, m=s.goldfish_m,
                               min_prompt=s.goldfish_min_prompt, context=t.seq_len,
                               batch_size=s.batch_size,
                               n_boot=s.n_boot, seed=s.seed,
                               progress=_stage(ctx.progress, "goldfish"))


def probe_membership(ctx: _Context) -> dict:
    n1, n0 = len(ctx.t.members), len(ctx.t.nonmembers)
    if not n1 or not n0:
        hint = ("pass --members FILE and --nonmembers FILE" if ctx.t.kind == "model"
                else "the run holds no documents out (data.holdout_fraction)")
        return _skip(f"membership needs members and non-members, got {n1} and {n0}: {hint}")
    scores = {k: v[: n1 + n0] for k, v in ctx.scores().items()}
    if ctx.s.reference_models:  # k reference models: offline LiRA and RMIA beside the ratio
        refs = models_mean_logp(ctx.s.reference_models, ctx.codec,
                                [d.text for d in ctx.t.members + ctx.t.nonmembers],
                                max_tokens=ctx.s.max_tokens, stride=window_stride(ctx.s),
                                batch_size=ctx.s.batch_size, device=ctx.s.device,
                                dtype=ctx.s.dtype)
        scores.update(reference_attacks(scores["loss"], refs))
    return run_membership(ctx.t.members, ctx.t.nonmembers, scores, n_boot=ctx.s.n_boot,
                          seed=ctx.s.seed, fprs=ctx.s.fprs)


def user_inference_sides(t: Target) -> tuple[list, list[int], list[int]] | str:
    """(documents, training users' unseen ones, held-out users' ones) as indices into the
    documents, or why user inference has nothing to compare (its skip reason)."""
    docs = t.members + t.nonmembers + t.heldout_user_docs
    if any(d.user is None for d in docs):
        return ("documents carry no user ids: give every document a 'user' field"
                if t.kind == "model" else "the run's documents carry no user ids")
    train_users = {d.user for d in t.members}
    idx_pos = [i for i, d in enumerate(docs) if d.role == "holdout" and d.user in train_users]
    idx_neg = [i for i, d in enumerate(docs) if d.role != "member" and d.user not in train_users]
    if not idx_pos:
        return ("no unseen documents of training users: pass --nonmembers FILE with "
                "documents of the --members users that were not trained on"
                if t.kind == "model" else "the run holds none of its training users' "
                "documents out (data.holdout_fraction)")
    if not idx_neg:
        return ("no held-out users: pass --heldout-users FILE (documents of users the "
                "model never saw)" if t.kind == "model"
                else "the run has no held-out users (data.heldout_users)")
    return docs, idx_pos, idx_neg


def check_user_docs(t: Target, settings: ProbeConfig) -> None:
    """--user-docs k that no user on one side of user inference has: refused from the counts."""
    k = settings.user_docs
    sides = user_inference_sides(t) if "user_inference" in settings.probes and k else None
    if not isinstance(sides, tuple):
        return
    docs, idx_pos, idx_neg = sides
    for idx in (idx_pos, idx_neg):
        per_user = Counter(docs[i].user for i in idx)
        if max(per_user.values()) < k:
            raise ValueError(f"no user has {k} documents on one side of user inference (at most "
                             f"{max(per_user.values())}); lower --user-docs")


def probe_user_inference(ctx: _Context) -> dict:
    """Training users' unseen documents vs held-out users; never a silent fallback."""
    t = ctx.t
    sides = user_inference_sides(t)
    if isinstance(sides, str):
        return _skip(sides)
    docs, idx_pos, idx_neg = sides
    key = "reference" if ctx.ref is not None else "loss"
    score = ctx.scores()[key]
    return run_user_inference(
        [docs[i] for i in idx_pos], [docs[i] for i in idx_neg], score[idx_pos], score[idx_neg],
        statistic="mean_llr_vs_reference" if ctx.ref else "mean_log_likelihood",
        k=ctx.s.user_docs, n_boot=ctx.s.n_boot, seed=ctx.s.seed, fprs=ctx.s.fprs,
    )


def probe_pii(ctx: _Context) -> dict:
    t = ctx.t
    trained = {m.user for m in t.members}
    held = t.heldout_user_docs or [d for d in t.nonmembers if d.user not in trained]
    if not t.members:
        return _skip("no member documents: pass --members FILE" if t.kind == "model"
                     else "the run has no member documents")
    return run_pii(ctx.model, ctx.codec, t.members, held, n_candidates=ctx.s.pii_candidates,
                   max_items=ctx.s.pii_max_items, batch_size=ctx.s.batch_size, seed=ctx.s.seed,
                   n_boot=ctx.s.n_boot, progress=_stage(ctx.progress, "pii"))


def probe_audit(ctx: _Context) -> dict:
    # lazy: torch (~2 s) only when called; this module imports without it
    from memaudit.probes.scoring import token_logprobs

    aud = ctx.t.canaries.audit if ctx.t.canaries is not None else ()
    if not aud:
        return _skip("no audit canaries: pass --canaries FILE with an 'audit' list"
                     if ctx.t.kind == "model"
                     else "no audit canaries (set data.audit_canaries in the run's config)")
    ctx.secrets.update({c.id: c.secret for c in aud if c.secret})

    lp = token_logprobs(ctx.model, [ctx.codec.encode(c.text) for c in aud],
                        batch_size=ctx.s.batch_size, progress=_stage(ctx.progress, "audit")).logp
    kind = ctx.t.canaries.audit_kind
    if AUDIT_SCORES[kind] == "min_k":
        scores = np.array([min_k(x, ctx.s.min_k) for x in lp])
    else:
        scores = np.array([x.mean() for x in lp])
    m = len(aud)
    grid = (ctx.s.audit_r
            or tuple(sorted({r for r in (m // 20, m // 10, m // 4, m // 2) if r >= 2})) or (m,))
    priv = ctx.t.privacy
    delta = ctx.s.audit_delta
    if delta is None:
        delta = priv.delta if priv is not None and priv.delta is not None else 1e-5
    out = run_audit(scores, np.array([c.included for c in aud]), [c.id for c in aud],
                    r_grid=grid, delta=delta, p=ctx.s.audit_p,
                    ledger_eps=None if priv is None else priv.epsilon)
    out["summary"].update(canaries=kind, score=AUDIT_SCORES[kind])
    if AUDIT_SCORES[kind] == "min_k":
        out["summary"]["min_k"] = ctx.s.min_k
    return out


REGISTRY: dict[str, Callable[[_Context], dict]] = {
    "exposure": probe_exposure,
    "extraction": probe_extraction,
    "goldfish_extraction": probe_goldfish_extraction,
    "membership": probe_membership,
    "user_inference": probe_user_inference,
    "pii": probe_pii,
    "audit": probe_audit,
}
assert tuple(REGISTRY) == PROBES
