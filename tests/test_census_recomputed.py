"""A false census (issue 30, item 7): the aggregator reports k_min silos for a class one silo holds, to get
that silo's per-class row. Under `secagg` every silo recomputes the census from the signed masked inputs and
reveals the aggregator relays (`privacy.secagg.protocol.Transcript`), so a count the aggregator alone reports
is never acted on. Each attack runs the real halves and `SiloRound`s in one process; only what the aggregator
sends is changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

from fedlt.aggregation import Field, Schema
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, Subject
from fedlt.aggregation.halves import AggregatorHalf, AggregatorSide, Released, SumAborted, SumSpec
from fedlt.aggregation.round_sums import AggregatorRound, RoundSums, SiloRound
from fedlt.errors import FedltError
from privacy.secagg.layer import SecAggSum
from privacy.secagg.protocol import MaskedInput, Reveal, Transcript

CLASSES, K_MIN = 4, 2
RARE, VICTIM = 3, "silo-c"
HOLDINGS = {"silo-a": (0, 1), "silo-b": (0, 1, 2), "silo-c": (0, RARE), "silo-d": (0, 2)}
SCHEMA = Schema((Field("per_class", (CLASSES, 2), 100.0, per_class=True, frac_bits=8),))

# (silo, the step the aggregator sends it) -> what it sends instead, or None to send nothing
Tamper = Callable[[str, object], object | None]


def contribution(silo: str) -> torch.Tensor:
    rows = torch.zeros(CLASSES, 2, dtype=torch.float64)
    for c in HOLDINGS[silo]:
        rows[c] = torch.tensor([1.0 + c, 10.0 * c + len(silo)])
    return SCHEMA.flatten({"per_class": rows})


def gated(silos: list[str]) -> dict[str, object]:
    """Each silo's own release gate, with the policy's default floors and a ledger for this round."""
    gate = ReleaseGate(consortium="c", floors=Floors(), members=lambda: silos, ledger=MemoryLedger())
    return {"gate": gate, "trained_from": Subject.fresh("contribution")}


def play(
    tamper: Tamper = lambda _, step: step,
    *,
    inflate: bool = False,
    dp: bool = False,
    kept: dict[str, bool] | None = None,
) -> tuple[Released | None, dict[str, str]]:
    """One round's census and contribution, delivered at once as the simulator does; a silo that refuses a
    step leaves the round's sums, as the agent does; with `inflate` the aggregator reports the false census.
    The released contribution sum (None if the round aborted) and each refusing silo's reason; `kept` gets
    whether each silo marked the census it kept as checked."""
    silos = sorted(HOLDINGS)
    sides, aggregator_side = SecAggSum().in_process(silos)
    sums = RoundSums("r1.a1", tuple(silos), SCHEMA, K_MIN, census=None)
    if inflate:
        aggregator_side = Inflating(aggregator_side)
    aggregator = AggregatorRound(aggregator_side, sums, min_contributors=2)
    marks = {} if kept is None else kept
    rounds = {
        u: SiloRound(
            sides[u],
            sums,
            contribution(u),
            me=u,
            on_census=lambda _census, checked, u=u: marks.__setitem__(u, checked),
            noise=Unnoised() if dp else None,
            **gated(silos),
        )
        for u in silos
    }
    refusals: dict[str, str] = {}

    def answer(silo: str, call: Callable[[], list[tuple[str, object]]]) -> list[tuple[str, str, object]]:
        if silo in refusals:
            return []
        try:
            return [(silo, purpose, message) for purpose, message in call()]
        except FedltError as exc:
            refusals[silo] = str(exc)
            return []

    inbox = [m for u, r in rounds.items() for m in answer(u, r.start)]
    while True:
        for silo, purpose, message in inbox:
            aggregator.receive(silo, purpose, message)
        try:
            out = aggregator.close()
        except SumAborted:
            return None, refusals
        if isinstance(out, Released):
            return out, refusals
        inbox = []
        for u, purpose, step in out:
            sent = tamper(u, step)
            if sent is not None:  # None: withheld
                inbox += answer(u, partial(rounds[u].step, purpose, sent))


class Unnoised:
    """A silo's DP as the census sees it: on, so the silo claims every class (no noise is drawn here)."""

    def noised(self, spec: SumSpec, vector: torch.Tensor, *, counted: int) -> torch.Tensor:
        return vector


def rare_row(released: Released | None) -> torch.Tensor:
    if released is None or released.total is None:
        return torch.zeros(2, dtype=torch.float64)
    return SCHEMA.unflatten(released.total)["per_class"][RARE]


class Inflating(AggregatorSide):
    """A malicious aggregator: the census it releases (to itself, so to every silo, and into the binding of
    the contribution it runs next) counts k_min - 1 more holders of the class only the victim holds."""

    def __init__(self, side: AggregatorSide) -> None:
        self.side = side

    def half(self, spec: SumSpec) -> AggregatorHalf:
        half = self.side.half(spec)
        if spec.purpose == "census":
            close = half.close

            def inflated() -> object:
                out = close()
                if isinstance(out, Released):
                    total = out.total.clone()
                    total[RARE] += K_MIN - 1
                    return Released(out.survivors, total)
                return out

            half.close = inflated
        return half


