"""LoRA on the 4D grid: the adapters follow the base weight's tensor-parallel split.

The cases run inside the world-2 and world-4 gloo groups that `results(world)` already spawns
(`tests/parallel/_lora_workers.py`); the oracle is peft + torch in one process. The config
checks run in this process.
"""

from __future__ import annotations

import pytest

from memaudit.config import load_config
from memaudit.errors import ConfigError
from memaudit.run.checks import check_before_disk
from tests.conftest import REPO_ROOT
from tests.parallel._lora_workers import LORA_GRIDS, LORA_KINDS, LORA_VOLUME_VARIANTS

_CASES = [(g, k) for g in LORA_GRIDS for k in LORA_KINDS]
_VOLUME = [f"lora-volume-{v}-{''.join(map(str, g))}" for g in LORA_GRIDS for v in LORA_VOLUME_VARIANTS]


@pytest.mark.parametrize(("grid", "kind"), _CASES, ids=[f"{k}-{''.join(map(str, g))}" for g, k in _CASES])
def test_lora_on_the_grid_equals_one_process(results, grid: tuple[int, int, int, int], kind: str) -> None:
    """train: two AdamW steps equal peft in one process (losses, adapters, merged model, peft's
    adapter state), the frozen base is bit-identical and gets no gradient nor optimizer state, the
    adapters change, a sharded checkpoint loads back bit for bit; dp: per-example adapter-gradient
    norms equal a brute-force per-example loop's, and one DP-SGD step (sigma=0, ghost clipping)
    that loop's clipped mean."""
    world = grid[0] * grid[1] * grid[2] * grid[3]
    err = results(world)[f"lora-{kind}-{''.join(map(str, grid))}"]
    assert err is None, err


@pytest.mark.parametrize("name", _VOLUME)
def test_lora_wire_volume_per_kind_equals_the_planner(results, name: str) -> None:
    """One LoRA step's bytes per (axis, collective kind), counted in `Comm`, equal
    `predict_collectives(lora=...)` exactly (payload and ring wire bytes): no weight-gradient
    reduce-scatter, the adapters' projections over the in and out axes, only the adapters synced
    over z and data, and in the first layer no backward of the frozen layers whose input needs no
    gradient; with recomputation, DP-SGD, micro-batches and the overlaps (no prefetched block
    left unused)."""
    grid = tuple(int(c) for c in name.rsplit("-", 1)[1])
    err = results(grid[0] * grid[1] * grid[2] * grid[3])[name]
    assert err is None, err


def _cfg(*over: str):
    return load_config(REPO_ROOT / "configs" / "tiny.yaml",
                       ["model.lora.rank=4", "model.lora.target_modules=[q_proj,o_proj]", *over])


@pytest.mark.parametrize(("over", "needle"), [
    (("parallel.x=3",), "parallel.x=3 does not divide A's columns (d_in)=128 of its adapters; choose parallel.x"),
    (("parallel.y=3",), "parallel.y=3 does not divide B's rows (d_out)=128"),
])
def test_lora_the_grid_cannot_split_is_one_line(over: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_before_disk(_cfg(*over))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_lora_on_a_grid_that_divides_it_passes_the_checks() -> None:
    check_before_disk(_cfg("parallel.x=2", "parallel.y=2"))


def _adapters(run) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def _peft_and_adamw(cfg):
    from memaudit.models.init import initial_model, model_vocab_size
    from memaudit.models.lora import apply_lora
    from memaudit.train.layout import make_optimizer

    model = apply_lora(initial_model(cfg.model, model_vocab_size(cfg.model)), cfg.model.lora, seed=cfg.model.init_seed)
    return model, make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.train)


