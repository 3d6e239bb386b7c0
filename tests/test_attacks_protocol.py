"""Attack (g): a malicious aggregator against the real silo code, in both directions.

Each attack must leak against the naive design (so the attack itself works and the contrast is real) and
must be refused by what silos run (so an audited finding fails the audit only if a silo's check is gone). The
last tests take a check away (monkeypatched) and watch the audited finding turn into a leak, so a finding's
`leaked` is measured, never written down.
"""

from __future__ import annotations

import numpy as np
import pytest

from attacks import protocol
from attacks.audit import Finding
from attacks.blind_sums import chosen_totals
from attacks.ckks_sums import SILOS, chosen_sums
from privacy.blind import halves as blind_halves
from privacy.peers import KeyPeers
from privacy.secagg.settings import SessionPolicy
from silo.releases import ReleaseLedger


def by_mode(findings: list[Finding]) -> dict[str, Finding]:
    return {f.mode: f for f in findings}


@pytest.fixture(scope="module")
def presence() -> dict[str, Finding]:
    return by_mode(protocol.presence_intersection(seed=0))


@pytest.fixture(scope="module")
def attempts() -> dict[str, Finding]:
    return by_mode(protocol.two_attempts(seed=0))


@pytest.fixture(scope="module")
def blind_attempts() -> dict[str, Finding]:
    return by_mode(protocol.two_attempts(seed=0, layer="blind"))


@pytest.fixture(scope="module")
def views() -> list[Finding]:
    return protocol.split_views(seed=0)


