"""Review of issue 35 (studies) as a hostile operator: attacks on a silo that takes part in several studies.

The operator controls the aggregator whole: its key, every message, the study ids and which study's agent a
call reaches. The silo's guarantees are one release gate and one DP ledger across its studies. Each test
mounts one attack in-process, on the silo's own code (`silo.participation`, `silo.work`, `silo.trust`, the
privacy and release ledgers, `silo.config`), with one object per study's agent on the silo's one state
directory, as the agents have. An attack that still works is marked `xfail(strict=True)` with the finding;
it turns into a failure (XPASS) once the silo refuses it, and the mark comes off then. The others are
regression tests of a defence that held.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedlt.aggregation import Field, Schema
from fedlt.aggregation.gate import Floors, MemoryLedger, ReleaseGate, RepeatedRelease, Subject
from fedlt.aggregation.halves import SiloHalf, SiloSide, SumSpec, census_schema
from fedlt.aggregation.round_sums import RoundSums, SiloRound
from fedlt.aggregation.tail_guard import Census, CensusError, floor_problems
from fedlt.dp import DPSettings
from fedlt.errors import ConfigError
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy import roundspec
from privacy.dp import Budget, PrivacyLedger
from privacy.dp.silo_privacy import COUNTS, SiloPrivacy
from privacy.pki.ca import revoke
from privacy.pki.roster import Roster
from silo.config import PolicySection, load_silo_config
from silo.participation import Participation
from silo.releases import LEDGER, ReleaseLedger
from silo.work import Work
from tests.consortium_harness import PLAN
from tests.test_release_gate import shard
from tests.test_roster_quorum import SILOS as MEMBERS
from tests.test_roster_quorum import Pki

CONSORTIUM = "c"
SILOS = ("a", "b", "c")
CLASSES = ("cat", "dog", "fox")
SCHEMA = Schema((Field("n", (), 100.0, frac_bits=0), Field("rows", (3, 2), 10.0, per_class=True)))
# the victim, "a", is the only silo that holds a dog; every silo holds the same classes in every study
HOLDS = {"a": [0, 1], "b": [0, 2], "c": [0, 2]}
TRUE_CENSUS = Census.of(SILOS, [3, 1, 2])
# what a census under DP reads (every silo claims every class), and what the operator names in its place
EVERY_CLASS_BY_EVERY_SILO = Census.of(SILOS, [3, 3, 3])


# --- the census a study without DP takes from a study with DP (or under plaintext) -------------------------


class Recording(SiloSide):
    """A layer side that keeps the vector each half starts with (what the silo puts into the sum)."""

    def __init__(self, *, hides_inputs: bool = True) -> None:
        self.hides_inputs = hides_inputs
        self.vectors: list[torch.Tensor] = []

    def half(self, spec: SumSpec, me: str, *, may_release) -> SiloHalf:
        return _Kept(self.vectors)


class _Kept(SiloHalf):
    def __init__(self, into: list[torch.Tensor]) -> None:
        self.into = into

    def start(self, vector: torch.Tensor) -> list[object]:
        self.into.append(vector.clone())
        return []

    def step(self, step: object) -> list[object]:
        return []

    @property
    def done(self) -> bool:
        return False

    @property
    def counted(self) -> tuple[str, ...]:
        return ()


class NoNoise:
    """A study's DP as far as the census needs it: its presence says DP is on (no noise is drawn here)."""

    def noised(self, spec: SumSpec, vector: torch.Tensor, *, counted: int) -> torch.Tensor:
        return vector


def rows_of(silo: str) -> torch.Tensor:
    """`silo`'s contribution: one count, and a per-class row for each class it holds."""
    rows = torch.zeros(3, 2, dtype=torch.float64)
    rows[HOLDS[silo]] = torch.tensor([1.0, 2.0], dtype=torch.float64) * (1 + SILOS.index(silo))
    return SCHEMA.flatten({"n": torch.tensor(1.0, dtype=torch.float64), "rows": rows})


