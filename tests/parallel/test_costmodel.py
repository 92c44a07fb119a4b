"""The planner's cost model: ring wire factors against a simulated ring, group bandwidths from size
and stride, the bounded grid search against brute force, memory with recomputation and
micro-batches, model shapes against their published sizes, and the paper's headline settings."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from memaudit.models.presets import llama_config
from memaudit.parallel.comm import wire_factor
from memaudit.parallel.dims import ParallelDims
from memaudit.parallel.planner import (
    MACHINES,
    SHAPES,
    LoraShape,
    Machine,
    ModelShape,
    candidate_grids,
    comm_time,
    factorisations,
    plan,
    predict_collectives,
    predict_memory,
    rank_key,
    wire_bytes,
)


# ----------------------------------------------------------------------------- ring oracle
def _ring(kind: str, n: int, numel: int) -> tuple[list[np.ndarray], int]:
    """Simulate the ring algorithm on n ranks; return the results and the elements rank 0 sent."""
    rng = np.random.default_rng(n * 100 + numel)
    if kind == "all_gather":
        shards = [rng.integers(0, 9, numel) for _ in range(n)]
        have = [{i: shards[i]} for i in range(n)]
        sent = 0
        for step in range(n - 1):  # pass the chunk received last step to the right
            for r in range(n):
                c = (r - step) % n
                have[(r + 1) % n][c] = have[r][c]
                sent += len(have[r][c]) if r == 0 else 0
        return [np.concatenate([have[r][c] for c in range(n)]) for r in range(n)], sent
    data = [rng.integers(0, 9, numel) for _ in range(n)]
    chunks = [np.array_split(d.copy(), n) for d in data]
    sent = 0
    for step in range(n - 1):  # reduce-scatter: chunk (r - step - 1) accumulates around the ring
        msgs = [(r, (r - step) % n, chunks[r][(r - step) % n].copy()) for r in range(n)]
        for r, c, m in msgs:
            chunks[(r + 1) % n][c] += m
            sent += len(m) if r == 0 else 0
    if kind == "reduce_scatter":
        return [chunks[r][(r + 1) % n] for r in range(n)], sent
    for step in range(n - 1):  # all-gather of the reduced chunks
        msgs = [(r, (r + 1 - step) % n, chunks[r][(r + 1 - step) % n].copy()) for r in range(n)]
        for r, c, m in msgs:
            chunks[(r + 1) % n][c] = m
            sent += len(m) if r == 0 else 0
    total = sum(data)
    for r in range(n):
        np.testing.assert_array_equal(np.concatenate(chunks[r]), total)
    return [np.concatenate(chunks[r]) for r in range(n)], sent


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_wire_factor_is_what_a_ring_sends(kind: str, n: int) -> None:
    numel = 12 * n  # payload: the shard (all-gather) or the full tensor (the others)
    _, sent = _ring(kind, n, numel)
    assert wire_factor(kind, n) * numel == sent
    assert wire_factor(kind, 1) == 0


# ----------------------------------------------------------------------------- bandwidth
def test_group_bandwidth_from_size_and_stride() -> None:
    p = MACHINES["perlmutter"]  # 4 GPUs per node, 100 GB/s intra, 100 GB/s per node network
    assert p.bandwidth(1, 4) == 100.0  # x=4: one node
    assert p.bandwidth(2, 2) == 100.0  # y=2 inside x=2: still one node
    assert p.bandwidth(4, 8) == 25.0  # stride 4: one GPU of the group per node, 1/4 of the NIC
    assert p.bandwidth(2, 4) == 50.0  # two of the group's GPUs on each node
    assert p.bandwidth(1, 8) == 100.0  # all four GPUs of a node in the group
    assert p.bandwidth(1, 3) == 100 * 3 / 4  # 3 does not tile a 4-GPU node: groups straddle nodes
    t = Machine("m", 4, 100.0, 100.0, 40.0, table={(4, 8): 7.5})
    assert t.bandwidth(4, 8) == 7.5 and t.bandwidth(1, 4) == 100.0  # measured entry wins


def test_comm_time_is_wire_over_bandwidth_per_axis() -> None:
    m, d = ModelShape.from_preset("tiny"), ParallelDims(data=4, x=2)
    mach = Machine("m", 4, 100.0, 40.0, 80.0)
    wire = wire_bytes(predict_collectives(m, d, batch=8, seq=16), d)
    t = comm_time(wire, d, mach)
    x_wire = sum(float(b) for (a, _), b in wire.items() if a == "x")
    d_wire = sum(float(b) for (a, _), b in wire.items() if a == "data")
    assert t["x"] == pytest.approx(x_wire / 100e9, rel=1e-12)
    assert t["data"] == pytest.approx(d_wire / (40e9 * 2 / 4), rel=1e-12)  # stride 2: 2 of 4 GPUs per node
    assert t["y"] == t["z"] == 0.0


@pytest.mark.parametrize(("kw", "needle"), [
    ({"mem_gib": math.nan}, "--mem-gib nan must be a finite number > 0"),
    ({"mem_gib": -1.0}, "--mem-gib -1.0 must be"),
    ({"intra_gbs": math.inf}, "--intra-bw inf must be"),
    ({"inter_gbs": 0.0}, "--inter-bw 0.0 must be"),
    ({"gpus_per_node": 0}, "--gpus-per-node 0 must be a positive integer"),
    ({"table": {(1, 2): math.nan}}, "bandwidth table entry (stride=1, size=2) = nan"),
])
def test_bad_machine_is_one_line(kw: dict, needle: str) -> None:
    args = {"name": "m", "gpus_per_node": 4, "intra_gbs": 100.0, "inter_gbs": 25.0, "mem_gib": 40.0} | kw
    with pytest.raises(ValueError) as e:
        Machine(**args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_refuses_zero_gpus_and_absurd_batches() -> None:
    with pytest.raises(ValueError, match="--gpus 0 must be an integer >= 1"):
        plan(ModelShape.from_preset("tiny"), gpus=0, batch=4, seq=16)
    with pytest.raises(ValueError, match=r"--batch 1099511627776 must be <= 1073741824 sequences"):
        plan(ModelShape.from_preset("tiny"), gpus=8, batch=2**40, seq=16)


def test_any_gpu_count_is_answered() -> None:
    for gpus in (10**18, 2**61 - 1, 6 * 10**12):  # huge, prime, highly composite
        res = plan(SHAPES["llama-70b"], gpus=gpus, batch=2**20, seq=4096, machine=MACHINES["frontier"])
        assert all(ParallelDims(**r["grid"]).world_size == gpus for r in res.grids)


# ----------------------------------------------------------------------------- search
@pytest.mark.parametrize(("preset", "gpus", "batch"), [("tiny", 24, 24), ("tiny", 36, 12), ("1b", 30, 60),
                                                      ("1b", 64, 16)])
def test_bounded_search_equals_brute_force(preset: str, gpus: int, batch: int) -> None:
    def admits(d: ParallelDims) -> bool:
        try:
            d.check_model(llama_config(preset))
        except ValueError:
            return False
        return batch % (d.data * d.z) == 0

    brute = {d for d in factorisations(gpus) if admits(d)}
    assert set(candidate_grids(ModelShape.from_preset(preset), gpus, batch)) == brute


def test_grids_are_not_only_powers_of_two() -> None:
    grids = candidate_grids(SHAPES["gpt-320b"], 6144, 6144)  # Alps: 3 x 2^11
    assert all(d.world_size == 6144 for d in grids)
    assert any(d.z % 3 == 0 for d in grids) and any(d.data % 3 == 0 for d in grids)


def test_a_hundred_million_gpus_is_answered() -> None:
    res = plan(SHAPES["llama-8b"], gpus=100_000_000, batch=100_000_000, seq=2048, machine=MACHINES["alps"])
    assert res.considered > 0 and res.grids[0]["fits"]
    assert all(ParallelDims(**r["grid"]).world_size == 100_000_000 for r in res.grids)
    none = plan(SHAPES["llama-8b"], gpus=100_000_000, batch=16, seq=2048)  # data*z cannot divide 16
    assert none.grids == [] and none.considered == 0


# ----------------------------------------------------------------------------- shapes and memory
@pytest.mark.parametrize(("name", "billions"), [
    ("gpt-5b", 5), ("gpt-10b", 10), ("gpt-20b", 20), ("gpt-40b", 40), ("gpt-60b", 60), ("gpt-80b", 80),
    ("gpt-160b", 160), ("gpt-320b", 320), ("gpt-640b", 640), ("llama-8b", 8.03), ("llama-70b", 70.6),
    ("llama-405b", 405.9),
])
def test_shapes_have_their_nominal_size(name: str, billions: float) -> None:
    assert SHAPES[name].params() == pytest.approx(billions * 1e9, rel=0.08)


def test_llama_8b_shape_is_the_8b_preset() -> None:
    from memaudit.models.presets import param_count

    assert SHAPES["llama-8b"] == ModelShape.from_preset("8b")
    assert ModelShape.from_preset("8b").params() == param_count("8b")


def test_gpt_shape_has_a_gelu_mlp_and_multi_head_attention() -> None:
    m = SHAPES["gpt-80b"]
    assert m.linears() == [(12288, 12288, False)] * 3 + [(12288, 12288, True), (49152, 12288, False),
                                                         (12288, 49152, True)]
    assert m.kv_heads == m.heads == 96


def test_memory_with_recomputation_and_micro_batches() -> None:
    m, d = SHAPES["gpt-20b"], ParallelDims(x=2, y=4, z=8)
    kw = {"batch": 64, "seq": 2048, "dtype_bytes": 2}
    full = predict_memory(m, d, **kw)
    ckpt = predict_memory(m, d, recompute=True, **kw)
    small = predict_memory(m, d, recompute=True, micro_batch=1, **kw)
    assert small["activations"] < ckpt["activations"] < full["activations"]
    assert full["weights"] == ckpt["weights"] == small["weights"]
    rows = 64 // 8  # local rows; checkpointing keeps one (rows, seq, hidden/x) input per layer
    h_x = m.hidden // 2
    assert ckpt["activations"] - predict_memory(m, d, recompute=True, micro_batch=rows, **kw)["activations"] == 0
    layer_inputs = m.layers * rows * 2048 * h_x * 2
    assert ckpt["activations"] > layer_inputs


def test_auto_micro_batch_is_the_largest_that_fits() -> None:
    mach = MACHINES["perlmutter"]
    res = plan(SHAPES["gpt-20b"], gpus=64, batch=512, seq=2048, machine=mach, dtype_bytes=2, recompute=True)
    for r in res.grids[:20]:
        d = ParallelDims(**r["grid"])
        rows = 512 // (d.data * d.z)
        kw = {"batch": 512, "seq": 2048, "dtype_bytes": 2, "recompute": True, "flash": True}
        if r["fits"]:
            assert predict_memory(m := SHAPES["gpt-20b"], d, micro_batch=r["micro_batch"], **kw)["total"] <= \
                mach.mem_gib * 2**30
            bigger = [c for c in range(r["micro_batch"] + 1, rows + 1) if rows % c == 0]
            if bigger:
                assert predict_memory(m, d, micro_batch=bigger[0], **kw)["total"] > mach.mem_gib * 2**30


# ----------------------------------------------------------------------------- volume relations
def test_recomputation_replays_exactly_the_forward_collectives() -> None:
    m, d = ModelShape.from_preset("tiny"), ParallelDims(x=2, z=2)
    base = predict_collectives(m, d, batch=8, seq=16)
    rc = predict_collectives(m, d, batch=8, seq=16, recompute=True)
    per_layer_shards = sum(math.ceil((o // (d.x if t else 1)) * (i // (1 if t else d.x)) / 2)
                           for o, i, t in m.linears())
    assert rc[("z", "all_gather")] - base[("z", "all_gather")] == m.layers * per_layer_shards * 4
    tokens = 8 // 2 * 16
    out_x = sum(o for o, _, t in m.linears() if not t)  # normal layers all-reduce their outputs over x
    norms = m.layers * 2 * tokens * 4
    assert rc[("x", "all_reduce")] - base[("x", "all_reduce")] == m.layers * tokens * out_x * 4 + norms
    assert rc[("z", "reduce_scatter")] == base[("z", "reduce_scatter")]


def test_dp_counts_two_passes_and_the_norm_all_reduces() -> None:
    m, d = ModelShape.from_preset("tiny"), ParallelDims(x=2, y=2)
    base = predict_collectives(m, d, batch=8, seq=16)
    dp = predict_collectives(m, d, batch=8, seq=16, dp=True)
    sync = predict_collectives(m, d, batch=8, seq=16, dp=True, micro_batches=1)
    assert dp == sync
    assert dp[("y", "all_reduce")] == 2 * base[("y", "all_reduce")] + 8 * 8  # + per-example norms (fp64)
    assert dp[("x", "all_reduce")] == 2 * base[("x", "all_reduce")] + 8 * 8
    assert wire_bytes(dp, d)[("x", "all_reduce")] == Fraction(dp[("x", "all_reduce")])  # 2(n-1)/n = 1 at n=2
    # per-user clipping (ULS): one norm per user; 7 rows of users of 2 pad to 8 (one empty user)
    users = predict_collectives(m, d, batch=7, seq=16, dp=True, user_group=2)
    assert users[("x", "all_reduce")] == 2 * base[("x", "all_reduce")] + 4 * 8
    with pytest.raises(ValueError, match="user_group"):
        predict_collectives(m, d, batch=8, seq=16, user_group=2)  # per-user groups need DP-SGD


# ----------------------------------------------------------------------------- LoRA
_SMALL = ModelShape(vocab=64, hidden=16, intermediate=32, layers=2, heads=4, kv_heads=2)  # q 16, k/v 8


def test_lora_syncs_only_the_adapters_and_reduce_scatters_nothing() -> None:
    d = ParallelDims(data=2, x=2, y=2, z=2)
    lora = LoraShape(rank=4, targets=("q_proj", "down_proj"))
    full = predict_collectives(_SMALL, d, batch=8, seq=4)
    p = predict_collectives(_SMALL, d, batch=8, seq=4, lora=lora)
    assert full[("z", "reduce_scatter")] > 0 and ("z", "reduce_scatter") not in p
    # q (normal, 16 -> 16): A_l 4 x 16/x, B_l 16/y x 4; down (transposed, 32 -> 16): A_l 4 x 32/y, B_l 16/x x 4
    adapters = _SMALL.layers * (4 * 8 + 8 * 4 + 4 * 16 + 8 * 4)
    assert lora.adapter_elements(_SMALL, d) == adapters
    loss_stats = 16  # the loss sum and target count (fp64) over z and over data
    assert p[("data", "all_reduce")] == p[("z", "all_reduce")] == adapters * 4 + loss_stats
    # the adapters are replicated over z: never in the backward's data buckets
    assert predict_collectives(_SMALL, d, batch=8, seq=4, lora=lora, data_in_backward=True, micro_batches=2) == \
        predict_collectives(_SMALL, d, batch=8, seq=4, lora=lora, micro_batches=2)


def test_lora_first_layer_skips_the_frozen_backward_before_its_adapter() -> None:
    """x = 2 alone, an adapter on down_proj only: layer 0 all-reduces over x its normal layers'
    outputs, the two norms' forward statistics and the adapter's gradient (down's out axis is
    x), while layer 1 adds o's and down's input gradients and the norms' backward statistics."""
    d, r = ParallelDims(x=2), 4
    p = predict_collectives(_SMALL, d, batch=8, seq=4, lora=LoraShape(r, ("down_proj",)))
    n, n1 = 8 * 4, 8 * 3  # tokens through the stack and through the LM head
    outputs = (16 + 8 + 8 + 32 + 32) * n * 4  # q, k, v, gate, up: partial outputs over x (fp32)
    layer0 = outputs + 2 * n * 4 + n * r * 4
    layer1 = outputs + (16 + 32) * n * 4 + 4 * n * 4 + n * r * 4
    head = 2 * n * 4 + n1 * 64 * 4  # final norm forward and backward; LM head outputs
    assert p == {("x", "all_reduce"): layer0 + layer1 + head}


