"""The audit: every configured attack on what each party sees in every configured mode, as findings.

A finding names the attack, the mode, the party whose view it attacks, its target and its scores, and says
whether it crossed the grid's threshold. Image attacks are scored against two baselines: random images, and
the attacker's prior (its own data's class prototype, decoded), because a decoder draws a plausible digit from
anything; a leak is a reconstruction that beats both by the threshold. A release the layer withholds (a class
under the tail guard) leaves the attacker its prior.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from attacks import analytic, moments
from attacks.config import Mode
from attacks.decoder import FeatureDecoder, decode, prior, train_decoder
from attacks.feature_inversion import invert_features
from attacks.scenario import (
    Planted,
    Refused,
    Release,
    Scenario,
    Uploads,
    attacked_state,
    joined,
    method_for,
    released,
    silo_uploads,
    trained_state,
)
from attacks.scoring import best_match, image_report
from fedlt.aggregation import tail_guard
from fedlt.aggregation.sums import SumLayer, Sums
from fedlt.methods import GlobalState, ServerContext
from fedlt.methods.heads import extract_features

if TYPE_CHECKING:
    from attacks.epsilon import EpsilonAudit


@dataclass
class Finding:
    attack: str
    mode: str
    party: str
    target: str
    metrics: dict[str, float]
    leaked: bool
    audited: bool
    images: dict[str, np.ndarray] = field(default_factory=dict)  # "original", "recovered": (n, C, H, W)
    note: str = ""


# what a party reads of a round: every upload, the sums, the sum under the silos' output masks (the ring total
# the aggregator cannot unmask), or the sums less the input of a silo colluding with the aggregator
UPLOADS, SUMS, MASKED, COLLUDING = "uploads", "sums", "masked total", "sums less a colluder's input"
# each layer's parties an audit attacks, with what each reads
VIEWS: dict[str, tuple[tuple[str, str], ...]] = {
    "plaintext": (("aggregator, each silo's upload", UPLOADS),),
    "secagg": (("aggregator, the sum", SUMS),),
    "ckks": (("each silo, the decrypted sum (the aggregator holds ciphertexts)", SUMS),),
    "blind": (
        ("aggregator, the sum under every silo's output mask", MASKED),
        ("aggregator + one silo, the sum less that silo's input", COLLUDING),
    ),
}
# a masked total whose bytes a chi-square test tells from uniform below this p-value carries information: the
# aggregator reads it as the sum; above it, what it holds is independent of the inputs, and it keeps its prior
UNIFORM_P = 1e-6
EPSILON = "empirical ε"  # the attack name of the ε audit's findings


@dataclass(frozen=True)
class View:
    """One party's view of a mode's round, for a target: what it reads (None: nothing it can read), the
    planted records it attacks (a colluding silo's own are no target), why it reads nothing, and what was
    measured of a masked total."""

    party: str
    values: Mapping[str, torch.Tensor] | None
    planted: Planted
    note: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def colluder_for(holders: tuple[int, ...], silos: int) -> int:
    """The silo whose collusion is worth most against records at `holders`: a co-holder of their class when
    several hold it (its own records come out of the sum, the others' stay), else the first that holds
    none."""
    if len(holders) > 1:
        return holders[0]
    return min(set(range(silos)) - set(holders))


def attacked(planted: Planted, colluder: int) -> Planted:
    """`planted` without the colluder's own records."""
    kept = [(s, r) for s, r in zip(planted.silos, planted.records, strict=True) if s != colluder]
    return Planted(planted.label, tuple(s for s, _ in kept), tuple(r for _, r in kept))


def masked_reading(release: Release) -> tuple[Sums | None, str, dict[str, float]]:
    """What the aggregator makes of a ring total it cannot unmask: a chi-square test of its bytes against
    uniform (255 degrees of freedom) and the share of its coordinates that decode to the sum's exactly. A
    total it can tell from uniform it reads as the sum; one it cannot is independent of the inputs, so every
    attack on it is left with the attacker's prior."""
    ring = np.frombuffer(release.total, dtype=np.uint8)
    expected = len(ring) / 256
    chi2 = float(((np.bincount(ring, minlength=256) - expected) ** 2 / expected).sum())
    p = float(torch.special.gammaincc(torch.tensor(127.5, dtype=torch.float64), torch.tensor(chi2 / 2)))
    sums = release.sums
    decoded = release.codec.decode(ring.copy())
    read = float((decoded == sums.schema.flatten(dict(sums))).double().mean())
    metrics = {"total_bytes_uniform_p": p, "coordinates_read": read}
    if p >= UNIFORM_P:
        note = (
            f"withheld: the aggregator holds the sum only under the silos' output masks (its bytes uniform, "
            f"p = {p:.3g}; {read:.0%} of its coordinates are the sum's)"
        )
        return None, note, metrics
    return (
        SumLayer.seal(sums.schema, decoded, sums.contributors),
        "the total is not uniform: read as the sum",
        metrics,
    )


def check_views(modes: tuple[Mode, ...]) -> None:
    """Refuse, before any training, a grid with a mode whose layer the audit has no view of (a layer
    installed after this table was written): ValueError naming it."""
    unknown = sorted({m.privacy for m in modes} - set(VIEWS))
    if unknown:
        raise ValueError(
            f"the audit does not know what each party holds of a {', '.join(unknown)} round; it knows "
            f"{', '.join(VIEWS)} (attacks.audit.VIEWS)"
        )


class Audit:
    """Runs the grid; `progress(label)` is told of each step as it starts."""

    def __init__(self, scenario: Scenario, progress: Callable[[str], None] = lambda _: None) -> None:
        self.scenario = scenario
        self.config = scenario.config
        self.progress = progress
        self.model = _model(scenario)
        self._uploads: dict[tuple[str, float], Uploads] = {}
        self._released: dict[tuple[int, str], Release | None] = {}
        self._refusals: dict[tuple[int, str], str] = {}
        self._decoder: FeatureDecoder | None = None
        self._priors: dict[int, np.ndarray] = {}

    # --- shared pieces ---------------------------------------------------------------------------

    def uploads(self, method: str, epsilon: float) -> Uploads:
        key = (method, epsilon)
        if key not in self._uploads:
            self._uploads[key] = silo_uploads(self.scenario, method, epsilon)
        return self._uploads[key]

    def released(self, uploads: Uploads, mode: Mode) -> Release | None:
        """What `mode` releases from `uploads`, aggregated once (a secure sum of CCVR's second moments is the
        slowest step of the audit); None where the mode's silos refuse the round (`Refused`)."""
        key = (id(uploads), mode.name)
        if key not in self._released:
            keep_total = any(reads == MASKED for _, reads in VIEWS[mode.privacy])
            try:
                self._released[key] = released(self.scenario, uploads, mode, keep_total=keep_total)
            except Refused as exc:
                self._released[key], self._refusals[key] = None, str(exc)
        return self._released[key]

    def refused(self, uploads: Uploads, mode: Mode, attack: str, planted: Planted) -> list[Finding]:
        """The findings of an attack on a round every silo refuses, one per party: nothing released, the
        prior left (none where the round was released)."""
        if self.released(uploads, mode) is not None or mode.privacy == "plaintext":
            return []
        note = f"refused by every silo: {self._refusals[(id(uploads), mode.name)]}"
        return [
            self.image_finding(attack, mode, View(name, None, planted, note), None)
            for name, _ in VIEWS[mode.privacy]
        ]

    def draw(self, features: torch.Tensor) -> np.ndarray:
        """What the attacker draws from features: an image whose feature through the encoder it holds matches
        (`attacks.feature_inversion`), searched from the decoder's image of them (its public data's prior)."""
        z = features.float()
        return invert_features(self.model, z, public=self.scenario.public, init=decode(self.decoder, z))

    def prior(self, label: int) -> np.ndarray:
        """The attacker's guess of a class's record without any release: its own data's mean feature of the
        class, decoded (a smooth average of the class, which scores higher against a record than the same
        feature drawn through the encoder: 0.18 against 0.12 SSIM on the default grid's class 9)."""
        if label not in self._priors:
            self._priors[label] = prior(self.decoder, self.model, self.scenario.public, label)
        return self._priors[label]

    @property
    def decoder(self) -> FeatureDecoder:
        if self._decoder is None:
            self._decoder = train_decoder(self.model, self.scenario.public, seed=self.config.seed)
        return self._decoder

    def records(self, planted: Planted) -> torch.Tensor:
        silos = self.scenario.federation.silos
        return torch.from_numpy(
            np.concatenate([silos[s].x[r] for s, r in zip(planted.silos, planted.records, strict=True)])
        )

    def features(self, planted: Planted, uploads: Uploads | None = None) -> torch.Tensor:
        """The planted records' features as the silo computed them: clipped per record under DP (the best
        an attacker can hope to recover)."""
        z = extract_features(self.model, self.records(planted)).double()
        dp = uploads.method.dp if uploads is not None else None
        if dp is None:
            return z
        return z * (dp.feature_norm / z.norm(dim=1, keepdim=True)).clamp(max=1.0)

    def views(self, mode: Mode, uploads: Uploads, planted: Planted) -> list[View]:
        """What each of `mode`'s parties has of the planted class (of a released round): its one holder's
        upload (plaintext), the sums (a class two silos hold: the sum, as the tail guard's count of silos
        lets it out), the total under the silos' output masks (`masked_reading`), or the sums less the
        input of the silo the aggregator colludes with (`colluder_for`), as that silo uploaded it (its rows
        the tail guard zeroed zeroed; under DP without its noise, which the silo also knows: a weaker
        attacker than it could be)."""
        release = self.released(uploads, mode)
        found = []
        for name, reads in VIEWS[mode.privacy]:
            if reads == UPLOADS and len(planted.silos) == 1:
                # its one holder's upload, as a sum of one: what the server steps take
                upload = uploads.contributions[planted.silos[0]]
                found.append(View(name, SumLayer.seal(upload.schema, upload.flat(), 1), planted))
            elif reads in (UPLOADS, SUMS):
                found.append(View(name, release.sums, planted))
            elif reads == MASKED:
                values, note, metrics = masked_reading(release)
                found.append(View(name, values, planted, note, metrics))
            else:
                colluder = colluder_for(planted.silos, len(self.scenario.silo_ids))
                less = _less(release, uploads.contributions[colluder].flat())
                note = f"silo-{colluder} colludes: its own input taken out of the sum"
                found.append(View(name, less, attacked(planted, colluder), note))
        return found

    def image_finding(
        self, attack: str, mode: Mode, view: View, recovered: np.ndarray | None, **extra
    ) -> Finding:
        """Scores decoded images against the view's planted records, with the random and prior baselines."""
        planted = view.planted
        originals = self.records(planted).numpy()
        guess = self.prior(planted.label)
        withheld = recovered is None
        found = _fit(np.repeat(guess, len(originals), axis=0) if withheld else recovered, len(originals))
        if len(found) > len(originals):  # synthetic draws: each scored against the record(s), none picked
            targets = originals[np.arange(len(found)) % len(originals)]
            scores = image_report(targets, found, seed=self.config.seed)
        else:  # as many as the records, in an order the attacker does not know: paired one to one
            targets, found = best_match(originals, found)
            scores = image_report(targets, found, seed=self.config.seed)
        prior_scores = image_report(targets, np.repeat(guess, len(targets), axis=0), seed=self.config.seed)
        metrics = {**image_metrics(scores, prior_scores), **extra, **view.metrics}
        leaked = self.beats_baselines(metrics)
        if "feature_error" in extra:
            leaked = leaked or extra["feature_error"] < self.config.thresholds.feature_error
        return Finding(
            attack,
            mode.name,
            view.party,
            planted.describe(),
            metrics,
            leaked,
            mode.audited,
            {"original": targets, "recovered": found},
            _note(view.note, withheld=withheld),
        )

    def beats_baselines(self, metrics: dict[str, float]) -> bool:
        baseline = max(metrics["ssim_random"], metrics["ssim_prior"])
        return metrics["ssim"] - baseline > self.config.thresholds.ssim_over_random

    # --- attacks ---------------------------------------------------------------------------------

    def analytic(self, mode: Mode) -> list[Finding]:
        """(a) on CReFF's per-class head gradients, for the class one record represents."""
        uploads = self.uploads("creff", mode.epsilon)
        planted = self.scenario.planted[0]
        refused = self.refused(uploads, mode, "analytic", planted)
        if refused:
            return refused
        classes = len(self.scenario.public.classes)
        findings = []
        for view in self.views(mode, uploads, planted):
            feature = None
            if view.values is not None:
                feature = analytic.recover_feature(
                    view.values["grad"].reshape(classes, classes, -1)[planted.label]
                )
            error = analytic.relative_error(feature, self.features(view.planted, uploads)[0])
            recovered = None if feature is None else self.draw(feature[None])
            findings.append(self.image_finding("analytic", mode, view, recovered, feature_error=error))
        return findings

    def moments(self, mode: Mode) -> list[Finding]:
        """(b) on CCVR's Σz, Σzzᵀ and counts, for the classes of one and of two records at one silo, and of
        one record at each of two silos (which a tail guard counting silos alone lets out)."""
        uploads = self.uploads("ccvr", mode.epsilon)
        findings = []
        for planted in self.scenario.planted:
            refused = self.refused(uploads, mode, "moments", planted)
            if refused:
                findings += refused
                continue
            for view in self.views(mode, uploads, planted):
                findings.append(self._moments_finding(mode, uploads, view))
        return findings

    def _moments_finding(self, mode: Mode, uploads: Uploads, view: View) -> Finding:
        label, values, found = view.planted.label, view.values, None
        if values is not None:
            found = moments.invert_moments(
                values["feature_sum"][label], values["outer_sum"][label], float(values["count"][label])
            )
        error = moments.matched_error(found, self.features(view.planted, uploads))
        recovered = None if found is None else self.draw(found)
        finding = self.image_finding("moments", mode, view, recovered, feature_error=error)
        if (
            found is None
            and values is not None
            and bool(values["feature_sum"][label].abs().max() > analytic.ZERO)
        ):
            finding.note = "released, but its noised count rounds to no record: nothing to invert"
        return finding

    def decoder_attack(self, mode: Mode) -> list[Finding]:
        """(c) the decoder on synthetic features the server half makes from the release, of the one-record
        class: CReFF's federated features, Gaussian features regenerated from the pooled statistics (DFL-FS's
        and CCVR's) and SFD's SAFS features (synthesised for that class only, with its M_c)."""
        planted = self.scenario.planted[0]
        findings = []
        for name, method, synthesise in (
            ("CReFF federated features", "creff", self._federated),
            ("regenerated Gaussian features", "ccvr", self._regenerated),
            ("SFD SAFS features", "sfd", self._safs),
        ):
            uploads = self.uploads(method, mode.epsilon)
            refused = self.refused(uploads, mode, f"decoder: {name}", planted)
            if refused:
                findings += refused
                continue
            for view in self.views(mode, uploads, planted):
                found = None if view.values is None else synthesise(uploads, view.values, planted.label)
                findings.append(self.image_finding(f"decoder: {name}", mode, view, found))
        return findings

    def _federated(self, creff: Uploads, sums: Sums, label: int) -> np.ndarray | None:
        state = creff.method.server_step(
            creff.state, sums, ServerContext(creff.state.round + 1, self.config.seed)
        )
        classes = len(self.scenario.public.classes)
        synthetic = state.extra["features"].reshape(classes, -1, state.extra["features"].shape[-1])
        held = float(sums["present"][label]) > 0  # else the features never met its gradient
        return self.draw(synthetic[label][:16]) if held else None

    def _regenerated(self, ccvr: Uploads, sums: Sums, label: int) -> np.ndarray | None:
        pooled = ccvr.method.pooled(sums)
        if not bool(pooled.present[label]):
            return None
        counts = torch.zeros(len(self.scenario.public.classes), dtype=torch.long)
        counts[label] = 16
        features, _ = pooled.sample_counts(counts, torch.Generator().manual_seed(self.config.seed))
        return self.draw(features)

    def _safs(self, sfd: Uploads, sums: Sums, label: int) -> np.ndarray | None:
        if float(sums["count"][label].round()) <= 0:
            return None
        ctx = ServerContext(sfd.state.round + 1, self.config.seed)
        features, _ = sfd.method.synthetic_features(sums, ctx, classes=[label])
        return self.draw(features[:16])

    def gradinv(self, mode: Mode) -> list[Finding]:
        """(d) on FedAvg's model delta of the smallest silo (plaintext) or on the averaged delta (sums):
        `GRADINV_COUNT` images sought, matched one to one to that silo's records. Baselines: random images
        and as many of the attacker's own images, matched the same way (an inversion that lands on generic
        digits is no closer than unrelated digits); a party with nothing to invert draws the latter."""
        from attacks.gradinv import invert_delta
        from fedlt.methods.state import float_keys, unflatten

        uploads = self.uploads("fedavg", mode.epsilon)  # what a silo releases without DP in every mode
        smallest, public, seed = self._smallest_silo(), self.scenario.public, self.config.seed
        originals = self.scenario.federation.silos[smallest].x
        own = self._own_digits(GRADINV_COUNT)
        unrelated = image_report(*best_match(originals, own), seed=seed)
        target = f"silo-{smallest}: {len(originals)} records, {GRADINV_COUNT} sought"
        whole = Planted(-1, (smallest,), (np.arange(len(originals)),))  # a silo's records, of no one class
        findings = []
        for view in self.views(mode, uploads, whole):
            images = own
            if view.values is not None:
                flat = view.values["delta"] / max(float(view.values["n"]), 1.0)
                model = uploads.method.load(uploads.state.model)
                per_key = unflatten(flat.float(), uploads.state.model, float_keys(uploads.state.model))
                delta = [per_key[name] for name, _ in model.named_parameters()]
                images = invert_delta(
                    model, delta, count=GRADINV_COUNT, image_shape=public.input_shape, seed=seed
                )
            paired, images = best_match(originals, images)
            metrics = {**image_metrics(image_report(paired, images, seed=seed), unrelated), **view.metrics}
            leaked = self.beats_baselines(metrics)
            shown = {"original": paired, "recovered": images}
            findings.append(
                Finding(
                    "gradinv", mode.name, view.party, target, metrics, leaked, mode.audited, shown, view.note
                )
            )
        return findings

    def _smallest_silo(self) -> int:
        return int(np.argmin([len(s) for s in self.scenario.federation.silos]))

    def _own_digits(self, count: int) -> np.ndarray:
        """`count` of the attacker's own images, drawn by the seed: the prior of gradient inversion."""
        public = self.scenario.public
        return public.x[np.random.default_rng(self.config.seed).choice(len(public), count, replace=False)]

    # --- attacks on what does not depend on the sum layer ----------------------------------------

    def gradinv_reference(self) -> list[Finding]:
        """(d)'s calibration: the same inversion on the plaintext gradient of a one-record batch, for
        `GRADINV_COUNT` records of distinct classes of the smallest silo, each on its own (the papers' case:
        Geiping et al. and DLG recover such a record near exactly). What it reaches is what the attack is
        worth; the realistic views (a silo's multi-step delta, the averaged delta) are scored beside it.
        Baselines as the attack's: random images and the attacker's own digits, matched."""
        from attacks.gradinv import calibration_records, invert_delta, record_gradient

        silo = self.scenario.federation.silos[self._smallest_silo()]
        seed, shape = self.config.seed, self.scenario.public.input_shape
        picked = calibration_records(silo.y, min(GRADINV_COUNT, len(np.unique(silo.y))), seed=seed)
        originals = silo.x[picked]
        images = np.concatenate(
            [
                invert_delta(
                    self.model,
                    record_gradient(self.model, silo.x[i], int(silo.y[i])),
                    count=1,
                    image_shape=shape,
                    seed=seed,
                )
                for i in picked
            ]
        )
        unrelated = image_report(*best_match(originals, self._own_digits(len(picked))), seed=seed)
        metrics = image_metrics(image_report(originals, images, seed=seed), unrelated)
        return [
            Finding(
                "gradinv: one record's gradient",
                "reference: one record's gradient",
                "nobody: the calibration (no layer releases one record's gradient)",
                f"silo-{self._smallest_silo()}: {len(picked)} records of distinct classes, one at a time",
                metrics,
                self.beats_baselines(metrics),
                False,
                {"original": originals, "recovered": images},
            )
        ]

    def feature_reference(self) -> list[Finding]:
        """The calibration of (a)-(c): the attacker's drawing from the planted records' true features, what
        a perfectly recovered feature is worth (a reference, not a release)."""
        reference = Mode(name="reference: true features", audited=False)
        findings = []
        for planted in self.scenario.planted:
            real = self.draw(self.features(planted))
            view = View("nobody: the calibration (no layer releases a record's feature)", None, planted)
            findings.append(self.image_finding("feature inversion: true feature", reference, view, real))
        return findings

    def presence(self) -> list[Finding]:
        """(e) on MFSC's disclosure, for each mask, beside the census that the tail guard uses instead."""
        from attacks.presence import census_scores, presence_report, presence_scores
        from fedlt.selection import (
            MASKS,
            SelectionConfig,
            class_mean_disclosure,
            mask_stream,
            simulated_mask_secret,
        )

        scenario, selection = self.scenario, SelectionConfig()
        ids = sorted(scenario.silo_ids)  # presence_scores' row order: silo-10 sorts before silo-2
        by_id = dict(zip(scenario.silo_ids, scenario.federation.silos, strict=True))
        silos = [by_id[i] for i in ids]
        counts = np.stack([s.class_counts() for s in silos])
        frequency = counts.sum(axis=0)
        tail_below = int(np.median(frequency))
        dflfs = method_for(scenario, "dflfs")
        state = attacked_state(dflfs, scenario.state)
        public_x, public_y = torch.from_numpy(scenario.public.x), torch.from_numpy(scenario.public.y)
        findings = []
        truth = counts >= selection.min_samples
        for mask in MASKS:
            disclosures = {
                sid: class_mean_disclosure(
                    dflfs,
                    state,
                    data,
                    mask,
                    mask_stream(simulated_mask_secret(self.config.seed, sid), "round-1"),
                    min_samples=selection.min_samples,
                )
                for sid, data in zip(ids, silos, strict=True)
            }
            scores = presence_scores(disclosures, self.model, public_x, public_y, seed=self.config.seed)
            report = presence_report(scores, truth, class_frequency=frequency, tail_below=tail_below)
            findings.append(self._presence_finding(f"MFSC disclosure, mask {mask}", report, audited=False))
        held = counts >= 1
        census = {"census": census_scores(held.sum(axis=0), len(silos))}
        report = presence_report(census, held, class_frequency=frequency, tail_below=tail_below)
        census_finding = self._presence_finding("census + tail guard", report, audited=False)
        census_finding.note = (
            "a reference: census scores are the same for every silo of a class by construction"
        )
        findings.append(census_finding)
        return findings

    def membership(self) -> list[Finding]:
        """(f) on the final model, which every sum layer releases alike, trained without DP and at each ε of
        the grid: silos' records against as many of the attacker's own (never trained on) of the same
        classes (`_candidates`), by loss threshold and offline LiRA. The 4 shadows are trained once, on the
        rest of the attacker's data the way silos train without DP (the attacker's best recipe), and serve
        every target."""
        from attacks.membership import (
            lira_scores_from_confidences,
            logit_confidence,
            loss_threshold_scores,
            sgd_trainer,
            shadow_confidences,
        )
        from fedlt.methods import TrainConfig

        scenario, seed = self.scenario, self.config.seed
        members = joined(scenario.federation.silos)
        public = scenario.public
        inside, outside, pool = _candidates(members.y, public.y, seed)
        x = torch.from_numpy(np.concatenate([members.x[inside], public.x[outside]]))
        y = torch.from_numpy(np.concatenate([members.y[inside], public.y[outside]]))
        is_member = np.arange(len(inside) + len(outside)) < len(inside)
        training = self.config.training
        recipe = TrainConfig(local_epochs=training.rounds, lr=training.lr, momentum=training.momentum)
        out_phi = shadow_confidences(
            x,
            y,
            public_x=torch.from_numpy(public.x[pool]),
            public_y=torch.from_numpy(public.y[pool]),
            train=sgd_trainer(method_for(scenario, "fedavg").model_spec, recipe),
            shadows=4,
            seed=seed,
        )
        targets = {"final model (any sum layer, no DP)": self.model}
        for epsilon in sorted({m.epsilon for m in self.config.modes if m.epsilon > 0}):
            self.progress(f"membership: training at ε = {epsilon:g}")
            state = trained_state(scenario, epsilon)
            targets[f"final model, dp ε={epsilon:g}"] = _model(scenario, state, epsilon)
        findings = []
        for mode, model in targets.items():
            scores = {
                "loss threshold": loss_threshold_scores(model, x, y),
                "LiRA (offline, 4 shadows)": lira_scores_from_confidences(
                    logit_confidence(model, x, y), out_phi
                ),
            }
            findings += [
                self._membership_finding(name, mode, score, is_member, members.class_counts(), y.numpy())
                for name, score in scores.items()
            ]
        return findings

    def _membership_finding(
        self,
        name: str,
        mode: str,
        score: np.ndarray,
        is_member: np.ndarray,
        counts: np.ndarray,
        y: np.ndarray,
    ) -> Finding:
        from attacks.membership import membership_report

        report = membership_report(
            score, is_member, class_counts=counts, y=y, tail_below=int(np.median(counts))
        )
        negatives = int((~is_member).sum())
        metrics = {
            "tpr_at_0.1%_fpr": report["all"]["tpr_at_0.1%_fpr"],
            "tpr_at_1%_fpr": report["all"]["tpr_at_1%_fpr"],
            "auc": report["all"]["auc"],
            "tail_auc": report["tail"]["auc"],
            "candidates": float(len(is_member)),
            "lowest_fpr": 1.0 / negatives,  # below it, "TPR at FPR" is the TPR with no false positive
        }
        leaked = metrics["tpr_at_0.1%_fpr"] > self.config.thresholds.membership_tpr
        target = f"{len(is_member) - negatives} members against {negatives} non-members"
        return Finding(f"membership: {name}", mode, "anyone holding the model", target, metrics, leaked, True)

    def protocol(self) -> list[Finding]:
        """(g) a malicious aggregator against the real silo code: presence intersection, two attempts, split
        views (`attacks.protocol`)."""
        from attacks.protocol import protocol_findings

        return protocol_findings(self.config.seed)

    def epsilon(self) -> list[Finding]:
        """(h) an empirical lower bound on the ε of a silo's DP-SGD, one training run with canaries at each ε
        of `[epsilon]` (`attacks.epsilon`) on the silos' records together, then the same run with the noise
        off: a run whose bound passes what its ledger charged fails the audit, and so does a control that
        does not reach its ceiling (an audit that cannot see a leak proves nothing)."""
        from attacks.epsilon import epsilon_grid
        from fedlt.dp import DPSettings
        from fedlt.methods import TrainConfig

        settings = self.config.epsilon
        members = joined(self.scenario.federation.silos)
        self.progress(f"empirical ε: {len(settings.epsilons) + 1} runs with {settings.canaries} canaries")
        runs = epsilon_grid(
            self.model,
            torch.from_numpy(members.x),
            torch.from_numpy(members.y),
            epsilons=settings.epsilons,
            delta=DPSettings().delta,
            canaries=settings.canaries,
            seed=self.config.seed,
            train=TrainConfig(local_epochs=settings.epochs, batch_size=settings.batch_size, lr=settings.lr),
        )
        return [_epsilon_finding(run) for run in runs]

    def _presence_finding(self, mode: str, report: dict, *, audited: bool) -> Finding:
        best = max(report, key=lambda d: _nan_low(report[d]["within_class_auc"]))
        within = report[best]["within_class_auc"]
        metrics = {
            "best_detector_within_class_auc": within,
            "best_detector_auc": report[best]["all"]["auc"],
            "tail_auc": report[best]["tail"]["auc"],
            "tpr_at_1%_fpr": report[best]["all"]["tpr_at_1%_fpr"],
        }
        metrics.update({f"{d}_within_class_auc": r["within_class_auc"] for d, r in report.items()})
        leaked = _nan_low(within) > self.config.thresholds.presence_auc
        target = f"which silo holds which class (best detector: {best})"
        return Finding("presence", mode, "aggregator", target, metrics, leaked, audited)


def _epsilon_finding(run: EpsilonAudit) -> Finding:
    """A finding of one audited DP-SGD run (`attacks.epsilon.EpsilonAudit`): a leak where its bound passes
    the charged ε, or, for the control, where the bound falls short of its ceiling."""
    metrics = {
        "epsilon_lower_bound": run.lower_bound,
        "epsilon_charged": math.inf if run.control else run.charged,
        "epsilon_planned": run.target,
        "ceiling": run.ceiling,
        "guesses": float(run.guesses),
        "correct": float(run.correct),
        "canaries": float(run.canaries),
        "noise_multiplier": run.noise_multiplier,
        "sample_rate": run.sample_rate,
        "steps": float(run.steps),
        "control": float(run.control),
    }
    if run.control:
        mode, leaked = "control: noise off", not run.at_ceiling
        note = (
            "every guess right: the bound is at its ceiling, the most this many canaries show at this δ"
            if run.at_ceiling
            else "the bound falls short of its ceiling with no noise at all: the audit lost its power"
        )
    else:
        mode, leaked = f"dp ε={run.target:g}", run.violated
        note = "" if run.lower_bound < run.ceiling else "the bound is at its ceiling"
        if run.charged >= run.ceiling:
            note = "cannot fail: the charged ε is above the most this audit can show at this δ"
    target = f"{run.canaries} gradient canaries, {run.steps} steps at q = {run.sample_rate:.3g}"
    return Finding(EPSILON, mode, "a silo's DP-SGD", target, metrics, leaked, True, note=note)


def _note(said: str, *, withheld: bool) -> str:
    """A finding's note: the view's, which for nothing recovered starts by saying so (the report marks those
    "withheld: prior")."""
    if not withheld or said.startswith(("withheld", "refused")):
        return said
    return "withheld: nothing released for this class" + (f"; {said}" if said else "")


def _less(release: Release, own: torch.Tensor) -> Sums:
    """The released sums less one silo's upload as it went into them (its rows the tail guard zeroed,
    zeroed): what that silo, colluding with the aggregator, learns of the others."""
    sums = release.sums
    sent = tail_guard.zero_classes(
        sums.schema, own.double(), list(release.zeroed), inverting=list(release.floored)
    )
    return SumLayer.seal(sums.schema, sums.schema.flatten(dict(sums)) - sent, sums.contributors - 1)


def image_metrics(found: dict, prior_report: dict) -> dict[str, float]:
    """Medians of what the attacker drew, of random images, and SSIM of the attacker's prior (the 'attack'
    part of `prior_report`, which scores the prior as its reconstruction)."""
    return {
        "ssim": found["ssim"]["attack"]["median"],
        "psnr": found["psnr"]["attack"]["median"],
        "mae": found["mae"]["attack"]["median"],
        "ssim_random": found["ssim"]["random"]["median"],
        "ssim_prior": prior_report["ssim"]["attack"]["median"],
    }


def _nan_low(value: float) -> float:
    return -1.0 if np.isnan(value) else value


def _model(scenario: Scenario, state: GlobalState | None = None, epsilon: float = 0.0):
    """A trained network as FedAvg's method builds it (under DP, with DP's layers): the scenario's model
    (the one the aggregator sent) unless another `state` is given."""
    method = method_for(scenario, "fedavg", epsilon)
    return method.load((state or scenario.state).model).eval()


def _fit(images: np.ndarray, count: int) -> np.ndarray:
    """Reconstructions for `count` originals: several are matched one to one by SSIM, fewer are repeated."""
    if len(images) >= count:
        return images
    return np.concatenate([images] * (count // len(images) + 1))[:count]


def _candidates(member_y: np.ndarray, public_y: np.ndarray, seed: int) -> tuple[np.ndarray, ...]:
    """Members and non-members in equal numbers per class, and the rest of the public data for shadows.
    Matching the classes matters: a long-tailed model is surer of head classes, so members drawn from a
    long tail against balanced non-members would score above chance with no membership signal at all
    (a DP model at ε = 1 gave AUC 0.73 that way)."""
    rng = np.random.default_rng(seed)
    inside, outside, pool = [], [], []
    for c in np.unique(public_y):
        mine = rng.permutation(np.flatnonzero(member_y == c))
        theirs = rng.permutation(np.flatnonzero(public_y == c))
        take = min(len(mine), len(theirs) // 2)
        inside.append(mine[:take])
        outside.append(theirs[:take])
        pool.append(theirs[take:])
    return tuple(np.concatenate(part) for part in (inside, outside, pool))


GRADINV_COUNT = 4

# every attack of config.ATTACKS, by what it runs on: each sharing mode, or once (what no sum layer changes)
PER_MODE: dict[str, Callable[[Audit, Mode], list[Finding]]] = {
    "analytic": Audit.analytic,
    "moments": Audit.moments,
    "decoder": Audit.decoder_attack,
    "gradinv": Audit.gradinv,
}
ONCE: dict[str, Callable[[Audit], list[Finding]]] = {
    "presence": Audit.presence,
    "membership": Audit.membership,
    "protocol": Audit.protocol,
    "epsilon": Audit.epsilon,
}
DRAWN = ("analytic", "moments", "decoder")  # attacks that draw images from features, calibrated by true ones
# each calibration row (a reference, not a release), run once where the grid runs any of its attacks
REFERENCES: tuple[tuple[tuple[str, ...], Callable[[Audit], list[Finding]]], ...] = (
    (DRAWN, Audit.feature_reference),
    (("gradinv",), Audit.gradinv_reference),
)