def study_round(state_dir: Path, silo: str, census: Census, side: SiloSide, *, dp: bool) -> Participation:
    """`silo`'s part in a round of one study whose RoundSpec names `census`, as its agent makes it (the plan's
    class names given, so the census is keyed by the classes held), on the silo's one release ledger."""
    spec = round_pb2.RoundSpec(
        consortium_id=CONSORTIUM,
        round=2,
        round_id="r2.a1.x",
        config_sha256="plan",
        schema=schema_to_pb(SCHEMA),
        privacy="secagg",
        participants=list(census.silos),
        secagg=round_pb2.SecAggParameters(k_min=2),
        census=round_pb2.Census(silos=census.silos, silos_per_class=census.counts),
    )
    ledger = ReleaseLedger(state_dir)
    return Participation(
        spec,
        roundspec.sums_of(round_pb2.SignedRoundSpec(spec=spec.SerializeToString()), spec),
        rows_of(silo),
        me=silo,
        side=side,
        gate=ReleaseGate(consortium=CONSORTIUM, floors=Floors(), members=lambda: SILOS, ledger=ledger),
        trained_from="the study's state",
        data="the silo's data",
        ledger=ledger,
        transport=None,
        on_sent=lambda purpose, message: None,
        noise=NoNoise() if dp else None,
        class_names=CLASSES,
    )


def secagg_study_rows(tmp_path: Path, census: Census) -> torch.Tensor:
    """The per-class rows the aggregator reads in a study without DP whose RoundSpec names `census`: the sum
    of what every silo puts into the contribution sum over the census set."""
    total = torch.zeros(SCHEMA.size, dtype=torch.float64)
    for silo in SILOS:
        side = Recording()
        study_round(tmp_path / silo, silo, census, side, dp=False).start()
        total += side.vectors[0]
    return SCHEMA.unflatten(total)["rows"]


def kept_in_a_trusting_study(tmp_path: Path, census: Census, via: str) -> None:
    """Every silo's agent of a study where the silo takes a census it cannot check: under DP (every silo
    claims every class, so any plausible census is taken), or under plaintext where the silo released its
    census over those silos (the aggregator reads every input, so its reading is taken)."""
    for silo in SILOS:
        state_dir = tmp_path / silo
        if via == "plaintext":
            held = Subject("census", json.dumps(sorted(CLASSES[c] for c in HOLDS[silo])).encode())
            ReleaseLedger(state_dir).pin_survivors(held.key(CONSORTIUM), SILOS, "census")
        side = Recording(hides_inputs=via != "plaintext")
        study_round(state_dir, silo, census, side, dp=via == "dp")


def test_a_census_nobody_computed_is_refused_by_a_study_without_dp(tmp_path):
    """Regression (finding 7 across studies): in a study under secagg without DP, a RoundSpec naming a census
    in which the victim's dog is held by every silo (it is held by the victim alone) is refused by every
    silo that never took part in that census, so the tail guard cannot be lifted by the aggregator's word."""
    for silo in SILOS:
        (tmp_path / silo).mkdir()
        with pytest.raises(CensusError, match="differs from the census this silo took part in"):
            study_round(tmp_path / silo, silo, EVERY_CLASS_BY_EVERY_SILO, Recording(), dp=False)


@pytest.mark.parametrize("via", ["dp", "plaintext"])
def test_a_census_kept_by_a_study_that_cannot_check_it_does_not_lift_another_studys_tail_guard(tmp_path, via):
    """The attack: the operator runs two studies over the same silos and data, one under DP (or under
    plaintext, where a silo's policy for that study allows it), one under secagg without DP. In the first,
    its RoundSpec names a census in which every silo holds every class: exactly what an honest census under
    DP reads, and plausible to every silo, which keeps it (under the key of the classes it holds, the same
    key in every study). In the second, its RoundSpec names that census: every silo finds it kept and takes
    it, so the tail guard (k_min = 2) zeroes nothing, and the dog's row of the sum is the victim's own row.
    The defence would be to keep a census that was not checked apart from checked ones (or not at all), so
    that the second study refuses it, or zeroes the dog."""
    for silo in SILOS:
        (tmp_path / silo).mkdir()
    kept_in_a_trusting_study(tmp_path, EVERY_CLASS_BY_EVERY_SILO, via)
    try:
        rows = secagg_study_rows(tmp_path, EVERY_CLASS_BY_EVERY_SILO)
    except CensusError:
        return  # refused: the defence
    victims = SCHEMA.unflatten(rows_of("a"))["rows"]
    assert rows[1].tolist() == [0.0, 0.0], f"the dog's row is the victim's own: {victims[1].tolist()}"