def test_lora_targets_are_checked() -> None:
    with pytest.raises(ValueError, match="LoRA target 'lm_head' is not a linear layer of the model; choose from q_proj"):
        predict_collectives(_SMALL, ParallelDims(x=2), batch=8, seq=4, lora=LoraShape(4, ("q_proj", "lm_head")))
    gelu = ModelShape(64, 16, 64, 2, 4, 4, "gelu", "layer")
    with pytest.raises(ValueError, match="'gate_proj' is not a linear layer"):
        predict_collectives(gelu, ParallelDims(x=2), batch=8, seq=4, lora=LoraShape(4, ("gate_proj",)))
    assert predict_collectives(gelu, ParallelDims(x=2), batch=8, seq=4, lora=LoraShape(4, ("fc_out",)))
    for rank, targets in ((0, ("q_proj",)), (4, ())):
        with pytest.raises(ValueError, match="LoRA"):
            LoraShape(rank, targets)


# ----------------------------------------------------------------------------- the paper's settings
@pytest.mark.parametrize(("machine", "gpus", "shape", "batch"), [
    ("perlmutter", 1024, "gpt-80b", 2048), ("frontier", 8192, "gpt-320b", 8192), ("alps", 6144, "gpt-320b", 6144),
    ("frontier", 8192, "gpt-640b", 8192),
])
def test_paper_headline_settings_fit_and_are_ranked(machine: str, gpus: int, shape: str, batch: int) -> None:
    res = plan(SHAPES[shape], gpus=gpus, batch=batch, seq=2048, machine=MACHINES[machine], dtype_bytes=2,
               recompute=True)
    fitting = [r for r in res.grids if r["fits"]]
    assert fitting and res.grids[0]["fits"]
    times = [rank_key(r) for r in fitting]  # AxoNN's key: all collectives, then exposed
    assert times == sorted(times) and times[0][1] > 0
    assert all(r["memory_bytes"]["total"] <= MACHINES[machine].mem_gib * 2**30 for r in fitting)


