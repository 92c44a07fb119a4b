"""Layer and model equivalence, clipping, DP-SGD (sigma=0) and wire volume per collective kind, on CPU gloo.

One spawned process group per world size (2, 4, 8) runs every case of that size; the
1x1x1x1 grid runs in this process without a process group.
"""

from __future__ import annotations

import pytest

from tests.parallel import _workers

WORLDS = (2, 4, 8)
_LAYER = [(w, n) for w in WORLDS for n in _workers.layer_case_names(w)]
_MODEL = [(g, kind) for g in _workers.MODEL_GRIDS for kind in ("train", "clip", "dp", "uls", "ghost", "noise", "payload")]
_OVERLAP = [f"overlap-{o}-{k}-{''.join(map(str, g))}" for g in _workers.MODEL_GRIDS if g != (1, 1, 1, 1)
            for k in ("plain", "recompute", "dp", "micro") for o in _workers.overlap_variants(g)]
_OVERLAP += [f"overlap-train-{''.join(map(str, g))}" for g in _workers.MODEL_GRIDS if g != (1, 1, 1, 1)]
_VOLUME = [f"volume-{v}-{''.join(map(str, g))}" for g in _workers.VOLUME_GRIDS for v in _workers.volume_variants(g)]


def test_layer_cases_cover_the_issue_grid() -> None:
    assert len(_LAYER) == 7 * 3 * 2 * 2


@pytest.mark.parametrize(("world", "name"), _LAYER, ids=[n for _, n in _LAYER])
def test_layer_equivalence(results, world: int, name: str) -> None:
    err = results(world)[name]
    assert err is None, err


@pytest.fixture(scope="module")
def serial_grid_results(serial_ref, tmp_path_factory):
    ref, _ = serial_ref
    return _workers.model_cases((1, 1, 1, 1), ref, str(tmp_path_factory.mktemp("grid1111")))


@pytest.mark.parametrize(("grid", "kind"), _MODEL, ids=[f"{k}-{''.join(map(str, g))}" for g, k in _MODEL])
def test_model(results, serial_grid_results, grid: tuple[int, int, int, int], kind: str) -> None:
    world = grid[0] * grid[1] * grid[2] * grid[3]
    res = serial_grid_results if world == 1 else results(world)
    err = res[f"{kind}-{''.join(map(str, grid))}"]
    assert err is None, err


@pytest.mark.parametrize("world", WORLDS)
def test_grid_of_wrong_size_is_one_clear_error(results, world: int) -> None:
    assert results(world)["bad-world"] is None


@pytest.mark.parametrize("name", _VOLUME)
def test_wire_volume_per_kind_equals_the_planner(results, name: str) -> None:
    """Counted in `Comm` on a gloo grid == `predict_collectives` exactly, per (axis, kind), for a
    plain step, recomputation, DP-SGD (two ghost passes), and micro-batches."""
    grid = tuple(int(c) for c in name.rsplit("-", 1)[1])
    err = results(grid[0] * grid[1] * grid[2] * grid[3])[name]
    assert err is None, err


@pytest.mark.parametrize("name", _OVERLAP)
def test_overlapped_collectives_equal_the_blocking_path(results, name: str) -> None:
    """ORS, OAG and bucketed data all-reduce (each, and all together) give the blocking path's
    gradients bit for bit on grids whose axes have size <= 2 (plain, recomputation, DP-SGD with
    noise), within float tolerance with micro-batches, and the same training losses."""
    grid = tuple(int(c) for c in name.rsplit("-", 1)[1])
    err = results(grid[0] * grid[1] * grid[2] * grid[3])[name]
    assert err is None, err
