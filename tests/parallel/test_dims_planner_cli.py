"""ParallelDims validation, rank layout, planner invariants and the `memaudit parallel plan` CLI."""

from __future__ import annotations

import json

import pytest

from memaudit.cli import main
from memaudit.models.presets import llama_config
from memaudit.parallel.dims import MeshAxis, ParallelDims, build_groups
from memaudit.parallel.planner import (
    LoraShape,
    ModelShape,
    factorisations,
    plan,
    predict_memory,
    predict_payload,
)
from memaudit.run.launch import resolve_backend


def test_rank_layout_x_fastest_then_y_z_data() -> None:
    d = ParallelDims(data=2, x=2, y=3, z=2)
    for r in range(d.world_size):
        c = d.coords(r)
        assert r == c["x"] + 2 * (c["y"] + 3 * (c["z"] + 2 * c["data"]))
        assert d.rank_of(**c) == r
    assert d.coords(1)["x"] == 1 and d.coords(2) == {"data": 0, "x": 0, "y": 1, "z": 0}


@pytest.mark.parametrize("axis", list(MeshAxis))
def test_axis_slices_partition_the_world(axis: MeshAxis) -> None:
    d = ParallelDims(data=2, x=2, y=2, z=2)
    slices = d.axis_slices(axis)
    assert sorted(r for s in slices for r in s) == list(range(16))
    assert all(len(s) == 2 for s in slices)
    for s in slices:  # members differ only in `axis`
        cs = [d.coords(r) for r in s]
        assert len({c[axis.value] for c in cs}) == 2
        assert all({k: v for k, v in c.items() if k != axis.value} == {k: v for k, v in cs[0].items()
                                                                     if k != axis.value} for c in cs)


def test_grid_product_must_match_the_process_count() -> None:
    with pytest.raises(ValueError, match=r"= 4 but 1 processes run; choose degrees whose product is 1"):
        build_groups(ParallelDims(x=2, y=2))  # no process group: only 1x1x1x1 is allowed
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(x=0)


@pytest.mark.parametrize(("dims", "needle"), [
    (ParallelDims(y=3), "num_attention_heads=4 is not divisible by parallel.y=3"),
    (ParallelDims(x=3), "hidden_size=128 is not divisible by parallel.x=3"),
])
def test_model_dims_must_divide(dims: ParallelDims, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as e:
        dims.check_model(llama_config("tiny"))
    assert "\n" not in str(e.value) and "choose parallel." in str(e.value)


def test_vocab_must_divide_by_y() -> None:
    with pytest.raises(ValueError, match="vocab_size=4097 is not divisible by parallel.y=2"):
        ParallelDims(y=2).check_model(llama_config("tiny", vocab_size=4097))


def test_nccl_without_enough_gpus_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"needs 4 CUDA devices .* use parallel.dist_backend=gloo"):
        resolve_backend("nccl", dims=ParallelDims(data=4))
    assert resolve_backend("auto", dims=ParallelDims(data=4)) in ("gloo", "nccl")


def test_factorisations_are_all_ordered_4_factorisations() -> None:
    assert len(factorisations(8)) == 20  # C(3+3, 3): three factors of 2 over four axes
    assert len(factorisations(1)) == 1
    assert all(d.world_size == 12 for d in factorisations(12))


def test_planner_zero_payload_on_one_device_and_hand_checked_terms() -> None:
    m = ModelShape.from_preset("tiny")
    assert sum(predict_payload(m, ParallelDims(), batch=4, seq=16).values()) == 0
    # data parallelism only: the gradient all-reduce carries every parameter once (fp32),
    # plus the loss sum and count (2 x fp64)
    from memaudit.models.presets import param_count

    p = predict_payload(m, ParallelDims(data=2), batch=4, seq=16)
    assert p["data"] == param_count("tiny") * 4 + 16
    assert p["x"] == p["y"] == p["z"] == 0
    # z only: each linear (LM head included) is all-gathered twice (half each time) and its
    # gradient reduce-scattered (whole): 2x; the embedding is gathered once: 1.5x; norm
    # gradients all-reduced over z; loss stats
    pz = predict_payload(m, ParallelDims(z=2), batch=4, seq=16)
    norms = (2 * m.layers + 1) * m.hidden
    emb = m.vocab * m.hidden
    lin = param_count("tiny") - norms - 2 * emb
    assert pz["z"] == (2 * lin + 2 * emb + emb // 2 + emb) * 4 + norms * 4 + 16


def test_memory_shrinks_with_sharding() -> None:
    m = ModelShape.from_preset("1b")
    one = predict_memory(m, ParallelDims(), batch=8, seq=512)
    eight = predict_memory(m, ParallelDims(x=2, y=2, z=2), batch=8, seq=512)
    assert eight["weights"] < one["weights"] / 7 and eight["total"] < one["total"]


def test_plan_ranks_fitting_grids_first() -> None:
    rows = plan(ModelShape.from_preset("8b"), gpus=16, batch=32, seq=1024).grids
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits)
    times = [r["comm_time_s"] for r in rows if r["fits"]]
    assert times == sorted(times)
    bad = [r for r in rows if not r["fits"]]
    assert all(r["reason"] for r in bad)


