"""Taking the model home: `python -m aggregator export`, `python -m silo export` and `load_exported`.

The aggregator's side runs on a real store (aggregator.store) written as a serving aggregator writes it, with
the kit `aggregator.demo` writes; the silo's side on the state a silo keeps when it steps (ckks), sealed with
a real CKKS key and signed with the silo's certificate key.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from aggregator.__main__ import main as aggregator_main
from aggregator.config import ConsortiumSection, TimeoutSection, load_consortium_config
from aggregator.demo import write_consortium
from aggregator.held_state import HeldState
from aggregator.store import DATABASE, Retention, Store
from fedlt.aggregation import record
from fedlt.export import CARD, README, WEIGHTS, ExportError, load_exported, write_export
from fedlt.methods import GlobalState, Method
from fedlt.methods.state import pack_state
from fedlt.metrics import accuracy_from_counts
from fedlt.plan import RoundPlan
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from privacy.ckks.settings import CkksSettings
from privacy.pki.identity import read_certificate
from privacy.pki.signing import sign, verify
from privacy.stepping.attestation import ATTESTATION_CONTEXT, attest, state_message
from privacy.stepping.sealed_state import seal_state
from silo.__main__ import main as silo_main
from silo.config import load_silo_config
from silo.export import STEPPED, keep_stepped
from silo.key_service import Keyring
from tests.consortium_harness import AUDIT_KEY, PLAN, RECIPE, write_kit
from tests.test_consortium import make_consortium  # noqa: F401 (a fixture)

ROUNDS = 3
CONSORTIUM = "test-consortium"


@pytest.fixture(scope="module")
def secagg_kit(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("secagg-kit")
    write_kit(directory, consortium_id=CONSORTIUM)
    return directory


@pytest.fixture(scope="module")
def ckks_kit(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckks-kit")
    write_consortium(
        directory,
        recipe=RECIPE,
        plan=PLAN,
        consortium=ConsortiumSection(id=CONSORTIUM, rounds=ROUNDS, min_silos=3, privacy="ckks"),
        timeouts=TimeoutSection(),
        layer_settings=CkksSettings(key_holder="silo-0"),
    )
    return directory


@pytest.fixture
def kit(secagg_kit, tmp_path) -> Path:
    """A copy of the module's kit, for a store of this test's own."""
    return Path(shutil.copytree(secagg_kit, tmp_path / "kit"))


def trained(state: GlobalState, round_number: int) -> GlobalState:
    """A state as a round could leave it: every float moved, by an amount of its own (seeded)."""
    generator = torch.Generator().manual_seed(round_number)
    model = {
        k: v + 0.05 * torch.randn(v.shape, generator=generator, dtype=v.dtype) if v.is_floating_point() else v
        for k, v in state.model.items()
    }
    return GlobalState(round_number, model, state.extra)


def metrics_of(round_number: int, digest: str) -> dict:
    """An evaluation entry as the aggregator's recorder saves it (counts of 30 test images per class)."""
    correct = [(3 * c + round_number) % 30 for c in range(10)]
    groups = {"many": [0, 1, 2], "medium": [3, 4, 5, 6], "few": [7, 8, 9]}
    report = accuracy_from_counts(correct, [30] * 10, groups)
    return {"round": round_number, **report, "state_digest": digest, "contributors": ["silo-0"]}


def write_store(
    directory: Path,
    *,
    rounds: int = ROUNDS,
    evaluated: bool = True,
    retention: Retention | None = None,
) -> list[GlobalState]:
    """An aggregator's store after `rounds` committed rounds of the kit's plan; its states, from round 0."""
    config = load_consortium_config(directory / "consortium.toml")
    method = config.plan.build_method()
    store = Store(config.path(config.server.data_dir) / DATABASE, audit_key=AUDIT_KEY, retention=retention)
    try:
        store.bind(config.fingerprint())
        states = [method.init_state(seed=config.consortium.seed)]
        store.save_initial_state(states[0].digest(), pack_state(states[0]))
        for r in range(1, rounds + 1):
            states.append(trained(states[-1], r))
            _, round_id = store.begin_attempt(r, ["silo-0", "silo-1", "silo-2"], f"n{r}")
            store.commit_round(
                round_number=r,
                round_id=round_id,
                digest=states[r].digest(),
                data=pack_state(states[r]),
                contributors=["silo-0", "silo-1", "silo-2"],
            )
            if evaluated:
                store.save_metrics(r, metrics_of(r, states[r].digest()))
    finally:
        store.close()
    return states


