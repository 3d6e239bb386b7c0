"""Shamir secret sharing of 32-byte seeds over the prime field of p = 2^521 − 1.

Any t shares rebuild the secret; fewer reveal nothing about it. The field must exceed every secret, and
2^521 − 1 (a Mersenne prime) comfortably holds 256-bit seeds. Share x-coordinates are 1..n, never 0 (the
secret's own point). Coefficients come from the operating system's CSPRNG. A rebuilt value of 2^256 or more
cannot be a seed, which catches a randomly corrupted share with probability 1 − 2^−265; it is no MAC:
shares are authenticated by the signed, sealed envelopes that carry them.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

PRIME = 2**521 - 1
SECRET_BYTES = 32


class ShamirError(ValueError):
    """Shares that cannot rebuild a secret: too few, repeated or out-of-range x, or a bad secret."""


def split(secret: bytes, *, shares: int, threshold: int) -> dict[int, int]:
    """Shares {x: y}, x = 1..shares, of a degree threshold−1 polynomial whose constant term is the secret."""
    if len(secret) != SECRET_BYTES:
        raise ShamirError(f"a secret has {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= shares:
        raise ShamirError(f"need 1 <= threshold <= shares, got threshold {threshold} of {shares}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x) for x in range(1, shares + 1)}


def combine(shares: Mapping[int, int], *, threshold: int) -> bytes:
    """The secret from at least `threshold` shares (Lagrange interpolation at 0).

    Shares beyond the threshold are not ignored: each must lie on the polynomial the first `threshold`
    define, so one corrupted share among more than enough is caught instead of yielding a wrong secret.
    """
    if len(shares) < threshold:
        raise ShamirError(f"{len(shares)} shares cannot rebuild a secret that needs {threshold}")
    items = sorted(shares.items())
    if any(not 0 < x < PRIME or not 0 <= y < PRIME for x, y in items):
        raise ShamirError("share coordinates must lie in the field, with x != 0")
    points = items[:threshold]
    secret = _interpolate(points, 0)
    consistent = all(_interpolate(points, x) == y for x, y in items[threshold:])
    if not consistent or secret >= 2 ** (8 * SECRET_BYTES):
        raise ShamirError("the shares do not come from one secret (inconsistent or tampered)")
    return secret.to_bytes(SECRET_BYTES, "big")


def _interpolate(points: list[tuple[int, int]], at: int) -> int:
    """The value at `at` of the polynomial of degree len(points) − 1 through `points` (Lagrange)."""
    value = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * (at - xj) % PRIME
                denominator = denominator * (xi - xj) % PRIME
        value = (value + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    return value


def _evaluate(coefficients: list[int], x: int) -> int:
    y = 0
    for c in reversed(coefficients):
        y = (y * x + c) % PRIME
    return y
