"""The trainer by composition: one `Trainer` class, layouts that fill in what differs, and
ghost norms that come back from the call computing them (no module-level sink)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import pytest

# every module the ghost norms, DP-SGD and the trainer pass through
SINK_MODULES = ("memaudit.parallel.ghost", "memaudit.parallel.layers", "memaudit.parallel.norm",
                "memaudit.parallel.dp", "memaudit.parallel.parallelize", "memaudit.parallel.comm",
                "memaudit.parallel.layout", "memaudit.train.ghost", "memaudit.train.dpsgd",
                "memaudit.train.trainer", "memaudit.train.layout")


def _import_all(package: str) -> None:
    pkg = importlib.import_module(package)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        importlib.import_module(info.name)


def test_no_module_level_mutable_sink_carries_ghost_norms() -> None:
    """The old defect: `memaudit.parallel.ghost._SINK`, a module-global list the layers wrote."""
    import torch

    for name in SINK_MODULES:
        mod = importlib.import_module(name)
        for attr, value in vars(mod).items():
            if attr.startswith("__") or isinstance(value, types.ModuleType):
                continue
            mutable = isinstance(value, list | dict | set | bytearray | torch.Tensor)
            assert not mutable, f"{name}.{attr} is a module-level {type(value).__name__}"


def test_one_trainer_class_and_no_subclass_overrides_its_seams() -> None:
    from memaudit.train import trainer

    _import_all("memaudit.train")
    _import_all("memaudit.parallel")
    assert trainer.Trainer.__subclasses__() == []
    assert trainer.CentralizedTrainer is trainer.Trainer  # the old name, one class
    from memaudit.run import launch

    assert not hasattr(importlib.import_module("memaudit.parallel"), "trainer_hooks")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("memaudit.parallel.trainer_hooks")
    assert "TensorParallelLayout(cfg)" in inspect.getsource(launch._run_here)


def test_both_layouts_implement_the_whole_layout_protocol() -> None:
    from memaudit.parallel.layout import TensorParallelLayout
    from memaudit.train.layout import Layout, SerialLayout

    wanted = {n for n, v in vars(Layout).items() if callable(v) and not n.startswith("_")}
    assert {"parallelize", "chunk_loss", "grad_norm", "dp_clipping", "write_state", "read_state",
            "export_model"} <= wanted
    for cls in (SerialLayout, TensorParallelLayout):
        for name in sorted(wanted):
            impl = getattr(cls, name, None)
            assert callable(impl) and impl is not getattr(Layout, name), (cls.__name__, name)
            assert list(inspect.signature(impl).parameters) == list(inspect.signature(getattr(Layout, name)).parameters), (
                cls.__name__, name)


def test_the_serial_trainer_is_the_trainer_with_the_serial_layout() -> None:
    from memaudit.config import load_config
    from memaudit.rundir import RunDir
    from memaudit.train.layout import SerialLayout
    from memaudit.train.trainer import Trainer

    tr = Trainer(load_config(None, ["train.device=cpu"]), RunDir("/nonexistent"))
    assert isinstance(tr.layout, SerialLayout) and tr.is_writer and tr.device.type == "cpu"


def test_ghost_norms_of_one_collector_per_model_and_call() -> None:
    """A collector is open only inside its call; a nested call on the same model is refused."""
    import torch

    from memaudit.parallel.ghost import GhostNorms, add_vector

    norms = GhostNorms()
    assert not norms.active and norms.current() is None
    with norms.collect(2) as acc:
        add_vector(norms.current(), torch.ones(2, 3, 4), scale=0.5)
        with pytest.raises(RuntimeError, match="one call at a time"), norms.collect(2):
            pass
    assert acc.tolist() == [18.0, 18.0]  # (3 tokens summed)^2 * 4 features * 0.5
    assert not norms.active


@pytest.mark.parametrize("sigma", [0.0, 1.3])
def test_one_dpsgd_takes_the_same_step_with_either_layouts_clipping(sigma) -> None:
    """Contract of `PerExampleClipping`: the same `DPSGD` step with the one-process clipping
    (ghost norms + book-keeping) and the grid's (two ghost passes; here the 1x1x1x1 grid),
    with noise keyed by the same secret, step and parameter."""
    import copy

    import torch

    from memaudit.parallel.dims import ParallelDims
    from memaudit.parallel.dp import TensorParallelClipping
    from memaudit.parallel.parallelize import parallelize_llama
    from memaudit.privacy.randomness import DPRandomness
    from memaudit.train.dpsgd import DPSGD
    from memaudit.train.ghost import GhostClipper
    from tests.train.test_dpsgd import _batch, _model

    serial = _model()
    pm = parallelize_llama(copy.deepcopy(serial), dims=ParallelDims())
    ids, attn, lmask = _batch()
    norms = sorted(GhostClipper(serial).clipped_sum(ids, attn, lmask, float("inf")).norms.tolist())
    clip = (norms[1] + norms[2]) / 2  # two of five clipped, away from any norm
    kw = {"clip": clip, "noise_multiplier": sigma, "expected_batch_size": 4.0, "micro_batch_size": 2}
    a = DPSGD(serial, randomness=DPRandomness.from_seed(9), **kw)
    b = DPSGD(pm, randomness=DPRandomness.from_seed(9), clipping=TensorParallelClipping(pm), **kw)
    sa = a.step_gradients(ids, attn, lmask, step=3)
    sb = b.step_gradients(ids, attn, lmask, step=3)
    assert sa["clip_fraction"] == sb["clip_fraction"] == pytest.approx(3 / 5)
    assert (sa["batch_size"], sa["noise_std"]) == (sb["batch_size"], sb["noise_std"]) == (5, sigma * clip / 4.0)
    assert sa["loss"] == pytest.approx(sb["loss"], rel=1e-5)
    pairs = list(zip(serial.named_parameters(), pm.hf.named_parameters(), strict=True))
    for (n, p), (m, q) in pairs:
        assert n == m
        want = q.shard_spec.local(p.grad, pm.comm)  # the layout of the grid's shard (z-flat blocks)
        torch.testing.assert_close(q.grad, want, rtol=1e-4, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")
    assert a.state_dict()["step"] == b.state_dict()["step"] == 4


def test_the_grid_layout_in_one_process_and_its_refusal_of_vmap_clipping() -> None:
    from memaudit.config import load_config
    from memaudit.parallel.layout import TensorParallelLayout

    layout = TensorParallelLayout(load_config(None, ["train.device=cpu"]))  # the 1x1x1x1 grid, no process group
    assert layout.is_writer and layout.device.type == "cpu" and layout.dims.world_size == 1
    with pytest.raises(ValueError, match="mode 'vmap' has no tensor-parallel form"):
        layout.dp_clipping(None, "vmap")