def test_a_census_taken_with_every_silo_guards_a_class_one_silo_holds(tmp_path):
    """The control of the attack above: with the census the silos took themselves, the dog's row is zeroed by
    every silo (one holder, fewer than k_min = 2), while the classes two or more hold go out."""
    for silo in SILOS:
        (tmp_path / silo).mkdir()
        held = Subject("census", json.dumps(sorted(CLASSES[c] for c in HOLDS[silo])).encode())
        ReleaseLedger(tmp_path / silo).record_census(held.key(CONSORTIUM), TRUE_CENSUS)
    rows = secagg_study_rows(tmp_path, TRUE_CENSUS)
    assert rows[1].tolist() == [0.0, 0.0]
    assert rows[0].abs().sum() > 0
    assert rows[2].abs().sum() > 0


# --- MFSC disclosures from one state in two studies ---------------------------------------------------------


class Disclosures:
    """A transport that keeps what the silo discloses."""

    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []

    def disclose(self, round_id: str, *, name: str, shape: list[int], values: bytes) -> str:
        self.sent.append(np.frombuffer(values, dtype="<f8").reshape(shape).copy())
        return hashlib.sha256(values).hexdigest()


def study_agent_work(shared: Path) -> Work:
    """A study's agent's work, on the silo's shared state directory (its ledger object of its own)."""
    return Work(
        shared,
        PolicySection(disclosures=("mfsc",)),
        ledger=ReleaseLedger(shared),
        plans=None,
        pending=None,
        standing=SimpleNamespace(activity=None),
        refuse=None,
    )


def disclosing_round(state, prepared, *, mask: str = "gaussian", min_samples: int = 5) -> SimpleNamespace:
    """An admitted round that asks for the silo's masked class means and no training."""
    return SimpleNamespace(
        spec=SimpleNamespace(round_id="r1.a1.x", round=1),
        plan=SimpleNamespace(selection=SimpleNamespace(min_samples=min_samples, mask=mask)),
        method=PLAN.build_method(),
        state=state,
        prepared=prepared,
        data=prepared.data,
        discloses=True,
        trains=False,
    )


@pytest.fixture(scope="module")
def disclosing():
    """The tests' plan's method, two seeded states of it, and silo 0's data as the plan prepares it."""
    method = PLAN.build_method()
    return method.init_state(seed=1), method.init_state(seed=2), shard(0)


def test_a_state_disclosed_in_one_study_is_disclosed_as_the_same_bytes_in_another(tmp_path, disclosing):
    """Regression: study A's agent discloses its masked class means from a state; the operator hands study
    B's agent the same state with a plan asking for another mask. B's agent sends A's bytes (kept in the
    silo's one release ledger), so the two say nothing a single disclosure did not."""
    state, _, prepared = disclosing
    sent = Disclosures()
    study_agent_work(tmp_path).train(sent, disclosing_round(state, prepared, mask="gaussian"))
    study_agent_work(tmp_path).train(sent, disclosing_round(state, prepared, mask="uniform"))
    assert np.array_equal(sent.sent[0], sent.sent[1])


def test_two_studies_disclosures_of_one_state_do_not_tell_held_classes_from_masks(tmp_path, disclosing):
    """The attack: study A's agent discloses from state S (gaussian masks); study B's agent then discloses
    from another state (its own round: the ledger keeps one disclosure, so A's is gone); the operator hands
    study A's agent S again, with a plan asking for uniform masks. The silo computes it afresh: the real
    class means are the same bytes, every mask point differs. The rows that are equal are exactly the
    classes the silo holds at least min_samples of, which the masks exist to hide (a class the silo alone
    holds, which MFSC's clustering reads as missing, included); raising min_samples plan by plan gives each
    class's sample count. Keeping every disclosure, or the mask and minimum each was made with, would make
    the second the same bytes as the first."""
    state, other, prepared = disclosing
    sent = Disclosures()
    study_agent_work(tmp_path).train(sent, disclosing_round(state, prepared, mask="gaussian"))
    study_agent_work(tmp_path).train(sent, disclosing_round(other, prepared, mask="gaussian"))
    study_agent_work(tmp_path).train(sent, disclosing_round(state, prepared, mask="uniform"))
    first, _, again = sent.sent
    told = [bool(np.array_equal(first[c], again[c])) for c in range(len(first))]
    held = (np.bincount(prepared.data.y, minlength=len(first)) >= 5).tolist()
    assert told != held, "comparing the two disclosures names exactly the classes held"


# --- DP: the class counts of two studies' data -------------------------------------------------------------


