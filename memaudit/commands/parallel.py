"""`memaudit parallel plan`: rank 4D grids (data x 3D tensor parallelism) for a model preset."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

app = typer.Typer(help="Plan the 4D hybrid-parallel grid (AxoNN) for the centralized backend.",
                  no_args_is_help=True)


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f}"


@app.command("plan", help="Enumerate grids for N devices; predict payload bytes and memory; rank them.")
def plan_cmd(
    gpus: Annotated[int, typer.Option("--gpus", help="Number of devices (processes).")],
    preset: Annotated[str, typer.Option("--preset", help="Model preset (tiny, small, 125m, 350m, 1b, 8b).")] = "8b",
    batch: Annotated[int, typer.Option("--batch", help="Global batch (sequences per step).")] = 16,
    seq: Annotated[int, typer.Option("--seq", help="Sequence length in tokens.")] = 2048,
    mem_gib: Annotated[float, typer.Option("--mem-gib", help="Device memory in GiB.")] = 80.0,
    dtype_bytes: Annotated[int, typer.Option("--dtype-bytes", help="Bytes per activation/weight element in collectives (4 fp32, 2 bf16).")] = 4,
    top: Annotated[int, typer.Option("--top", help="Rows to show in the table.")] = 10,
    fmt: Annotated[Literal["table", "json"], typer.Option("--format", help="table or json.")] = "table",
) -> None:
    from memaudit.commands._common import print_json, stdout
    from memaudit.parallel.planner import ModelShape, plan

    if gpus < 1:
        raise ValueError(f"--gpus {gpus} must be >= 1")
    if batch < 1 or seq < 2:
        raise ValueError(f"--batch {batch} / --seq {seq} must be >= 1 / >= 2")
    if dtype_bytes not in (2, 4):
        raise ValueError(f"--dtype-bytes {dtype_bytes} must be 2 or 4")
    rows = plan(ModelShape.from_preset(preset), gpus=gpus, batch=batch, seq=seq, mem_gib=mem_gib,
                dtype_bytes=dtype_bytes)
    if fmt == "json":
        print_json({"preset": preset, "gpus": gpus, "batch": batch, "seq": seq, "mem_gib": mem_gib, "grids": rows})
        return
    from rich.table import Table

    t = Table(title=f"{preset} on {gpus} devices, batch {batch} x {seq}")
    for c in ("data", "x", "y", "z", "x GiB", "y GiB", "z GiB", "data GiB", "mem GiB", "comm s", "fits"):
        t.add_column(c, justify="right")
    for r in rows[:top]:
        g = r["grid"]
        p = r.get("payload_bytes")
        cells = [str(g[a]) for a in ("data", "x", "y", "z")]
        if p is None:
            cells += ["-"] * 6
        else:
            cells += [_gib(p[a]) for a in ("x", "y", "z", "data")]
            cells += [_gib(r["memory_bytes"]["total"]), f"{r['comm_time_s']:.3f}"]
        cells.append("yes" if r["fits"] else ("no: memory" if "memory" in r["reason"] else "no: shape"))
        t.add_row(*cells)
    stdout.print(t)
    stdout.print("payload: bytes each device passes to collectives per step, per axis; "
                 "comm s: bandwidth-only estimate (see --format json for reasons and memory terms)")
