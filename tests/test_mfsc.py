"""MFSC (DFL-FS stage 1): masked class means, the coverage they reveal, tail-first picking, and the rules
around the disclosure (config, the aggregator's bookkeeping, the silo's policy)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aggregator.config import load_consortium_config
from aggregator.picking import BadDisclosure, RoundPicker
from aggregator.store import Store
from fedlt.errors import ConfigError
from fedlt.methods import METHODS, MethodChoice
from fedlt.selection import (
    MASKS,
    MaskStream,
    SelectionBook,
    SelectionConfig,
    choose_participants,
    estimate_coverage,
    mask_stream,
    masked_class_means,
    tail_first,
)
from fedlt.sim.config import load_sim_config
from fedlt.sim.run import CHECKPOINT, run_simulation
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy.pki.signing import ROUNDSPEC_CONTEXT, sign
from silo import releases, work
from silo.admission import RefusedRound
from silo.agent import SiloAgent
from silo.config import PolicySection, load_silo_config
from silo.releases import ReleaseLedger
from silo.work import Work
from tests.consortium_harness import AUDIT_KEY, PLAN, write_kit
from tests.test_release_gate import shard
from tests.test_review_studies import Disclosures, disclosing_round
from tests.test_silo_refusals import check

CLASSES, DIM = 6, 32


def synthetic_silos(holdings: list[list[int]], seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Features of each silo: 20 samples per class it holds around that class's centre (ReLU-like, ≥ 0)."""
    gen = torch.Generator().manual_seed(seed)
    centres = 4 * torch.rand(CLASSES, DIM, generator=gen)
    silos = {}
    for k, classes in enumerate(holdings):
        y = torch.tensor(classes).repeat_interleave(20)
        z = (centres[y] + 0.5 * torch.randn(len(y), DIM, generator=gen)).clamp_min(0)
        silos[f"silo-{k}"] = (z, y)
    return silos


# silo-k's classes; class 5 is a tail class held by two silos, class 4 by three
HOLDINGS = [[0, 1, 2, 5], [0, 1, 3], [0, 2, 3, 4], [0, 1, 4], [1, 2, 3, 4, 5], [0, 3]]


def disclose(silos, mask: str, seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        s: masked_class_means(z, y, CLASSES, mask, stream(seed + k))
        for k, (s, (z, y)) in enumerate(silos.items())
    }


def stream(seed: int) -> MaskStream:
    """A mask keystream for tests, one per seed."""
    return MaskStream(seed.to_bytes(32, "little"))


def test_a_one_sample_class_mean_is_that_sample_so_silos_disclose_small_classes_as_masks():
    """Under an encoder the aggregator chose to be the identity, a class mean is an input mean: a class of one
    sample is that sample. The attack works at min_samples = 1; the default discloses a mask instead."""
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(41, DIM, generator=gen)
    y = torch.tensor([0] * 20 + [1] * 20 + [2])  # class 2: one patient
    identity = x  # the features an identity-like first layer hands back
    leaked = masked_class_means(identity, y, CLASSES, "gaussian", stream(0), min_samples=1)
    assert torch.allclose(leaked[2], x[40].double())
    default = SelectionConfig().min_samples
    assert default >= 5
    guarded = masked_class_means(identity, y, CLASSES, "gaussian", stream(0), min_samples=default)
    assert not torch.allclose(guarded[2], x[40].double(), atol=1e-3)
    assert torch.allclose(guarded[0], x[:20].double().mean(0))  # classes with enough samples are unchanged


def test_mask_keystream_is_chacha20_known_answer_and_uniform():
    """RFC 8439 A.1, test vector 1 (zero key, zero nonce, counter 0): the keystream starts 76 b8 e0 ad a0 f1
    3d 90, so the first draw is that little-endian word's top 53 bits."""
    first = MaskStream(bytes(32)).uniform(1).item()
    word = int.from_bytes(bytes.fromhex("76b8e0ada0f13d90"), "little")
    assert first == (word >> 11) * 2.0**-53
    draws = MaskStream(b"k" * 32).uniform(100_000)
    assert draws.min() >= 0.0
    assert draws.max() < 1.0
    assert abs(draws.mean().item() - 0.5) < 0.01