def test_two_dp_studies_over_different_data_each_noise_their_class_counts_once(tmp_path):
    """The attack needs no malice: two studies under DP over different data (this year's and last year's),
    each agent with its own ledger object on the silo's one privacy ledger, each round reporting its class
    counts and charging DP-SGD. `reported_counts` reused the latest "class counts" entry only when its
    records matched; once an agent's ledger object had re-read the file (at its DP-SGD charge), the latest
    was the other study's, so it drew fresh noise for the same records and charged it again: about every
    second round (now the entry with the same records is found under the file's lock, whoever wrote it).
    The aggregator got many independently noised copies of each data's counts (their average ever closer to
    the truth), and the budget paid for releases the plan never planned (its σ is calibrated for one). Each
    data's counts should be noised once, and found again by their records."""
    dp = DPSettings(enabled=True, epsilon=8.0)
    method = replace(PLAN, dp=dp).build_method()
    path = tmp_path / "privacy-ledger.json"

    def agent(study: str) -> SiloPrivacy:
        return SiloPrivacy(dp, method=method, ledger=PrivacyLedger(Budget(100.0, 1e-5), path), run=study)

    readmission, imaging = agent("readmission"), agent("imaging")
    records = {"readmission": np.array([5, 47, 1, 16]), "imaging": np.array([30, 2, 9, 4])}
    reported = []
    for _ in range(4):
        for study, privacy in (("readmission", readmission), ("imaging", imaging)):
            reported.append((study, privacy.reported_counts(records[study]).tolist()))
            privacy.admit_sgd(sample_rate=0.1, steps=1)
    entries = PrivacyLedger(Budget(100.0, 1e-5), path).entries
    released = [e["run"] for e in entries if e["what"] == COUNTS]
    distinct = {study: {tuple(r) for s, r in reported if s == study} for study in records}
    assert sorted(released) == ["imaging", "readmission"], f"class counts charged {len(released)} times"
    assert all(len(values) == 1 for values in distinct.values())


# --- a study's own policy for what the silo keeps across studies --------------------------------------------


FLOORS = """
state_dir = "state"

[data]
path = "admissions.csv"

[policy]
min_class_records = 2

[study.readmission]

[study.imaging.policy]
min_class_records = 5
"""


def census_at_floor(floor: int, records: np.ndarray) -> tuple[Subject, np.ndarray]:
    """What one silo's census at record floor `floor` is keyed by, and what it sends (presence, capped
    records), as its round driver makes them."""
    schema = Schema((Field("rows", (3, 2), 10.0, per_class=True, inverts=True),))
    rows = torch.zeros(3, 2, dtype=torch.float64)
    rows[records > 0] = 1.0
    sums = RoundSums("r1.a1", SILOS, schema, k_min=2, census=None, record_floor=floor)
    silo_round = SiloRound(
        Recording(),
        sums,
        rows.flatten(),
        me="a",
        gate=ReleaseGate(
            consortium=CONSORTIUM, floors=Floors(), members=lambda: SILOS, ledger=MemoryLedger()
        ),
        trained_from=Subject("contribution", b"s"),
        records=records,
        class_names=CLASSES,
    )
    return silo_round.census_subject, silo_round.census_input()


def test_a_silo_sends_its_capped_record_counts_at_one_floor_across_its_studies(tmp_path):
    """The attack: a silo's administrator gives one study a record floor of 2 and another of 5 (each study
    may override any policy key but roster_quorum_above). The operator takes each study's census over the
    same three silos: each study's agent accepts its own floor (`floor_problems`), and the census is keyed by
    the classes held, so the second is the same key over the same set, which the ledger allows. The two sums
    of counts capped at 2 and at 5 say more about each class's records than either (Σ min(nᵢ, r) bends at
    every nᵢ, the reason a silo caps at one floor only). Either silo.toml should refuse a study's own
    min_class_records, or the second census should be refused."""
    try:
        config = load_silo_config_at(tmp_path)
    except ConfigError:
        return  # refused: the defence
    records = np.array([3, 7, 0])
    ledger = ReleaseLedger(tmp_path)
    sent = []
    for study in ("readmission", "imaging"):
        floor = config.for_study(study).policy.min_class_records
        assert not floor_problems(floor, dp=False, accepted=floor)  # each agent accepts its own floor
        subject, vector = census_at_floor(floor, records)
        gate = ReleaseGate(consortium=CONSORTIUM, floors=Floors(), members=lambda: SILOS, ledger=ledger)
        try:
            gate.release(
                SumSpec("r1.a1", "census", SILOS, census_schema(3, floor)), Recording(), SILOS, subject
            )
        except RepeatedRelease:
            return  # refused: the defence
        sent.append(vector.tolist())
    pytest.fail(f"one silo set got this silo's capped record counts at two floors: {sent}")