def test_an_honest_census_zeroes_the_class_one_silo_holds():
    released, refusals = play()
    assert not refusals
    assert released is not None
    assert set(released.survivors) == set(HOLDINGS)
    assert torch.equal(rare_row(released), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("dp", [False, True])
def test_a_silo_marks_as_checked_only_a_census_it_computed_without_dp(dp):
    """What a silo keeps decides which census a round of another study may guard with (finding 1 of issue
    35's review): only the sum the silo recomputed from its peers' signed inputs, without DP, says which
    classes are held; under DP every silo claims every class, so the sum reads every class everywhere."""
    kept: dict[str, bool] = {}
    released, refusals = play(dp=dp, kept=kept)
    assert not refusals
    assert released is not None
    assert kept == dict.fromkeys(HOLDINGS, not dp)


def test_an_aggregator_that_inflates_the_census_gets_no_row_of_a_class_one_silo_holds():
    """Before the census was recomputed, every silo took the aggregator's counts: the rare class passed the
    guard and the released sum's row was the victim's own."""
    released, refusals = play(inflate=True)
    assert torch.equal(rare_row(released), torch.zeros(2, dtype=torch.float64))
    assert VICTIM in refusals
    assert "not the sum this silo computed" in refusals[VICTIM]


def withheld(victim: str) -> Tamper:
    """The transcript kept from `victim`, so that it has no sum of its own to compare the counts with."""

    def tamper(silo: str, step: object) -> object:
        return None if silo == victim and isinstance(step, Transcript) else step

    return tamper


def test_a_census_result_without_its_transcript_is_refused():
    """The aggregator skips the victim's transcript, so that it has no sum of its own to compare with."""
    released, refusals = play(withheld(VICTIM), inflate=True)
    assert "computed no census of its own" in refusals[VICTIM]
    assert torch.equal(rare_row(released), torch.zeros(2, dtype=torch.float64))


def transcript_changed(change: Callable[[Transcript], Transcript]) -> Tamper:
    def tamper(_: str, step: object) -> object:
        return change(step) if isinstance(step, Transcript) else step

    return tamper


def _masked(t: Transcript, silo: str, masked: MaskedInput) -> Transcript:
    return replace(t, masked={**t.masked, silo: masked})


def _revealed(t: Transcript, silo: str, reveal: Reveal) -> Transcript:
    return replace(t, reveals={**t.reveals, silo: reveal})


def _plus_one(vector: np.ndarray, word: int) -> np.ndarray:
    """`vector` with one more in a census word (the flags are narrow words: the census is small)."""
    out = vector.copy()
    out.view("<u4")[word] += np.uint32(1)
    return out


def _flipped(share: bytes) -> bytes:
    return share[:-1] + bytes([share[-1] ^ 1])


def _first(mapping: Mapping[str, object]) -> str:
    return sorted(mapping)[0]


TRANSCRIPTS: dict[str, tuple[Callable[[Transcript], Transcript], str]] = {
    "a masked input altered": (
        lambda t: _masked(
            t, VICTIM, replace(t.masked[VICTIM], vector=_plus_one(t.masked[VICTIM].vector, RARE))
        ),
        "masked input",
    ),
    "a masked input's signature dropped": (
        lambda t: _masked(t, "silo-a", replace(t.masked["silo-a"], signature=b"")),
        "masked input",
    ),
    "a masked input signed by another silo": (
        lambda t: _masked(t, "silo-a", replace(t.masked["silo-a"], signature=t.masked["silo-b"].signature)),
        "masked input",
    ),
    "a reveal's share altered": (
        lambda t: _revealed(
            t,
            "silo-a",
            replace(
                t.reveals["silo-a"],
                self_mask={
                    **t.reveals["silo-a"].self_mask,
                    VICTIM: _flipped(t.reveals["silo-a"].self_mask[VICTIM]),
                },
            ),
        ),
        "reveal",
    ),
    "a reveal's signature dropped": (
        lambda t: _revealed(t, "silo-b", replace(t.reveals["silo-b"], signature=b"")),
        "reveal",
    ),
    "a masked input left out": (
        lambda t: replace(t, masked={u: m for u, m in t.masked.items() if u != "silo-d"}),
        "not those of the survivors",
    ),
    "a masked input from a silo outside the survivors": (
        lambda t: _masked(t, "silo-e", t.masked["silo-a"]),
        "not those of the survivors",
    ),
    "a reveal from a silo that signed no consistency": (
        lambda t: _revealed(t, "silo-e", t.reveals[_first(t.reveals)]),
        "signed no consistency",
    ),
    "too few reveals": (
        lambda t: replace(t, reveals={u: t.reveals[u] for u in sorted(t.reveals)[:1]}),
        "cannot be the aggregator's",
    ),
    "a reveal for the wrong silos": (
        lambda t: _revealed(
            t, "silo-a", replace(t.reveals["silo-a"], mask_key=dict(t.reveals["silo-a"].self_mask))
        ),
        "revealed shares for the wrong silos",
    ),
}


@pytest.mark.parametrize("case", TRANSCRIPTS)
def test_a_transcript_the_silos_did_not_sign_is_refused(case):
    """Whatever in the transcript is not what the silos signed, or not what this silo saw, ends its census:
    no silo acts on the counts, so no per-class row leaves."""
    change, refusal = TRANSCRIPTS[case]
    released, refusals = play(transcript_changed(change))
    assert set(refusals) == set(HOLDINGS), refusals
    assert all(refusal in reason for reason in refusals.values()), refusals
    assert released is None


def test_a_transcript_checked_against_another_survivor_set_is_refused():
    """The aggregator relays the transcript of a census over other silos (one left out after the
    consistency round): the survivors this silo signed for are not the transcript's."""
    released, refusals = play(
        transcript_changed(lambda t: replace(t, masked=dict(list(t.masked.items())[1:])))
    )
    assert set(refusals) == set(HOLDINGS)
    assert all("not those of the survivors" in reason for reason in refusals.values())
    assert released is None