def truth(holdings: list[list[int]]) -> dict[str, torch.Tensor]:
    return {f"silo-{k}": torch.isin(torch.arange(CLASSES), torch.tensor(c)) for k, c in enumerate(holdings)}


@pytest.mark.parametrize("mask", MASKS)
def test_masked_means_are_exact_for_held_classes_and_masked_elsewhere(mask):
    z, y = synthetic_silos([[0, 2, 5]])["silo-0"]
    means = masked_class_means(z, y, CLASSES, mask, stream(1))
    assert means.shape == (CLASSES, DIM)
    assert torch.isfinite(means).all()
    for c in (0, 2, 5):
        assert torch.allclose(means[c], z[y == c].double().mean(0))
    again = masked_class_means(z, y, CLASSES, mask, stream(1))
    assert torch.equal(means, again)  # seeded: a resumed run discloses the same values
    other = masked_class_means(z, y, CLASSES, mask, stream(2))
    assert not torch.equal(means[[1, 3, 4]], other[[1, 3, 4]])
    # a range or sign test does not single masks out: every coordinate within the real means' range
    real = means[[0, 2, 5]]
    masks = means[[1, 3, 4]]
    assert (masks >= real.min(0).values).all()
    assert (masks <= real.max(0).values).all()
    assert not any(torch.allclose(m, r) for m in masks for r in real)


@pytest.mark.parametrize("mask", MASKS)
def test_a_silo_holding_one_class_does_not_mask_with_copies_of_its_mean(mask):
    z, y = synthetic_silos([[3]])["silo-0"]
    means = masked_class_means(z, y, CLASSES, mask, stream(0))
    others = means[[0, 1, 2, 4, 5]]
    assert not any(torch.allclose(m, means[3]) for m in others)
    assert len(torch.unique(others, dim=0)) == 5


def test_masks_are_keyed_by_a_secret_the_aggregator_does_not_have():
    z, y = synthetic_silos([[0, 2, 5]])["silo-0"]

    def masks(secret: bytes, state: str) -> torch.Tensor:
        return masked_class_means(z, y, CLASSES, "gaussian", mask_stream(secret, state))[[1, 3, 4]]

    # every attempt, under any round label, of one state: one answer; another state, other masks
    assert torch.equal(masks(b"k" * 32, "state-a"), masks(b"k" * 32, "state-a"))
    assert not torch.equal(masks(b"k" * 32, "state-a"), masks(b"k" * 32, "state-b"))
    assert not torch.equal(masks(b"k" * 32, "state-a"), masks(b"j" * 32, "state-a"))


def test_an_unknown_mask_is_refused():
    z, y = synthetic_silos([[0]])["silo-0"]
    with pytest.raises(ValueError, match="unknown mask"):
        masked_class_means(z, y, CLASSES, "zeros", stream(0))


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clustering_recovers_the_coverage_of_a_constructed_case(mask, seed):
    estimate = estimate_coverage(disclose(synthetic_silos(HOLDINGS, seed), mask, seed), separation=2.0)
    expected = truth(HOLDINGS)
    for silo, holds in estimate.items():
        assert torch.equal(holds, expected[silo]), silo


def test_two_silos_with_the_same_data_do_not_upset_everyone_elses_estimate():
    silos = synthetic_silos(HOLDINGS)
    disclosed = disclose(silos, "gaussian")
    disclosed["silo-6"] = disclosed["silo-0"].clone()  # the same data, and the same mask secret
    estimate = estimate_coverage(disclosed, separation=2.0)
    everything = torch.ones(CLASSES, dtype=torch.bool)  # the twins corroborate each other's masks too
    expected = {**truth(HOLDINGS), "silo-0": everything, "silo-6": everything}
    for silo, holds in estimate.items():
        assert torch.equal(holds, expected[silo]), silo