def test_grids_below_the_memory_floor_cannot_fit() -> None:
    m, mach = replace(SHAPES["gpt-20b"], min_tp=1), MACHINES["perlmutter"]  # the memory floor alone
    res = plan(m, gpus=64, batch=64, seq=2048, machine=mach, dtype_bytes=2, recompute=True)
    evaluated = {ParallelDims(**r["grid"]) for r in res.grids}
    skipped = [d for d in candidate_grids(m, 64, 64) if d not in evaluated]
    assert len(skipped) == res.below_floor > 0
    for d in skipped:  # weights, gradients and AdamW moments alone exceed the device
        mem = predict_memory(m, d, batch=64, seq=2048, dtype_bytes=2, recompute=True, micro_batch=1, flash=True)
        assert mem["weights"] + mem["grads"] + mem["optimizer"] > mach.mem_gib * 2**30


def test_grids_below_axonns_minimum_tensor_parallel_size_are_counted_not_planned() -> None:
    m = SHAPES["gpt-20b"]  # AxoNN runs it on x*y*z >= 16
    res = plan(m, gpus=64, batch=64, seq=2048, machine=MACHINES["perlmutter"], dtype_bytes=2, recompute=True)
    free = plan(replace(m, min_tp=1), gpus=64, batch=64, seq=2048, machine=MACHINES["perlmutter"], dtype_bytes=2,
                recompute=True)
    assert m.min_tp == 16 and all(ParallelDims(**r["grid"]).tp_size >= 16 for r in res.grids)
    assert res.below_min_tp == len(free.grids) - len(res.grids) > 0
    assert res.considered == free.considered and res.below_floor == free.below_floor
    assert ModelShape.from_preset("8b").min_tp == 1  # memaudit's presets: memory alone decides