def test_presence_intersection_recovers_every_bit_from_a_census_per_round(presence):
    """Guards the attack itself: over changing silo sets, a census per round reveals every silo's classes."""
    naive = presence["census every round"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["bits_recovered"] == 1.0
    assert naive.metrics["system_rank"] == protocol.SILOS
    assert naive.metrics["rounds_with_class_rows"] == naive.metrics["rounds"]


def test_the_secagg_layer_leaves_the_intersection_nothing_beyond_its_one_census(presence):
    """Guards the census-once rule and the tail guard: per-class rows go out in one round's sum only, so the
    aggregator knows no bit beyond what the census's counts imply (a class none or all of its silos hold)."""
    real = presence["secagg + tail guard"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["bits_beyond_census"] == 0.0
    assert real.metrics["bits_recovered"] == real.metrics["bits_from_census_counts"] < 0.5
    assert real.metrics["rounds_with_class_rows"] == 1.0
    assert real.metrics["system_rank"] == 1.0


@pytest.mark.parametrize("seed", [1, 2])
def test_the_presence_findings_hold_for_other_seeds(seed):
    """Guards against a finding that holds for one lucky draw of holdings and schedules only."""
    found = by_mode(protocol.presence_intersection(seed=seed))
    assert found["census every round"].metrics["bits_recovered"] == 1.0
    assert found["secagg + tail guard"].metrics["bits_beyond_census"] == 0.0


def test_the_presence_solver_uses_that_bits_are_zero_or_one():
    """Guards the solver's strength: a sum of 2 over two silos pins both bits, a sum of 1 pins neither, a sum
    over one silo pins it, though none of these systems has full rank."""
    truth = np.zeros((protocol.SILOS, protocol.CLASSES), dtype=int)
    truth[[0, 1], 0] = 1
    truth[2, 1] = 1
    both = [[((0, 1), 2)]] + [[] for _ in range(protocol.CLASSES - 1)]
    either = [[((1, 2), 1)], [((1, 2), 1)]] + [[] for _ in range(protocol.CLASSES - 2)]
    alone = [[((3,), 0)]] + [[] for _ in range(protocol.CLASSES - 1)]
    assert protocol._recovered(both, truth) * truth.size == 2
    assert protocol._recovered(either, truth) == 0.0
    assert protocol._recovered(alone, truth) * truth.size == 1


def test_two_attempts_against_silos_that_forget_give_the_late_silos_contribution(attempts):
    """Guards the attack itself: the difference of two attempts' sums is the late silo's contribution."""
    naive = attempts["silos without a release ledger"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["second_sums_formed"] == 1.0
    assert naive.metrics["max_abs_error"] < 1e-6 < naive.metrics["contribution_max_abs"]


def test_the_release_ledger_refuses_the_second_survivor_set(attempts):
    """Guards the silos' release ledger: the silos of the first attempt refuse to sign the second set, so no
    second sum is formed and there is nothing to subtract."""
    real = attempts["silo release gate"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["first_sums_formed"] == 1.0
    assert real.metrics["second_sums_formed"] == 0.0
    assert real.metrics["silos_refusing"] == len(protocol.FIRST)
    assert "would let the aggregator subtract the two sums" in real.note


@pytest.mark.parametrize("relabel", [r for r in protocol.RELABELS if r])
def test_a_relabelled_second_attempt_subtracts_against_a_ledger_keyed_by_labels(attempts, relabel):
    """Guards the attack itself (issue 30, finding 1): the same state under a new plan text or seed is a new
    key for a ledger keyed by the RoundSpec's labels, and the difference of the sums is the late silo's input
    (exactly for a comment, to within the seed's wobble for a new seed)."""
    naive = attempts[f"ledger keyed by the RoundSpec's labels ({relabel})"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["second_sums_formed"] == 1.0
    assert naive.metrics["max_abs_error"] < 0.05 * naive.metrics["contribution_max_abs"]


@pytest.mark.parametrize("relabel", [r for r in protocol.RELABELS if r])
def test_the_release_gate_refuses_a_relabelled_second_attempt(attempts, relabel):
    """Guards the ledger's key (the state trained from, not the labels): a relabelled attempt meets the same
    key, and the first attempt's silos refuse the second set."""
    real = attempts[f"silo release gate ({relabel})"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["second_sums_formed"] == 0.0
    assert real.metrics["silos_refusing"] == len(protocol.FIRST)
    assert "would let the aggregator subtract the two sums" in real.note


BLIND = f"blind, aggregator + silo {protocol.COLLUDER}: "


def test_under_blind_a_silo_of_both_attempts_reads_both_sums_against_silos_that_forget(blind_attempts):
    """Guards the attack itself under blind, where only silos read the sums: a silo of the first attempt
    colluding with the aggregator reads both sums, whose difference is the late silo's contribution."""
    naive = blind_attempts[BLIND + "silos without a release ledger"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.party == f"aggregator + 1 colluding silo ({protocol.COLLUDER})"
    assert naive.metrics["second_sums_formed"] == 1.0
    assert naive.metrics["max_abs_error"] < 1e-6 < naive.metrics["contribution_max_abs"]


def test_under_blind_the_aggregator_alone_subtracts_two_totals_to_noise(blind_attempts):
    """Against the same forgetful silos both totals are formed, but each carries its attempt's fresh output
    masks, which only silos can remove: no coordinate of the late silo's contribution comes out."""
    alone = blind_attempts["blind, the aggregator alone: silos without a release ledger"]
    assert (alone.leaked, alone.audited, alone.party) == (False, True, protocol.AGGREGATOR)
    assert alone.metrics["second_sums_formed"] == 1.0
    assert alone.metrics["coordinates_recovered"] == 0.0


def test_without_the_output_mask_the_blind_aggregator_alone_would_subtract_the_attempts(monkeypatch):
    """Guards that the aggregator-alone finding is measured: with no output mask added or removed, the
    total the aggregator hands out is the sum, and two attempts give the late silo's contribution."""
    monkeypatch.setattr(blind_halves, "add_mask", lambda *args: None)
    monkeypatch.setattr(blind_halves, "remove_masks", lambda *args: None)
    found = by_mode(protocol.two_attempts(seed=0, layer="blind"))
    alone = found["blind, the aggregator alone: silos without a release ledger"]
    assert alone.leaked
    assert alone.metrics["coordinates_recovered"] == 1.0


@pytest.mark.parametrize("relabel", [r for r in protocol.RELABELS if r])
def test_under_blind_a_relabelled_second_attempt_subtracts_against_a_ledger_keyed_by_labels(
    blind_attempts, relabel
):
    """Guards the attack itself under blind: the colluding silo reads the relabelled second sum too."""
    naive = blind_attempts[BLIND + f"ledger keyed by the RoundSpec's labels ({relabel})"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["second_sums_formed"] == 1.0
    assert naive.metrics["max_abs_error"] < 0.05 * naive.metrics["contribution_max_abs"]


@pytest.mark.parametrize("relabel", list(protocol.RELABELS))
def test_under_blind_the_release_gate_refuses_a_second_attempt_whatever_its_labels(blind_attempts, relabel):
    """Guards the ledger's key under blind: the first attempt's silos, the colluder among them, refuse to
    sign the second set, so no silo reads a second sum (a new round id and attempt in every case; the plan's
    text, the seed or the round number changed too)."""
    real = blind_attempts[BLIND + "silo release gate" + (f" ({relabel})" if relabel else "")]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["first_sums_formed"] == 1.0
    assert real.metrics["second_sums_formed"] == 0.0
    assert real.metrics["silos_refusing"] == len(protocol.FIRST)
    assert "would let the aggregator subtract the two sums" in real.note


@pytest.fixture(scope="module")
def censuses() -> dict[str, Finding]:
    return by_mode(protocol.census_relabels(seed=0))


@pytest.fixture(scope="module")
def blind_censuses() -> dict[str, Finding]:
    return by_mode(protocol.census_relabels(seed=0, layer="blind"))


def test_censuses_under_new_seeds_give_every_silos_presence_against_label_keys(censuses):
    """Guards the attack itself (issue 30, finding 2): a census over all silos and one over each leave-one-out
    set, each under a new seed, recover every presence bit from silos that key the census by labels."""
    naive = censuses["census keyed by the RoundSpec's labels"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["censuses_formed"] == 1 + len(protocol.CENSUS_SILOS)
    assert naive.metrics["bits_recovered"] == 1.0


def test_the_release_gate_gives_a_silos_presence_over_one_set_only(censuses):
    """Guards the census's key (the presence sent, not the labels): every leave-one-out census is refused by
    the silos of the first, so nothing beyond the first census's counts is known."""
    real = censuses["silo release gate"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["censuses_formed"] == 1.0
    assert real.metrics["bits_recovered"] == real.metrics["bits_from_one_census"]
    assert "would let the aggregator subtract the two sums" in real.note


def test_under_blind_censuses_under_new_seeds_give_the_colluder_every_other_silos_presence(blind_censuses):
    """Guards the attack itself under blind: the colluding silo reads every census it is in (all but the
    one without it), so against label keys it gets the presence of every other silo."""
    naive = blind_censuses[BLIND + "census keyed by the RoundSpec's labels"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["censuses_formed"] == len(protocol.CENSUS_SILOS)
    others = (len(protocol.CENSUS_SILOS) - 1) / len(protocol.CENSUS_SILOS)
    assert naive.metrics["bits_recovered"] >= others


def test_under_blind_the_release_gate_gives_a_silos_presence_over_one_set_only(blind_censuses):
    real = blind_censuses[BLIND + "silo release gate"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["censuses_formed"] == 1.0
    assert real.metrics["bits_recovered"] == real.metrics["bits_from_one_census"]
    assert "would let the aggregator subtract the two sums" in real.note


def test_split_views_on_a_bare_majority_recover_the_victims_input_with_one_colluder(views):
    """Guards the attack itself: at threshold 3 of 5 one colluder and the aggregator rebuild both seeds."""
    (naive,) = [f for f in views if f.mode == "silos without a session policy" and "victim" in f.target]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["colluders_needed"] == 1.0
    assert naive.metrics["recovered"] == 1.0


def test_the_default_threshold_needs_2t_minus_n_colluders(views):
    """Guards the honest silos' signature checks: at the default threshold (4 of 5) one colluder fewer than
    2t − n learns nothing, and exactly 2t − n do (the bound the threat model states)."""
    (real,) = [f for f in views if f.mode == "silo session policy" and "victim" in f.target]
    assert (real.leaked, real.audited) == (False, True)
    t, n = real.metrics["threshold"], real.metrics["silos"]
    assert real.metrics["colluders"] == 2 * t - n - 1
    assert real.metrics["colluders_needed"] == 2 * t - n


@pytest.mark.parametrize(
    ("target", "refusal"),
    [
        ("bare-majority", "threshold 3 of 5 share holders is not above 2/3"),
        ("two silos", "2 silos in the contribution sum"),
        ("threshold 6 of 9", "threshold 6 of 9"),
        ("2 neighbours over 12 silos", "accepts only the complete graph"),
        ("census on a 2-neighbour graph", "threshold 2 of 3 share holders is not above 2/3"),
    ],
)
def test_the_silo_policy_refuses_every_weak_session(views, target, refusal):
    """Guards the default silo policy: each weak session is refused, with its reason in the report."""
    (found,) = [f for f in views if f.mode == "silo session policy" and target in f.target]
    assert (found.leaked, found.audited) == (False, True)
    assert found.metrics["refused"] == 1.0
    assert refusal in found.note


def test_a_two_silo_sum_without_a_policy_gives_the_other_silos_input_away(views):
    """Guards the contrast: the two-silo session the policy refuses really does leak when run."""
    (naive,) = [f for f in views if f.mode == "silos without a session policy" and "two silos" in f.target]
    assert (naive.leaked, naive.audited) == (True, False)


@pytest.mark.parametrize(
    ("target", "refusal"),
    [
        ("without silo-02", "signed a different view of this round"),
        ("replaced by the aggregator's", "signature does not verify"),
    ],
)
def test_silos_shown_different_key_lists_never_reveal_shares(views, target, refusal):
    """Guards the clients' key-list checks: a silo shown a list its peers were not (a peer left out, or keys
    the aggregator made) stops before revealing any share for that view."""
    (found,) = [f for f in views if f.mode == "secagg client checks" and target in f.target]
    assert (found.leaked, found.audited) == (False, True)
    assert found.metrics["deceived_silos_revealing"] == 0.0
    assert found.metrics["envelopes_opened_by_aggregator"] == 0.0
    assert refusal in found.note


def test_protocol_findings_are_all_of_them_and_fail_no_audited_mode():
    """Guards the audit's verdict on attack (g): every audited finding holds, every contrast leaks."""
    findings = protocol.protocol_findings(seed=0)
    assert {f.attack for f in findings} == {
        "protocol: presence intersection",
        "protocol: two attempts",
        "protocol: census relabelled",
        "protocol: split views",
        "protocol: ckks chosen sum",
        "protocol: blind chosen total",
    }
    secagg, blind = 2 * len(protocol.RELABELS), 2 * len(protocol.RELABELS) + 1  # blind: the aggregator alone
    assert len(findings) == 2 + secagg + blind + 2 + 2 + 10 + 2 + 2
    assert not [f for f in findings if f.audited and f.leaked]
    assert all(f.leaked for f in findings if not f.audited)
    assert all(isinstance(v, float) for f in findings for v in f.metrics.values())


@pytest.fixture(scope="module")
def chosen() -> dict[str, Finding]:
    return by_mode(chosen_sums(seed=0))


@pytest.fixture(scope="module")
def chosen_blind() -> dict[str, Finding]:
    return by_mode(chosen_totals(seed=0))


def test_a_ckks_aggregator_handing_silos_different_sums_reads_one_silos_counts_where_they_decrypt_anything(
    chosen,
):
    """Guards the attack itself (issue 30, finding 3): the victim given the true sum and the rest `E + P`, the
    evaluation sum's count of the forced class is the victim's own held-out count."""
    naive = chosen["silos decrypting what they are handed"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["read"] == naive.metrics["victims_count"] > 0


def test_the_ckks_consistency_step_leaves_no_silo_decrypting_a_split_sum(chosen):
    real = chosen["silo consistency step"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["silos_decrypting"] == 0.0
    assert real.metrics["silos_refusing"] == len(SILOS)


def test_a_blind_aggregator_handing_silos_different_totals_reads_one_silos_counts_against_round_bound_masks(
    chosen_blind,
):
    """Guards the attack itself under blind, where silos sign no total they are handed: the victim's total
    forces its model to class k, the others' to class 0, and with evaluation masks bound to the round alone
    the summed correct count of class k is the victim's own held-out count."""
    naive = chosen_blind["evaluation masks bound to the round alone"]
    assert (naive.leaked, naive.audited) == (True, False)
    assert naive.metrics["read"] == naive.metrics["victims_count"] > 0


def test_blind_evaluation_masks_bound_to_the_stepped_state_leave_a_split_total_as_no_counts(chosen_blind):
    """Guards the binding `silo.stepping.step_and_report` gives blind's evaluation sum: silos that stepped to
    different states drew their masks for different sums, so none cancel, and no silo reports."""
    real = chosen_blind["evaluation masks bound to the stepped state"]
    assert (real.leaked, real.audited) == (False, True)
    assert real.metrics["silos_reporting"] == 0.0
    assert "no counts (masks left over)" in real.note


def test_the_findings_are_deterministic(
    presence, attempts, blind_attempts, censuses, blind_censuses, views, chosen, chosen_blind
):
    """Guards reproducible reports: fresh keys and masks every run, the same findings every run."""
    again = protocol.protocol_findings(0)
    first = [
        *presence.values(),
        *attempts.values(),
        *blind_attempts.values(),
        *censuses.values(),
        *blind_censuses.values(),
        *views,
        *chosen.values(),
        *chosen_blind.values(),
    ]
    assert [(f.mode, f.target, f.metrics, f.leaked) for f in again] == [
        (f.mode, f.target, f.metrics, f.leaked) for f in first
    ]


def test_a_ledger_that_never_refuses_makes_the_audited_findings_leak(monkeypatch):
    """Guards that the ledger findings are measured: take the ledger's check away and the attacks succeed."""
    monkeypatch.setattr(ReleaseLedger, "pin_survivors", lambda self, key, survivors, what: None)
    for layer, prefix in (("secagg", ""), ("blind", BLIND)):
        found = by_mode(protocol.two_attempts(seed=0, layer=layer))
        real = [f for mode, f in found.items() if mode.startswith(prefix + "silo release gate")]
        assert len(real) == len(protocol.RELABELS)
        assert all(f.leaked and f.metrics["second_sums_formed"] == 1.0 for f in real)
        census = by_mode(protocol.census_relabels(seed=0, layer=layer))[prefix + "silo release gate"]
        assert census.leaked
        assert census.metrics["bits_recovered"] > census.metrics["bits_from_one_census"]


def test_a_policy_that_accepts_everything_makes_the_audited_findings_leak(monkeypatch):
    """Guards that the policy findings are measured: a policy without minimums accepts every weak session."""
    monkeypatch.setattr(SessionPolicy, "problems", lambda self, spec: [])
    weak = [f for f in protocol.split_views(seed=0) if f.mode == "silo session policy" and "weak" in f.target]
    assert len(weak) == 5
    assert all(f.leaked for f in weak)


def test_silos_that_check_no_signatures_fall_to_both_key_list_attacks(monkeypatch):
    """Guards that the key-list findings are measured: without signature checks a silo shown a list without
    a peer reveals shares, and silos given the aggregator's keys for silo-00 seal their shares to it."""
    monkeypatch.setattr(KeyPeers, "verify", lambda self, *args, **kwargs: None)
    found = {f.target: f for f in protocol._key_list_findings(seed=0)}
    assert all(f.leaked for f in found.values())
    (omitted,) = [f for t, f in found.items() if "without silo-02" in t]
    (planted,) = [f for t, f in found.items() if "replaced" in t]
    assert omitted.metrics["deceived_silos_revealing"] == 1.0
    assert planted.metrics["envelopes_opened_by_aggregator"] == 2.0