def test_a_class_held_by_one_silo_reads_as_missing_and_full_coverage_as_full():
    alone = [[0, 1, 5], [0, 1], [0, 1]]  # nobody corroborates silo-0's class 5
    estimate = estimate_coverage(disclose(synthetic_silos(alone), "gaussian"), separation=2.0)
    assert not estimate["silo-0"][5]
    assert estimate["silo-0"][:2].all()
    everything = [list(range(CLASSES))] * 4  # no mask anywhere: one mode of distances
    estimate = estimate_coverage(disclose(synthetic_silos(everything), "gaussian"), separation=2.0)
    assert all(holds.all() for holds in estimate.values())


def test_tail_first_covers_the_rarest_class_and_rotates_among_its_holders():
    coverage = truth(HOLDINGS)
    candidates = sorted(coverage)
    rng = np.random.default_rng(0)
    picked = tail_first(candidates, 2, coverage, {}, rng)
    assert {"silo-0", "silo-4"} & set(picked), "a holder of class 5, the rarest"
    # silo-0 and silo-4 hold class 5; the one picked more recently waits
    assert "silo-4" in tail_first(candidates, 2, coverage, {"silo-0": 3, "silo-4": 1}, rng)
    assert "silo-0" in tail_first(candidates, 2, coverage, {"silo-0": 1, "silo-4": 3}, rng)
    # with room for everyone, every class is covered
    picked = tail_first(candidates, 3, coverage, {}, rng)
    assert torch.stack([coverage[s] for s in picked]).any(0).all()


def test_silos_that_have_not_disclosed_are_picked_first():
    coverage = {s: v for s, v in truth(HOLDINGS).items() if s != "silo-5"}
    picked = tail_first(sorted([*coverage, "silo-5"]), 2, coverage, {}, np.random.default_rng(0))
    assert "silo-5" in picked


def test_random_and_full_participation():
    silos = [f"silo-{k}" for k in range(10)]
    book = SelectionBook()
    everyone = choose_participants(SelectionConfig(), silos, 1, 0, book)
    assert everyone == silos
    three = SelectionConfig(per_round=3)
    picks = [choose_participants(three, silos, r, 0, book) for r in range(1, 6)]
    assert all(len(p) == 3 and p == sorted(p) for p in picks)
    assert picks[0] == choose_participants(three, silos, 1, 0, book)  # seeded by (seed, round)
    assert len({tuple(p) for p in picks}) > 1


def test_selection_settings_are_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match="per_round must be at least 1"):
        load_sim_config(None, {"selection": "mfsc"})
    with pytest.raises(ConfigError, match=r"data\.silos is only 10"):
        load_sim_config(None, {"per_round": 11})
    with pytest.raises(ConfigError, match=r"selection\.strategy"):
        load_sim_config(None, {"per_round": 2, "selection": "clustered"})
    config = tmp_path / "consortium.toml"
    config.write_text('[consortium]\nmin_silos = 3\n[selection]\nper_round = 2\nstrategy = "mfsc"\n')
    with pytest.raises(ConfigError, match=r"cannot make consortium\.min_silos"):
        load_consortium_config(config)
    config.write_text("[consortium]\nmin_silos = 2\n[secagg]\nthreshold = 4\n[selection]\nper_round = 3\n")
    with pytest.raises(ConfigError, match=r"secagg\.threshold: 4 survivors can never come from 3 silos"):
        load_consortium_config(config)