def export(directory: Path, out: Path, *extra: str) -> int:
    return aggregator_main(
        ["export", "--config", str(directory / "consortium.toml"), "--out", str(out), *extra]
    )


def method_of(directory: Path) -> Method:
    return load_consortium_config(directory / "consortium.toml").plan.build_method()


def same_predictions(model: torch.nn.Module, method: Method, state: GlobalState) -> None:
    images = torch.rand((64, *PLAN.model.image_shape), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = method.eval_model(state).eval()(images)
        assert torch.equal(model(images), expected)


# --- the aggregator's export --------------------------------------------------------------------------------


def test_the_last_committed_model_is_exported_and_loads_back_as_the_stored_state(kit, tmp_path, capsys):
    states = write_store(kit)
    out = tmp_path / "model"
    assert export(kit, out) == 0
    assert "exported round 3 of 3" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted([WEIGHTS, CARD, README])

    model, card = load_exported(out)
    final = states[-1]
    weights = model.state_dict()
    assert set(weights) == set(final.model)
    for name, tensor in final.model.items():
        assert torch.equal(weights[name], tensor), name
    same_predictions(model, method_of(kit), final)
    # in plain PyTorch: the plan's network, holding the file's tensors
    plain = RoundPlan.from_toml(card["plan"]["toml"], "card").build_method().network(0)
    plain.load_state_dict(load_file(out / WEIGHTS))
    same_predictions(plain.eval(), method_of(kit), final)


def test_the_card_says_what_was_trained_how_by_whom_and_how_well(kit, tmp_path):
    states = write_store(kit)
    config = load_consortium_config(kit / "consortium.toml")
    assert export(kit, tmp_path / "model") == 0
    card = json.loads((tmp_path / "model" / CARD).read_text())

    assert card["consortium"] == CONSORTIUM
    assert card["plan"] == {"sha256": config.plan.sha256(), "toml": config.plan.to_toml()}
    assert (card["method"], card["privacy"]) == ("fedavg", "secagg")
    assert card["rounds"] == {"committed": ROUNDS, "planned": config.consortium.rounds}
    assert card["model"] == {"name": "cnn-small", "image_shape": [1, 8, 8], "classes": list("0123456789")}
    assert card["state"]["round"] == ROUNDS
    assert card["state"]["digest"] == states[-1].digest()
    assert card["state"]["contributors"] == ["silo-0", "silo-1", "silo-2"]
    data = (tmp_path / "model" / WEIGHTS).read_bytes()
    assert card["weights"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert card["weights"]["digest_checks_weights"] is True
    expected = metrics_of(ROUNDS, states[-1].digest())
    evaluation = card["evaluation"]
    assert evaluation["accuracy"] == expected["accuracy"]
    assert evaluation["per_class"] == dict(zip(config.plan.model.classes, expected["per_class"], strict=True))
    assert (evaluation["many"], evaluation["medium"], evaluation["few"]) == (
        expected["many"],
        expected["medium"],
        expected["few"],
    )
    assert "digits" in evaluation["on"]
    assert card["attestations"] is None
    assert card["silos"]["epsilon_remaining"] == {}  # no silo registered in this store
    assert "dp.report" in card["silos"]["note"]

    text = (tmp_path / "model" / README).read_text()
    assert states[-1].digest() in text
    assert card["weights"]["sha256"] in text
    assert f"{100 * expected['accuracy']:.1f}%" in text
    assert config.plan.to_toml().strip() in text


def test_the_same_state_gives_the_same_file_every_time(kit, tmp_path):
    """Byte for byte, so silos (and an auditor exporting again) can compare the SHA-256 their cards name."""
    write_store(kit)
    for k in range(3):
        assert export(kit, tmp_path / f"model-{k}") == 0
    files = {(tmp_path / f"model-{k}" / WEIGHTS).read_bytes() for k in range(3)}
    assert len(files) == 1


def test_an_earlier_round_is_exported_when_asked_for(kit, tmp_path):
    states = write_store(kit)
    assert export(kit, tmp_path / "model", "--round", "1") == 0
    model, card = load_exported(tmp_path / "model")
    assert card["state"]["digest"] == states[1].digest()
    same_predictions(model, method_of(kit), states[1])


def test_a_round_without_an_evaluation_says_why_rather_than_a_number(kit, tmp_path):
    write_store(kit, evaluated=False)
    assert export(kit, tmp_path / "model") == 0
    _, card = load_exported(tmp_path / "model")
    assert card["evaluation"]["accuracy"] is None
    assert "no evaluation of round 3" in card["evaluation"]["why"]
    assert "Not known: the store has no evaluation" in (tmp_path / "model" / README).read_text()


def test_the_epsilon_silos_reported_is_carried_on_the_card(kit, tmp_path):
    """The store keeps the ε each silo last reported in a heartbeat, so the card of a stopped aggregator
    carries it, and a silo that reports none is said to report none."""
    write_store(kit)
    config = load_consortium_config(kit / "consortium.toml")
    store = Store(config.path(config.server.data_dir) / DATABASE, audit_key=AUDIT_KEY)
    for silo in ("silo-0", "silo-1"):
        store.register_silo(silo, "sha", "test", {})
    store.touch_silo("silo-0", 2.5)
    store.touch_silo("silo-1")
    store.close()
    assert export(kit, tmp_path / "model") == 0
    _, card = load_exported(tmp_path / "model")
    assert card["silos"]["epsilon_remaining"] == {"silo-0": 2.5, "silo-1": None}
    text = (tmp_path / "model" / README).read_text()
    assert "| silo-0 | 2.5 |" in text
    assert "| silo-1 | not reported |" in text


def test_the_store_is_only_read_even_while_the_aggregator_writes(kit, tmp_path):
    """A serving aggregator in the middle of a commit holds the write lock; the export reads beside it, sees
    the last committed round, and leaves the store's rows and audit chain exactly as they were."""
    write_store(kit)
    config = load_consortium_config(kit / "consortium.toml")
    path = config.path(config.server.data_dir) / DATABASE
    store = Store(path, audit_key=AUDIT_KEY)

    def rows() -> list:
        db = sqlite3.connect(path)
        try:
            return [
                db.execute(f"SELECT * FROM {t}").fetchall() for t in ("states", "metrics", "audit", "meta")
            ]
        finally:
            db.close()

    before = rows()
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO metrics VALUES (99, '{}')")
    try:
        assert export(kit, tmp_path / "model") == 0
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert rows() == before
    store.verify_audit()
    store.close()
    assert load_exported(tmp_path / "model")[1]["state"]["round"] == ROUNDS


def test_under_ckks_the_aggregator_refuses_and_names_the_silos_command(ckks_kit, tmp_path, capsys):
    """The aggregator holds a sealed state it cannot read: exit 2, with the command silos run instead."""
    config = load_consortium_config(ckks_kit / "consortium.toml")
    method = config.plan.build_method()
    start = method.init_state(seed=config.consortium.seed)
    following = trained(start, 1)
    secret = Keyring(tmp_path / "silo-state", "ckks", record("ckks").key_service).rotate()
    sealed = seal_state(
        secret, consortium=CONSORTIUM, round_number=1, digest=following.digest(), packed=pack_state(following)
    )
    held = HeldState.sealed(1, following.digest(), sealed, method.schema(following), 2, True, None)
    store = Store(config.path(config.server.data_dir) / DATABASE, audit_key=AUDIT_KEY)
    store.bind(config.fingerprint())
    store.save_initial_state(start.digest(), pack_state(start))
    _, round_id = store.begin_attempt(1, ["silo-0"], "n1")
    store.commit_round(
        round_number=1,
        round_id=round_id,
        digest=following.digest(),
        data=held.stored(),
        contributors=["silo-0"],
    )
    store.close()

    out = tmp_path / "model"
    assert export(ckks_kit, out) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "sealed by the silos" in err
    assert "only silos can export it" in err
    assert "python -m silo export --config silo.toml" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no data directory", "no such data directory"),
        ("no round committed", "no round is committed yet"),
        ("round not committed", "round 7 is not committed"),
        ("round zero", "round 0 is not committed"),
        ("weights not kept", "the weights of round 1 were not kept"),
        ("out not empty", "is not empty"),
        ("another run's store", "holds a consortium run with other settings"),
    ],
)
def test_what_cannot_be_exported_is_said_in_one_line_with_exit_2(kit, tmp_path, capsys, case, expected):
    out = tmp_path / "model"
    extra: list[str] = []
    if case == "no round committed":
        write_store(kit, rounds=0)
    elif case in ("round not committed", "round zero"):
        write_store(kit)
        extra = ["--round", "7" if case == "round not committed" else "0"]
    elif case == "weights not kept":
        write_store(kit, retention=Retention(last=1))
        extra = ["--round", "1"]
    elif case == "out not empty":
        write_store(kit)
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "another run's store":
        write_store(kit)
        toml = kit / "consortium.toml"
        toml.write_text(toml.read_text().replace("seed = 0", "seed = 1", 1))
    assert export(kit, out, *extra) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert expected in err
    assert case == "out not empty" or not out.exists()


