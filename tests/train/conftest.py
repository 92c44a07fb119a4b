"""A jax-engine run that two test files compare against: trained once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import built_once, xdist_shared_dir

# The jax engine's reduced tiny run (16 users, sequences of 64, batches of 8).
JAX_TINY = (
    "data.synth.users=16", "data.synth.docs_per_user=6", "data.canaries.repetitions=[1,2,4]",
    "data.seq_len=64", "train.batch_size=8", "train.warmup_steps=2", "train.eval_batches=1",
    "train.engine=jax",
)
# 3 steps of user-level DP-SGD, ULS (each user's rows clipped as one), σ = 1.
JAX_ULS = (
    "train.steps=3", "train.eval_every=3", "train.checkpoint_every=3", "privacy.noise_multiplier=1.0",
    "privacy.unit=user", "privacy.max_examples_per_user=4", "privacy.user_sampling=uls",
    "privacy.reproducible_randomness=true", "privacy.clip=0.5",
)


@pytest.fixture(scope="session")
def jax_uls_run(tmp_path_factory) -> Path:
    """`JAX_TINY` + `JAX_ULS` with ghost clipping on one device: the reference of
    test_jax_engine.py's mesh (the same run on 8 devices) and test_jax_ghost.py's clipping (the
    same run with vmap). Under pytest-xdist one worker trains it and the others read it."""
    shared = xdist_shared_dir(tmp_path_factory)

    def build() -> dict:
        import jax

        from memaudit.config import load_config
        from memaudit.run.driver import run_trainer
        from memaudit.rundir import prepare_new_run
        from memaudit.train.jax_trainer import JaxTrainer

        base = (shared / "jax-uls-run") if shared is not None else tmp_path_factory.mktemp("jax-uls")
        base.mkdir(parents=True, exist_ok=True)
        cfg = load_config(None, [*JAX_TINY, *JAX_ULS, "train.clipping=ghost"])
        run = prepare_new_run(base / "run", overwrite=False)
        run_trainer(JaxTrainer(cfg, run, devices=jax.devices()[:1]), resume=False)
        return {"path": str(run.path)}

    return Path(built_once(shared, "jax-uls-run", build)["path"])