def test_lora_trainer_on_a_grid_writes_what_one_process_writes(results, train_runs, tiny_corpus, tmp_path) -> None:
    """The Trainer with LoRA and adapter dropout under DP-SGD (sigma=0) on x=2 against
    `train_centralized` of the same config: the same steps, dropout masks, clipping and weights; the merged model/ and the PEFT adapter folder
    agree (its frozen base bit for bit); the sharded checkpoint loads into the one-process peft
    model, and the one-process checkpoint into a grid's layout, each giving the adapters exported."""
    import json

    import torch
    from safetensors.torch import load_file

    from memaudit.models.lora import adapter_state
    from memaudit.parallel.layout import TensorParallelLayout
    from memaudit.parallel.lora import gather_peft
    from memaudit.run.centralized import train_centralized
    from memaudit.rundir import RunDir
    from memaudit.train.layout import SerialLayout
    from tests._metrics import merged_metrics
    from tests.parallel import _workers

    err = results(2)["train-lora-dp0-x2"]
    assert err is None, err
    par = train_runs[1] / "lora-dp0-x2"
    cfg = load_config(REPO_ROOT / "configs" / "tiny.yaml",
                      _workers.train_overrides("lora-dp0-x2", str(tiny_corpus), parallel=False))
    ser = tmp_path / "single"
    train_centralized(cfg, RunDir(ser))
    a, b = merged_metrics(par), merged_metrics(ser)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-4 and abs(x["grad_norm"] - y["grad_norm"]) < 1e-4 * max(1.0, y["grad_norm"])
        assert (x["batch_size"], x["clip_fraction"]) == (y["batch_size"], y["clip_fraction"])
    assert 0 < sum(m["clip_fraction"] for m in a) < 4  # some, not all, clipped
    _workers.assert_weights_close(par, ser, max_abs=1e-5, far_fraction=0.0)
    pa, sa = _adapters(par), _adapters(ser)
    assert set(pa) == set(sa) and len(pa) == 4 * 2 * 2  # 4 layers x (q, o) x (A, B)
    for k in sa:  # Adam normalises each coordinate: summation-order noise in a small gradient moves it by up to
        # ~0.1% of a step (3e-6 against updates of 2e-3, measured with adapter dropout)
        torch.testing.assert_close(pa[k], sa[k], atol=1e-5, rtol=1e-5, msg=k)
    pc, sc = (json.loads((r / "adapter" / "adapter_config.json").read_text()) for r in (par, ser))
    assert pc.pop("base_model_name_or_path") == str((par / "adapter" / "base").resolve())
    sc.pop("base_model_name_or_path")
    assert pc == sc
    pb, sb = (load_file(str(r / "adapter" / "base" / "model.safetensors")) for r in (par, ser))
    assert set(pb) == set(sb) and all(torch.equal(pb[k], sb[k]) for k in sb)
    pd, sd = (json.loads((r / "run.json").read_text())["result"] for r in (par, ser))
    assert {k: pd[k] for k in ("trained", "parameters", "trained_parameters", "frozen_parameters")} == \
        {k: sd[k] for k in ("trained", "parameters", "trained_parameters", "frozen_parameters")}
    # the step-2 checkpoints across layouts: the grid's sharded one in one process, the one-process
    # one on a (1x1x1x1) grid's layout, each against the one-process run's own
    own, own_opt = _peft_and_adamw(cfg)
    SerialLayout(cfg).read_state(RunDir(ser), own, own_opt)
    want = adapter_state(own)
    model, opt = _peft_and_adamw(cfg)
    SerialLayout(cfg).read_state(RunDir(par), model, opt)
    got = adapter_state(model)
    assert set(got) == set(want) and not torch.equal(got[next(iter(got))], pa[next(iter(got))])  # step 2, not 4
    for k in want:  # Adam's per-coordinate noise, as above
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    for st, st_own in zip(opt.state_dict()["state"].values(), own_opt.state_dict()["state"].values(), strict=True):
        torch.testing.assert_close(st["exp_avg_sq"], st_own["exp_avg_sq"], atol=1e-9, rtol=1e-4)
    layout = TensorParallelLayout(cfg)
    pm = layout.parallelize(_peft_and_adamw(cfg)[0])
    popt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad])
    layout.read_state(RunDir(ser), pm, popt)
    got = adapter_state(gather_peft(pm, _peft_and_adamw(cfg)[0]))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    for st, st_own in zip(popt.state_dict()["state"].values(), own_opt.state_dict()["state"].values(), strict=True):
        assert torch.equal(st["exp_avg"], st_own["exp_avg"])


def test_lora_dp_run_on_a_grid_stopped_in_step_3_resumes_to_the_same_bits(results, train_runs) -> None:
    """Every rank of the x=2 LoRA DP-SGD job fails in step 3, after its step-2 checkpoint; the
    run resumed on the same grid ends with the uninterrupted run's adapters, merged weights,
    steps and ledger, bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file

    from tests._metrics import merged_metrics

    for job in ("lora-dp0-x2", "lora-dp0-x2-resume"):
        err = results(2)[f"train-{job}"]
        assert err is None, err
    whole, resumed = train_runs[1] / "lora-dp0-x2", train_runs[1] / "lora-dp0-x2-resume"
    m = json.loads((resumed / "run.json").read_text())
    assert m["status"] == "complete" and m["result"]["resumed_from_step"] == 2
    assert [x["step"] for x in merged_metrics(resumed)] == [1, 2, 3, 4]
    for x, y in zip(merged_metrics(resumed), merged_metrics(whole), strict=True):
        assert (x["loss"], x["clip_fraction"], x["batch_size"]) == (y["loss"], y["clip_fraction"], y["batch_size"])
    for sub in ("adapter/adapter_model.safetensors", "model/model.safetensors"):
        a, b = load_file(str(resumed / sub)), load_file(str(whole / sub))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), sub
    la, lb = (json.loads((r / "privacy.json").read_text()) for r in (resumed, whole))
    assert la["epsilon"] == lb["epsilon"] and la["events"] == lb["events"] and la["steps"] == 4