def test_a_replaced_weights_file_is_refused_by_its_hash_and_by_the_signed_digest(kit, tmp_path):
    """Someone swaps the weights: the card's SHA-256 catches it; swapping the card's hash too, the state
    digest the silos checked (recomputed from the file's tensors) still does."""
    states = write_store(kit)
    out = tmp_path / "model"
    assert export(kit, out) == 0
    other = tmp_path / "other"
    write_export(
        other,
        plan=PLAN,
        method=method_of(kit),
        state=trained(states[-1], 99),
        facts=json.loads((out / CARD).read_text()),
    )
    shutil.copy(other / WEIGHTS, out / WEIGHTS)
    with pytest.raises(ExportError, match="not the file its card describes"):
        load_exported(out)
    card = json.loads((out / CARD).read_text())
    card["weights"]["sha256"] = hashlib.sha256((out / WEIGHTS).read_bytes()).hexdigest()
    (out / CARD).write_text(json.dumps(card))
    with pytest.raises(ExportError, match="are not the state"):
        load_exported(out)


def test_the_loader_says_what_is_wrong_with_a_folder_that_is_no_whole_export(kit, tmp_path):
    with pytest.raises(ExportError, match=r"is .* an export folder"):
        load_exported(tmp_path)
    write_store(kit)
    out = tmp_path / "model"
    assert export(kit, out) == 0
    card = json.loads((out / CARD).read_text())
    del card["weights"]["sha256"]
    (out / CARD).write_text(json.dumps(card))
    with pytest.raises(ExportError, match=r"lacks weights\.sha256"):
        load_exported(out)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(round_number=st.integers(1, 10_000), scale=st.floats(1e-6, 1e3), rows=st.integers(0, 9))
