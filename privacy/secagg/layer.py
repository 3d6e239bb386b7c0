"""The `secagg` privacy layer in one process: what the simulator runs, with the consortium's protocol code.

Each call runs the phase's census when the schema has per-class fields, the tail guard is on and the phase has
no census yet, then the secure sum of the fixed-point encoded contributions, through real clients and a real
server. Per-class rows are released only when the round's silos are the census set (see `tail_guard`). The
decoded sum is the same whichever masks were drawn, so a seeded simulation gives the consortium's numbers.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

from fedlt.aggregation import Contribution, Schema, SumLayer, Sums
from privacy.secagg import tail_guard
from privacy.secagg.codec import FixedPointCodec
from privacy.secagg.local import run_session
from privacy.secagg.settings import SecAggSettings
from privacy.secagg.tail_guard import Census

log = logging.getLogger(__name__)


class SecAggSum(SumLayer):
    name = "secagg"

    def __init__(self, settings: SecAggSettings | None = None) -> None:
        self.settings = settings or SecAggSettings()
        self.censuses: dict[str, Census] = {}  # by schema phase
        self.held_back: list[int] = []

    def aggregate(
        self, schema: Schema, contributions: Sequence[Contribution], *, silos: Sequence[str] = ()
    ) -> Sums:
        self.check_round(schema, contributions)
        silos = list(silos) or [f"silo-{i:04d}" for i in range(len(contributions))]
        codec = FixedPointCodec(schema, max_silos=len(silos))
        vectors = dict(zip(silos, (c.flat() for c in contributions), strict=True))
        round_id = secrets.token_hex(8)
        self.held_back = []
        if schema.classes and self.settings.k_min >= 2:
            census = self.censuses.get(schema.phase)
            if census is None:
                spec = self.settings.session(round_id, "census", silos, schema.classes, b"")
                counts, counted = run_session(
                    spec, {u: tail_guard.presence(schema, v) for u, v in vectors.items()}
                )
                census = self.censuses[schema.phase] = Census.of(counted, counts)
            self.held_back = census.guarded(silos, self.settings.k_min)
            if self.held_back:
                log.info("tail guard: classes %s are zeroed in this round's sum", self.held_back)
            vectors = {u: tail_guard.zero_classes(schema, v, self.held_back) for u, v in vectors.items()}
        session = self.settings.session(round_id, "contribution", silos, schema.size, b"")
        total, _ = run_session(session, {u: codec.encode(v) for u, v in vectors.items()})
        return self.seal(schema, codec.decode(total), len(silos))

    def saved(self) -> dict:
        return {
            phase: {"silos": list(c.silos), "counts": list(c.counts)} for phase, c in self.censuses.items()
        }

    def restore(self, saved: dict) -> None:
        self.censuses = {phase: Census.of(c["silos"], c["counts"]) for phase, c in saved.items()}
