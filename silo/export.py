"""`python -m silo export --config silo.toml --out DIR`: the model this silo stepped to, taken home.

Where only silos can read the consortium's state (a layer whose silos step the model, e.g. ckks, seals it),
the aggregator cannot export the model: a silo can. Each time it steps the model and the aggregator accepts
its report, the silo keeps what it reported, the state sealed with the consortium's key, its digest and the
silo's signature over it (`keep_stepped`), in one file under state_dir that each step replaces. The export
fetches nothing: it opens that sealed state with a key of the layer it names that this silo holds (its
keyring, `silo.key_service`), recomputes the digest it signed, and writes the weights and a model card
(`fedlt.export`) with that signature. The other counted silos' signatures over the digest stay with the
aggregator, which commits a state only when every counted silo reported that same digest.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlt.aggregation import layers
from fedlt.atomic import atomic_write
from fedlt.errors import ConfigError
from fedlt.export import CARD, README, WEIGHTS, ExportError, check_out_dir, utc, write_export
from fedlt.methods import GlobalState
from fedlt.methods.state import unpack_state
from fedlt.plan import RoundPlan
from fedlt.tensorpack import PackError
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.stepping.attestation import ATTESTATION_CONTEXT
from privacy.stepping.sealed_state import SealedStateError, open_state
from silo.budget import open_ledger
from silo.config import SiloConfig
from silo.key_service import Keyring
from silo.models import model_refusals

STEPPED = "stepped-state.bin"
MAGIC = b"FSTEPPED1"


def keep_stepped(
    state_dir: Path, spec: round_pb2.RoundSpec, me: str, header: pb.StateReportHeader, sealed: bytes
) -> None:
    """Keep the state this silo reported for `spec`'s round, sealed as reported, with what opens and
    describes it: a JSON header, then the sealed bytes, in one file written in one step."""
    facts = {
        "consortium": spec.consortium_id,
        "silo": me,
        "privacy": spec.privacy,
        "plan": spec.method_config,
        "round": header.round,
        "round_id": header.round_id,
        "digest": header.state_digest,
        "sha256": header.sha256,
        "counted": list(header.counted),
        "signature": header.state_signature.hex(),
        "stepped_from": spec.state_digest,
        "kept_at": utc(time.time()),
    }
    text = json.dumps(facts).encode()
    atomic_write(
        state_dir / STEPPED, lambda fh: fh.write(MAGIC + struct.pack("<I", len(text)) + text + sealed)
    )


def export_stepped(config: SiloConfig, out: Path, *, echo: Callable = print) -> int:
    check_out_dir(out)
    state_dir = config.path(config.state_dir)
    facts, sealed = _kept(state_dir)
    plan = _plan(facts, state_dir)
    refused = model_refusals(plan.model.name, config.policy.pinned_models)
    if refused:  # the policy may have dropped the model, or its code changed, since the round: run nothing
        raise ExportError("; ".join(refused))
    state = _opened(state_dir, facts, sealed)
    card = write_export(
        out, plan=plan, method=plan.build_method(), state=state, facts=_card_facts(config, facts, plan)
    )
    echo(
        f"exported the state of round {state.round} that {facts['silo']} stepped to (consortium "
        f"{facts['consortium']!r}) to {out}: {WEIGHTS} (SHA-256 {card['weights']['sha256'][:16]}…), {CARD}, "
        f"{README}"
    )
    echo(f'load it with: from fedlt.export import load_exported; model, card = load_exported("{out}")')
    return 0


def _kept(state_dir: Path) -> tuple[dict[str, Any], bytes]:
    path = state_dir / STEPPED
    if not state_dir.is_dir():
        raise ExportError(f"no such state directory {state_dir} (state_dir of the silo's config)")
    if not path.is_file():
        stepping = ", ".join(name for name, layer in layers().items() if layer.silos_step) or "none installed"
        raise ExportError(
            f"this silo has stepped no model yet ({path} does not exist): a silo keeps the last state it "
            f"stepped to where only silos can read the state ({stepping}); under any other layer the "
            "operator exports the model (python -m aggregator export)"
        )
    data = path.read_bytes()
    try:
        if not data.startswith(MAGIC):
            raise ValueError("it does not start as one")
        (length,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        facts, sealed = json.loads(data[start : start + length]), data[start + length :]
        expected = facts["sha256"]
    except (ValueError, struct.error, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is not a state this silo kept ({exc})") from None
    if hashlib.sha256(sealed).hexdigest() != expected:
        raise ExportError(f"{path} is damaged: its sealed state is not the one this silo reported")
    return facts, sealed


def _plan(facts: dict[str, Any], state_dir: Path) -> RoundPlan:
    source = f"the plan of round {facts['round']} in {state_dir / STEPPED}"
    try:
        return RoundPlan.from_toml(facts["plan"], source)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None


def _opened(state_dir: Path, facts: dict[str, Any], sealed: bytes) -> GlobalState:
    """The kept state, opened with a key of its layer this silo holds (an older one after a rotation) and
    checked against the digest this silo signed."""
    bound = {"consortium": facts["consortium"], "round_number": facts["round"], "digest": facts["digest"]}
    keyring = _keyring(state_dir, facts["privacy"])
    keys = keyring.held()
    for key in keys:
        try:
            packed = open_state(key, **bound, sealed=sealed)
        except SealedStateError:
            continue
        try:
            state = unpack_state(packed, facts["round"])
        except PackError as exc:
            raise ExportError(f"the state kept in {state_dir / STEPPED} does not unpack: {exc}") from None
        if state.digest() != facts["digest"]:
            raise ExportError(f"the state kept in {state_dir / STEPPED} is not the one this silo signed")
        return state
    raise ExportError(
        f"none of the {len(keys)} {keyring.layer} keys in {keyring.dir} opens the state kept in "
        f"{state_dir / STEPPED}: was the key removed?"
    )


def _keyring(state_dir: Path, layer: str) -> Keyring:
    """The keys of the layer the kept state names, which must be installed and ask for the key service."""
    record = layers().get(layer)
    if record is None or record.key_service is None:
        raise ExportError(
            f"the state kept in {state_dir / STEPPED} is of privacy layer {layer!r}, which is not installed "
            "here with a key service: no key of it opens the state"
        )
    return Keyring(state_dir, layer, record.key_service)


def _card_facts(config: SiloConfig, facts: dict[str, Any], plan: RoundPlan) -> dict[str, Any]:
    """What the card says beyond the plan and the state: what this silo kept and knows of its own."""
    round_number, me = facts["round"], facts["silo"]
    progress = config.path(config.state_dir) / "progress.json"
    committed = json.loads(progress.read_text()).get("committed") if progress.exists() else None
    heard = (
        f"The aggregator told this silo of round {committed} committed."
        if committed is not None and committed >= round_number
        else f"This silo has not heard that round {round_number} was committed: compare the digest with the "
        "operator's `python -m aggregator status` before relying on it."
    )
    return {
        "consortium": facts["consortium"],
        "exported_by": f"silo {me}",
        "privacy": facts["privacy"],
        "rounds": {"committed": committed, "planned": plan.rounds},
        "state": {
            "round_id": facts["round_id"],
            "stepped_at": facts["kept_at"],
            "stepped_from": facts["stepped_from"],
            "contributors": facts["counted"],
        },
        "evaluation": {
            "accuracy": None,
            "why": "a silo keeps no evaluation of the state it steps to; the consortium's accuracy of round "
            f"{round_number} is in the operator's metrics (status, the status page, its run folder)",
        },
        "silos": _own_epsilon(config, me),
        "attestations": {
            "note": f"{me}'s signature (context {ATTESTATION_CONTEXT}) over the consortium, the "
            "round, this digest and the silos counted. The aggregator keeps every counted silo's signature "
            f"and commits a state only when all of them reported the same digest. {heard}",
            "counted": facts["counted"],
            "signatures": [{"silo": me, "signature": facts["signature"]}],
        },
    }


def _own_epsilon(config: SiloConfig, me: str) -> dict[str, Any]:
    if not config.dp.report:
        return {
            "note": "This silo does not report its ε (its dp.report is off); `python -m silo budget` shows "
            "its ledger.",
            "epsilon_remaining": {},
        }
    return {
        "note": "This silo's ε left (its dp.report says to tell); each other silo reports its own.",
        "epsilon_remaining": {me: open_ledger(config).remaining()},
    }
