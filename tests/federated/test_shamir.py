"""Shamir sharing: any t shares reconstruct; t-1 shares are consistent with every secret."""

import itertools
import random

import pytest

from memaudit.federated.secagg import shamir


def test_any_t_shares_reconstruct_large_field():
    rng = random.Random(0)
    secret = rng.getrandbits(256)
    shares = shamir.split(secret, threshold=3, n=6, rng=rng)
    for subset in itertools.combinations(shares, 3):
        assert shamir.reconstruct(subset) == secret
    assert shamir.reconstruct(shares) == secret  # more than t also works


def test_bytes_roundtrip_with_custom_points():
    secret = bytes(range(32))
    shares = shamir.split_bytes(secret, threshold=2, n=4, xs=[3, 9, 10, 12])
    assert shamir.reconstruct_bytes(shares[2:], 32) == secret


@pytest.mark.parametrize("p,t,n", [(11, 3, 5), (13, 2, 4)])
def test_small_field_exhaustive(p, t, n):
    rng = random.Random(1)
    for secret in range(p):
        shares = shamir.split(secret, threshold=t, n=n, prime=p, rng=rng)
        for subset in itertools.combinations(shares, t):
            assert shamir.reconstruct(subset, prime=p) == secret
    # t-1 shares: each secret s is matched by exactly one polynomial of degree t-1 with
    # constant term s through the t-1 points, so the shares are consistent with every secret.
    shares = shamir.split(5, threshold=t, n=n, prime=p, rng=rng)
    for subset in itertools.combinations(shares, t - 1):
        counts = {s: 0 for s in range(p)}
        for coeffs in itertools.product(range(p), repeat=t - 1):
            for s in range(p):
                if all(_poly(s, coeffs, x, p) == y for x, y in subset):
                    counts[s] += 1
        assert set(counts.values()) == {p ** (t - 1 - len(subset))}


def _poly(s, coeffs, x, p):
    return (s + sum(c * x ** (k + 1) for k, c in enumerate(coeffs))) % p


def test_errors():
    with pytest.raises(ValueError, match="threshold"):
        shamir.split(1, threshold=4, n=3)
    with pytest.raises(ValueError, match="duplicate"):
        shamir.reconstruct([(1, 2), (1, 2)])
