"""Which silos train in a round: all of them, a seeded random sample, or MFSC's tail-class-first pick.

A driver (the simulator, the aggregator) keeps a `SelectionBook`: each silo's latest disclosure and the last
round it was picked. The paper keeps the last statistics each client uploaded because only the picked
clients upload; here every connected silo discloses each training round (so that one round's means share one
encoder), and the book still covers a silo that was offline. A silo that has never disclosed is picked
first, so every silo is seen.

Tail-first (DFL-FS, Sec. 3.2): classes are visited from the fewest estimated holders to the most; for each
class no picked silo covers yet, the holder picked least recently is added (ties: the one adding most
uncovered classes, then a seeded draw). Slots left over go to the silos picked least recently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from fedlt.seeding import derive_seed
from fedlt.selection.config import SelectionConfig
from fedlt.selection.mfsc import estimate_coverage


@dataclass
class SelectionBook:
    disclosures: dict[str, torch.Tensor] = field(default_factory=dict)
    last_picked: dict[str, int] = field(default_factory=dict)

    def record(self, round_number: int, picked: Sequence[str]) -> None:
        for silo in picked:
            self.last_picked[silo] = round_number

    def as_dict(self) -> dict:
        return {"disclosures": dict(self.disclosures), "last_picked": dict(self.last_picked)}

    @classmethod
    def from_dict(cls, saved: dict) -> SelectionBook:
        return cls(dict(saved["disclosures"]), dict(saved["last_picked"]))


def choose_participants(
    config: SelectionConfig, candidates: Sequence[str], round_number: int, seed: int, book: SelectionBook
) -> list[str]:
    candidates = sorted(candidates)
    k = config.per_round
    if k == 0 or k >= len(candidates):
        return candidates
    rng = np.random.default_rng(derive_seed(seed, "selection", round_number))
    if config.strategy == "random":
        return sorted(str(s) for s in rng.choice(candidates, size=k, replace=False))
    coverage = estimate_coverage(
        {s: book.disclosures[s] for s in candidates if s in book.disclosures}, config.separation
    )
    return tail_first(candidates, k, coverage, book.last_picked, rng)


def tail_first(
    candidates: Sequence[str],
    k: int,
    coverage: dict[str, torch.Tensor],
    last_picked: dict[str, int],
    rng: np.random.Generator,
) -> list[str]:
    draw = dict(zip(candidates, rng.permutation(len(candidates)).tolist(), strict=True))

    def staleness(silo: str) -> tuple[int, int]:
        return last_picked.get(silo, 0), draw[silo]

    def preference(silo: str, uncovered: torch.Tensor) -> tuple[int, int, int]:
        last, tie = staleness(silo)
        return last, -int((coverage[silo] & uncovered).sum()), tie

    picked = sorted((s for s in candidates if s not in coverage), key=staleness)[:k]
    known = [s for s in candidates if s in coverage]
    if known and len(picked) < k:
        holds = torch.stack([coverage[s] for s in known])  # [silos, classes]
        covered = torch.zeros(holds.shape[1], dtype=torch.bool)
        for c in torch.argsort(holds.sum(0), stable=True).tolist():
            if len(picked) == k:
                break
            options = [s for i, s in enumerate(known) if holds[i, c] and s not in picked]
            if covered[c] or not options:
                continue
            chosen = min(options, key=partial(preference, uncovered=~covered))
            picked.append(chosen)
            covered |= coverage[chosen]
    rest = sorted((s for s in candidates if s not in picked), key=staleness)
    return sorted(picked + rest[: k - len(picked)])
