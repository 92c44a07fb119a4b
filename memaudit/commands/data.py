"""`memaudit data synth` and `memaudit data prepare`.

Only counts, paths and the fingerprint are printed: never document text or secrets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from memaudit.commands._common import console, progress
from memaudit.errors import DataError

app = typer.Typer(help="Build a synthetic PII corpus, or prepare a run's data.", no_args_is_help=True)

_PROGRESS_FROM_USERS = 256  # smaller corpora take well under a second


@app.command("synth", help="Write a seeded synthetic corpus with PII spans as JSONL.")
def synth(
    out: Annotated[Path, typer.Option("--out", help="Output JSONL file, e.g. corpus.jsonl.")],
    users: Annotated[int, typer.Option("--users", help="Number of users (>= 2).")] = 64,
    docs_per_user: Annotated[int, typer.Option("--docs-per-user", help="Messages per user (>= 1).")] = 8,
    seed: Annotated[int, typer.Option("--seed", help="Seed: the same seed gives the same corpus.")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.")] = False,
) -> None:
    # lazy: `memaudit --help` does not import numpy (~0.4 s)
    from memaudit.data.documents import Document
    from memaudit.data.synth import synthesize
    from memaudit.io import atomic_write_bytes

    if users < 2:
        raise DataError(f"--users {users} is too few; memaudit needs at least 2 users")
    if docs_per_user < 1:
        raise DataError(f"--docs-per-user {docs_per_user} must be at least 1")
    if out.is_dir():
        raise DataError(f"--out '{out}' is a directory; pass a file name such as corpus.jsonl")
    if out.exists() and not overwrite:
        raise DataError(f"--out '{out}' already exists; pass --overwrite to replace it")
    if users >= _PROGRESS_FROM_USERS:
        bar = progress()
        bar.live.transient = True
        with bar:
            task = bar.add_task("synth", total=users, info="")
            docs = synthesize(users, docs_per_user, seed, progress=lambda d, t, i: bar.update(
                task, completed=d, info=f"{i['docs']} docs"))
    else:
        docs = synthesize(users, docs_per_user, seed)

    data = "".join(json.dumps(Document.to_corpus_json(d), ensure_ascii=False) + "\n" for d in docs)
    atomic_write_bytes(out, data.encode("utf-8"))
    console.print(f"wrote {len(docs)} documents of {users} users to {out}")


@app.command("prepare", help="Prepare a config's data (corpus, split, canaries, tokenizer) in a directory.")
def prepare(
    config: Annotated[Path, typer.Argument(help="YAML config, e.g. configs/tiny.yaml.")],
    out: Annotated[Path, typer.Option("--out", help="Directory that receives data/, split.json, canaries.json.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a key, e.g. --set data.seq_len=64.")
    ] = None,
) -> None:
    # lazy: `memaudit --help` does not import numpy (~0.4 s)
    from memaudit.config import load_config
    from memaudit.data.prepare import prepare_data
    from memaudit.models.presets import get_preset
    from memaudit.rundir import RunDir

    cfg = load_config(config, set_ or [])
    if out.exists() and not out.is_dir():
        raise DataError(f"--out '{out}' exists and is not a directory; choose another --out")
    if RunDir(out).is_run():
        raise DataError(f"--out '{out}' holds a run; prepare into a new directory")
    vocab = _vocab_size(cfg.model.preset, cfg.model.name_or_path, get_preset)
    bar = progress()
    bar.live.transient = True  # an error leaves only its one line behind
    with bar:
        task = bar.add_task("prepare", total=5, info="")
        prepared = prepare_data(cfg.data, RunDir(out), vocab_size=vocab, base_model=cfg.model.init_from,
                                progress=lambda d, t, i: bar.update(task, completed=d, total=t,
                                                                    info=i.get("stage", "")))
    m = prepared.meta
    console.print(
        f"prepared {m['documents']} documents, {len(prepared.canaries.inserted)} canaries, "
        f"sequences train/holdout/heldout {m['sequences']['train']}/{m['sequences']['holdout']}/"
        f"{m['sequences']['heldout']} in {out} (fingerprint {prepared.fingerprint[:12]})"
    )
    spans = m.get("sequences_per_document")
    if isinstance(spans, dict) and spans.get("max_sequences_per_document") is not None:
        n = spans["spanning"]
        console.print(f"trained documents spanning 1/2/3+ sequences: {n['1']}/{n['2']}/{n['3+']} "
                      f"(at most {spans['max_sequences_per_document']}: the m of the epsilon per document)")


def _vocab_size(preset: str, name_or_path: str | None, get_preset) -> int:
    if name_or_path is None:
        return get_preset(preset).vocab_size
    # lazy: `memaudit --help` does not import transformers (~1.3 s)
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(name_or_path).vocab_size)
    except Exception as e:  # noqa: BLE001 (any load failure is a user-input error)
        raise DataError(f"model.name_or_path '{name_or_path}' could not be loaded ({type(e).__name__}); "
                        "pass a Hugging Face model directory") from None
