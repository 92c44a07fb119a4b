"""`memaudit parallel plan`: rank 4D grids (data x 3D tensor parallelism) for a model shape on a machine."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.table import Table

from memaudit.commands._common import print_json, stdout

app = typer.Typer(help="Plan the 4D hybrid-parallel grid (AxoNN) for the centralized backend.",
                  no_args_is_help=True)


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _table(path: Path) -> dict[tuple[int, int], float]:
    """A measured bandwidth table: a JSON list of {"stride": int, "size": int, "gbs": float}."""
    try:
        rows = json.loads(path.read_text())
        return {(int(r["stride"]), int(r["size"])): float(r["gbs"]) for r in rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--bw-table {path}: cannot read it ({type(e).__name__}); give a JSON list of "
                         '{"stride": int, "size": int, "gbs": float}') from None


@app.command("plan", help="Enumerate grids for N devices; predict wire volume, time and memory; rank them.")
def plan_cmd(
    gpus: Annotated[int, typer.Option("--gpus", help="Number of devices (processes).")],
    preset: Annotated[str, typer.Option("--preset", help="Model: a memaudit preset (tiny ... 8b), gpt-5b ... "
                                        "gpt-640b (AxoNN's GPT shapes) or llama-8b/70b/405b.")] = "8b",
    batch: Annotated[int, typer.Option("--batch", help="Global batch (sequences per step).")] = 16,
    seq: Annotated[int, typer.Option("--seq", help="Sequence length in tokens.")] = 2048,
    machine: Annotated[str, typer.Option("--machine", help="perlmutter, frontier, alps or generic.")] = "generic",
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node", help="Override the machine's.")] = None,
    intra_bw: Annotated[float | None, typer.Option("--intra-bw", help="Intra-node GB/s per GPU.")] = None,
    inter_bw: Annotated[float | None, typer.Option("--inter-bw", help="Network GB/s per node.")] = None,
    mem_gib: Annotated[float | None, typer.Option("--mem-gib", help="Device memory in GiB.")] = None,
    bw_table: Annotated[Path | None, typer.Option("--bw-table", help="JSON list of measured "
                                                  "{stride, size, gbs}; wins over the formula.")] = None,
    dtype_bytes: Annotated[int, typer.Option("--dtype-bytes", help="Bytes per activation element (4 fp32, 2 bf16).")] = 4,
    weight_bytes: Annotated[int, typer.Option("--weight-bytes", help="Bytes per weight/gradient element in "
                                              "collectives (4: memaudit's fp32 master weights; 2: bf16).")] = 4,
    recompute: Annotated[bool, typer.Option("--recompute/--no-recompute", help="Activation checkpointing.")] = False,
    dp: Annotated[bool, typer.Option("--dp/--no-dp", help="DP-SGD with ghost clipping (two passes).")] = False,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Local rows per pass "
                                                    "(default: the largest that fits).")] = None,
    lora_rank: Annotated[int | None, typer.Option("--lora-rank", help="Train LoRA adapters of this rank on a "
                                                  "frozen base (as model.lora.rank).")] = None,
    lora_targets: Annotated[str, typer.Option("--lora-targets", help="Comma-separated modules the adapters sit on "
                                              "(as model.lora.target_modules), with --lora-rank.")] = "q_proj,v_proj",
    top: Annotated[int, typer.Option("--top", help="Rows to show in the table.")] = 10,
    fmt: Annotated[Literal["table", "json"], typer.Option("--format", help="table or json.")] = "table",
) -> None:
    # lazy: `memaudit --help` does not import torch (~2 s)
    from memaudit.parallel.planner import MACHINES, LoraShape, ModelShape, largest_admitted, plan

    if gpus < 1:
        raise ValueError(f"--gpus {gpus} must be >= 1")
    if batch < 1 or seq < 2:
        raise ValueError(f"--batch {batch} / --seq {seq} must be >= 1 / >= 2")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"--dtype-bytes {dtype_bytes} must be 2 or 4")
    if weight_bytes not in (2, 4):
        raise ValueError(f"--weight-bytes {weight_bytes} must be 2 or 4")
    if machine not in MACHINES:
        raise ValueError(f"--machine {machine!r} is unknown; choose one of {', '.join(MACHINES)}")
    for flag, v in (("--intra-bw", intra_bw), ("--inter-bw", inter_bw), ("--mem-gib", mem_gib)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag} {v} must be a finite number > 0")
    over = {k: v for k, v in (("gpus_per_node", gpus_per_node), ("intra_gbs", intra_bw),
                              ("inter_gbs", inter_bw), ("mem_gib", mem_gib)) if v is not None}
    if bw_table is not None:
        over["table"] = _table(bw_table)
    mach = replace(MACHINES[machine], **over)  # validated again in Machine
    m = ModelShape.from_preset(preset)
    lora = None
    if lora_rank is not None:
        if lora_rank < 1:
            raise ValueError(f"--lora-rank {lora_rank} must be >= 1")
        lora = LoraShape(lora_rank, tuple(t.strip() for t in lora_targets.split(",") if t.strip()))
    res = plan(m, gpus=gpus, batch=batch, seq=seq, machine=mach, dtype_bytes=dtype_bytes, weight_bytes=weight_bytes,
               recompute=recompute, dp=dp, micro_batch=micro_batch, lora=lora)
    if not res.grids and res.below_min_tp:
        raise ValueError(f"--gpus {gpus:,} admits only grids below AxoNN's minimum x*y*z ({m.min_tp}) for "
                         f"{preset}; use --gpus of at least {m.min_tp}")
    if not res.grids:  # an empty table is no plan: say why, and the count that has one
        most = largest_admitted(m, gpus, batch)
        raise ValueError(
            f"--gpus {gpus:,} admits no grid of {preset} at --batch {batch} (x must divide the hidden size "
            f"{m.hidden}, y the heads, KV heads, MLP width and vocabulary ({m.y_divisors_of()}), data x z "
            f"the batch); use --gpus {most:,}, the largest count up to {gpus:,} that one does, or change --batch")
    if fmt == "json":
        md = asdict(mach) | {"table": [{"stride": s, "size": n, "gbs": v} for (s, n), v in mach.table.items()]}
        print_json({"preset": preset, "gpus": gpus, "batch": batch, "seq": seq, "machine": md,
                    "weight_bytes": weight_bytes, "recompute": recompute, "dp": dp,
                    "lora": None if lora is None else {"rank": lora.rank, "targets": list(lora.targets)},
                    "considered": res.considered,
                    "below_memory_floor": res.below_floor, "below_min_tp": res.below_min_tp, "grids": res.grids})
        return

    trains = "" if lora is None else f", LoRA r={lora.rank} on {','.join(lora.targets)}"
    t = Table(title=f"{preset} on {gpus} devices ({mach.name}), batch {batch} x {seq}{trains}")
    for c in ("data", "x", "y", "z", "mb", "x GiB", "y GiB", "z GiB", "data GiB", "mem GiB", "comm s", "step s",
              "fits"):
        t.add_column(c, justify="right")
    for r in res.grids[:top]:
        g, w = r["grid"], r["wire_bytes"]
        cells = [str(g[a]) for a in ("data", "x", "y", "z")] + [str(r["micro_batch"])]
        cells += [_gib(w[a]) for a in ("x", "y", "z", "data")]
        step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3f}"
        cells += [_gib(r["memory_bytes"]["total"]), f"{r['comm_time_s']:.3f}", step, "yes" if r["fits"] else "no: memory"]
        t.add_row(*cells)
    stdout.print(t)
    small = f", {res.below_min_tp} below AxoNN's minimum x*y*z ({m.min_tp})" if res.below_min_tp else ""
    stdout.print(f"{res.considered} grids admitted by the model and batch, {res.below_floor} below the memory "
                 f"floor{small}; wire: bytes each device sends per step, per axis; comm s: all collectives, "
                 "AxoNN-style bandwidth model (the ranking, as AxoNN's; ties: less exposed first); step s: "
                 "computation plus the communication overlap does not hide (docs/planner.md; --format json "
                 "for per-kind volumes, bandwidths and memory terms)")