def test_simulator_picks_silos_scores_mfsc_and_resumes_identically(tmp_path):
    flags = {"dataset": "digits", "silos": 4, "imbalance": 10.0, "per_round": 2, "selection": "mfsc"}
    straight = run_simulation(
        load_sim_config(None, {**flags, "rounds": 3}), tmp_path / "a", echo=lambda _: None
    )
    rounds = straight.metrics["rounds"]
    assert all(len(r["participants"]) == 2 for r in rounds)
    assert all(0.0 <= r["coverage_error"] <= 1.0 for r in rounds)
    run_simulation(load_sim_config(None, {**flags, "rounds": 2}), tmp_path / "b", echo=lambda _: None)
    saved = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=True)["selection"]
    book = SelectionBook.from_dict(saved)
    assert sorted(book.disclosures) == [f"silo-{k}" for k in range(4)]
    assert book.last_picked == {s: r["round"] for r in rounds[:2] for s in r["participants"]}
    resumed = run_simulation(
        load_sim_config(None, {**flags, "rounds": 3}), tmp_path / "b", echo=lambda _: None
    )
    assert resumed.state.digest() == straight.state.digest()
    assert [r["participants"] for r in resumed.metrics["rounds"]] == [r["participants"] for r in rounds]


# --- the aggregator's side ---------------------------------------------------------------------------


def picker_with(tmp_path, policies: dict[str, list[str]]) -> tuple[RoundPicker, Store]:
    store = Store(tmp_path / "consortium.sqlite", audit_key=AUDIT_KEY)
    for silo, disclosures in policies.items():
        store.register_silo(silo, "0" * 64, "test", {"disclosures": disclosures})
    plan = replace(PLAN, selection=SelectionConfig(per_round=2, strategy="mfsc"))
    method = plan.build_method()
    return RoundPicker(plan.selection, 0, store, method), store


def test_nobody_is_asked_to_disclose_unless_every_connected_silo_accepts(tmp_path):
    picker, store = picker_with(tmp_path, {"silo-0": ["mfsc"], "silo-1": ["mfsc"], "silo-2": []})
    picked, disclosers = picker.pick(True, 1, ["silo-0", "silo-1", "silo-2"])
    assert disclosers == []
    assert len(picked) == 2
    declined = [r.detail for r in store.audit_log() if r.event == "disclosure_declined"]
    assert declined == [{"round": 1, "name": "mfsc", "silos": ["silo-2"]}]
    picked, disclosers = picker.pick(True, 1, ["silo-0", "silo-1"])
    assert disclosers == ["silo-0", "silo-1"]
    store.close()


def test_disclosures_are_checked_kept_audited_and_survive_a_restart(tmp_path):
    picker, store = picker_with(tmp_path, {"silo-0": ["mfsc"]})
    shape = picker.shape
    good = torch.rand(shape, dtype=torch.float64)
    with pytest.raises(BadDisclosure, match="matrix"):
        picker.accept("silo-0", "r1.a1.x", "mfsc", (shape[0], shape[1] + 1), good.numpy().tobytes())
    bad = good.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(BadDisclosure, match="not finite"):
        picker.accept("silo-0", "r1.a1.x", "mfsc", shape, bad.numpy().tobytes())
    with pytest.raises(BadDisclosure, match="unknown disclosure"):
        picker.accept("silo-0", "r1.a1.x", "labels", shape, good.numpy().tobytes())
    digest = picker.accept("silo-0", "r1.a1.x", "mfsc", shape, good.numpy().tobytes())
    assert digest == hashlib.sha256(good.numpy().tobytes()).hexdigest()
    audited = [r.detail for r in store.audit_log() if r.event == "disclosure_received"]
    assert audited == [{"round_id": "r1.a1.x", "silo": "silo-0", "name": "mfsc", "sha256": digest}]
    store.save_initial_state("c", b"")
    _, round_id = store.begin_attempt(1, ["silo-0"], "x")
    store.commit_round(
        round_number=1,
        round_id=round_id,
        digest="d",
        data=b"",
        contributors=["silo-0"],
        picked=["silo-0"],
        disclosures={"silo-0": ("mfsc", good.numpy().tobytes())},
    )
    _, closing = store.begin_attempt(2, ["silo-0", "silo-1"], "x")  # a closing round: nobody was picked
    store.commit_round(round_number=2, round_id=closing, digest="e", data=b"", contributors=["silo-0"])
    store.close()
    store = Store(tmp_path / "consortium.sqlite", audit_key=AUDIT_KEY)
    reopened = RoundPicker(picker.selection, 0, store, picker.method)
    assert torch.equal(reopened.book.disclosures["silo-0"], good)
    assert reopened.book.last_picked == {"silo-0": 1}
    store.close()


