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
from functools import lru_cache

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
    xs = tuple(x for x, _ in items[:threshold])
    ys = [y for _, y in items[:threshold]]
    secret = _value_at(xs, ys, 0)
    consistent = all(_value_at(xs, ys, x) == y for x, y in items[threshold:])
    if not consistent or secret >= 2 ** (8 * SECRET_BYTES):
        raise ShamirError("the shares do not come from one secret (inconsistent or tampered)")
    return secret.to_bytes(SECRET_BYTES, "big")


def _value_at(xs: tuple[int, ...], ys: list[int], at: int) -> int:
    """The value at `at` of the polynomial of degree len(xs) − 1 through the points (xs, ys) (Lagrange)."""
    return sum(w * y for w, y in zip(_basis(xs, at), ys, strict=True)) % PRIME


@lru_cache(maxsize=256)
def _basis(xs: tuple[int, ...], at: int) -> tuple[int, ...]:
    """Lagrange's basis at `at` for the distinct x-coordinates `xs`:
    L_i(at) = Π_{j≠i} (at − x_j) / (x_i − x_j).

    It depends on the x-coordinates alone, which are public (a holder's place among a seed's holders), so
    it is cached: an aggregator rebuilds every seed of a session from shares of the same holders' places,
    and computes the basis once instead of once a seed (with t shares and m − t checked beyond them, m − t + 1
    bases of t inversions and t² products each: most of the unmasking's time at n = 30 before). The cache
    holds no secret.
    """
    differences = [(at - x) % PRIME for x in xs]
    after = [1] * (len(xs) + 1)  # after[i] = Π_{j ≥ i} (at − x_j)
    for i in range(len(xs) - 1, -1, -1):
        after[i] = after[i + 1] * differences[i] % PRIME
    weights, before = [], 1  # before = Π_{j < i} (at − x_j)
    for i, inverse in enumerate(_inverse_denominators(xs)):
        weights.append(before * after[i + 1] % PRIME * inverse % PRIME)
        before = before * differences[i] % PRIME
    return tuple(weights)


@lru_cache(maxsize=64)
def _inverse_denominators(xs: tuple[int, ...]) -> tuple[int, ...]:
    """1 / Π_{j≠i} (x_i − x_j) for each i: the part of Lagrange's basis that does not depend on where it is
    evaluated, shared by the secret (at 0) and the checks of the shares beyond the threshold."""
    inverses = []
    for i, xi in enumerate(xs):
        denominator = 1
        for j, xj in enumerate(xs):
            if i != j:
                denominator = denominator * (xi - xj) % PRIME
        inverses.append(pow(denominator, -1, PRIME))
    return tuple(inverses)


def _evaluate(coefficients: list[int], x: int) -> int:
    y = 0
    for c in reversed(coefficients):
        y = (y * x + c) % PRIME
    return y
