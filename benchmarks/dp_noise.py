"""DP-SGD's noise per rank and step: each rank's own tiles against the whole logical tensors.

For each preset the model is laid out on one process (`parallelize_llama`, which gives every
trained parameter's `ShardSpec`) and, for each grid (x, y, z) and a few of its ranks, one
step's noise of that rank is drawn two ways, side by side, on one thread:

  whole   each parameter's whole logical tensor drawn from its generator, then cut to the
          rank's shard (`ShardSpec.local`): what every rank did before the tiles
  tiles   the tiles that hold the rank's elements (`memaudit.train.noise.noise_block` through
          `ShardSpec.local_of`): what `memaudit.parallel.dp.add_noise_` does now

and, for one process, the whole model's noise: ``torch.normal`` of each parameter against its
tiles (`memaudit.train.noise.full_noise`). Prints one JSON object: per preset and grid, the
median seconds over --repeats, the normals drawn, and the ratio whole / tiles.

    python benchmarks/dp_noise.py --presets small 125m 350m --repeats 5

Measured 2026-12-06 with that command (2 CPU cores, one thread, torch 2.13.0), one rank's
noise of a step, whole against tiles: 350m (349M parameters) on x=y=z=2 1.83 s against
0.19 s (9.6x), x=4 y=2 1.79 s against 0.18 s (9.9x), x=y=2 z=4 1.81 s against 0.14 s
(13.1x); 125m 7.8x, 8.2x and 11.8x; small 5.8x, 5.2x and 6.9x. A rank drew 0.1251 of the
normals on the 8-rank grids (its own share 0.125) and 0.0626 on the 16-rank one (0.0625).
One process, the whole model's noise: tiles 1.07x (small), 1.11x (125m) and 1.02x (350m)
faster than one draw per tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics

import torch
from timing import median_seconds  # benchmarks/timing.py, beside this script

from memaudit.models.presets import build_model
from memaudit.parallel.dims import ParallelDims
from memaudit.parallel.layers import RankOnGrid
from memaudit.parallel.parallelize import parallelize_llama
from memaudit.privacy.randomness import DPRandomness
from memaudit.train.noise import full_noise, noise_block, parameter_key

STD = 0.5


def _whole(specs, rand, at) -> int:
    n = 0
    for i, spec in enumerate(specs):
        full = torch.randn(spec.full_shape, generator=rand.torch_generator("dpsgd-noise", 0, i)) * STD
        n += full.numel()
        spec.local(full, at)
    return n


def _tiles(specs, rand, at) -> int:
    drawn = [0]
    for i, spec in enumerate(specs):
        key = parameter_key(rand, 0, i)

        def block(rows, cols, s=spec, k=key):
            out = noise_block(k, s.full_shape, rows, cols, STD)
            drawn[0] += out.numel()
            return out

        spec.local_of(block, at)
    return drawn[0]


def run(preset: str, grids: list[tuple[int, int, int]], repeats: int) -> dict:
    model = parallelize_llama(build_model(preset, seed=0), dims=ParallelDims())
    specs = [p.shard_spec for p in model.hf.parameters() if p.requires_grad]
    del model
    rand = DPRandomness.from_seed(0)
    numel = sum(math.prod(s.full_shape) for s in specs)
    out = {"parameters": numel, "tensors": len(specs)}

    def serial_normal() -> None:
        for i, s in enumerate(specs):
            torch.normal(0.0, STD, size=s.full_shape, generator=rand.torch_generator("dpsgd-noise", 0, i))

    def serial_tiles() -> None:
        for i, s in enumerate(specs):
            full_noise(parameter_key(rand, 0, i), s.full_shape, STD)

    a, b = median_seconds(serial_normal, repeats), median_seconds(serial_tiles, repeats)
    out["one process"] = {"whole_s": round(a, 4), "tiles_s": round(b, 4), "whole/tiles": round(a / b, 3)}
    for x, y, z in grids:
        dims = ParallelDims(x=x, y=y, z=z)
        ranks = sorted({0, dims.tp_size - 1})
        whole, tiles, drawn = [], [], []
        for r in ranks:
            at = RankOnGrid(dims, r)
            whole.append(median_seconds(lambda at=at: _whole(specs, rand, at), repeats))
            tiles.append(median_seconds(lambda at=at: _tiles(specs, rand, at), repeats))
            drawn.append(_tiles(specs, rand, at))
        w, t = statistics.median(whole), statistics.median(tiles)
        out[f"grid x={x} y={y} z={z}"] = {
            "ranks_timed": ranks, "whole_s": round(w, 4), "tiles_s": round(t, 4), "whole/tiles": round(w / t, 2),
            "normals_whole": numel, "normals_tiles": max(drawn),
            "tiles_share": round(max(drawn) / numel, 4), "own_share": round(1 / dims.tp_size, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["small", "125m"])
    ap.add_argument("--grids", nargs="+", default=["2,2,2", "4,2,1", "2,2,4"],
                    help="x,y,z of each tensor-parallel grid")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one rank's draw on one core; ranks of a grid each have their own
    grids = [tuple(int(v) for v in g.split(",")) for g in args.grids]
    res = {"torch": torch.__version__, "machine": platform.machine(), "threads": 1, "repeats": args.repeats,
           "presets": {p: run(p, grids, args.repeats) for p in args.presets}}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