def test_a_retry_picks_around_silos_that_let_the_first_attempt_down(tmp_path):
    picker, store = picker_with(tmp_path, {f"silo-{k}": ["mfsc"] for k in range(4)})
    connected = [f"silo-{k}" for k in range(4)]
    first, _ = picker.pick(True, 1, connected)
    retry, disclosers = picker.pick(True, 1, connected, avoid=first[:1])
    assert first[0] not in retry
    assert len(retry) == 2
    assert disclosers == connected  # every connected silo is still asked
    everyone_failed, _ = picker.pick(True, 1, connected, avoid=connected[:3])  # too few left: pick anyway
    assert len(everyone_failed) == 2
    store.close()


# --- the silo's side ---------------------------------------------------------------------------------


def test_a_silo_refuses_a_round_asking_for_a_disclosure_its_policy_does_not_allow(tmp_path):
    plan = replace(PLAN, method=MethodChoice("dflfs", METHODS["dflfs"].Options()))
    silo_configs = write_kit(tmp_path, consortium_id="c", plan=plan)
    agent = SiloAgent(load_silo_config(silo_configs[0]))
    agent.standing.silo_id = "silo-0"
    agent.standing.aggregator_pem = (tmp_path / "pki" / "aggregator.pem").read_bytes()
    plan_toml = plan.to_toml()
    spec = round_pb2.RoundSpec(
        consortium_id="c",
        round=1,
        round_id="r1.a1.x",
        method="dflfs",
        schema=schema_to_pb(plan.build_method().schema(plan.build_method().init_state(seed=0))),
        method_config=plan_toml,
        config_sha256=hashlib.sha256(plan_toml.encode()).hexdigest(),
        privacy="secagg",
        participants=["silo-0", "silo-1", "silo-2"],
        disclosures=["mfsc"],
        disclosers=["silo-0", "silo-1", "silo-2"],
        secagg=round_pb2.SecAggParameters(k_min=2),
    )
    blob = spec.SerializeToString()
    signed = round_pb2.SignedRoundSpec(
        spec=blob, signature=sign(tmp_path / "pki" / "aggregator.key", blob, context=ROUNDSPEC_CONTEXT)
    )
    with pytest.raises(RefusedRound, match=r"disclosures \['mfsc'\] are not allowed by policy.disclosures"):
        check(agent, signed)
    allowing = replace(agent.config, policy=replace(agent.config.policy, disclosures=("mfsc",)))
    agent.admission.config = allowing
    checked = check(agent, signed).spec
    assert list(checked.disclosers) == ["silo-0", "silo-1", "silo-2"]


def test_a_silos_mask_secret_is_its_own_kept_and_private(tmp_path):
    silo_configs = write_kit(tmp_path, consortium_id="c")
    first, second = (SiloAgent(load_silo_config(c)) for c in silo_configs[:2])
    secret = first.work.mask_secret()
    assert len(secret) == 32
    assert secret != second.work.mask_secret()
    first.state_lock.release()  # the first agent stops: its directory is free for the restart
    assert SiloAgent(load_silo_config(silo_configs[0])).work.mask_secret() == secret  # kept across restarts
    assert (first.state_dir / "mask.secret").stat().st_mode & 0o077 == 0


# --- one disclosure per state and data, whatever the plan asks later --------------------------------------


@pytest.fixture(scope="module")
def states_and_data():
    """Two seeded states of the tests' plan, and silo 0's data as the plan prepares it (its classes hold
    5, 47, 1, 16, 1, 29, 2, 4, 0 and 1 samples)."""
    method = PLAN.build_method()
    return method.init_state(seed=1), method.init_state(seed=2), shard(0)


