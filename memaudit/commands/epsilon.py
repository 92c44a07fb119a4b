"""`memaudit epsilon`: ε of a DP-SGD plan, or the noise multiplier for a target ε.

    memaudit epsilon --sampling-rate 0.04 --noise-multiplier 1.5 --steps 2250 --delta 1e-5
    memaudit epsilon --sampling-rate 0.04 --target-epsilon 8 --steps 2250 --delta 1e-5
    memaudit epsilon -q 0.01 -s 1.0 -T 500 --delta 1e-6 --sampling fixed --population 10000

Poisson sampling is add/remove-one adjacency; ``--sampling fixed`` (a fixed-size sample of
q * population drawn without replacement, e.g. fixed federated cohorts) is replace-one, whose
sensitivity is 2C (the event carries z/2) and which only the RDP accountant interprets. Both
go through the mechanism's own event (`memaudit.privacy.mechanisms.SampledGaussian`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer
from rich.table import Table

from memaudit.commands._common import print_json, stdout
from memaudit.errors import MemauditError

HELP = ("Privacy budget of DP-SGD: epsilon for (sampling rate, noise multiplier, steps, delta), "
        "or with --target-epsilon the noise multiplier that reaches it.")


def compute(*, q: float, sigma: float | None, steps: int, delta: float | None,
            dataset_size: int | None, target_epsilon: float | None, accountant: str,
            clip: float | None, group_size: int | None, sampling: str = "poisson",
            population: int | None = None, unit: str = "example", max_examples_per_user: int | None = None,
            algorithm: str | None = None) -> dict[str, Any]:
    """The numbers `memaudit epsilon` prints (library code: no printing here).

    With unit "user" the ε is per user: `algorithm` "uls" (q = the user sampling rate; a
    Poisson-sampled Gaussian over users) or "els" (q = the example sampling rate, each user's
    examples capped at `max_examples_per_user`; a mixture of Gaussians, PLD only, with the
    group-privacy bound of the example-level ε beside it for comparison).
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
    led = PrivacyLedger(unit=unit, delta=delta)
    led.record_mechanism(mech.with_noise(sigma), steps=steps)
    out["epsilon"] = {a: led.epsilon(a) for a in accountants} if steps else {a: 0.0 for a in accountants}
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
        sampling_rate: Annotated[float, typer.Option("--sampling-rate", "-q",
            help="Poisson sampling rate q in (0, 1] (expected batch size / data set size).")],
        steps: Annotated[int, typer.Option("--steps", "-T", help="Number of DP-SGD steps.")],
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
        fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
    ) -> None:
        if fmt not in ("table", "json"):
            raise MemauditError(f"--format '{fmt}' is not known; use table or json")
        res = compute(q=sampling_rate, sigma=noise_multiplier, steps=steps, delta=delta,
                      dataset_size=dataset_size, target_epsilon=target_epsilon,
                      accountant=accountant, clip=clip, group_size=group_size, sampling=sampling,
                      population=population, unit=unit, max_examples_per_user=max_examples_per_user,
                      algorithm=algorithm)

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
            elif key == "group":
                table.add_row(f"group of {val['k']}: epsilon", _fmt(val["epsilon"]))
                table.add_row(f"group of {val['k']}: delta", _fmt(val["delta"]))
                table.add_row(f"group of {val['k']}: vacuous", str(val["vacuous"]))
            else:
                table.add_row(key.replace("_", " "), _fmt(val))
        stdout.print(table)