def test_any_state_exported_loads_back_bit_for_bit(tmp_path_factory, round_number, scale, rows):
    """Whatever the round and the weights (of any scale, the head's rows partly zeroed), the model loaded
    holds exactly the state's tensors and its digest."""
    method = PLAN.build_method()
    start = method.init_state(seed=round_number)
    model = {k: v * scale for k, v in start.model.items()}
    head = next(k for k in model if k.endswith("weight") and model[k].dim() == 2)
    model[head] = model[head].clone()
    model[head][:rows] = 0
    state = GlobalState(round_number, model)
    out = tmp_path_factory.mktemp("export")
    facts = {
        "consortium": CONSORTIUM,
        "exported_by": "a test",
        "privacy": "plaintext",
        "rounds": {"committed": round_number, "planned": round_number},
        "evaluation": {"accuracy": None, "why": "not evaluated"},
        "silos": {"note": "", "epsilon_remaining": {}},
        "attestations": None,
    }
    write_export(out, plan=PLAN, method=method, state=state, facts=facts)
    loaded, card = load_exported(out)
    assert card["state"]["digest"] == state.digest()
    assert GlobalState(round_number, loaded.state_dict()).digest() == state.digest()


# --- a silo's export (ckks) ---------------------------------------------------------------------------------


def state_of(round_number: int) -> GlobalState:
    """The state the kit's plan reaches after `round_number` rounds (of `trained` steps)."""
    state = PLAN.build_method().init_state(seed=0)
    for r in range(1, round_number + 1):
        state = trained(state, r)
    return state


