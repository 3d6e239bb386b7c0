"""The `secagg` privacy layer in one process: what the simulator runs, with the consortium's protocol code.

Each call runs the census (when the schema has per-class fields and the tail guard is on) and then the
secure sum of the fixed-point encoded contributions, through real clients and a real server. The decoded
sum is the same whichever masks were drawn, so a seeded simulation gives the numbers the consortium gives.
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

log = logging.getLogger(__name__)


class SecAggSum(SumLayer):
    name = "secagg"

    def __init__(self, settings: SecAggSettings | None = None) -> None:
        self.settings = settings or SecAggSettings()
        self.held_back: list[int] = []

    def aggregate(self, schema: Schema, contributions: Sequence[Contribution]) -> Sums:
        self.check_round(schema, contributions)
        silos = [f"silo-{i:04d}" for i in range(len(contributions))]
        codec = FixedPointCodec(schema, max_silos=len(silos))
        vectors = dict(zip(silos, (c.flat() for c in contributions), strict=True))
        round_id = secrets.token_hex(8)
        self.held_back = []
        if schema.classes and self.settings.k_min >= 2:
            census = self.settings.session(round_id, "census", silos, schema.classes, b"")
            counts, _ = run_session(census, {u: tail_guard.presence(schema, v) for u, v in vectors.items()})
            self.held_back = tail_guard.held_back(counts, self.settings.k_min)
            if self.held_back:
                log.info(
                    "tail guard: classes %s are held by fewer than %d silos",
                    self.held_back,
                    self.settings.k_min,
                )
            vectors = {u: tail_guard.zero_classes(schema, v, self.held_back) for u, v in vectors.items()}
        session = self.settings.session(round_id, "contribution", silos, schema.size, b"")
        total, _ = run_session(session, {u: codec.encode(v) for u, v in vectors.items()})
        return self.seal(schema, codec.decode(total), len(silos))
