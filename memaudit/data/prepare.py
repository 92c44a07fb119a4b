"""Build the prepared data of a run (corpus, split, canaries, tokenizer, packed sets).

`prepare_data` writes exactly the "Prepared data" contract of DEVELOPERS.md; `load_prepared`
reads it back and checks it against its fingerprint. In documents.jsonl, `repeats` counts
the documents of the same role with identical text: for a member document (or canary copy)
the number of times that text is trained on. The fingerprint is a sha256 over the
content of every prepared file (documents.jsonl, the three safetensors, the tokenizer
files, split.json, canaries.json), so the same config gives the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from safetensors.numpy import load, save

from memaudit.config import DataConfig
from memaudit.data.canaries import CanarySet, canary_documents, make_canaries
from memaudit.data.corpus import load_corpus
from memaudit.data.documents import Document, count_repeats, dumps_jsonl, loads_jsonl
from memaudit.data.packing import PackedSequences, pack, span_summary
from memaudit.data.splits import Split, assign_roles, make_split
from memaudit.data.synth import synthesize, synthesize_public
from memaudit.errors import DataError, RunDirError
from memaudit.io import atomic_dir, atomic_write_bytes, private_tree, read_json
from memaudit.models import tokenizer as T
from memaudit.models.init import base_model_record
from memaudit.models.tokenizer import digits_split, encode, pad_id
from memaudit.rundir import RunDir

Progress = Callable[[int, int, dict], None]
SETS = ("train", "holdout", "heldout")
_ROLE_OF_SET = {"train": "member", "holdout": "holdout", "heldout": "heldout_user"}
_STAGES = 5


@dataclass
class PreparedData:
    """The prepared data of a run. `train`/`holdout`/`heldout` are the packed sets."""

    path: Path  # the run directory
    documents: list[Document]
    split: Split
    canaries: CanarySet
    train: PackedSequences
    holdout: PackedSequences
    heldout: PackedSequences
    meta: dict[str, Any]
    fingerprint: str
    _tok: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:  # counts only: no text, no secrets
        return (f"PreparedData(path={str(self.path)!r}, documents={len(self.documents)}, "
                f"train={len(self.train)}, holdout={len(self.holdout)}, heldout={len(self.heldout)}, "
                f"fingerprint={self.fingerprint[:12]!r})")

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "data" / "tokenizer"

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def max_sequences_per_document(self) -> int | None:
        """The most training sequences one trained document spans; None when the data was prepared
        before memaudit counted it (unknown)."""
        spans = self.meta.get("sequences_per_document")
        m = spans.get("max_sequences_per_document") if isinstance(spans, dict) else None
        return int(m) if m is not None else None

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.meta["pad_id"])

    def tokenizer(self):
        """The run's Hugging Face tokenizer (loaded once)."""
        if self._tok is None:
            # lazy: transformers (~1.3 s) only when called; this module imports without it
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        return self._tok

    def copy_tokenizer(self, dest: str | Path) -> None:
        """Copy the tokenizer files into `dest` (e.g. the model directory being saved)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted(self.tokenizer_dir.iterdir()):
            shutil.copy2(f, dest / f.name)


# ----------------------------------------------------------------------------- helpers
def _source_stamp(*paths: str | None) -> list[list[Any]]:
    """(name, size, mtime) of the local input files, so an edited corpus is prepared again."""
    out = []
    for path in paths:
        if path is None:
            continue
        p = Path(path).expanduser()
        files = sorted(p.rglob("*")) if p.is_dir() else [p]
        out += [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]
    return out


def config_hash(cfg: DataConfig, vocab_size: int, *, base_model: str | None = None) -> str:
    """What the prepared data depends on: the data config, the vocabulary, the input files and
    the starting checkpoint whose tokenizer the run adopts (its path and weights' sha256)."""
    raw = json.dumps({"data": cfg.model_dump(mode="json"), "vocab_size": vocab_size,
                      "sources": _source_stamp(cfg.path, cfg.tokenizer, cfg.tokenizer_corpus),
                      **_base_entry(base_model)}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()


def _base_entry(base_model: str | None) -> dict[str, Any]:
    if base_model is None:
        return {}

    tok = [f for f in _source_stamp(base_model) if not f[0].endswith(".safetensors")]
    return {"base_model": base_model_record(base_model), "base_files": tok}


def fingerprint(files: dict[str, bytes]) -> str:
    """sha256 over (name, length, content) of every file, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


def _corpus(cfg: DataConfig, progress: Progress | None) -> list[Document]:
    if cfg.path is None:
        s = cfg.synth
        if s.kind == "public":
            return synthesize_public(s.users, s.docs_per_user, s.seed,
                                     paragraph_sentences=s.paragraph_sentences, language_seed=s.language_seed,
                                     topics=s.topics, facts_per_author=s.facts_per_user)
        return synthesize(s.users, s.docs_per_user, s.seed, repeat_every=s.repeat_every,
                          repeat_counts=s.repeat_counts, paragraph_sentences=s.paragraph_sentences,
                          topics=s.topics, facts_per_user=s.facts_per_user)

    return load_corpus(cfg.path, text_field=cfg.text_field, user_field=cfg.user_field,
                       text_unit=cfg.text_unit, split_name=cfg.split_name,
                       pseudo_users=cfg.pseudo_users)


# Seed offset of the public synthetic corpus the default tokenizer learns from.
PUBLIC_SEED_OFFSET = 7919


def _tokenizer_texts(cfg: DataConfig, docs: list[Document]) -> list[str]:
    """Non-private text for the tokenizer, never canaries or trained documents.

    The synthetic default draws a separate public corpus of different people from the same
    generator: learning merges from the held-out users' own text would turn *their* names and
    addresses into single tokens the model never trained on, making held-out users look
    unfamiliar and inflating user inference. Real corpora fall back to the held-out users'
    documents unless `data.tokenizer_corpus` names a public text file (recommended).
    """
    if cfg.tokenizer_corpus is None:
        if cfg.path is None and cfg.synth.kind == "public":
            return [d.text for d in docs if d.kind == "doc"]  # a public corpus: all of it
        if cfg.path is None:
            public = synthesize(max(32, cfg.synth.users), cfg.synth.docs_per_user,
                                cfg.synth.seed + PUBLIC_SEED_OFFSET, repeat_every=0,
                                paragraph_sentences=cfg.synth.paragraph_sentences,
                                topics=cfg.synth.topics, facts_per_user=cfg.synth.facts_per_user)
            return [d.text for d in public]
        return [d.text for d in docs if d.role == "heldout_user"]
    p = Path(cfg.tokenizer_corpus)
    if not p.is_file():
        raise DataError(f"tokenizer corpus '{p}' not found; set data.tokenizer_corpus to a text file")
    try:
        return [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise DataError(f"tokenizer corpus '{p}' is not UTF-8 text; re-encode it as UTF-8") from None


def _tokenizer(cfg: DataConfig, docs: list[Document], vocab_size: int, base_model: str | None = None):
    if base_model is not None:  # the starting checkpoint's own tokenizer (model.init_from)
        return T.load_tokenizer(Path(base_model).expanduser(), vocab_size=vocab_size)
    if cfg.tokenizer is not None:
        return T.load_tokenizer(cfg.tokenizer, vocab_size=vocab_size)
    texts = _tokenizer_texts(cfg, docs)
    if not texts:
        raise DataError("the tokenizer corpus is empty; set data.tokenizer_corpus to a text file")
    return T.train_tokenizer(texts, vocab_size=vocab_size)


def _tokenizer_files(tok) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        return {f.name: f.read_bytes() for f in sorted(Path(d).iterdir()) if f.is_file()}


def _pack_sets(docs: list[Document], tok, cfg: DataConfig) -> dict[str, PackedSequences]:
    ids = encode(tok, [d.text for d in docs])
    long_audit = [d.id for d, t in zip(docs, ids, strict=True)
                  if d.kind == "audit_canary" and len(t) + 1 > cfg.seq_len]  # in or out alike
    if long_audit:  # one canary in two sequences would be two examples under example-level DP
        raise DataError(f"{len(long_audit)} audit canaries are longer than data.seq_len = {cfg.seq_len} "
                        "tokens, so one would span two training sequences; raise data.seq_len")
    out = {}
    for name, role in _ROLE_OF_SET.items():
        by_user: dict[str, list[list[int]]] = defaultdict(list)
        for d, t in zip(docs, ids, strict=True):
            if d.role == role:
                by_user[d.user].append(t)
        out[name] = pack(by_user, seq_len=cfg.seq_len, eos_id=tok.eos_token_id, pad_id=pad_id(tok),
                         seed=cfg.seed)
    return out


def _safetensors(p: PackedSequences) -> bytes:
    return save(p.arrays())


# ----------------------------------------------------------------------------- build
def private_documents(cfg: DataConfig, progress: Progress | None = None) -> tuple[list[Document], Split, CanarySet]:
    """The documents a run with data config `cfg` would train on and hold out, with its split
    and canaries (no tokenizer, nothing written): what the public/private overlap check reads."""
    corpus = _corpus(cfg, progress)
    if progress is not None:
        progress(1, _STAGES, {"stage": "corpus", "documents": len(corpus)})
    split = make_split(corpus, heldout_users=cfg.heldout_users,
                       holdout_fraction=cfg.holdout_fraction, seed=cfg.seed)
    corpus = assign_roles(corpus, split)
    canaries = make_canaries(cfg.canaries, list(split.train_users), cfg.audit_canaries, seed=cfg.seed)
    cdocs = canary_documents(canaries)
    clash = {d.user for d in cdocs if d.kind == "audit_canary"} & {d.user for d in corpus}
    ids_clash = {d.id for d in cdocs} & {d.id for d in corpus}
    if clash or ids_clash:
        raise DataError("the corpus already uses canary user or document ids ('audit-0000', 'c0#0', "
                        "...); rename those users or documents")
    docs = count_repeats(corpus + cdocs, by_role=True)
    split = replace(split, member_docs=tuple(sorted(d.id for d in docs if d.role == "member")))
    return docs, split, canaries


def _build(cfg: DataConfig, vocab_size: int, progress: Progress | None, base_model: str | None = None):
    def tick(i: int, stage: str, **info: Any) -> None:
        if progress is not None:
            progress(i, _STAGES, {"stage": stage, **info})

    docs, split, canaries = private_documents(cfg, progress)
    tick(2, "split", users=len(split.train_users) + len(split.heldout_users))
    tok = _tokenizer(cfg, docs, vocab_size, base_model)
    tick(3, "tokenizer", tokens=len(tok))
    packed = _pack_sets(docs, tok, cfg)
    tick(4, "pack", sequences=len(packed["train"]))
    return docs, split, canaries, tok, packed


def prepare_data(
    cfg: DataConfig, run: RunDir, *, vocab_size: int, base_model: str | None = None,
    progress: Progress | None = None,
) -> PreparedData:
    """Build (or, when the run already holds data prepared from the same config, load) the data.

    Writes RUN_DIR/data/{documents.jsonl, train,holdout,heldout.safetensors, meta.json,
    tokenizer/}, RUN_DIR/split.json and RUN_DIR/canaries.json. Raises DataError on bad input.
    With `base_model` (the run's `model.init_from`) the data is tokenized with that
    checkpoint's tokenizer instead of a trained one, and meta.json records the checkpoint
    (`base_model`: path and sha256 of its weights).
    """
    chash = config_hash(cfg, vocab_size, base_model=base_model)
    meta_path = run.data_dir / "meta.json"
    if meta_path.is_file():
        try:
            if read_json(meta_path).get("config_hash") == chash:
                return load_prepared(run)
        except (ValueError, DataError):
            pass  # stale or damaged: rebuild
    docs, split, canaries, tok, packed = _build(cfg, vocab_size, progress, base_model)

    data_files = {"documents.jsonl": dumps_jsonl(docs)}
    data_files.update({f"{name}.safetensors": _safetensors(p) for name, p in packed.items()})
    tok_files = _tokenizer_files(tok)
    top = {"split.json": _json_bytes(split.to_json()), "canaries.json": _json_bytes(canaries.to_json())}
    fp = fingerprint({**data_files, **{f"tokenizer/{k}": v for k, v in tok_files.items()}, **top})
    meta = {
        "seq_len": cfg.seq_len,
        "vocab_size": vocab_size,
        "tokenizer_size": len(tok),
        "eos_id": tok.eos_token_id,
        "pad_id": pad_id(tok),
        "digits_split": digits_split(tok),
        "users": {name: list(p.users) for name, p in packed.items()},
        "sequences": {name: len(p) for name, p in packed.items()},
        "tokens": {name: p.n_tokens() for name, p in packed.items()},
        "documents": len(docs),
        # how many training sequences each trained document spans (document-level DP's m)
        "sequences_per_document": span_summary(packed["train"].doc_spans),
        "config_hash": chash,
        "fingerprint": fp,
    }
    if base_model is not None:
        meta["base_model"] = {**base_model_record(base_model), "tokenizer": "adopted"}
    for name, data in top.items():
        atomic_write_bytes(run.path / name, data)
    with atomic_dir(run.data_dir) as tmp:
        for name, data in data_files.items():
            (tmp / name).write_bytes(data)
        (tmp / "tokenizer").mkdir()
        for name, data in tok_files.items():
            (tmp / "tokenizer" / name).write_bytes(data)
        (tmp / "meta.json").write_bytes(_json_bytes(meta))
        private_tree(tmp)  # the corpus as trained: its owner's only, wherever it is prepared
    if progress is not None:
        progress(_STAGES, _STAGES, {"stage": "written"})
    return PreparedData(run.path, docs, split, canaries, packed["train"], packed["holdout"],
                        packed["heldout"], meta, fp, _tok=tok)


# ----------------------------------------------------------------------------- load
def load_prepared(run: RunDir) -> PreparedData:
    """Read the prepared data of `run` back; DataError when missing or not matching its fingerprint."""
    d = run.data_dir
    if not (d / "meta.json").is_file():
        raise DataError(f"'{run.path}' holds no prepared data (no data/meta.json); run "
                        "`memaudit train` or `memaudit data prepare` first")
    try:
        meta = read_json(d / "meta.json")
        files = {name: (d / name).read_bytes()
                 for name in ["documents.jsonl", *(f"{s}.safetensors" for s in SETS)]}
        files.update({f"tokenizer/{f.name}": f.read_bytes()
                      for f in sorted((d / "tokenizer").iterdir()) if f.is_file()})
        files.update({name: (run.path / name).read_bytes() for name in ("split.json", "canaries.json")})
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"prepared data in '{d}' is incomplete or corrupt ({type(e).__name__}); "
                        "prepare it again") from None
    if fingerprint(files) != meta.get("fingerprint"):
        raise DataError(f"prepared data in '{d}' does not match its fingerprint; prepare it again")
    packed = {}
    for s in SETS:
        arrays = load(files[f"{s}.safetensors"])
        packed[s] = PackedSequences(arrays["input_ids"], arrays["attention_mask"],
                                    arrays["user_index"], tuple(meta["users"][s]))
    return PreparedData(
        run.path,
        loads_jsonl(files["documents.jsonl"]),
        Split.from_json(json.loads(files["split.json"])),
        CanarySet.from_json(json.loads(files["canaries.json"])),
        packed["train"], packed["holdout"], packed["heldout"], meta, meta["fingerprint"],
    )


def verify_run_data(run: RunDir) -> str | None:
    """The data fingerprint, checked three ways: run.json, data/meta.json and the files.

    Probes and reports call this, so they never measure a model against data that is not
    the data it was trained on. None when the run has no prepared data to check.
    """
    if not (run.data_dir / "meta.json").is_file():
        return None
    want = run.read_manifest().get("data_fingerprint")
    meta = read_json(run.data_dir / "meta.json", what="prepared-data summary")
    got = meta.get("fingerprint") if isinstance(meta, dict) else None
    complete = all((run.data_dir / f"{s}.safetensors").is_file() for s in SETS)
    if complete:
        got = load_prepared(run).fingerprint  # recomputed from the files themselves
    if want is not None and want != got:
        raise RunDirError(f"the prepared data in '{run.data_dir}' is not the data run "
                          f"'{run.path}' was trained on (fingerprint differs from run.json); "
                          "retrain the run, its data was replaced")
    return str(got)
