"""Admission: a signed RoundSpec checked against this silo's roster and policy, and parsed, once.

For each RoundSpec the agent verifies the signature, that it is addressed to the roster's consortium and to
this silo, that its method, privacy layer, disclosures and secure-sum parameters meet the silo's policy, that
the plan parses and matches its hash, that a model it names by entry point is one the policy pins, with the
pinned digest (`silo.models`: checked before anything of it is imported), and that the state it streams
matches the signed digest. Only then does it train. The layer must be one this silo implements and its
policy lists (`sides`, this silo's side of each); a RoundSpec naming any other layer is refused, so no layer
ever falls back to a plain upload. Where the layer asks for the key service, the key the RoundSpec names is
fetched first (`silo.key_service`), so that a round naming a key this silo cannot hold is refused here.

Every release passes the silo's one release gate (`fedlt.aggregation.gate`: roster, floors, and the release
ledger keyed by the state trained from), whose ledgers fail closed at start (`silo.releases.check_ledgers`);
the gate is made here, and its floors are checked against a round's sums before any work.

What admission hands on is one `AdmittedRound`: the spec, its plan, its sums (with the layer's parameters as
signed), this silo's side of its layer, the data in the plan's label space, and the checked starting state and
method. Later steps read that object; none opens the signed RoundSpec or reads its parameters again.

What an admitted plan builds here is kept while the plan stays the same from round to round
(`PlanCache`): its method (with its working model) and its differential privacy, charged to the silo's one
privacy ledger.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, fields, replace

import grpc
import torch
from google.protobuf.message import DecodeError

from fedlt.aggregation import Schema, layer_names, tail_guard
from fedlt.aggregation.gate import Floors, ReleaseGate, data_digest
from fedlt.aggregation.halves import SiloSide
from fedlt.aggregation.round_sums import RoundSums
from fedlt.data.arrays import LabeledData
from fedlt.data.source import DataSource, Wanted, prepared_bytes
from fedlt.errors import DataError, FedltError
from fedlt.methods import GlobalState, Method
from fedlt.methods.state import unpack_state
from fedlt.plan import RoundPlan
from fedlt.selection import DISCLOSURE
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from fedlt.wire import schema_from_pb
from privacy import roundspec
from privacy.dp import PrivacyLedger, SiloPrivacy
from privacy.pki.errors import PkiError
from privacy.roundspec import RoundSpecError
from silo.config import SiloConfig
from silo.connection import Standing
from silo.key_service import KeyService
from silo.models import model_refusals
from silo.releases import ReleaseLedger
from silo.stepping import expected_schema, opened_state
from silo.transport import SiloTransport
from silo.trust import SiloTrust

log = logging.getLogger("silo")

# What the aggregator is told of a refusal whose message names this silo's own facts (its data, its privacy
# budget): the kind alone. The message stays in the silo's log.
TOLD = {
    pb.REFUSAL_CODE_DATA: "this silo's data does not fit the plan; the silo's log says how",
    pb.REFUSAL_CODE_BUDGET: "the round would spend more of this silo's privacy budget than it has left",
}
TOLD_CHARS = 512  # the aggregator takes one printable line of at most this many characters


class RefusedRound(FedltError):
    """A RoundSpec this silo will not act on (bad signature, policy, plan, data, mismatched state), of the
    kind `code` names (a RefusalCode). `told` is what the aggregator hears: by default the message, which
    speaks of the policy and the plan; for a kind whose message names this silo's own facts (`TOLD`), the
    kind's sentence only. A raiser whose message names local facts under another kind passes its own."""

    def __init__(self, message: str, *, code: int = pb.REFUSAL_CODE_POLICY, told: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.told = told if told is not None else TOLD.get(code, message)


@dataclass(frozen=True)
class Prepared:
    """This silo's data as a plan wants it, with the digests its releases are keyed by (`gate.data_digest`,
    computed once per prepared dataset)."""

    data: LabeledData
    held_out: LabeledData | None
    data_digest: str
    held_out_digest: str  # "" where there is no held-out data

    @classmethod
    def of(cls, data: LabeledData, held_out: LabeledData | None) -> Prepared:
        counted = "" if held_out is None else data_digest(held_out.x, held_out.y)
        return cls(data, held_out, data_digest(data.x, data.y), counted)


@dataclass(frozen=True)
class AdmittedSpec:
    """A RoundSpec whose signature and claims this silo checked, read once: `me` the id it checked it as,
    `prepared` this silo's data (and held-out data) in the plan's label space."""

    spec: round_pb2.RoundSpec
    plan: RoundPlan
    sums: RoundSums  # with the layer's parameters as signed (`sums.settings`)
    side: SiloSide
    me: str
    prepared: Prepared

    @property
    def data(self) -> LabeledData:
        return self.prepared.data

    @property
    def held_out(self) -> LabeledData | None:
        return self.prepared.held_out

    @property
    def trains(self) -> bool:
        return self.me in self.spec.participants

    @property
    def discloses(self) -> bool:
        return DISCLOSURE in self.spec.disclosures and self.me in self.spec.disclosers


@dataclass(frozen=True)
class AdmittedRound(AdmittedSpec):
    """An admitted RoundSpec and the state it starts from, fetched and checked, with the plan's method."""

    state: GlobalState
    method: Method

    @classmethod
    def starting_from(cls, admitted: AdmittedSpec, *, state: GlobalState, method: Method) -> AdmittedRound:
        checked = {f.name: getattr(admitted, f.name) for f in fields(AdmittedSpec)}
        return cls(**checked, state=state, method=method)


class Admission:
    """Checks each RoundSpec and its starting state, and refuses, telling the aggregator, what it will not
    act on. `sides`: this silo's side of each layer its policy lists; `local` and `local_held_out`: its files,
    opened, which each plan prepares its own way (`fedlt.data.source`)."""

    def __init__(
        self,
        config: SiloConfig,
        *,
        trust: SiloTrust,
        ledger: ReleaseLedger,
        keys: KeyService,
        sides: dict[str, SiloSide],
        plans: PlanCache,
        standing: Standing,
        local: DataSource,
        local_held_out: DataSource | None,
    ) -> None:
        self.config, self.trust, self.keys, self.sides = config, trust, keys, sides
        self.plans, self.standing = plans, standing
        self.local, self.local_held_out = local, local_held_out
        self._prepared: tuple[Wanted, Prepared] | None = None
        self.gate = ReleaseGate(
            consortium=trust.roster.consortium,
            floors=Floors(config.policy.min_participants, config.policy.min_survivors),
            members=lambda: trust.roster.silo_ids,
            ledger=ledger,
        )

    def admit(self, transport: SiloTransport, signed: round_pb2.SignedRoundSpec) -> AdmittedSpec | None:
        """The RoundSpec checked (`check`), or None once refused to the aggregator."""
        try:
            return self.check(transport, signed)
        except RefusedRound as exc:
            self.refuse(transport, round_id_of(signed), exc)
        except PkiError as exc:  # the signer is not the roster's aggregator, or the signature is not its
            self.refuse(
                transport, round_id_of(signed), RefusedRound(str(exc), code=pb.REFUSAL_CODE_SIGNATURE)
            )
        return None

    def check(self, transport: SiloTransport, signed: round_pb2.SignedRoundSpec) -> AdmittedSpec:
        """The RoundSpec opened and read once, its key fetched where its layer has a key service, and checked;
        RefusedRound, or PkiError where the roster's aggregator did not sign it."""
        spec = self._opened(signed)
        sums = self._read_sums(signed, spec)
        if spec.privacy in self.keys.keyrings:  # only a layer with the key service names a key to fetch
            self.keys.before_round(transport, spec, _key_parameters(spec, sums))
        problems = self._spec_problems(spec) + ([] if sums is None else self._sum_problems(spec, sums))
        if problems or not isinstance(sums, RoundSums):  # no sums read back: `problems` says why
            raise RefusedRound(f"{spec.round_id}: " + "; ".join(problems))
        plan = self._plan(spec)
        side = self.sides[spec.privacy]
        refused = self._plan_problems(plan, side, sums)
        if refused:
            raise RefusedRound(f"{spec.round_id}: " + "; ".join(refused))
        prepared = self._in_label_space(spec, plan)
        return AdmittedSpec(
            spec=spec, plan=plan, sums=sums, side=side, me=self.standing.silo_id, prepared=prepared
        )

    def starting_state(self, transport: SiloTransport, admitted: AdmittedSpec) -> AdmittedRound | None:
        """The round with its state, fetched and checked against the signed digest and schema (where this
        silo steps the model, opened from its seal and checked against every counted silo's signature);
        None once refused."""
        spec, plan = admitted.spec, admitted.plan
        self.standing.activity = pb.SILO_ACTIVITY_FETCHING
        fetch_started = time.perf_counter()
        data = fetched_state(transport, spec)
        if data is None:
            state_refused = RefusedRound(
                f"{spec.round_id}: the state streamed does not fit its signed size; not training",
                code=pb.REFUSAL_CODE_STATE,
            )
            self.refuse(transport, spec.round_id, state_refused)
            return None
        method = self.plans.method(plan, spec.config_sha256)
        steps_model = admitted.side.steps_model
        try:
            if steps_model:
                state = opened_state(
                    data,
                    spec,
                    self.keys.secret(spec.privacy, admitted.sums.settings),
                    method,
                    older=self.keys.held(spec.privacy),
                    peers=admitted.side.peers,
                    min_counted=self.config.policy.min_survivors,
                )
            else:
                state = unpack_state(data, spec.round - 1)
        except FedltError as exc:
            problem = str(exc) or type(exc).__name__
        else:
            expected = expected_schema(plan, method, state, steps_model=steps_model)
            problem = _state_problem(method, state, spec, expected)
        if problem:
            refusal = RefusedRound(f"{spec.round_id}: {problem}; not training", code=pb.REFUSAL_CODE_STATE)
            self.refuse(transport, spec.round_id, refusal)
            return None
        log.debug(
            "round %d: state fetched and checked in %.3f s", spec.round, time.perf_counter() - fetch_started
        )
        return AdmittedRound.starting_from(admitted, state=state, method=method)

    def refuse(self, transport: SiloTransport, round_id: str, refusal: RefusedRound) -> None:
        """Tell the aggregator that this silo will not take part in `round_id`, so that no stage waits for it
        and the operator sees why: in the words of `refusal.told`, the whole message in this log only. A
        refusal the aggregator does not take (another attempt in flight, the network) is logged, no more."""
        self.standing.activity = pb.SILO_ACTIVITY_IDLE
        log.error("refusing a round: %s", refusal)
        if refusal.code in (pb.REFUSAL_CODE_POLICY, pb.REFUSAL_CODE_DATA):
            log.error("this agent reads silo.toml and its data when it starts: restart it after a change")
        if not round_id:
            return  # a RoundSpec that names no attempt: nothing to tell
        told = one_line(refusal.told.removeprefix(f"{round_id}: "))  # the aggregator shows the id beside it
        try:
            transport.refuse(round_id, code=refusal.code, text=told)
        except grpc.RpcError as exc:
            log.warning(
                "%s: the aggregator did not take this refusal (%s: %s)",
                round_id,
                exc.code().name,
                exc.details(),
            )

    # --- the checks, in the order they run ----------------------------------------------------------------

    def _opened(self, signed: round_pb2.SignedRoundSpec) -> round_pb2.RoundSpec:
        signer = self.trust.members.aggregator(
            self.standing.aggregator_pem
        )  # valid, not revoked, on the roster
        try:
            return roundspec.open_signed(signed, signer)
        except RoundSpecError as exc:
            raise RefusedRound(str(exc)) from None

    def _read_sums(
        self, signed: round_pb2.SignedRoundSpec, spec: round_pb2.RoundSpec
    ) -> RoundSums | str | None:
        """The round's sums, the layer's parameters with them, as signed; why they do not read back; or None
        for a layer that is not this silo's (refused as such)."""
        if spec.privacy not in self.sides:
            return None
        try:
            return roundspec.sums_of(signed, spec)
        except (FedltError, ValueError) as exc:
            return str(exc)

    def _spec_problems(self, spec: round_pb2.RoundSpec) -> list[str]:
        """Whom the RoundSpec is for, and what it asks, against the roster and the policy."""
        policy, me = self.config.policy, self.standing.silo_id
        problems = []
        if spec.consortium_id != self.trust.roster.consortium:
            problems.append(
                f"it is for consortium {spec.consortium_id!r}, not {self.trust.roster.consortium!r}"
            )
        if me not in spec.participants and me not in spec.disclosers:
            problems.append(f"this silo ({me}) is not among the participants")
        if spec.method not in policy.methods:
            problems.append(f"method {spec.method!r} is not allowed by policy.methods")
        if spec.privacy not in layer_names():
            problems.append(f"privacy layer {spec.privacy!r} is not installed with this agent")
        elif spec.privacy not in self.sides:
            problems.append(f"privacy layer {spec.privacy!r} is not allowed by policy.privacy")
        extra = sorted(set(spec.disclosures) - set(policy.disclosures))
        if extra:
            problems.append(f"disclosures {extra} are not allowed by policy.disclosures")
        if hashlib.sha256(spec.method_config.encode()).hexdigest() != spec.config_sha256:
            problems.append("method_config does not match config_sha256")
        if spec.state_bytes > policy.max_state_mb * 2**20:
            problems.append(f"state of {spec.state_bytes} bytes exceeds policy.max_state_mb")
        return problems

    def _sum_problems(self, spec: round_pb2.RoundSpec, sums: RoundSums | str) -> list[str]:
        """The signed parameters of the round's sums against this silo's minimums, before any work."""
        if isinstance(sums, str):
            return [f"its sums are malformed: {sums}"]
        side = self.sides[spec.privacy]
        problems = []
        if side.hides_inputs and sums.k_min < self.config.policy.min_tail_guard:
            problems.append(
                f"tail guard k_min {sums.k_min} is below policy.min_tail_guard "
                f"{self.config.policy.min_tail_guard}"
            )
        if self.standing.silo_id in spec.participants:
            try:
                problems += self.gate.problems(sums.contribution_spec(sums.participants, sums.census), side)
            except FedltError as exc:
                problems.append(f"its sums are malformed: {exc}")
        return problems

    def _plan(self, spec: round_pb2.RoundSpec) -> RoundPlan:
        try:
            plan = RoundPlan.from_toml(spec.method_config, f"RoundSpec {spec.round_id}")
        except FedltError as exc:
            raise RefusedRound(
                f"{spec.round_id}: its method_config is not a plan this silo can run: {exc}",
                code=pb.REFUSAL_CODE_PLAN,
            ) from None
        if plan.method.name != spec.method:
            raise RefusedRound(
                f"{spec.round_id}: plan runs {plan.method.name!r}, spec says {spec.method!r}",
                code=pb.REFUSAL_CODE_PLAN,
            )
        return plan

    def _plan_problems(self, plan: RoundPlan, side: SiloSide, sums: RoundSums) -> list[str]:
        """The plan's model against the entry points this silo pins (nothing of it imported yet), its DP
        against this silo's [dp], and, where the layer hides inputs, the statistics that would invert
        against its record floor."""
        refused = model_refusals(plan.model.name, self.config.policy.pinned_models)
        refused += self.config.dp.problems(plan.dp)
        if side.hides_inputs:
            accepted = self.config.policy.min_class_records
            refused += tail_guard.inverting_problems(
                sums.schema, sums.record_floor, dp=plan.dp.enabled, accepted=accepted
            )
            refused += tail_guard.floor_problems(sums.record_floor, dp=plan.dp.enabled, accepted=accepted)
        return refused

    def _in_label_space(self, spec: round_pb2.RoundSpec, plan: RoundPlan) -> Prepared:
        """This silo's data, and its held-out slice, prepared as the plan wants them (resized, encoded by its
        schema, labelled by its class names), with their digests; kept for the next round of the same plan."""
        wanted = plan.wanted()
        if self._prepared is None or self._prepared[0] != wanted:
            self._prepared = None  # the last plan's arrays go before this one's are made
            sources = [self.local] if self.local_held_out is None else [self.local, self.local_held_out]
            size = prepared_bytes(wanted, sources)
            if size > self.config.policy.data_limit():  # sized before a sample is decoded
                raise RefusedRound(
                    f"{spec.round_id}: the plan's input shape {list(wanted.input_shape)} would make this "
                    f"silo's {sum(map(len, sources))} samples {size / 2**20:,.0f} MB, more than "
                    "policy.max_data_mb (default: half this machine's memory)",
                    code=pb.REFUSAL_CODE_DATA,
                )
            try:
                data = self.local.prepared(wanted)
                held_out = None if self.local_held_out is None else self.local_held_out.prepared(wanted)
            except DataError as exc:
                raise RefusedRound(f"{spec.round_id}: local data {exc}", code=pb.REFUSAL_CODE_DATA) from None
            self._prepared = (wanted, Prepared.of(data, held_out))
        return self._prepared[1]


def _key_parameters(spec: round_pb2.RoundSpec, sums: RoundSums | str | None) -> object:
    """The layer's parameters, which name the round's key: as the sums read them. Where the sums do not read
    back, the parameters alone (read again, in this case only: the key they name is fetched all the same,
    then the check refuses the round); None for a layer that is not this silo's, or parameters that do not
    read back."""
    if isinstance(sums, str):
        try:
            return roundspec.settings_of(spec)
        except RoundSpecError:
            return None
    return None if sums is None else sums.settings


def round_id_of(signed: round_pb2.SignedRoundSpec) -> str:
    """The attempt a refused RoundSpec names, read whatever its signature: only to tell the aggregator which
    attempt is refused, which it takes for the attempt in flight alone. "" if it does not parse."""
    try:
        return round_pb2.RoundSpec.FromString(signed.spec).round_id
    except DecodeError:
        return ""


def one_line(text: str) -> str:
    """`text` as the aggregator takes a refusal's: one printable line of at most TOLD_CHARS characters."""
    line = " ".join("".join(c if c.isprintable() else " " for c in text).split()) or "refused"
    return line if len(line) <= TOLD_CHARS else line[: TOLD_CHARS - 1] + "…"


def fetched_state(transport: SiloTransport, spec: round_pb2.RoundSpec) -> bytes | None:
    """The streamed state, read only as far as the signed size: a longer or out-of-order stream is dropped."""
    data = bytearray()
    for part in transport.fetch_state(spec.round_id):
        if part.offset != len(data) or len(data) + len(part.data) > spec.state_bytes:
            log.error("%s: the state streamed does not fit the signed size; not training", spec.round_id)
            return None
        data += part.data
    if len(data) != spec.state_bytes:
        log.error("%s: the state streamed is shorter than the signed size; not training", spec.round_id)
        return None
    return bytes(data)


def _state_problem(method: Method, state: GlobalState, spec: round_pb2.RoundSpec, expected: Schema) -> str:
    """Why the streamed state is not the round's ("" if it is): the signed digest, the signed schema (the
    one this silo `expected`), and a model the plan's network can hold."""
    if state.digest() != spec.state_digest:
        return "the state received does not match the signed digest"
    if expected != schema_from_pb(spec.schema):
        return "the signed schema differs from the method's own"
    unfit = _unfit_model(method, state)
    return f"the state's model {unfit}" if unfit else ""


def _unfit_model(method: Method, state: GlobalState) -> str:
    """Why the state's model is not one the plan's network can hold and train ("" if it is): its tensors'
    names, shapes and dtypes are the network's, and its floats finite. The digest and schema checks cannot
    tell: an aggregator signs the digest of whatever it sends, and a renamed tensor keeps the schema's size.
    """
    network = method.working_model().state_dict()
    model = state.model
    missing, unexpected = sorted(set(network) - set(model)), sorted(set(model) - set(network))
    if missing or unexpected:
        return f"lacks tensors {missing[:3]} and has others {unexpected[:3]}"
    for name, held in network.items():
        tensor = model[name]
        if tensor.shape != held.shape or tensor.dtype != held.dtype:
            wanted = f"{held.dtype} {tuple(held.shape)}"
            return f"holds {name!r} as {tensor.dtype} {tuple(tensor.shape)}, not {wanted}"
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"holds non-finite values in {name!r}"
    return ""


class PlanCache:
    """The method and DP of the plan at hand, by the plan's `config_sha256`; the privacy ledger is the silo's
    one ledger across plans, read once at start and kept in step. The method computes on `device`, this
    silo's `[compute] device`: a plan's text never names one, and one that did would be overruled here."""

    def __init__(self, privacy_ledger: PrivacyLedger, *, device: str = "cpu") -> None:
        self.privacy_ledger = privacy_ledger
        self.device = device
        self._method: tuple[str, Method] | None = None
        self._privacy: tuple[str, SiloPrivacy] | None = None

    def method(self, plan: RoundPlan, config_sha256: str) -> Method:
        """The same plan from round to round reuses one method (and its working model)."""
        if self._method is None or self._method[0] != config_sha256:
            own = replace(plan, train=replace(plan.train, device=self.device))
            self._method = (config_sha256, own.build_method())
        return self._method[1]

    def privacy(self, plan: RoundPlan, config_sha256: str) -> SiloPrivacy | None:
        """Under a plan with [dp]: this silo's DP for it, charged to the one ledger in its state folder; what
        it will do is logged once per plan, when first built (the administrator's only word that DP is on)."""
        if not plan.dp.enabled:
            return None
        if self._privacy is None or self._privacy[0] != config_sha256:
            method = self.method(plan, config_sha256)
            privacy = SiloPrivacy(plan.dp, method=method, ledger=self.privacy_ledger, run=config_sha256)
            self._privacy = (config_sha256, privacy)
            known = self._sgd_sigmas(config_sha256)  # trained under this plan before a restart
            sigma = known[0] if known else (plan.dp.noise_multiplier or None)
            log.info("plan %s…: %s", config_sha256[:16], _dp_summary(privacy, sigma))
        return self._privacy[1]

    def announce_sigma(self, plan: RoundPlan, config_sha256: str) -> None:
        """After this plan's first DP-SGD training: the σ this silo chose for it (unknown until it knew its
        steps and sampling rate), once; later rounds and restarts find it in the ledger."""
        sigmas = self._sgd_sigmas(config_sha256) if plan.dp.enabled and not plan.dp.noise_multiplier else []
        if len(sigmas) == 1:
            log.info(
                "plan %s…: DP-SGD σ %.4g, the smallest that keeps the plan within ε %g",
                config_sha256[:16],
                sigmas[0],
                plan.dp.epsilon,
            )

    def _sgd_sigmas(self, config_sha256: str) -> list[float]:
        """DP-SGD's σ at each training under this plan so far, as the ledger recorded it when admitted."""
        return [
            e["params"]["noise_multiplier"]
            for e in self.privacy_ledger.entries
            if e["mechanism"] == "dp-sgd" and e.get("run") == config_sha256
        ]


def _dp_summary(privacy: SiloPrivacy, sigma: float | None) -> str:
    """DP as this silo applies a plan: the plan's (ε, δ), DP-SGD's σ (None: chosen at the first training,
    from the steps and sampling rate it then knows), the statistics' noise and the budget left."""
    dp, ledger = privacy.settings, privacy.ledger
    sgd = "chosen at its first training" if sigma is None else f"{sigma:.4g}"
    return (
        f"differential privacy on: ε {dp.epsilon:g} at δ {dp.delta:g} for the plan; DP-SGD σ {sgd}, "
        f"clipping at {privacy.max_grad_norm:g}; statistics noise multiplier {privacy.statistics_noise:.4g}; "
        f"ε left in this silo's budget {ledger.remaining():.4g} of {ledger.budget.epsilon:g}"
    )