def test_cli_takes_a_measured_bandwidth_table(tmp_path, capsys) -> None:
    import json

    from memaudit.cli import main

    table = tmp_path / "bw.json"
    table.write_text(json.dumps([{"stride": 1, "size": 2, "gbs": 3.5}]))
    argv = ["parallel", "plan", "--gpus", "2", "--preset", "tiny", "--batch", "4", "--seq", "16",
            "--machine", "perlmutter", "--bw-table", str(table), "--format", "json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["table"] == [{"stride": 1, "size": 2, "gbs": 3.5}]
    x_grid = next(r for r in out["grids"] if r["grid"]["x"] == 2)
    assert x_grid["bandwidth_gbs"] == {"x": 3.5}
    assert x_grid["comm_time_by_axis_s"]["x"] == pytest.approx(x_grid["wire_bytes"]["x"] / 3.5e9)


def test_cli_plans_axonns_shapes_on_axonns_minimum_and_measured_bandwidths(capsys) -> None:
    import json

    from memaudit.cli import main

    argv = ["parallel", "plan", "--gpus", "64", "--preset", "gpt-20b", "--batch", "64", "--seq", "2048",
            "--machine", "perlmutter-measured", "--dtype-bytes", "2", "--recompute"]
    assert main([*argv, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["below_min_tp"] > 0 and out["machine"]["inter_gbs"] == 80.0
    assert all(g["grid"]["x"] * g["grid"]["y"] * g["grid"]["z"] >= 16 for g in out["grids"])
    assert main(argv) == 0
    assert "below AxoNN's minimum x*y*z (16)" in " ".join(capsys.readouterr().out.split())
