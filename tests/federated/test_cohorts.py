"""Cohort sampling (Poisson and fixed) and packing of clients' data."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from memaudit.federated.cohorts import (
    cohort_capacity,
    pack_clients,
    poisson_capacity,
    sample_cohort,
)


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_deterministic_per_round_and_independent_across_rounds(mode):
    a = sample_cohort(7, 200, 20, mode=mode, round=3)
    np.testing.assert_array_equal(a, sample_cohort(7, 200, 20, mode=mode, round=3))
    assert not np.array_equal(a, sample_cohort(7, 200, 20, mode=mode, round=4))
    assert not np.array_equal(a, sample_cohort(8, 200, 20, mode=mode, round=3))
    assert np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 200


def test_fixed_size_is_exact_and_uniform():
    counts = np.zeros(10)
    for r in range(2000):
        c = sample_cohort(0, 10, 3, mode="fixed", round=r)
        assert len(c) == 3
        counts[c] += 1
    # each client is in a cohort with probability 3/10: 600 of 2000 rounds, sd ~20.5
    assert np.all(np.abs(counts - 600) < 5 * 20.5)


def test_poisson_sizes_follow_the_binomial():
    sizes = np.array([len(sample_cohort(1, 100, 10, round=r)) for r in range(2000)])
    # Binomial(100, 0.1): mean 10, variance 9; the mean of 2000 rounds has sd 0.067
    assert abs(sizes.mean() - 10) < 5 * 0.067
    assert abs(sizes.var() - 9) < 1.5


def test_jax_key_seeds_work():
    key = jax.random.PRNGKey(5)
    np.testing.assert_array_equal(
        sample_cohort(key, 50, 5, "fixed", 1), sample_cohort(key, 50, 5, "fixed", 1)
    )
    typed = jax.random.key(5)
    assert len(sample_cohort(typed, 50, 5, "fixed", 1)) == 5


def test_bad_input():
    with pytest.raises(ValueError, match="cohort 11 is larger than the population of 10"):
        sample_cohort(0, 10, 11, mode="fixed")
    with pytest.raises(ValueError, match="cohort 11 is larger"):
        sample_cohort(0, 10, 11, mode="poisson")
    with pytest.raises(ValueError, match="cohort must be a positive int"):
        sample_cohort(0, 10, 0)
    with pytest.raises(ValueError, match="population must be a positive int"):
        sample_cohort(0, 0, 1)
    with pytest.raises(ValueError, match="sampling mode must be"):
        sample_cohort(0, 10, 2, mode="uniform")
    with pytest.raises(ValueError, match="round must be >= 0"):
        sample_cohort(0, 10, 2, round=-1)


def test_capacity_and_packing():
    assert [cohort_capacity(k) for k in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
    assert cohort_capacity(3, multiple=8) == 8
    clients = [{"x": np.arange(k * 2, dtype=np.float32).reshape(k, 2)} for k in (2, 0, 3)]
    data = pack_clients(clients, capacity=4)
    assert data.examples["x"].shape == (4, 3, 2)
    np.testing.assert_array_equal(data.num_examples, [2, 0, 3, 0])
    np.testing.assert_array_equal(data.examples["x"][2], clients[2]["x"])
    np.testing.assert_array_equal(data.examples["x"][0, 2], [0, 0])
    with pytest.raises(ValueError, match="capacity 2 < cohort of 3"):
        pack_clients(clients, capacity=2)
    with pytest.raises(ValueError, match="max_examples=2"):
        pack_clients(clients, max_examples=2)


def test_poisson_capacity_holds_all_but_a_tail_of_the_rounds():
    population, expected = 56, 8
    cap = poisson_capacity(population, expected, tail=0.01)
    # oracle: the cohorts sample_cohort actually draws; the fraction larger than cap is about
    # the tail (<= 1%), and cap is the smallest such size (cap - 1 overflows more often)
    sizes = np.array([len(sample_cohort(3, population, expected, round=r)) for r in range(20000)])
    assert np.mean(sizes > cap) <= 0.01 + 3 * np.sqrt(0.01 * 0.99 / sizes.size)
    assert np.mean(sizes > cap - 1) > 0.01 - 3 * np.sqrt(0.01 * 0.99 / sizes.size)
    assert poisson_capacity(population, expected) == 17  # the default tail, 1e-3
    assert poisson_capacity(population, expected, multiple=4) == 20
    assert poisson_capacity(10, 10) == 10  # everyone, every round
    with pytest.raises(ValueError, match="expected cohort must be in"):
        poisson_capacity(10, 11)
    with pytest.raises(ValueError, match="tail must be in"):
        poisson_capacity(10, 2, tail=0)


@pytest.mark.parametrize("mode", ["poisson", "fixed"])
def test_dp_cohorts_come_from_the_secret_not_the_seed(mode):
    from memaudit.privacy.randomness import DPRandomness

    a, b = DPRandomness.fresh(), DPRandomness.fresh()
    ca = [sample_cohort(a, 200, 10, mode, round=r).tolist() for r in range(5)]
    assert ca != [sample_cohort(b, 200, 10, mode, round=r).tolist() for r in range(5)]
    assert ca == [sample_cohort(a, 200, 10, mode, round=r).tolist() for r in range(5)]  # resumable
    seeded = [sample_cohort(DPRandomness.from_seed(0), 200, 10, mode, round=r).tolist() for r in range(5)]
    assert seeded == [sample_cohort(DPRandomness.from_seed(0), 200, 10, mode, round=r).tolist() for r in range(5)]
    assert seeded != [sample_cohort(0, 200, 10, mode, round=r).tolist() for r in range(5)]
    # the federated trainer's key words expand to a DPRandomness the same way on resume
    words = np.array([123, 456], np.uint32)
    assert DPRandomness.from_key_words(words, reproducible=False) == DPRandomness.from_key_words(
        words.tolist(), reproducible=False)
