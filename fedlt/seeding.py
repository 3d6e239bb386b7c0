"""Named, independent random streams derived from one run seed.

Each consumer (test split, partition, silo k's shuffling in round r, model init) gets its own seed from
SHA-256 of the run seed and its labels, so runs are reproducible across processes and machines, and adding a
consumer never shifts another's stream (as sharing one global RNG would).
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *labels: object) -> int:
    text = "\x1f".join([str(seed), *map(str, labels)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def torch_generator(seed: int, *labels: object) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *labels))
