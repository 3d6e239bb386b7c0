"""Which silos a round invites, and the MFSC disclosures that decide it, kept apart from the sums.

The picking itself is `fedlt.selection`, the same function the simulator calls; this module feeds it what a
consortium knows: the connected silos, each silo's registered policy, the last committed round each silo was
invited to, and the disclosures stored so far (they survive a restart, like everything else the aggregator
needs). MFSC asks every connected silo to disclose, not only those that train, so that the class means of
one round all come from one model; if any connected silo's policy does not accept the disclosure, nobody is
asked that round and the silos are drawn at random instead — loudly, in the log and the audit log.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Collection
from dataclasses import replace

import numpy as np
import torch

from aggregator.store import Store
from fedlt.errors import FedltError
from fedlt.methods import Method
from fedlt.selection import DISCLOSURE, SelectionBook, SelectionConfig, choose_participants

log = logging.getLogger("aggregator")


class BadDisclosure(FedltError):
    """A disclosure that does not fit what the round asked for."""


class RoundPicker:
    def __init__(self, selection: SelectionConfig, seed: int, store: Store, method: Method) -> None:
        self.selection = selection
        self.seed = seed
        self.store = store
        self.method = method
        self.shape = (method.model_spec.num_classes, method.feature_dim)
        saved = {silo: self._matrix(data) for silo, data in store.disclosures(DISCLOSURE).items()}
        self.book = SelectionBook(saved, store.last_picked())

    def pick(
        self, trains: bool, round_number: int, connected: list[str], avoid: Collection[str] = ()
    ) -> tuple[list[str], list[str]]:
        """(participants, disclosers) of the coming round. `avoid`: silos that let an earlier attempt of
        this round down; a retry picks around them when enough others are connected, or it would pick the
        same silos, and fail the same way, forever."""
        if not trains:
            return connected, []
        selection, disclosers = self.selection, []
        if selection.discloses:
            declined = [s for s in connected if DISCLOSURE not in self.store.policy(s).get("disclosures", [])]
            if declined:
                log.warning(
                    "round %d: %s do not accept the %r disclosure; picking silos at random instead",
                    round_number,
                    ", ".join(declined),
                    DISCLOSURE,
                )
                self.store.audit(
                    "disclosure_declined", {"round": round_number, "name": DISCLOSURE, "silos": declined}
                )
                selection = replace(selection, strategy="random")
            else:
                disclosers = list(connected)
        candidates = [s for s in connected if s not in avoid]
        if not selection.per_round or len(candidates) < selection.per_round:
            candidates = connected
        picked = choose_participants(selection, candidates, round_number, self.seed, self.book)
        return picked, disclosers

    def accept(self, silo_id: str, round_id: str, name: str, shape: tuple[int, ...], values: bytes) -> str:
        """Check and audit one disclosure (the caller has checked the silo was asked for it); it is kept
        by `committed` only if its round commits, so a retried round picks as the first attempt did."""
        if name != DISCLOSURE:
            raise BadDisclosure(f"unknown disclosure {name!r}")
        if shape != self.shape:
            raise BadDisclosure(f"{name} must be a {list(self.shape)} matrix, got {list(shape)}")
        if len(values) != math.prod(shape) * 8:
            raise BadDisclosure(f"{name} has {len(values)} bytes for a {list(shape)} float64 matrix")
        if not np.isfinite(np.frombuffer(values, dtype="<f8")).all():
            raise BadDisclosure(f"{name} holds values that are not finite")
        digest = hashlib.sha256(values).hexdigest()
        self.store.audit(
            "disclosure_received", {"round_id": round_id, "silo": silo_id, "name": name, "sha256": digest}
        )
        return digest

    def committed(self, round_number: int, participants: list[str], disclosed: dict[str, bytes]) -> None:
        """The round's picks and disclosures, now that it committed (the store keeps them in its commit)."""
        self.book.record(round_number, participants)
        self.book.disclosures.update({silo: self._matrix(values) for silo, values in disclosed.items()})

    def _matrix(self, values: bytes) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(values, dtype="<f8").copy()).reshape(self.shape)