def _admits(d: ParallelDims, preset: str, *, batch: int) -> bool:
    try:
        d.check_model(llama_config(preset))
    except ValueError:
        return False
    return batch % (d.data * d.z) == 0


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["parallel", "plan", "--gpus", "8", "--preset", "tiny", "--batch", "8", "--seq", "64",
               "--format", "json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    # the grids the model itself accepts (brute force over all 20 factorisations of 8)
    admitted = [d for d in factorisations(8) if _admits(d, "tiny", batch=8)]
    assert out["considered"] == len(out["grids"]) == len(admitted)
    first = out["grids"][0]
    assert first["fits"] and set(first["wire_bytes"]) == {"data", "x", "y", "z"}


def test_cli_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["parallel", "plan", "--gpus", "4", "--preset", "tiny", "--batch", "4", "--seq", "32"]) == 0
    assert "tiny on 4 devices" in capsys.readouterr().out


def test_cli_plan_lora_json(capsys: pytest.CaptureFixture[str]) -> None:
    """--lora-rank/--lora-targets: every grid's volume is `predict_payload(lora=...)` (no weight
    gradient reduce-scattered), and only the adapters have gradients and AdamW moments."""
    argv = ["parallel", "plan", "--gpus", "4", "--preset", "tiny", "--batch", "4", "--seq", "16",
            "--lora-rank", "4", "--lora-targets", "q_proj,down_proj", "--format", "json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    lora, m = LoraShape(4, ("q_proj", "down_proj")), ModelShape.from_preset("tiny")
    assert out["lora"] == {"rank": 4, "targets": ["q_proj", "down_proj"]} and out["grids"]
    for r in out["grids"]:
        d = ParallelDims(**r["grid"])
        assert r["payload_bytes"] == predict_payload(m, d, batch=4, seq=16, micro_batches=r["passes"], lora=lora)
        assert "reduce_scatter" not in r["wire_bytes_by_kind"]["z"]
        assert r["memory_bytes"]["grads"] == lora.adapter_elements(m, d) * 4 == r["memory_bytes"]["optimizer"] // 2
    full = plan(m, gpus=4, batch=4, seq=16)
    assert sum(r["memory_bytes"]["total"] for r in out["grids"]) < sum(r["memory_bytes"]["total"] for r in full.grids)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--gpus", "4", "--preset", "9b"], "unknown model preset '9b'"),
    (["--gpus", "4", "--seq", "1"], "--seq 1 must be"),
    (["--gpus", "4", "--mem-gib", "nan"], "--mem-gib nan must be a finite number > 0"),
    (["--gpus", "4", "--mem-gib", "-3"], "--mem-gib -3.0 must be a finite number > 0"),
    (["--gpus", "4", "--intra-bw", "inf"], "--intra-bw inf must be a finite number > 0"),
    (["--gpus", "4", "--inter-bw", "nan"], "--inter-bw nan must be a finite number > 0"),
    (["--gpus", "4", "--gpus-per-node", "0"], "--gpus-per-node 0 must be a positive integer"),
    (["--gpus", "4", "--machine", "summit"], "--machine 'summit' is unknown"),
    (["--gpus", "4", "--micro-batch", "0"], "--micro-batch 0 must be an integer >= 1"),
    (["--gpus", "4", "--bw-table", "/nonexistent.json"], "--bw-table /nonexistent.json: cannot read it"),
    (["--gpus", "4", "--lora-rank", "0"], "--lora-rank 0 must be >= 1"),
    (["--gpus", "4", "--lora-rank", "4", "--lora-targets", "q_proj,lm_head"],
     "LoRA target 'lm_head' is not a linear layer of the model; choose from q_proj"),
])
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert main(["parallel", "plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("argv", "largest"), [
    # 8b: x | hidden 4096, y | gcd(32 heads, 8 KV heads, 14336, 128256) = 8, data x z | batch 16
    (["--gpus", "100000000"], 4096 * 8 * 16),
    (["--gpus", "100000000", "--format", "json"], 4096 * 8 * 16),
    (["--gpus", "7", "--preset", "tiny", "--batch", "4"], 4),  # a prime no grid admits: the next below
])
def test_cli_plan_with_no_admitted_grid_is_refused_with_the_largest_count(
        capsys: pytest.CaptureFixture[str], argv: list[str], largest: int) -> None:
    """Issue 61, item 6: `parallel plan --gpus 100000000` exited 0 with an empty table. No grid of
    the model and batch uses that many devices: exit 2, one line, the largest count below it that
    one does (checked against the planner's own grid search)."""
    from memaudit.parallel.planner import ModelShape, candidate_grids

    assert main(["parallel", "plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--gpus {largest:,}" in err and "no grid" in err
    args = dict(zip(argv[::2], argv[1::2], strict=False))
    m, batch = ModelShape.from_preset(args.get("--preset", "8b")), int(args.get("--batch", 16))
    gpus = int(args["--gpus"])
    assert candidate_grids(m, largest, batch)
    # none just above it (below --gpus) has a grid either
    top = min(gpus, largest + 256)
    assert all(not candidate_grids(m, n, batch) for n in range(largest + 1, top + 1))
