"""`memaudit epsilon`: ε of a DP-SGD plan, or the noise multiplier for a target ε.

    memaudit epsilon --sampling-rate 0.04 --noise-multiplier 1.5 --steps 2250 --delta 1e-5
    memaudit epsilon --sampling-rate 0.04 --target-epsilon 8 --steps 2250 --delta 1e-5
    memaudit epsilon -q 0.01 -s 1.0 -T 500 --delta 1e-6 --sampling fixed --population 10000
    memaudit epsilon -q 0.04 -s 1.5 -T 2250 --delta 1e-5 --max-sequences-per-document 3
    memaudit epsilon --run runs/centralized-eps8-s0      # recomputed from the run's privacy.json

Poisson sampling is add/remove-one adjacency; ``--sampling fixed`` (a fixed-size sample of
q * population drawn without replacement, e.g. fixed federated cohorts) is replace-one, whose
sensitivity is 2C (the event carries z/2) and which only the RDP accountant interprets. Both
go through the mechanism's own event (`memaudit.privacy.mechanisms.SampledGaussian`).

The example-level ε is per packed training sequence. With ``--max-sequences-per-document m``
(the data's ``meta.json`` records m) it also prints the ε per document, composed by the ledger
for a document spanning m sequences (`memaudit.privacy.ledger.PrivacyLedger.document`).
``--run RUN_DIR`` prints a trained run's figures instead, recomputed from the events of its
privacy.json: per sequence and per document (m from the run), or per user.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from memaudit.commands._common import print_json, stdout
from memaudit.errors import MemauditError
from memaudit.io import read_json

HELP = ("Privacy budget of DP-SGD: epsilon for (sampling rate, noise multiplier, steps, delta), "
        "or with --target-epsilon the noise multiplier that reaches it.")


def compute(*, q: float, sigma: float | None, steps: int, delta: float | None,
            dataset_size: int | None, target_epsilon: float | None, accountant: str,
            clip: float | None, group_size: int | None, sampling: str = "poisson",
            population: int | None = None, unit: str = "example", max_examples_per_user: int | None = None,
            algorithm: str | None = None, max_sequences_per_document: int | None = None) -> dict[str, Any]:
    """The numbers `memaudit epsilon` prints (library code: no printing here).

    With unit "user" the ε is per user: `algorithm` "uls" (q = the user sampling rate; a
    Poisson-sampled Gaussian over users) or "els" (q = the example sampling rate, each user's
    examples capped at `max_examples_per_user`; a mixture of Gaussians, PLD only, with the
    group-privacy bound of the example-level ε beside it for comparison). With unit "example" the
    ε is per sequence, and `max_sequences_per_document` m adds the ε per document.
    """
    # lazy: `memaudit --help` does not import dp_accounting (~1.5 s) and numpy (~0.4 s)
    from memaudit.privacy.accounting import (
        check_delta,
        check_dpsgd,
        default_delta,
        group_epsilon,
        group_privacy_bound,
    )
    from memaudit.privacy.ledger import PrivacyLedger
    from memaudit.privacy.mechanisms import calibrate, repeated

    if accountant not in ("rdp", "pld", "both"):
        raise MemauditError(f"--accountant '{accountant}' is not known; use rdp, pld or both")
    if clip is not None and not clip > 0:
        raise MemauditError(f"--clip must be > 0, got {clip}")
    if dataset_size is not None and dataset_size < 1:
        raise MemauditError(f"--dataset-size must be >= 1, got {dataset_size}")
    if group_size is not None and group_size < 1:
        raise MemauditError(f"--group-size must be >= 1, got {group_size}")
    if delta is None:
        if dataset_size is None:
            raise MemauditError("pass --delta (e.g. 1e-5) or --dataset-size N (delta = 1/(10 N) rounded down)")
        delta = default_delta(dataset_size)
    check_delta(delta)
    if (sigma is None) == (target_epsilon is None):
        raise MemauditError("pass exactly one of --noise-multiplier and --target-epsilon")
    check_dpsgd(q, 0.0 if sigma is None else sigma, steps)
    m = _check_document(max_sequences_per_document, unit, sampling)
    accountants = ["rdp", "pld"] if accountant == "both" else [accountant]
    mech = _mechanism(q, sampling, population)
    if sampling == "fixed":
        accountants = ["rdp"]
    if unit == "user":
        mech = _user_mechanism(q, sampling, max_examples_per_user, algorithm)
        if algorithm == "els":
            accountants = ["pld"]  # only PLD interprets the mixture of Gaussians
    elif unit != "example":
        raise MemauditError(f"--unit '{unit}' is not known; use example or user")
    out: dict[str, Any] = {"unit": unit, "sampling_rate": q, "steps": steps, "delta": delta, "sampling": sampling,
                           "adjacency": mech.adjacency}
    if unit == "user":
        out.update(algorithm=algorithm, max_examples_per_user=max_examples_per_user)
    if target_epsilon is not None:
        first = accountants[-1]  # the tightest accountant asked for sets sigma
        try:
            sigma = calibrate(target_epsilon, lambda z: mech.with_noise(z).dp_event(), steps=steps, delta=delta,
                              accountant=first, unit=unit)
        except ValueError as e:
            raise MemauditError(str(e)) from None
        out["target_epsilon"] = target_epsilon
        out["calibrated_with"] = first
    out["noise_multiplier"] = sigma
    led = PrivacyLedger(unit=unit, delta=delta, max_sequences_per_document=m)
    led.record_mechanism(mech.with_noise(sigma), steps=steps)
    out["epsilon"] = {a: led.epsilon(a) for a in accountants} if steps else {a: 0.0 for a in accountants}
    out["protects"] = led.protects()
    if unit == "user":
        out["protects"]["contribution_bound"] = (f"at most {max_examples_per_user} training sequences per "
                                                 "user, clipped to C")
    if m is not None:
        doc = led.document()
        out["document"] = {"max_sequences_per_document": m,
                           "epsilon": {a: v for a, v in doc["epsilon"].items() if v is not None},
                           "composed_as": doc["composed_as"]}
    if clip is not None:
        out["clip"] = clip
        out["noise_std_sum"] = sigma * clip
        if dataset_size is not None:
            out["expected_batch_size"] = q * dataset_size
            out["noise_std_mean"] = sigma * clip / (q * dataset_size)
    if group_size is not None:
        best = min(out["epsilon"].values())
        out["group"] = group_epsilon(best, delta, group_size)
    if unit == "user" and algorithm == "els" and steps:
        out["group_privacy_bound"] = group_privacy_bound(  # for comparison: looser than the mixture
            repeated(mech.with_noise(sigma).example_event(), steps), delta, int(max_examples_per_user))
    return out


def from_run(path: str) -> dict[str, Any]:
    """A run's ε, recomputed from its ledger's events (RUN_DIR or a privacy.json): the unit and its
    contribution bound, per sequence and per document (example-level), or per user."""
    # lazy: dp_accounting (~1.5 s) only when a command runs; `memaudit --help` does not pay for it
    from memaudit.privacy.ledger import ledger_summary

    p = Path(path)
    file = p / "privacy.json" if p.is_dir() else p
    try:
        obj = read_json(file, what="privacy ledger")
    except FileNotFoundError:
        raise MemauditError(f"no privacy ledger at '{file}'; pass a run directory trained with DP") from None
    if not isinstance(obj, dict):
        raise MemauditError(f"'{file}' is not a privacy ledger; re-run training to rewrite it")
    try:  # recomputed from the events; the stored numbers are never read
        s = ledger_summary(obj)
    except (ValueError, KeyError, TypeError) as e:
        raise MemauditError(f"'{file}' holds a privacy ledger this version cannot interpret "
                            f"({type(e).__name__}); re-run training to rewrite it") from None
    out: dict[str, Any] = {"run": str(p), "unit": s["unit"], "delta": s["delta"],
                           "epsilon": {a: v for a, v in s["epsilons"].items() if v is not None}}
    if s["unit"] is None:
        return out  # trained without DP: epsilon = inf
    out["protects"] = s["protects"]
    doc = s["document"]
    if doc is not None:
        out["document"] = {"max_sequences_per_document": doc["max_sequences_per_document"],
                           "epsilon": {a: v for a, v in (doc["epsilon"] or {}).items() if v is not None},
                           "composed_as": doc["composed_as"]}
    if s["per_user"] is not None:
        out["group"] = s["per_user"]
    return out


def _check_document(m: int | None, unit: str, sampling: str) -> int | None:
    if m is None:
        return None
    if m < 1:
        raise MemauditError(f"--max-sequences-per-document must be >= 1, got {m}")
    if unit != "example":
        raise MemauditError("--max-sequences-per-document applies to --unit example; a user-level epsilon "
                            "already covers every document of the user")
    if sampling != "poisson":
        raise MemauditError("--max-sequences-per-document accounts Poisson sampling; drop --sampling fixed")
    return int(m)


def _user_mechanism(q: float, sampling: str, k: int | None, algorithm: str | None):
    """The user-level mechanism of --algorithm els|uls (only q matters: Poisson sampling)."""
    # lazy: `memaudit --help` does not import dp_accounting (~1.5 s) and numpy (~0.4 s)
    from memaudit.privacy.mechanisms import ExampleSampledUsers, SampledGaussian

    if algorithm not in ("els", "uls"):
        raise MemauditError("--unit user needs --algorithm els or uls")
    if k is None or k < 1:
        raise MemauditError(f"--unit user needs --max-examples-per-user k >= 1 (the contribution bound), got {k}")
    if sampling != "poisson":
        raise MemauditError("--unit user accounts Poisson sampling; drop --sampling fixed")
    n = 10**9
    if algorithm == "els":
        return ExampleSampledUsers(noise_multiplier=0.0, population=n, expected=q * n, max_examples_per_user=k)
    return SampledGaussian(name="ULS", unit="user", noise_multiplier=0.0, population=n, expected=q * n,
                           centralized=True, max_examples_per_user=k)


def _mechanism(q: float, sampling: str, population: int | None):
    # lazy: `memaudit --help` does not import dp_accounting (~1.5 s) and numpy (~0.4 s)
    from memaudit.privacy.mechanisms import SampledGaussian

    if sampling not in ("poisson", "fixed"):
        raise MemauditError(f"--sampling '{sampling}' is not known; use poisson or fixed")
    if sampling == "poisson":
        n = population or 10**9  # only q matters for Poisson sampling
        return SampledGaussian(name="DP-SGD", unit="example", noise_multiplier=0.0, population=n, expected=q * n)
    if population is None:
        raise MemauditError("--sampling fixed needs --population N (the sample is q * N units)")
    size = q * population
    if abs(size - round(size)) > 1e-9 or round(size) < 1:
        raise MemauditError(f"--sampling-rate {q} times --population {population} is not a whole sample size; "
                            "pass q = sample / population")
    return SampledGaussian(name="fixed-size sampled Gaussian", unit="example", noise_multiplier=0.0,
                           population=population, expected=round(size), sampling="fixed")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return str(v)


def register(app: typer.Typer) -> None:
    @app.command("epsilon", help=HELP)
    def _cmd(
        sampling_rate: Annotated[float | None, typer.Option("--sampling-rate", "-q",
            help="Poisson sampling rate q in (0, 1] (expected batch size / data set size).")] = None,
        steps: Annotated[int | None, typer.Option("--steps", "-T", help="Number of DP-SGD steps.")] = None,
        noise_multiplier: Annotated[float | None, typer.Option("--noise-multiplier", "-s",
            help="Noise multiplier sigma >= 0 (noise std / clip norm).")] = None,
        target_epsilon: Annotated[float | None, typer.Option("--target-epsilon",
            help="Find the noise multiplier that reaches this epsilon instead.")] = None,
        delta: Annotated[float | None, typer.Option("--delta",
            help="Target delta in (0, 1); default from --dataset-size.")] = None,
        dataset_size: Annotated[int | None, typer.Option("--dataset-size",
            help="Number of training sequences N (default delta: largest power of ten <= 1/(10 N)).")] = None,
        clip: Annotated[float | None, typer.Option("--clip",
            help="Clip norm C > 0, to report the noise standard deviation.")] = None,
        group_size: Annotated[int | None, typer.Option("--group-size",
            help="Also report the group-privacy bound for a user with this many sequences.")] = None,
        accountant: Annotated[str, typer.Option("--accountant",
            help="rdp, pld or both.")] = "both",
        sampling: Annotated[str, typer.Option("--sampling",
            help="poisson (add/remove) or fixed (without replacement, replace-one; RDP only).")] = "poisson",
        population: Annotated[int | None, typer.Option("--population",
            help="Units sampled from; needed with --sampling fixed.")] = None,
        unit: Annotated[str, typer.Option("--unit",
            help="example (one sequence) or user (a user's up to k sequences).")] = "example",
        max_examples_per_user: Annotated[int | None, typer.Option("--max-examples-per-user",
            help="With --unit user: the contribution bound k.")] = None,
        algorithm: Annotated[str | None, typer.Option("--algorithm",
            help="With --unit user: els (q samples examples) or uls (q samples users).")] = None,
        max_sequences_per_document: Annotated[int | None, typer.Option("--max-sequences-per-document",
            help="With --unit example: the most packed sequences one document spans (the data's "
                 "meta.json records it); adds the epsilon per document.")] = None,
        run: Annotated[str | None, typer.Option("--run",
            help="A trained run (RUN_DIR or its privacy.json): its epsilon recomputed from the ledger, "
                 "instead of the parameters.")] = None,
        fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
    ) -> None:
        if fmt not in ("table", "json"):
            raise MemauditError(f"--format '{fmt}' is not known; use table or json")
        if run is not None:
            if sampling_rate is not None or steps is not None:
                raise MemauditError("--run reads the run's own parameters; drop --sampling-rate and --steps")
            _print(from_run(run), fmt)
            return
        if sampling_rate is None or steps is None:
            raise MemauditError("pass --sampling-rate and --steps (or --run RUN_DIR for a trained run)")
        res = compute(q=sampling_rate, sigma=noise_multiplier, steps=steps, delta=delta,
                      dataset_size=dataset_size, target_epsilon=target_epsilon,
                      accountant=accountant, clip=clip, group_size=group_size, sampling=sampling,
                      population=population, unit=unit, max_examples_per_user=max_examples_per_user,
                      algorithm=algorithm, max_sequences_per_document=max_sequences_per_document)
        _print(res, fmt)


def _print(res: dict[str, Any], fmt: str) -> None:
    if fmt == "json":
        print_json(res)
        return
    table = Table(title="DP-SGD privacy budget", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for key, val in res.items():
        if key == "epsilon":
            for acc, e in val.items():
                table.add_row(f"epsilon ({acc})", _fmt(e))
        elif key == "protects":
            table.add_row("epsilon is per", val["unit"])
            table.add_row("contribution bound", val["contribution_bound"])
        elif key == "document":
            for acc, e in val["epsilon"].items():
                table.add_row(f"epsilon per document ({acc})", _fmt(e))
            table.add_row("document composed as", val["composed_as"])
        elif key == "group":
            table.add_row(f"group of {val['k']}: epsilon", _fmt(val["epsilon"]))
            table.add_row(f"group of {val['k']}: delta", _fmt(val["delta"]))
            table.add_row(f"group of {val['k']}: vacuous", str(val["vacuous"]))
        else:
            table.add_row(key.replace("_", " "), _fmt(val))
    if res["unit"] == "example" and "document" not in res:
        table.add_row("epsilon per document", "pass --max-sequences-per-document m")
    if res["unit"] is None:
        table.add_row("privacy", "trained without DP: epsilon = inf")
    stdout.print(table)
