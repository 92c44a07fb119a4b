"""Resolve what to probe: a memaudit run directory, or any Hugging Face causal LM directory with
explicit --members / --nonmembers / --canaries files.

Only the on-disk formats of the run directory are read (documents.jsonl, canaries.json,
privacy.json, meta.json), so probing does not depend on the data or training code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from memaudit.data.prepare import verify_run_data
from memaudit.errors import DataError, MemauditError, RunDirError
from memaudit.io import read_json
from memaudit.probes.inputs import DEFAULT_COLUMNS, Columns, Doc, read_docs, read_documents  # noqa: F401 - Doc, read_docs re-exported
from memaudit.probes.loaders import Canaries, Privacy
from memaudit.probes.sources import ADAPTER_CONFIG, TOKENIZER_FILES, ModelSource, resolve_model
from memaudit.rundir import RunDir


@dataclass
class Target:
    kind: str  # "run" | "model"
    path: Path
    model_path: Path
    tokenizer_path: Path
    out: Path | None
    members: list[Doc] = field(default_factory=list)
    nonmembers: list[Doc] = field(default_factory=list)  # IID holdout docs of training users
    heldout_user_docs: list[Doc] = field(default_factory=list)
    canaries: Canaries | None = None
    privacy: Privacy | None = None
    eos_id: int | None = None
    seq_len: int | None = None  # the run's training sequence length (data/meta.json)
    source: ModelSource | None = None  # an outside model: folder, cached hub id or adapter
    base: str | None = None  # the model this one was fine-tuned from (adapter base, init_from)
    counts: dict = field(default_factory=dict)  # units skipped, windowed, ... (first screen)


class Codec:
    """Text <-> ids with one leading start token (BOS, else EOS) when the tokenizer has one."""

    def __init__(self, tokenizer, start_id: int | None = None) -> None:
        self.tok = tokenizer
        if start_id is None:
            start_id = (
                tokenizer.bos_token_id
                if tokenizer.bos_token_id is not None
                else tokenizer.eos_token_id
            )
        self.start = [] if start_id is None else [int(start_id)]
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (start_id if start_id is not None else 0))
        self._memo: dict[str, list[int]] = {}

    def plain(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        """The start token and the text's ids; each text is tokenized once per Codec (the window
        fit, membership, extraction and the reference pass all encode the same documents)."""
        ids = self._memo.get(text)
        if ids is None:
            ids = self._memo[text] = self.start + self.plain(text)
        return list(ids)

    def batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text in one tokenizer call (a fast tokenizer encodes a list in Rust,
        in parallel), not remembered: for texts seen once, as exposure's candidates."""
        if not texts:
            return []
        return [self.start + list(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def encode_all(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, those not seen before tokenized in one call (`batch`)."""
        new = [t for t in dict.fromkeys(texts) if t not in self._memo]
        self._memo.update(zip(new, self.batch(new), strict=True))
        return [list(self._memo[t]) for t in texts]

    def start_or_zero(self) -> list[int]:
        return self.start or [0]

    def encode_split(self, prefix: str, rest: str) -> tuple[list[int], int]:
        """ids of prefix + rest tokenized together, and how many leading ids lie inside the prefix.

        A token counts as prefix only when its character span ends within the prefix, so a token
        that merges the prefix's last space with the first character of `rest` (GPT-2-style
        byte-level BPE) is scored as part of `rest`.
        """
        if not getattr(self.tok, "is_fast", False):
            p = self.encode(prefix)
            return p + self.plain(rest), len(p)
        enc = self.tok(prefix + rest, add_special_tokens=False, return_offsets_mapping=True)
        cut = len(prefix)
        n = 0
        for a, b in enc["offset_mapping"]:
            if b > cut or (b == a and a >= cut):
                break
            n += 1
        ids = self.start + list(enc["input_ids"])
        n_prefix = len(self.start) + n
        if n_prefix == 0:  # no start token and an empty prefix: score from the second token
            n_prefix = 1
        return ids, n_prefix

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: Path):
    # lazy: transformers (~1.3 s) only when called; this module imports without it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def check_disjoint(members: list[Doc], nonmembers: list[Doc]) -> None:
    texts = {d.text for d in members}
    both = [d.id for d in nonmembers if d.text in texts]
    if both:
        raise DataError(
            f"member and non-member files share {len(both)} document(s) (e.g. non-member id "
            f"'{both[0]}'); remove them from one of the files"
        )


def read_heldout_users(path: str | Path, members: list[Doc],
                       columns: Columns = DEFAULT_COLUMNS) -> list[Doc]:
    """Documents of users the model never saw; a training user among them is refused."""
    docs = read_documents(path, "heldout_user", columns)
    trained = {d.user for d in members}
    shared = sorted({d.user for d in docs if d.user in trained} - {None})
    if shared:
        raise DataError(
            f"held-out-users file '{path}' holds documents of training user '{shared[0]}'; "
            "give only users the model never saw"
        )
    return docs


def _run_docs(run: RunDir) -> tuple[list[Doc], list[Doc], list[Doc]]:
    """Natural documents by role, one per distinct text (documents.jsonl holds a line per
    trained copy); a non-member whose text was also trained on counts as a member only."""
    path = run.data_dir / "documents.jsonl"
    if not path.is_file():
        raise DataError(
            f"run '{run.path}' has no data/documents.jsonl; re-run `memaudit data` / training"
        )
    out: dict[str, list[Doc]] = {"member": [], "holdout": [], "heldout_user": []}
    seen: set[tuple[str, str]] = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("kind", "doc") != "doc" or r.get("role") not in out:
            continue  # canaries are probed from canaries.json
        if (r["role"], r["text"]) in seen:
            continue
        seen.add((r["role"], r["text"]))
        out[r["role"]].append(
            Doc(
                id=str(r["id"]),
                text=r["text"],
                user=None if r.get("user") is None else str(r["user"]),
                repeats=int(r.get("repeats") or 1),
                pii=r.get("pii"),
                role=r["role"],
            )
        )
    trained = {d.text for d in out["member"]}

    def unseen(docs: list[Doc]) -> list[Doc]:
        return [d for d in docs if d.text not in trained]

    return out["member"], unseen(out["holdout"]), unseen(out["heldout_user"])


def base_reference(run: RunDir) -> str | None:
    """run.json's model.init_from when that checkpoint is still on disk (the default reference)."""
    m = run.read_manifest()
    if isinstance(m, dict) and m.get("role") == "public-base":
        return None  # the base itself: a reference to itself would score every document 0
    cfg = m.get("config") if isinstance(m, dict) else None
    model = cfg.get("model") if isinstance(cfg, dict) else None
    init = model.get("init_from") if isinstance(model, dict) else None
    return str(init) if isinstance(init, str) and (Path(init) / "config.json").is_file() else None


def resolve_target(
    target: str | Path,
    *,
    members: str | None = None,
    nonmembers: str | None = None,
    canaries: str | None = None,
    heldout_users: str | None = None,
    out: str | None = None,
    base: str | None = None,
    columns: Columns = DEFAULT_COLUMNS,
) -> Target:
    """A `Target` from a run directory or a HF model directory; refuses bad input in one line."""
    p = Path(target)
    run = RunDir(p)
    if out is not None and Path(out).is_dir():
        raise MemauditError(f"--out '{out}' is a directory; pass the file name probes.json should "
                            "get (e.g. {out}/probes.json)".replace("{out}", str(out)))
    if run.is_run():
        verify_run_data(run)  # the data the model was trained on, or refused
        model_dir = run.model_dir
        if not (model_dir / "config.json").is_file():
            raise RunDirError(f"run '{p}' has no trained model in model/; train it first")
        tok_dir = model_dir if _has_tokenizer(model_dir) else run.data_dir / "tokenizer"
        if not _has_tokenizer(tok_dir):
            raise DataError(
                f"run '{p}' has no tokenizer in model/ or data/tokenizer/; re-run training"
            )
        t = Target(
            kind="run",
            path=p,
            model_path=model_dir,
            tokenizer_path=tok_dir,
            out=Path(out) if out else run.probes_path,
        )
        t.members, t.nonmembers, t.heldout_user_docs = _run_docs(run)
        if run.canaries_path.is_file():
            t.canaries = Canaries.from_json(read_json(run.canaries_path), str(run.canaries_path))
        if run.privacy_path.is_file():
            t.privacy = Privacy.from_json(read_json(run.privacy_path), str(run.privacy_path))
        t.base = base_reference(run)
        meta = run.data_dir / "meta.json"
        if meta.is_file():
            meta_json = read_json(meta)
            t.eos_id = meta_json.get("eos_id")
            t.seq_len = meta_json.get("seq_len")
    elif (p / "config.json").is_file() or (p / ADAPTER_CONFIG).is_file() or not p.exists():
        src = resolve_model(target, base=base)
        if not _has_tokenizer(src.tokenizer_path):
            raise DataError(
                f"model directory '{src.path}' has no tokenizer files; save the tokenizer next "
                "to the model (tokenizer.json)"
            )
        if out is None:
            raise MemauditError(f"target '{p}' is a model directory; pass --out for probes.json")
        t = Target(kind="model", path=p, model_path=src.path, tokenizer_path=src.tokenizer_path,
                   out=Path(out), source=src, base=None if src.base is None else src.base.name)
    else:
        raise MemauditError(
            f"target '{p}' is neither a memaudit run (run.json) nor a Hugging Face "
            "model directory (config.json); pass one of those"
        )
    if members:
        t.members = read_documents(members, "member", columns)
    if nonmembers:
        t.nonmembers = read_documents(nonmembers, "holdout", columns)
    if heldout_users:
        t.heldout_user_docs = read_heldout_users(heldout_users, t.members, columns)
    if members or nonmembers or heldout_users:
        check_disjoint(t.members, t.nonmembers + t.heldout_user_docs)
    if canaries:
        cp = Path(canaries)
        if not cp.is_file():
            raise DataError(f"canaries file '{cp}' not found; pass a canaries.json")
        try:
            raw = json.loads(cp.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            where = f" (line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
            raise DataError(f"canaries file '{cp}' is not JSON{where}; write it as the JSON object "
                            "docs/canaries.schema.json describes (template, alphabet, inserted and "
                            "references; example: docs/canaries.example.json)") from None
        t.canaries = Canaries.from_json(raw, str(cp))
        c = t.canaries
        if not (c.inserted or c.references or c.audit):
            raise DataError(f"canaries file '{cp}' lists no canaries ('inserted', 'references' "
                            "or 'audit'); see docs/canaries.schema.json and "
                            "docs/canaries.example.json")
    return t