def load_silo_config_at(directory: Path):
    path = directory / "silo.toml"
    path.write_text(FLOORS)
    return load_silo_config(path)


# --- the upgrade past keys that name the data, with several studies' agents --------------------------------


def test_a_version_2_census_pin_binds_every_studys_agent_not_only_the_one_that_upgraded(tmp_path):
    """Regression: a silo gave its class presence over three silos before the upgrade (a version-2 key in its
    ledger). After the upgrade two studies' agents open the ledger: the first rewrites it with version-3
    keys, noting the old keys; the second opens the rewritten file. The operator asks the second agent
    (another study, another plan) for the presence again over four silos: refused, by the old pin."""
    four = (*SILOS, "d")
    presence = Subject("census", json.dumps(["cat", "dog"]).encode())
    older = {"survivors": {presence.v2_key(CONSORTIUM): list(SILOS)}, "censuses": {}, "disclosure": {}}
    (tmp_path / LEDGER).write_text(json.dumps(older))
    readmission = ReleaseLedger(tmp_path)  # upgrades the file
    imaging = ReleaseLedger(tmp_path)  # opens the upgraded file
    assert json.loads((tmp_path / LEDGER).read_text())["v2"] == [presence.v2_key(CONSORTIUM)]
    for ledger in (readmission, imaging):
        gate = ReleaseGate(consortium=CONSORTIUM, floors=Floors(), members=lambda: four, ledger=ledger)
        with pytest.raises(RepeatedRelease, match="recorded before this version"):
            gate.release(SumSpec("r1.a1", "census", four, census_schema(3, 0)), Recording(), four, presence)


# --- the silo's one roster and revocations, as each study's agent acts on them ------------------------------


@pytest.fixture
def pki(tmp_path):
    return Pki(tmp_path / "pki")


def test_a_revocation_one_studys_agent_took_stops_every_studys_agent_counting_that_member(pki, tmp_path):
    """The attack (the operator holds the key of a member it expelled, delta, as in
    tests/test_roster_quorum.py): two studies' agents run on one state directory; the operator relays the
    CRL that revokes delta to study A's agent, which writes it to the silo's revoked.json, and relays none to
    study B's agent. Then it offers study B's agent a roster adding two Sybils, signed by alpha, bravo and
    delta: 3 of 4, the quorum, counting delta. A silo with one agent refuses it (delta is revoked); B's
    agent never re-read the silo's revocations and adopts it, and writes it as the silo's one pinned roster,
    which study A's agent takes from the disk at its next offer. Reading revoked.json (under its lock) before
    each check, as the pinned roster is, would count the silo's revocations in every agent."""
    readmission, imaging = (pki.silo(pki.v1, tmp_path, crl=None) for _ in range(2))
    revoke(pki.ca, silo_id="delta", expel=True)
    readmission.offer_crl((pki.ca / "crl.pem").read_bytes())
    imaging.offer_crl(b"")  # the aggregator relays no CRL to this study's agent
    sybils = pki.signed(pki.with_sybils(pki.v1), ("alpha", "bravo", "delta"), pinned=pki.v1)
    adopted = imaging.offer_roster(sybils.to_json())
    pinned = Roster.read(tmp_path / "state" / "roster.json")
    assert (adopted, pinned.silo_ids) == (False, MEMBERS), f"the silo pinned {pinned.silo_ids}"


def test_a_member_one_studys_agent_saw_removed_is_no_member_to_another_studys_agent(pki, tmp_path):
    """The attack: study A's agent adopts roster v2, which a quorum signed to remove delta (whose key the
    operator may hold); the operator never offers v2 to study B's agent, which goes on listing delta as a
    member (its release gate's `members`, the peers it accepts), although the silo's pinned roster is v2."""
    readmission, imaging = (pki.silo(pki.v1, tmp_path, crl=None) for _ in range(2))
    without_delta = MEMBERS[:3]
    v2 = pki.signed(pki.roster(without_delta, previous=pki.v1), without_delta, pinned=pki.v1)
    assert readmission.offer_roster(v2.to_json())
    assert Roster.read(tmp_path / "state" / "roster.json").version == 2
    assert imaging.current().silo_ids == without_delta
