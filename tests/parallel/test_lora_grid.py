"""LoRA on the 4D grid: the adapters follow the base weight's tensor-parallel split.

The cases run inside the world-2 and world-4 gloo groups that `results(world)` already spawns
(`tests/parallel/_lora_workers.py`); the oracle is peft + torch in one process. The config
checks run in this process.
"""

from __future__ import annotations

import pytest

from memaudit.checks import check_before_disk
from memaudit.config import load_config
from memaudit.errors import ConfigError
from tests.conftest import REPO_ROOT
from tests.parallel._lora_workers import LORA_GRIDS, LORA_KINDS

_CASES = [(g, k) for g in LORA_GRIDS for k in LORA_KINDS]


@pytest.mark.parametrize(("grid", "kind"), _CASES, ids=[f"{k}-{''.join(map(str, g))}" for g, k in _CASES])
def test_lora_on_the_grid_equals_one_process(results, grid: tuple[int, int, int, int], kind: str) -> None:
    """train: two AdamW steps equal peft in one process (losses, adapters, merged model, peft's
    adapter state), the frozen base is bit-identical and gets no gradient nor optimizer state, the
    adapters change, a sharded checkpoint loads back bit for bit; dp: one DP-SGD step (sigma=0,
    ghost clipping) equals a brute-force per-example loop's clipped mean; ghost: per-example
    adapter-gradient norms equal that loop's."""
    world = grid[0] * grid[1] * grid[2] * grid[3]
    err = results(world)[f"lora-{kind}-{''.join(map(str, grid))}"]
    assert err is None, err


def _cfg(*over: str):
    return load_config(REPO_ROOT / "configs" / "tiny.yaml",
                       ["model.lora.rank=4", "model.lora.target_modules=[q_proj,o_proj]", *over])


@pytest.mark.parametrize(("over", "needle"), [
    (("parallel.x=3",), "parallel.x=3 does not divide A's columns (d_in)=128 of its adapters; choose parallel.x"),
    (("parallel.y=3",), "parallel.y=3 does not divide B's rows (d_out)=128"),
    (("parallel.x=2", "model.lora.dropout=0.1"), "model.lora.dropout=0.1 has no tensor-parallel form; set model.lora.dropout=0"),
])
def test_lora_the_grid_cannot_split_is_one_line(over: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_before_disk(_cfg(*over))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_lora_on_a_grid_that_divides_it_passes_the_checks() -> None:
    check_before_disk(_cfg("parallel.x=2", "parallel.y=2"))
