"""DP-FedAvg: limit case against FedAvg, clipping against a NumPy loop, noise std, composition."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memaudit.federated.aggregators import mean_aggregator
from memaudit.federated.dp import clip_deltas, dp_fedavg
from memaudit.federated.secagg.aggregator import secure_aggregation


@pytest.fixture(scope="module")
def deltas():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(6, 4, 3)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)}


def test_no_privacy_equals_fedavg_unweighted_mean(deltas):
    weights = jnp.array([1, 1, 0, 1, 0, 1.0])
    agg = dp_fedavg(mean_aggregator(), clip=math.inf, noise_multiplier=0.0, expected_cohort=4)
    res = jax.jit(agg.aggregate)(deltas, weights, agg.init(None), jax.random.key(0))
    fedavg = mean_aggregator().aggregate(deltas, weights, None, None).update
    for k in deltas:
        np.testing.assert_allclose(res.update[k], fedavg[k], rtol=1e-5, atol=1e-6)
    assert float(res.metrics["clip_fraction"]) == 0.0


def test_clipping_and_fixed_denominator_against_numpy_loop(deltas):
    weights = np.array([1, 1, 1, 0, 1, 1.0])
    clip, expected = 2.0, 7.5
    agg = jax.jit(dp_fedavg(mean_aggregator(), clip=clip, noise_multiplier=0.0, expected_cohort=expected).aggregate)
    res = agg(deltas, jnp.asarray(weights), dp_fedavg(clip=clip, noise_multiplier=0.0, expected_cohort=expected).init(None),
              jax.random.key(0))
    want = {k: np.zeros(v.shape[1:]) for k, v in deltas.items()}
    n_clipped = 0
    for i in range(6):
        if not weights[i]:
            continue
        norm = math.sqrt(sum(float(np.sum(np.asarray(v[i], np.float64) ** 2)) for v in deltas.values()))
        f = min(1.0, clip / norm)
        n_clipped += f < 1
        for k in deltas:
            want[k] += np.asarray(deltas[k][i], np.float64) * f
    for k in deltas:
        np.testing.assert_allclose(res.update[k], want[k] / expected, rtol=1e-5, atol=1e-6)
    assert float(res.metrics["clip_fraction"]) == pytest.approx(n_clipped / 5)


def test_clip_deltas_norms():
    x = {"a": jnp.array([[3.0, 4.0], [0.3, 0.4]])}
    clipped, norms = clip_deltas(x, jnp.float32(1.0))
    np.testing.assert_allclose(norms, [5.0, 0.5], rtol=1e-6)
    np.testing.assert_allclose(clipped["a"], [[0.6, 0.8], [0.3, 0.4]], rtol=1e-6)


def test_a_clients_clipped_row_is_the_same_whatever_rows_share_its_array():
    """Secure aggregation clips each client's delta before encoding it: on a Flower node, over
    the rows that node holds (1, 2, 3 ...), in JAX over the cohort's. A client's norm, its
    clipped row and so its encoded row must not depend on which rows share its array. Failed
    before: XLA's reduction of a (k, d) array sums in an order that depends on k; a norm moved by
    one ulp, 113,808 of a client's clipped values with it, and a DP run with secure aggregation
    on 4 SuperNodes ended 0.055 away from the in-JAX run (benchmarks/federated_round.py)."""
    from memaudit.federated.client_ops import ClientStep, global_norms, within

    rng = np.random.default_rng(0)
    leaves = [(rng.standard_normal((8, *shape)) * 0.01).astype(np.float32)
              for shape in [(512, 128), (128,), (128, 384), (1000,)]]
    step = ClientStep((1.0,))
    norms, rows, inside = np.asarray(global_norms(leaves)), step.apply(leaves), within(leaves, 1.0)
    for start, stop in [(0, 1), (0, 2), (0, 3), (3, 8), (7, 8), (2, 6)]:
        part = [x[start:stop] for x in leaves]
        assert np.array_equal(np.asarray(global_norms(part)), norms[start:stop]), (start, stop)
        for got, want in zip(step.apply(part), rows, strict=True):
            assert np.array_equal(np.asarray(got), np.asarray(want)[start:stop]), (start, stop)
        assert np.array_equal(within(part, 1.0), inside[start:stop])
    # against an independent oracle: float64 norms of each row alone
    oracle = [math.sqrt(sum(float(np.sum(x[i].astype(np.float64) ** 2)) for x in leaves)) for i in range(8)]
    np.testing.assert_allclose(norms, oracle, rtol=1e-6)
    traced = jax.jit(global_norms)(leaves)  # inside a program: XLA's reduction, within an ulp or so
    np.testing.assert_allclose(np.asarray(traced), norms, rtol=1e-6)


def test_clipping_concrete_rows_compiles_nothing_and_equals_the_programs_clip():
    """Secure aggregation clips a node's rows on the host, for as many rows as the node holds
    that round. Failed before: eager jnp compiled each operation of the clip for every new count
    of rows, 0.25-0.35 s for the tiny model's leaves, in the masked-input step of the first DP
    round that gave a node that many users (0.75-0.9 s on 4 SuperNodes sharing 2 cores). The
    clipped rows equal the clip inside a jitted program (XLA's float32 arithmetic) on the same
    norms, and the norm check (`within`) equals the float64 oracle's."""
    from memaudit.federated.client_ops import ClientStep, clip_deltas, row_norms, within

    compiles = []

    def on_event(event, duration, **_kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        rng = np.random.default_rng(1)
        shapes = [(64, 32), (32,), (32, 48)]
        step = ClientStep((0.5, 0.25), count=0.5)
        for k in (1, 2, 3, 5):
            leaves = [(rng.standard_normal((k, *s)) * 0.05).astype(np.float32) for s in shapes]
            leaves[0][0] = 0.0  # a zero row: its factor is 1
            before = len(compiles)
            clipped, inside = step.apply(leaves), within(leaves, step.count)
            assert len(compiles) == before, f"{k} rows: {len(compiles) - before} XLA compiles"
            # the oracle: each clip inside one program, on the norms of each row alone
            want = list(leaves)
            for c in step.clips:
                norms = row_norms(want)
                want = jax.jit(lambda xs, n, c=c: [x * jnp.minimum(1.0, c / jnp.maximum(n, 1e-30)).reshape(
                    (-1,) + (1,) * (x.ndim - 1)) for x in xs])(want, norms)
            for got, ref in zip(clipped, want, strict=True):
                assert np.array_equal(np.asarray(got), np.asarray(ref)), k
            oracle = [math.sqrt(sum(float(np.sum(x[i].astype(np.float64) ** 2)) for x in leaves)) <= 0.5
                      for i in range(k)]
            assert list(inside) == oracle
        out, norms = clip_deltas({"a": np.array([[3.0, 4.0]], np.float32)}, jnp.asarray(1.0))
        np.testing.assert_allclose(out["a"], [[0.6, 0.8]], rtol=1e-6)
        np.testing.assert_allclose(norms, [5.0])
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_noise_std_matches_configuration():
    # zero deltas: the update is pure noise with std z C / expected cohort per coordinate
    z, clip, m = 1.3, 0.7, 10.0
    agg = dp_fedavg(mean_aggregator(), clip=clip, noise_multiplier=z, expected_cohort=m)
    zeros = {"w": jnp.zeros((4, 20000))}
    res = jax.jit(agg.aggregate)(zeros, jnp.ones(4), agg.init(None), jax.random.key(3))
    got = float(np.std(np.asarray(res.update["w"])))
    want = z * clip / m
    # 20000 draws: the std's relative standard error is 1/sqrt(2*20000) = 0.5%; allow 3%
    assert got == pytest.approx(want, rel=0.03)
    assert float(res.metrics["noise_std"]) == pytest.approx(want)
    assert float(res.metrics["effective_noise"]) == pytest.approx(z)


def test_dp_over_secure_aggregation_uses_survivors():
    rng = np.random.default_rng(1)
    d = {"w": jnp.asarray(rng.normal(size=(5, 8)) * 0.1, jnp.float32)}
    sa = secure_aggregation(mean_aggregator(), clip=1.0, bits=24, seed=0)
    agg = dp_fedavg(sa, clip=1.0, noise_multiplier=0.0, expected_cohort=5)
    assert agg.jittable is False
    res = agg.aggregate(d, jnp.ones(5), agg.init(None), jax.random.key(0))
    np.testing.assert_allclose(res.update["w"], np.asarray(d["w"]).sum(0) / 5, atol=5 / 2**23)
    assert float(res.metrics["survivors"]) == 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected_cohort"):
        dp_fedavg(clip=1.0, noise_multiplier=1.0, expected_cohort=0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_fedavg(clip=1.0, noise_multiplier=-1.0, expected_cohort=3)
