"""The overlap switches in `ParallelConfig`, and the overlapped code paths on the 1x1x1x1 grid
(in-process, no process group): the same gradients as the blocking path, bit for bit."""

from __future__ import annotations

import pytest
import torch

from memaudit.config import load_config
from memaudit.errors import ConfigError
from memaudit.models.presets import build_model
from memaudit.parallel.dims import ParallelDims
from memaudit.parallel.parallelize import overlap_options, parallelize_llama


def test_overlap_switches_default_off_and_map_to_parallelize() -> None:
    cfg = load_config(None)
    assert overlap_options(cfg.parallel) == {"overlap": True, "overlap_reduce_scatter": False,
                                             "overlap_all_gather": False, "bucket_mb": None}
    on = load_config(None, ["parallel.overlap_reduce_scatter=true", "parallel.overlap_all_gather=true",
                            "parallel.bucket_data_sync=true", "parallel.bucket_mb=4"])
    assert overlap_options(on.parallel) == {"overlap": True, "overlap_reduce_scatter": True,
                                            "overlap_all_gather": True, "bucket_mb": 4.0}


def test_bad_bucket_size_is_one_line() -> None:
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(None, ["parallel.bucket_mb=0"])
    assert "bucket_mb" in str(e.value) and "\n" not in str(e.value).strip()
    with pytest.raises(ValueError, match=r"parallel.bucket_mb=-1.0 must be > 0"):
        parallelize_llama(build_model("tiny", seed=0), dims=ParallelDims(), bucket_mb=-1.0)


def _grads(**opts) -> list[torch.Tensor]:
    pm = parallelize_llama(build_model("tiny", seed=0), dims=ParallelDims(), **opts)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pm.hf.config.vocab_size, (2, 16), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    for _ in range(2):  # two backward passes accumulate, as micro-batches do
        pm(ids, mask)[0].backward()
    pm.finish_grad_sync()
    return [p.grad for p in pm.hf.parameters()]


def test_overlapped_paths_equal_blocking_on_one_process() -> None:
    base = _grads(overlap=False)
    got = _grads(overlap=True, overlap_reduce_scatter=True, overlap_all_gather=True, bucket_mb=0.01)
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