def stepped(
    kit_dir: Path, round_number: int = 2, silo: int = 1, plan: RoundPlan = PLAN
) -> tuple[Path, GlobalState, bytes]:
    """A silo that stepped `round_number` of `plan` under ckks and kept its report, as the agent keeps it;
    (its config, the state it stepped to, the signature it reported)."""
    config_path = kit_dir / f"silo-{silo}.toml"
    config = load_silo_config(config_path)
    state_dir = config.path(config.state_dir)
    keyring = Keyring(state_dir, "ckks", record("ckks").key_service)
    secret = keyring.current()
    start, following = state_of(round_number - 1), state_of(round_number)
    digest, counted = following.digest(), ("silo-0", "silo-1", "silo-2")
    sealed = seal_state(
        secret, consortium=CONSORTIUM, round_number=round_number, digest=digest, packed=pack_state(following)
    )
    key = config.path(config.connection.key)
    signature = attest(
        lambda data, context: sign(key, data, context=context),
        consortium=CONSORTIUM,
        round_number=round_number,
        digest=digest,
        counted=counted,
    )
    spec = round_pb2.RoundSpec(
        consortium_id=CONSORTIUM,
        round=round_number,
        round_id=f"r{round_number}.a1.x",
        privacy="ckks",
        method_config=plan.to_toml(),
        config_sha256=plan.sha256(),
        state_digest=start.digest(),
    )
    header = pb.StateReportHeader(
        round_id=spec.round_id,
        state_digest=digest,
        total_bytes=len(sealed),
        sha256=hashlib.sha256(sealed).hexdigest(),
        state_signature=signature,
        round=round_number,
        counted=counted,
    )
    keep_stepped(state_dir, spec, f"silo-{silo}", header, sealed)
    return config_path, following, signature