def agent_work(state_dir, *, policy_minimum: int = 1) -> Work:
    policy = PolicySection(disclosures=("mfsc",), disclosure_min_samples=policy_minimum)
    ledger = ReleaseLedger(state_dir)
    return Work(
        state_dir, policy, ledger=ledger, plans=None, pending=None, standing=SimpleNamespace(), refuse=None
    )


def dropped_after_another(tmp_path, states_and_data, monkeypatch) -> Disclosures:
    """State S disclosed (gaussian masks, minimum 5), then another state, after which the ledger keeps the
    newest values only: S's values are dropped, its settings and digest kept."""
    monkeypatch.setattr(releases, "KEPT_DISCLOSURES", 1)
    state, other, prepared = states_and_data
    sent = Disclosures()
    agent_work(tmp_path).train(sent, disclosing_round(state, prepared))
    agent_work(tmp_path).train(sent, disclosing_round(other, prepared))
    assert ReleaseLedger(tmp_path).disclosure(f"{state.content_digest()}/{prepared.data_digest}") is None
    return sent


@pytest.mark.parametrize("later", [{"mask": "uniform"}, {"min_samples": 20}], ids=["mask", "minimum"])
def test_a_state_whose_disclosure_was_dropped_is_disclosed_again_as_the_same_bytes(
    tmp_path, states_and_data, monkeypatch, later
):
    """The attack of finding 2 past the ledger's bound on kept values: S handed back (another study's agent)
    with a plan asking for uniform masks, or a higher minimum (which would name each class's sample count),
    is made again with the mask and minimum S was first made with: the same bytes, so comparing the two
    tells no held class from a mask. The plan's settings alone would have given other bytes."""
    state, _, prepared = states_and_data
    sent = dropped_after_another(tmp_path, states_and_data, monkeypatch)
    agent_work(tmp_path).train(sent, disclosing_round(state, prepared, **later))
    first, _, again = sent.sent
    assert np.array_equal(first, again)
    fresh = Disclosures()
    agent_work(tmp_path / "fresh").train(fresh, disclosing_round(state, prepared, **later))
    assert not np.array_equal(first, fresh.sent[0])


def test_a_disclosure_made_again_as_other_bytes_is_not_sent(tmp_path, states_and_data, monkeypatch):
    """A silo whose features no longer compute to the same values (another thread count, another torch)
    would show its real class means beside the same masks moved otherwise: it discloses nothing."""
    state, _, prepared = states_and_data
    sent = dropped_after_another(tmp_path, states_and_data, monkeypatch)
    made = work.class_mean_disclosure
    monkeypatch.setattr(work, "class_mean_disclosure", lambda *a, **k: made(*a, **k) * (1 + 1e-12))
    agent_work(tmp_path).train(sent, disclosing_round(state, prepared))
    assert len(sent.sent) == 2


@pytest.mark.parametrize("dropped", [False, True], ids=["kept", "dropped"])
def test_a_disclosure_made_under_a_lower_minimum_than_the_policy_now_asks_is_not_sent_again(
    tmp_path, states_and_data, monkeypatch, dropped
):
    """The administrator raised policy.disclosure_min_samples: a state's disclosure made under the lower
    minimum is not sent again (it may never have reached the aggregator), kept or made again."""
    state, other, prepared = states_and_data
    monkeypatch.setattr(releases, "KEPT_DISCLOSURES", 1 if dropped else releases.KEPT_DISCLOSURES)
    sent = Disclosures()
    agent_work(tmp_path).train(sent, disclosing_round(state, prepared))
    agent_work(tmp_path).train(sent, disclosing_round(other, prepared))
    agent_work(tmp_path, policy_minimum=10).train(sent, disclosing_round(state, prepared))
    assert len(sent.sent) == 2
