"""Shamir t-of-n secret sharing over a prime field.

Secrets are integers in [0, p); byte strings (seeds, private keys) go through
:func:`split_bytes` / :func:`reconstruct_bytes`, which use the Mersenne prime
2^521 - 1 so that any 32-byte secret fits in one field element.

References:
    Shamir, "How to share a secret", CACM 1979.

>>> shares = split(7, threshold=3, n=5, prime=13, rng=__import__("random").Random(0))
>>> reconstruct(shares[1:4], prime=13)
7
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Sequence

PRIME = 2**521 - 1  # Mersenne prime; holds 65-byte secrets

Share = tuple[int, int]  # (x, y) with x in 1..n


def _rand_below(p: int, rng: random.Random | None) -> int:
    return rng.randrange(p) if rng is not None else secrets.randbelow(p)


def split(secret: int, *, threshold: int, n: int, prime: int = PRIME,
          rng: random.Random | None = None, xs: Sequence[int] | None = None) -> list[Share]:
    """Split ``secret`` into ``n`` shares; any ``threshold`` of them reconstruct it.

    Args:
        secret: integer in [0, prime).
        threshold: t, the number of shares needed (1 <= t <= n).
        n: number of shares.
        prime: field modulus (must exceed n and the secret).
        rng: a seeded ``random.Random`` for tests; default the OS CSPRNG.
        xs: evaluation points (distinct, nonzero mod prime); default 1..n.

    Returns:
        List of (x, y) shares.
    """
    if not 1 <= threshold <= n:
        raise ValueError(f"threshold must be in 1..n={n}, got {threshold}")
    if not 0 <= secret < prime:
        raise ValueError(f"secret must be in [0, {prime}), got a value out of range")
    xs = list(range(1, n + 1)) if xs is None else list(xs)
    if len(xs) != n or len({x % prime for x in xs}) != n or any(x % prime == 0 for x in xs):
        raise ValueError("evaluation points must be n distinct nonzero field elements")
    coeffs = [secret] + [_rand_below(prime, rng) for _ in range(threshold - 1)]
    shares = []
    for x in xs:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % prime
        shares.append((x, y))
    return shares


def reconstruct(shares: Sequence[Share], *, prime: int = PRIME) -> int:
    """Lagrange interpolation at 0 from t or more shares (all must be genuine)."""
    xs = [x % prime for x, _ in shares]
    if len(set(xs)) != len(xs):
        raise ValueError("duplicate share x-coordinates; pass each share once")
    secret = 0
    for i, (xi, yi) in enumerate(shares):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (-xj) % prime
                den = den * (xi - xj) % prime
        secret = (secret + yi * num * pow(den, -1, prime)) % prime
    return secret


def split_bytes(secret: bytes, *, threshold: int, n: int, xs: Sequence[int] | None = None,
                rng: random.Random | None = None) -> list[Share]:
    """Share a byte string of at most 64 bytes (length is fixed by the caller)."""
    if len(secret) > 64:
        raise ValueError(f"secret of {len(secret)} bytes is too long; at most 64 bytes")
    return split(int.from_bytes(secret, "big"), threshold=threshold, n=n, rng=rng, xs=xs)


def reconstruct_bytes(shares: Sequence[Share], length: int) -> bytes:
    """Inverse of :func:`split_bytes` for a secret of ``length`` bytes."""
    value = reconstruct(shares)
    if value >= 1 << (8 * length):
        raise ValueError("reconstructed value does not fit the secret length; shares are inconsistent")
    return value.to_bytes(length, "big")
