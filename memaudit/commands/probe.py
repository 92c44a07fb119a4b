"""`memaudit probe TARGET`: measure memorization of a run or any Hugging Face causal LM."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from memaudit.commands._common import console, print_json, progress, stdout
from memaudit.probes.context import context_count, context_measure
from memaudit.probes.inputs import FORMATS
from memaudit.reports.cells import TERMINAL, as_cell, format_cell


def register(app: typer.Typer) -> None:
    @app.command(
        "probe",
        # typer 0.20 drops an argument's own help from --help: what TARGET may be is said here
        help="Probe a trained run (or any HF causal LM) for memorization; writes probes.json. "
        "TARGET: a run directory memaudit trained, or a Hugging Face model directory, cached hub "
        "id or LoRA adapter (then --members, --nonmembers and --out).",
    )
    def _cmd(
        target: Annotated[
            str, typer.Argument(help="Run directory, or a Hugging Face model directory.")
        ],
        probes: Annotated[
            str | None,
            typer.Option(
                help="Comma-separated, from exposure, extraction, goldfish_extraction, membership, "
                "user_inference, pii, audit. Default: all of them on a memaudit run; on any other "
                "model all but goldfish_extraction, which runs there only when named (it decodes "
                "the last tokens of every member document: minutes on a CPU)."
            ),
        ] = None,
        out: Annotated[
            str | None,
            typer.Option(
                help="Where probes.json goes (default: the run directory; "
                "required for a model directory)."
            ),
        ] = None,
        members: Annotated[
            str | None, typer.Option(help=f"Member documents: {FORMATS}; the text in column "
                                     "'text' (--text-column), a .txt file one document a line.")
        ] = None,
        nonmembers: Annotated[
            str | None, typer.Option(help=f"Non-member documents: {FORMATS}.")
        ] = None,
        canaries: Annotated[
            str | None, typer.Option(help="A canaries.json: template with {secret}, alphabet, "
                                     "inserted/references [{id, secret}]; schema in "
                                     "docs/canaries.schema.json, example in "
                                     "docs/canaries.example.json.")
        ] = None,
        text_column: Annotated[
            str | None, typer.Option(help="Column holding the text (JSONL, Parquet, CSV, "
                                     "dataset; default text).")
        ] = None,
        user_column: Annotated[
            str | None, typer.Option(help="Column holding the user id (optional; default user).")
        ] = None,
        pii_column: Annotated[
            str | None, typer.Option(help="Column holding PII spans [{type, value, start}] "
                                     "(optional; default pii).")
        ] = None,
        split: Annotated[
            str | None, typer.Option(help="Split of a saved DatasetDict (default train).")
        ] = None,
        columns: Annotated[
            str | None, typer.Option(help="A YAML file naming the columns instead of the four "
                                     "flags above: keys text, user, pii, split (e.g. 'text: "
                                     "body'); a flag passed as well wins over its key.")
        ] = None,
        fpr: Annotated[
            str | None, typer.Option(help="FPRs of the TPR cells, comma-separated (default "
                                     "0.01,0.001); refused when the non-members are fewer "
                                     "than 10/FPR.")
        ] = None,
        prefix_lengths: Annotated[
            str | None, typer.Option(help="Extraction: prefix tokens k, comma-separated "
                                     "(default 32,50).")
        ] = None,
        window_stride: Annotated[
            int | None, typer.Option(help="A document longer than the model's context is scored "
                                     "in windows of the context, this many tokens apart (default "
                                     "half the context); every token is scored once.")
        ] = None,
        heldout_users: Annotated[
            str | None,
            typer.Option(help=f"Documents of users the model never saw ({FORMATS}; with a user "
                         "column, --user-column), for user inference and PII."),
        ] = None,
        user_docs: Annotated[
            int | None,
            typer.Option(help="Documents per user on both sides of user inference "
                         "(default: the most every compared user has)."),
        ] = None,
        reference: Annotated[
            str | None, typer.Option(help="Reference model (folder, cached hub id or adapter) for "
                                     "the loss-ratio attack; default: the target's base (an "
                                     "adapter's, run.json's model.init_from); 'none' for none.")
        ] = None,
        cache: Annotated[
            str | None, typer.Option("--cache", help="A folder that keeps the reference's scores of "
                                      "the documents and the split's shift check, so that probing "
                                      "another model on the same documents against the same "
                                      "reference (checkpoints of one fine-tune) reads them; "
                                      "sensitive, as probes.json: owner-only files.")
        ] = None,
        reference_models: Annotated[
            str | None, typer.Option(help="k >= 2 reference models trained without the "
                                     "candidates, comma-separated: adds offline RMIA, and from "
                                     "k = 16 offline LiRA (with fewer, LiRA's pooled variance "
                                     "ranks exactly as the ratio attack, so it is not listed).")
        ] = None,
        base: Annotated[
            str | None, typer.Option(help="An adapter's base model (folder or cached hub id), "
                                     "overriding adapter_config.json's base_model_name_or_path.")
        ] = None,
        device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "auto",
        dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
        engine: Annotated[str, typer.Option(help="Who scores and generates: jax, torch or auto "
                                            "(jax on a TPU for a Llama model, torch otherwise).")
                          ] = "auto",
        batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 32,
        seed: Annotated[int, typer.Option(help="Seed for bootstrap, sampling and candidates.")] = 0,
        bootstrap: Annotated[
            int, typer.Option(help="Bootstrap resamples per confidence interval.")
        ] = 1000,
        exposure_enumerate_max: Annotated[
            int, typer.Option(help="Score every secret (exact exposure) when the secret space "
                              "has at most this many; 10^6 takes minutes on a CPU.")
        ] = 10_000,
        exposure_candidates: Annotated[
            int, typer.Option(help="Sampled candidates when the space is larger (exposure "
                              "beyond what they resolve is a lower bound).")
        ] = 10_000,
        show_secrets: Annotated[
            bool, typer.Option("--show-secrets", help="Print canary secrets (off: ids only).")
        ] = False,
        fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
    ) -> None:
        # lazy: `memaudit --help` does not import scikit-learn (~4 s) and numpy (~0.4 s)
        from memaudit.config import ProbeConfig
        from memaudit.probes.document import write_probes
        from memaudit.probes.engines import ENGINES
        from memaudit.probes.inputs import check_fpr_negatives, resolve_columns
        from memaudit.probes.runner import parse_probes
        from memaudit.probes.targets import resolve_target

        if fmt not in ("table", "json"):
            raise ValueError(f"--format '{fmt}' is not one of table, json")
        if engine not in ENGINES:
            raise ValueError(f"--engine '{engine}' is not one of {', '.join(ENGINES)}")
        if batch_size < 1 or bootstrap < 10:
            raise ValueError("--batch-size must be >= 1 and --bootstrap >= 10")
        names = parse_probes(probes) if probes is not None else None
        cols = resolve_columns(columns, text=text_column, user=user_column, pii=pii_column,
                               split=split)
        t = resolve_target(
            target, members=members, nonmembers=nonmembers, canaries=canaries,
            heldout_users=heldout_users, out=out, base=base, columns=cols,
        )
        if names is None:
            names = default_probes(t.kind)
        tuning = tuning_options(fpr=fpr, prefix_lengths=prefix_lengths)
        if fpr is not None and "membership" in names and t.nonmembers:
            check_fpr_negatives(len(t.nonmembers), tuning["fprs"])
        if reference is None:
            reference = t.base  # the fine-tune's own base: the natural reference
        elif reference.lower() == "none":
            reference = None
        # lazy: `memaudit --help` does not import scikit-learn (~4 s) and torch (~2 s)
        from memaudit.probes.runner import run_probes
        from memaudit.probes.scoring import resolve_device

        if exposure_candidates < 100 or exposure_enumerate_max < 1:
            raise ValueError(
                f"--exposure-candidates must be >= 100 (got {exposure_candidates}) and "
                f"--exposure-enumerate-max >= 1 (got {exposure_enumerate_max})"
            )
        if user_docs is not None and user_docs < 1:
            raise ValueError(f"--user-docs must be >= 1, got {user_docs}")
        if window_stride is not None and window_stride < 1:
            raise ValueError(f"--window-stride must be >= 1 token, got {window_stride}")
        cache_dir = None
        if cache is not None:
            from memaudit.rundir import check_output_folder  # lazy: as run_probes above

            cache_dir = Path(cache)
            check_output_folder(cache_dir, what="--cache")
        settings = ProbeConfig(
            probes=names,
            user_docs=user_docs,
            device=resolve_device(device),
            dtype=dtype,
            batch_size=batch_size,
            reference=reference,
            seed=seed,
            n_boot=bootstrap,
            window_stride=window_stride,
            exposure_enumerate_max=exposure_enumerate_max,
            exposure_samples=exposure_candidates,
            reference_models=tuple(r.strip() for r in (reference_models or "").split(",")
                                   if r.strip()),
            **tuning,
        )
        with progress() as bar:
            tasks: dict[str, int] = {}

            def report(done: int, total: int, info: dict) -> None:
                stage = info.get("stage", "probe")
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total, info="")
                bar.update(tasks[stage], completed=done, total=total)

            if not console.is_terminal:  # a log file or a pipe: lines, not a bar
                report = LogProgress(lambda line: console.print(line, markup=False,
                                                                highlight=False))
            result = run_probes(t, settings, progress=report, engine=engine, cache=cache_dir)
        write_probes(t.out, result.document)
        if fmt == "json":
            print_json(result.document)
        else:
            render_table(result, show_secrets=show_secrets)
            console.print(f"probes.json written to {t.out}")


def default_probes(kind: str) -> tuple[str, ...]:
    """The probes run when --probes is not given: all on a memaudit run ("run"); on any other
    model ("model") all but goldfish_extraction, which decodes every member document's last
    tokens (217 s of a default probe of GPT-2 on a CPU, issue 68) and runs there only when named."""
    # lazy: `memaudit --help` does not import memaudit.config (pydantic, ~0.3 s)
    from memaudit.config import PROBE_NAMES

    return tuple(n for n in PROBE_NAMES if kind == "run" or n != "goldfish_extraction")


def _duration(seconds: float) -> str:
    """
    >>> _duration(4.2), _duration(75), _duration(3725)
    ('4s', '1m15s', '1h02m')
    """
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class LogProgress:
    """Progress for a log: per stage, one line at its first report, then at most one every
    `every` seconds, and one when it is done; each with done/total, the time spent and an
    estimate of the time left (the stage's rate so far). Counts only: never a text.

    >>> t = [0.0]
    >>> p = LogProgress(print, clock=lambda: t[0])
    >>> p(1, 4, {"stage": "scoring"}); t[0] = 10.0; p(2, 4, {"stage": "scoring"})
    probe scoring: 1/4 (25%), 0s spent, about 0s left
    >>> t[0] = 31.0; p(3, 4, {"stage": "scoring"}); p(4, 4, {"stage": "scoring"})
    probe scoring: 3/4 (75%), 31s spent, about 10s left
    probe scoring: 4/4 (100%), done in 31s
    """

    def __init__(self, write: Callable[[str], None], *, clock: Callable[[], float] = time.monotonic,
                 every: float = 30.0) -> None:
        self.write, self.clock, self.every = write, clock, every
        self._stages: dict[str, list] = {}  # stage -> [start, last line's time, ended]

    def __call__(self, done: int, total: int, info: dict) -> None:
        stage = info.get("stage", "probe")
        now = self.clock()
        st = self._stages.setdefault(stage, [now, None, False])
        start, last, ended = st
        finished = total > 0 and done >= total
        if ended or not (last is None or finished or now - last >= self.every):
            return
        st[1], st[2] = now, finished
        spent = now - start
        head = f"probe {stage}: {done}/{total} ({100 * done // max(total, 1)}%)"
        if finished:
            self.write(f"{head}, done in {_duration(spent)}")
        elif done > 0:
            left = spent / done * (total - done)
            self.write(f"{head}, {_duration(spent)} spent, about {_duration(left)} left")
        else:
            self.write(f"{head}, {_duration(spent)} spent, time left not yet known")


def _numbers(spec: str, flag: str, kind) -> tuple:
    try:
        vals = tuple(kind(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} '{spec}' is not a comma-separated list of numbers") from None
    if not vals:
        raise ValueError(f"{flag} is empty; pass e.g. {flag} 0.01")
    return vals


def tuning_options(*, fpr: str | None, prefix_lengths: str | None) -> dict:
    """ProbeConfig fields set by --fpr and --prefix-lengths (unset: defaults)."""
    out: dict = {}
    if fpr is not None:
        out["fprs"] = _numbers(fpr, "--fpr", float)
        if any(not 0 < f < 1 for f in out["fprs"]):
            raise ValueError(f"--fpr '{fpr}': every FPR must lie strictly between 0 and 1")
    if prefix_lengths is not None:
        out["extraction_ks"] = _numbers(prefix_lengths, "--prefix-lengths", int)
        if min(out["extraction_ks"]) < 1:
            raise ValueError("--prefix-lengths must be positive token counts")
    return out


def _fmt(stat: dict | None, bound: bool = False) -> str:
    """A probes.json cell in the table's style (`memaudit.reports.cells.TERMINAL`); `bound`: the
    bucket says its value is a lower bound (canaries at the exposure estimator's ceiling)."""
    cell = as_cell(stat)
    if cell is not None and bound:
        cell = replace(cell, lower_bound=True)
    return format_cell(cell, TERMINAL)


def summary_rows(doc: dict) -> list[tuple[str, str, str]]:
    """(probe, measure, value) rows of the headline numbers of a probes.json document."""
    rows = []
    c = doc.get("counts") or {}
    if c.get("context"):
        rows.append(("input", context_measure(c), f"{context_count(c)} of {c['documents']}"))
        if c.get("extraction_ks_dropped"):
            rows.append(("input", "extraction prefix lengths beyond the context",
                         ", ".join(map(str, c["extraction_ks_dropped"]))))
    shift = (doc.get("checks") or {}).get("distribution_shift")
    if shift and shift.get("auc") is not None:
        rows.append(("input", "blind classifier, members vs non-members on the texts alone",
                     f"AUC {shift['auc']:.3f} (chance 0.5 ± {shift['null_sd']:.3f}, n = "
                     f"{shift['n_members']} + {shift['n_nonmembers']} documents)"
                     + (f"; WARNING: {shift['note']}" if shift["flagged"] else "")))
    for name, res in doc["probes"].items():
        s = res["summary"]
        if "skipped" in s:
            rows.append((name, "skipped", s["skipped"]))
            continue
        if name == "exposure":
            rows.append((name, f"max (log2|R|, {s['method']})", f"{s['max_exposure']:.2f}"))
            rows.append((name, "references (null)", _fmt(s["references"])))
            for rep, g in s["by_repetitions"].items():
                rows.append((name, f"inserted x{rep}", _fmt(g["all"], bool(g.get("lower_bound")))))
                if g.get("test"):
                    # the raw p: `memaudit report` corrects every test in one Holm family
                    rows.append((name, f"x{rep} excess over references",
                                 f"{_fmt(g['excess'])}; p = {g['test']['p_value']:.3g} unadjusted"))
        elif name == "extraction":
            for k, g in s.get("discoverable", {}).items():
                if g.get("skipped_short"):
                    rows.append((name, f"skipped k={k} (shorter than k + suffix)",
                                 f"{g['skipped_short']} documents"))
                rows.append((name, f"exact k={k}", _fmt(g["exact"])))
                rows.append((name, f"approx lev k={k}", _fmt(g["approx_levenshtein"])))
                rows.append((name, f"approx bleu k={k}", _fmt(g["approx_bleu"])))
            if "canaries" in s:
                rows.append((name, "canary greedy completion", _fmt(s["canaries"]["greedy"])))
            for metric, g in s.get("non_discoverable", {}).items():
                if isinstance(g, dict):
                    rows.append(
                        (
                            name,
                            f"unprompted top-{s['non_discoverable']['top_n']} by {metric}",
                            f"{g['memorised_in_top']} memorised",
                        )
                    )
        elif name == "goldfish_extraction":
            for kind in ("documents", "canaries"):
                if g := s.get(kind):
                    last = f"last {s['suffix_tokens']}, {g['skipped_short']} too short"
                    rows.append((name, f"{kind} exact ({last})", _fmt(g["exact"])))
                    rows.append((name, f"{kind} ROUGE-L", _fmt(g["rouge_l"])))
        elif name in ("membership", "user_inference"):
            attacks = s.items() if name == "membership" else [(s["statistic"], s)]
            for attack, a in attacks:
                rows.append((name, f"{attack} AUC", _fmt(a["auc"])))
                for f, v in a["tpr_at_fpr"].items():
                    rows.append((name, f"{attack} TPR@{f}", _fmt(v)))
        elif name == "pii":
            for group, g in s.items():
                rows.append((name, f"{group} extraction ({g['items']})", _fmt(g["extraction"])))
                chance = g.get("chance_top1")
                label = f"{group} inference top-1" + (f" (chance {chance:.3f})" if chance else "")
                rows.append((name, label, _fmt(g["inference_top1"])))
        elif name == "audit":
            rows.append(
                (
                    name,
                    f"ε one-sided lower bound (r={s['r']}, v={s['v']}, m={s['m']})",
                    f">= {s['eps_lower_bound']:.3f} at {s.get('confidence', 0.95):.0%} confidence",
                )
            )
            rows.append((name, f"ceiling (m={s['m']}, δ={s['delta']:g})", f"{s['ceiling']:.3f}"))
            rows.append(
                (name, "ledger ε", "-" if s["ledger_eps"] is None else f"{s['ledger_eps']:.3f}")
            )
    return rows


def render_table(result, *, show_secrets: bool) -> None:
    table = Table(title="memaudit probe")
    for col in ("probe", "measure", "value [95% CI]"):
        table.add_column(col)
    for row in summary_rows(result.document):
        table.add_row(*row)
    stdout.print(table)
    if show_secrets and result.secrets:
        exp = {r["id"]: r for r in result.document["probes"].get("exposure", {}).get("scores", [])}
        st = Table(title="canary secrets (--show-secrets)")
        for col in ("id", "secret", "exposure"):
            st.add_column(col)
        for cid, secret in result.secrets.items():
            e = exp.get(cid.split(":")[0], {}).get("exposure")
            st.add_row(cid, secret, "-" if e is None else f"{e:.2f}")
        stdout.print(st)
