"""The planner ranks grids as AxoNN does and predicts what AxoNN reports.

AxoNN's planner (Megatron-AxoNN `examples/comm_model.py`, commit 8a4ae24 of the
`gordon-bell-perlmutter` branch, 2024-03-23; launched by `examples/launch_per_comm_model.py`,
6920ac0) ranks the configurations of a GPT model by the time of all of their collectives, overlapped
ones included, with bandwidths from a table it measured, among configurations whose tensor-parallel
size is at least the model's minimum; it then times the top 20 with overlap on. The oracle below is
that rule, written here from those formulas and inputs over memaudit's collectives. docs/planner.md
argues the rule and gives the case table.

References: Singh et al., "A 4D Hybrid Algorithm to Scale Parallel Training to Thousands of
GPUs" (arXiv:2305.13525); "Democratizing AI: Open-source Scalable LLM Training on GPU-based
Supercomputers" (AxoNN, SC'24, arXiv:2502.08145)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from memaudit.parallel.planner import MACHINES, SHAPES, Machine, ModelShape, plan
from memaudit.parallel.scaling import (
    AXONN_FRONTIER_EFFICIENCY,
    FRONTIER_WEAK_SERIES,
    frontier_weak_scaling,
)

SEQ = 2048
# (machine, GPUs, model, batch): the paper-scale settings (tests/parallel/test_costmodel.py), issue 34's
# 80B on 1,024 Perlmutter GPUs at batch 1,024, and the nominal-bandwidth Frontier headline; the
# Perlmutter and Frontier cases with the bandwidths AxoNN measured
PAPER_CASES = [
    ("perlmutter-measured", 1024, "gpt-80b", 2048), ("perlmutter-measured", 1024, "gpt-80b", 1024),
    ("frontier-measured", 8192, "gpt-320b", 8192), ("frontier-measured", 8192, "gpt-640b", 8192),
    ("frontier-measured", 512, "gpt-20b", 512), ("alps", 6144, "gpt-320b", 6144),
    ("frontier", 8192, "gpt-320b", 8192),
]
# the smallest tensor-parallel size AxoNN runs each GPT model on (launch_per_comm_model.py, `min_tp`)
AXONN_MIN_TP = {"gpt-5b": 4, "gpt-10b": 8, "gpt-20b": 16, "gpt-40b": 32, "gpt-60b": 64, "gpt-80b": 64,
                "gpt-160b": 128, "gpt-320b": 256, "gpt-640b": 512}


@functools.cache
def _plan(machine: str, gpus: int, shape: str, batch: int):
    return plan(SHAPES[shape], gpus=gpus, batch=batch, seq=SEQ, machine=MACHINES[machine], dtype_bytes=2,
                recompute=True)


# ----------------------------------------------------------------------------- independent model
def _ring(kind: str, n: int, nbytes: float, gbs: float) -> float:
    """Seconds of a ring collective of `nbytes` (the full buffer) over `n` ranks (Thakur et al.)."""
    if n == 1:
        return 0.0
    return (2 if kind == "ar" else 1) * (n - 1) / n * nbytes / (gbs * 1e9)


def _group_gbs(mach: Machine, stride: int, n: int) -> float:
    """A group inside a node runs at the intra-node rate; across nodes each GPU gets its node's
    injection bandwidth shared by the node's GPUs, times its group members on the node."""
    g = mach.gpus_per_node
    if stride * n <= g:
        return mach.intra_gbs
    return min(mach.intra_gbs, mach.inter_gbs * min(n, max(1, g // stride)) / g)


def _axonn_gbs(machine: str, ip: int, n: int) -> float:
    """AxoNN's measured GB/s of a group of `n` whose members are `ip` ranks apart (`get_bw`)."""
    if machine == "perlmutter-measured":
        if ip == 1:
            return {2: 76, 4: 225}.get(n, 80)
        return (76 if n == 2 else 40) if ip == 2 else 20
    assert machine == "frontier-measured"
    if ip == 1:
        return {2: 129, 4: 52, 8: 135}.get(n, 40)
    if ip == 2:
        return {2: 50, 4: 72}.get(n, 20)
    return (36 if n == 2 else 10) if ip == 4 else 5


def _bandwidths(machine: str, grid: dict) -> dict[str, float]:
    x, y, z, d = grid["x"], grid["y"], grid["z"], grid["data"]
    groups = {"x": (1, x), "y": (x, y), "z": (x * y, z), "data": (x * y * z, d)}
    if machine.endswith("-measured"):
        return {a: _axonn_gbs(machine, s, n) for a, (s, n) in groups.items()}
    return {a: _group_gbs(MACHINES[machine], s, n) for a, (s, n) in groups.items()}


def _collectives(m: ModelShape, grid: dict, passes: int, bw: dict[str, float], batch: int) -> tuple[float, float]:
    """(blocking, overlapped) seconds of one step from the papers' per-collective formulas: per
    linear layer (o x i) z all-gathers of its weight block (forward, recomputation, backward), its z
    reduce-scatter, an all-reduce of partial outputs over the input-split axis and of input
    gradients over the output-split axis; the embedding's; the data all-reduce of the gradient
    shard. Overlapped (AxoNN's non-blocking collectives): z and data; blocking: x and y."""
    d, x, y, z = grid["data"], grid["x"], grid["y"], grid["z"]
    size = {"x": x, "y": y, "z": z, "data": d}
    tokens = batch * SEQ / (d * z)  # per rank and step (all passes)
    act, wb = 2, 4  # bf16 activations, fp32 weights and gradients
    hidden = blocking = 0.0
    layers = [(o, i, t, m.layers) for o, i, t in m.linears()] + [(m.vocab, m.hidden, False, 1)]
    for o, i, transposed, count in layers:
        in_ax, out_ax = ("y", "x") if transposed else ("x", "y")
        block = o * i / (x * y) * wb
        replay = 2 if count == m.layers else 1  # recomputed decoder layers gather and reduce twice
        hidden += count * passes * (replay + 1) * _ring("ag", z, block, bw["z"])
        hidden += count * passes * _ring("rs", z, block, bw["z"])
        blocking += count * replay * _ring("ar", size[in_ax], tokens * o / size[out_ax] * act, bw[in_ax])
        blocking += count * _ring("ar", size[out_ax], tokens * i / size[in_ax] * act, bw[out_ax])
    emb = m.vocab * m.hidden / (x * y) * wb
    hidden += passes * (_ring("ag", z, emb, bw["z"]) + _ring("rs", z, emb, bw["z"]))
    blocking += _ring("ar", y, tokens * m.hidden / x * act, bw["y"])
    hidden += _ring("ar", d, m.params() / (x * y * z) * wb, bw["data"])
    return blocking, hidden


def _axonn_best(machine: str, gpus: int, shape: str, batch: int) -> tuple[dict, float]:
    """AxoNN's first: the fitting grid of least total communication with x*y*z >= its min_tp."""
    rows = [r for r in _plan(machine, gpus, shape, batch).grids
            if r["fits"] and r["grid"]["x"] * r["grid"]["y"] * r["grid"]["z"] >= AXONN_MIN_TP[shape]]
    times = [sum(_collectives(SHAPES[shape], r["grid"], r["passes"], _bandwidths(machine, r["grid"]), batch))
             for r in rows]
    best = min(range(len(rows)), key=times.__getitem__)
    return rows[best]["grid"], times[best]


@pytest.mark.parametrize(("machine", "gpus", "shape", "batch"), PAPER_CASES)
def test_top_grid_is_axonns_best(machine, gpus, shape, batch):
    res = _plan(machine, gpus, shape, batch)
    best, _ = _axonn_best(machine, gpus, shape, batch)
    top = res.grids[0]
    assert top["fits"] and top["grid"] == best, (top["grid"], best)
    assert top["grid"]["x"] * top["grid"]["y"] * top["grid"]["z"] >= AXONN_MIN_TP[shape]


@pytest.mark.parametrize("machine", ["perlmutter-measured", "frontier-measured"])
def test_measured_machines_are_axonns_table(machine):
    """Every power-of-two group up to 2^14 GPUs has the bandwidth AxoNN's planner gives it."""
    mach = MACHINES[machine]
    for s in (2**i for i in range(15)):
        for n in (2**i for i in range(1, 15 - s.bit_length() + 1)):
            assert mach.bandwidth(s, n) == _axonn_gbs(machine, s, n), (s, n)
    assert "comm_model.py" in mach.source


# ----------------------------------------------------------------------------- weak scaling
def test_frontier_weak_scaling_runs_every_point_on_a_grid_axonn_runs():
    """Each point's top grid has x*y*z >= AxoNN's min_tp: the first point (the denominator of every
    efficiency) is 20B on 512 GCDs on a grid AxoNN would run, not a smaller one."""
    rows = frontier_weak_scaling(MACHINES["frontier-measured"])
    assert [r["gpus"] for r in rows] == [512, 1024, 2048, 4096, 8192]
    assert rows[0]["efficiency"] == 1.0
    for r, (shape, _, _) in zip(rows, FRONTIER_WEAK_SERIES, strict=True):
        g = r["grid"]
        assert g["x"] * g["y"] * g["z"] >= AXONN_MIN_TP[shape], (shape, g)
        # each point's time is computation plus the communication left exposed
        assert r["step_time_s"] == pytest.approx(r["compute_time_s"] + r["exposed_comm_s"])


def test_frontier_weak_scaling_endpoint_is_set_by_unsourced_inputs():
    """AxoNN reports one point of this curve (88.3% at 8,192 GCDs against 512). The prediction of it
    moves by more than 10 points between the nominal network and the one AxoNN measured, with the
    GEMM rate (assumed) and the batch per GCD (memaudit's choice) fixed, so no 5-point match is
    claimed: only that AxoNN's figure lies inside that band (docs/planner.md, "Weak scaling")."""
    ends = [frontier_weak_scaling(MACHINES[m])[-1]["efficiency"] for m in ("frontier", "frontier-measured")]
    assert min(ends) <= AXONN_FRONTIER_EFFICIENCY <= max(ends), ends
    assert max(ends) - min(ends) > 0.10, ends


def test_measured_bandwidth_sits_beside_the_nominal_one():
    nominal, measured = MACHINES["frontier"], MACHINES["frontier-measured"]
    assert measured.inter_gbs == pytest.approx(nominal.inter_gbs / 2.5, rel=0.01)
    assert measured.source and nominal.source
    assert (nominal.intra_gbs, nominal.peak_tflops) == (measured.intra_gbs, measured.peak_tflops)


def test_overlap_hides_only_what_computation_covers():
    row = _plan("frontier-measured", 512, "gpt-20b", 512).grids[0]
    comm = row["comm_time_s"]
    assert row["exposed_comm_s"] <= comm
    assert row["step_time_s"] >= max(row["compute_time_s"], comm - row["overlapped_comm_s"])
    fast = replace(MACHINES["frontier-measured"], peak_tflops=1e9)  # no computation to hide behind
    r = plan(SHAPES["gpt-20b"], gpus=512, batch=512, seq=SEQ, machine=fast, dtype_bytes=2,
             recompute=True, micro_batch=row["micro_batch"])
    same = next(g for g in r.grids if g["grid"] == row["grid"])
    assert same["exposed_comm_s"] == pytest.approx(same["comm_time_s"], rel=1e-6)