def silo_export(config_path: Path, out: Path, capsys) -> tuple[int, str]:
    code = silo_main(["export", "--config", str(config_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_a_silo_exports_the_state_it_stepped_to_with_its_signature_over_the_digest(
    ckks_kit, tmp_path, capsys
):
    kit_dir = Path(shutil.copytree(ckks_kit, tmp_path / "kit"))
    config_path, following, signature = stepped(kit_dir)
    out = tmp_path / "model"
    assert silo_export(config_path, out, capsys)[0] == 0

    model, card = load_exported(out)
    for name, tensor in following.model.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    same_predictions(model, PLAN.build_method(), following)
    assert card["exported_by"] == "silo silo-1"
    assert (card["consortium"], card["privacy"], card["method"]) == (CONSORTIUM, "ckks", "fedavg")
    assert card["plan"]["sha256"] == PLAN.sha256()
    assert card["state"]["digest"] == following.digest()
    assert card["state"]["stepped_from"] == state_of(1).digest()
    assert card["evaluation"]["accuracy"] is None
    assert "has not heard that round 2 was committed" in card["attestations"]["note"]
    # the signature on the card checks out against the silo's certificate, over what silos sign
    (signed,) = card["attestations"]["signatures"]
    assert signed == {"silo": "silo-1", "signature": signature.hex()}
    message = state_message(CONSORTIUM, 2, following.digest(), card["attestations"]["counted"])
    certificate = read_certificate(kit_dir / "pki" / "silo-1.pem")
    verify(certificate, bytes.fromhex(signed["signature"]), message, context=ATTESTATION_CONTEXT)


def test_a_silo_that_reports_its_epsilon_puts_it_on_its_card(ckks_kit, tmp_path, capsys):
    kit_dir = Path(shutil.copytree(ckks_kit, tmp_path / "kit"))
    config_path, _, _ = stepped(kit_dir)
    config_path.write_text(config_path.read_text() + "\n[dp]\nepsilon = 4.0\nreport = true\n")
    (kit_dir / "silo-1-state" / "progress.json").write_text(json.dumps({"committed": 2}))
    assert silo_export(config_path, tmp_path / "model", capsys)[0] == 0
    _, card = load_exported(tmp_path / "model")
    assert card["silos"]["epsilon_remaining"] == {"silo-1": 4.0}
    assert "told this silo of round 2 committed" in card["attestations"]["note"]
    assert card["rounds"]["committed"] == 2


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("nothing stepped", "this silo has stepped no model yet"),
        ("damaged", "is damaged"),
        ("key gone", "opens the state kept"),
        ("out not empty", "is not empty"),
    ],
)
def test_what_a_silo_cannot_export_is_said_in_one_line_with_exit_2(
    ckks_kit, tmp_path, capsys, case, expected
):
    kit_dir = Path(shutil.copytree(ckks_kit, tmp_path / "kit"))
    config_path = kit_dir / "silo-1.toml"
    state_dir = kit_dir / "silo-1-state"
    out = tmp_path / "model"
    if case == "nothing stepped":
        state_dir.mkdir()
    else:
        stepped(kit_dir)
    if case == "damaged":
        kept = bytearray((state_dir / STEPPED).read_bytes())
        kept[-1] ^= 1
        (state_dir / STEPPED).write_bytes(bytes(kept))
    elif case == "key gone":
        for path in (state_dir / "ckks").glob("*.secret"):
            path.unlink()
    elif case == "out not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    code, err = silo_export(config_path, out, capsys)
    assert code == 2
    assert expected in err
    assert case == "out not empty" or not out.exists()


def test_a_silo_exports_no_model_its_policy_does_not_pin(ckks_kit, tmp_path, capsys):
    """Exporting builds the plan's model: a model the policy does not pin (or no longer does) is refused in
    one line, and its code is never imported."""
    kit_dir = Path(shutil.copytree(ckks_kit, tmp_path / "kit"))
    plan = replace(PLAN, model=replace(PLAN.model, name="fedlt_unpinned_model:make"))
    config_path, _, _ = stepped(kit_dir, plan=plan)
    code, err = silo_export(config_path, tmp_path / "model", capsys)
    assert code == 2
    assert "'fedlt_unpinned_model:make' is not an entry point policy.models allows" in err
    assert "fedlt_unpinned_model" not in sys.modules
    assert not (tmp_path / "model").exists()


def test_the_kept_state_is_replaced_by_each_step(ckks_kit, tmp_path, capsys):
    """A silo keeps only the last state it stepped to: a later round's report replaces the earlier one."""
    kit_dir = Path(shutil.copytree(ckks_kit, tmp_path / "kit"))
    stepped(kit_dir, round_number=2)
    config_path, later, _ = stepped(kit_dir, round_number=3)
    assert [p.name for p in (kit_dir / "silo-1-state").iterdir() if p.name.startswith("stepped")] == [STEPPED]
    assert silo_export(config_path, tmp_path / "model", capsys)[0] == 0
    model, card = load_exported(tmp_path / "model")
    assert card["state"] | {"round": 3, "digest": later.digest()} == card["state"]
    same_predictions(model, PLAN.build_method(), later)


@pytest.mark.slow
def test_ckks_silos_export_the_committed_state(make_consortium, tmp_path):  # noqa: F811
    """Under ckks only silos hold the model: each exports the state it stepped to, the one the aggregator
    committed, and every silo's file is the same bytes."""
    consortium = make_consortium(rounds=2, min_silos=3, privacy="ckks")
    consortium.start()
    assert consortium.wait_aggregator(timeout=300) == 0, "\n".join(consortium.output[-30:])
    consortium.stop()
    store = consortium.store()
    latest = store.latest_state()
    store.close()
    assert export(consortium.directory, tmp_path / "agg") == 2
    cards = []
    for k in range(3):
        out = tmp_path / f"silo-{k}"
        assert silo_main(["export", "--config", str(consortium.silo_configs[k]), "--out", str(out)]) == 0
        cards.append(load_exported(out)[1])
    assert {c["state"]["digest"] for c in cards} == {latest.digest}
    assert len({c["weights"]["sha256"] for c in cards}) == 1
    assert all(c["rounds"]["committed"] == 2 for c in cards)
