"""Models by entry point (issue 34): a plan names `package.module:factory`, each silo runs only the entry
points its policy pins by a digest of the installed source, and refuses any other before importing it.

The model packages are written by the tests into tmp_path and put on sys.path, outside fedlt/; each imports
with a side effect (a line appended to a marker file), so that a test sees whether anything imported it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import textwrap
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlt.errors import ConfigError
from fedlt.methods import METHODS, MethodChoice
from fedlt.models import build_model
from fedlt.plan import ModelSection, RoundPlan
from fedlt.sim.config import ModelChoice, SimConfig, load_sim_config
from fedlt.sim.run import run_simulation
from fedlt.v1 import consortium_pb2 as pb
from fedlt.v1 import round_pb2
from fedlt.wire import schema_to_pb
from privacy.pki.signing import ROUNDSPEC_CONTEXT, sign
from silo.__main__ import main as silo_main
from silo.agent import SiloAgent
from silo.config import load_silo_config
from silo.models import DIGEST_PREFIX, pin_line, source_digest
from silo.models import entry_point as parse_pinned
from silo.transport import SiloTransport
from tests.consortium_harness import ENV, PLAN, RECIPE, SILO_THREADS, Consortium, write_kit

NETS = """
import pathlib

from torch import nn

pathlib.Path({marker!r}).open("a").write("imported\\n")


def tiny(num_classes, hidden=16, image_shape=(1, 8, 8)):
    channels, height, width = image_shape
    return nn.Sequential(
        nn.Flatten(), nn.Linear(channels * height * width, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


class Declared(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.classifier = nn.Linear(32, num_classes)  # registered first: only the declaration finds it
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh())

    def forward(self, x):
        return self.classifier(self.encoder(x))


def no_linear(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes), nn.ReLU())


def wrong_classes(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes + 1))


class AuxLast(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes), nn.ReLU())
        self.fc = nn.Linear(num_classes, num_classes)
        self.aux = nn.Linear(num_classes, num_classes)  # registered last, but not the output layer

    def forward(self, x):
        return self.fc(self.body(x))


def not_a_module(num_classes):
    return num_classes
"""


class ModelPackage:
    """A package `name` in `root` (on sys.path) whose `nets` module appends a line to `marker` when
    imported."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        self.marker = root / f"{name}.imported"
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "nets.py").write_text(NETS.format(marker=str(self.marker)))

    def entry(self, factory: str = "tiny") -> str:
        return f"{self.name}.nets:{factory}"

    @property
    def imported(self) -> bool:
        return self.marker.exists() or any(m.split(".")[0] == self.name for m in sys.modules)


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """Makes model packages with fresh names (so no test finds another's in sys.modules), and forgets them."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    made: list[ModelPackage] = []

    def make() -> ModelPackage:
        made.append(ModelPackage(root, f"byo_{uuid.uuid4().hex[:12]}"))
        return made[-1]

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] in {p.name for p in made}]:
        del sys.modules[name]


def digits_plan(name: str, options: str = "") -> str:
    return f'[model]\nname = "{name}"\nimage_shape = [1, 8, 8]\n{options}'


# --- the split and the factory's contract ---------------------------------------------------------------


def test_a_final_linear_is_found_and_becomes_the_classifier(packages):
    package = packages()
    model = build_model(package.entry(), input_shape=(1, 8, 8), num_classes=10, seed=0)
    assert isinstance(model.classifier, torch.nn.Linear)
    assert (model.feature_dim, model.num_classes) == (16, 10)
    assert isinstance(model.encoder[3], torch.nn.Identity)  # the Linear's place in the encoder
    x = torch.rand(4, 1, 8, 8)
    assert model.encoder(x).shape == (4, 16)
    assert torch.equal(model(x), model.classifier(model.encoder(x)))


def test_a_declared_split_is_used_even_where_the_last_child_is_not_the_classifier(packages):
    model = build_model(packages().entry("Declared"), input_shape=(1, 8, 8), num_classes=10, seed=0)
    assert model.feature_dim == 32
    assert isinstance(model.encoder[-1], torch.nn.Tanh)


@pytest.mark.parametrize(
    ("factory", "problem"),
    [
        ("no_linear", "declare `encoder` and `classifier` (an nn.Linear), or end in an nn.Linear"),
        ("wrong_classes", "classifier has 11 outputs, but the plan has 10 classes"),
        ("AuxLast", "output is not classifier(encoder(x)) of its split"),
        ("not_a_module", "returned a int, not a torch.nn.Module"),
        ("missing", "has no function or class 'missing'"),
    ],
)
def test_a_network_without_a_usable_split_is_a_clear_config_error(packages, factory, problem):
    with pytest.raises(ConfigError, match=r"model\.name") as err:
        build_model(packages().entry(factory), input_shape=(1, 8, 8), num_classes=10, seed=0)
    assert problem in str(err.value)


def test_options_reach_the_factory_and_the_seed_fixes_the_weights_without_touching_global_rng(packages):
    plan = RoundPlan.from_toml(digits_plan(packages().entry(), "[model.options]\nhidden = 24\n"), "plan")
    spec = plan.build_method().model_spec
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = spec.build(7), spec.build(7), spec.build(8)
    assert torch.equal(before, torch.rand(1))
    assert a.feature_dim == 24
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_a_factory_rejecting_its_options_is_a_config_error_naming_the_call(packages):
    entry = packages().entry()
    plan = RoundPlan.from_toml(digits_plan(entry, "[model.options]\nwidth = 3\n"), "plan")
    with pytest.raises(ConfigError, match=r"\(num_classes=10, width=3, image_shape=\(1, 8, 8\)\) failed"):
        plan.build_method().model_spec.build(0)


def state_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [  # the weights fedlt built at 2e88912, before entry points
        ("cnn", (1, 28, 28), "b31975e71541b721e73badf2c4271e2ab92ab8226097e77d7931aa36aaae6135"),
        ("cnn-small", (1, 8, 8), "4fc69768a4b7e667152106fa91f103b8bcb0e4e46930b0a74d6df8584d934a40"),
        ("resnet8", (3, 32, 32), "382e7e9130580b4563bc27029ac81dcd09e1a6a0c809b669795e18e63163c12e"),
    ],
)
def test_built_in_models_are_bit_identical_to_before_entry_points(name, shape, expected):
    assert state_digest(build_model(name, input_shape=shape, num_classes=10, seed=0)) == expected


def test_a_built_in_plan_hashes_as_before_entry_points():
    assert RoundPlan().sha256() == "9bdeec4a588c47d7f036ed7bd25e4df5436bed34a06d8406010f1966d4f3f5ed"
    small = RoundPlan(model=ModelSection(name="cnn-small", image_shape=(1, 8, 8)))
    assert small.sha256() == "2c8d7bacb34918aecd25ab1031cf57829bf5af0e63cd62dc8a9dfb5f7805ad21"


# --- the plan's options, validated when the plan is read (nothing imported) --------------------------------


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        (
            "[model.options]\nlayers = { depth = 2 }\n",
            "model.options.layers: expected a string, number, boolean",
        ),
        ("[model.options]\nwhen = 2024-01-01\n", "got a date or time"),
        ("[model.options]\ngrid = [[1, 2], [3]]\n", "arrays of arrays are not plain values"),
        ("[model.options]\nnum_classes = 3\n", "set by fedlt from the plan"),
        ('[model.options]\n"not-a-name" = 1\n', "not a Python keyword-argument name"),
        ("[model.options]\nclass = 1\n", "not a Python keyword-argument name"),
        ("options = 3\n", "model.options: expected a table"),
    ],
)
def test_malformed_options_are_refused_when_the_plan_is_read(packages, lines, problem):
    package = packages()
    with pytest.raises(ConfigError) as err:
        RoundPlan.from_toml(digits_plan(package.entry(), lines), "plan.toml")
    assert problem in str(err.value)
    assert not package.imported


@pytest.mark.parametrize(
    ("name", "options", "problem"),
    [
        ("cnn-small", "[model.options]\nhidden = 3\n", "the built-in model cnn-small takes no options"),
        ("vgg", "", "unknown model 'vgg'; allowed: 'cnn', 'cnn-small', 'resnet8', 'mlp', or an entry point"),
        ("pkg.mod:factory:x", "", "unknown model"),
        ("pkg.class:f", "", "unknown model"),
        ("os.system", "", "unknown model"),
    ],
)
def test_a_model_name_is_a_built_in_or_an_entry_point(name, options, problem):
    with pytest.raises(ConfigError, match=r"plan\.toml") as err:
        RoundPlan.from_toml(digits_plan(name, options), "plan.toml")
    assert problem in str(err.value)


def test_options_keep_their_values_through_the_plans_text(packages):
    lines = '[model.options]\nhidden = 24\nname = "x"\nscale = 0.5\nflag = true\nsizes = [1, 2]\n'
    plan = RoundPlan.from_toml(digits_plan(packages().entry(), lines), "plan")
    again = RoundPlan.from_toml(plan.to_toml(), "again")
    assert again == plan
    assert again.model.options.to_table() == {
        "flag": True,
        "hidden": 24,
        "name": "x",
        "scale": 0.5,
        "sizes": [1, 2],
    }


# --- pinning: what is hashed, computed without importing ---------------------------------------------------


def reference_digest(files: dict[str, bytes]) -> str:
    """The digest as silo/models.py's docstring defines it, computed from the files themselves."""
    digest = hashlib.sha256(DIGEST_PREFIX)
    for relative in sorted(files):
        data = files[relative]
        digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    files=st.dictionaries(
        st.lists(names, min_size=1, max_size=3).map(lambda parts: "/".join(parts) + ".py"),
        st.binary(max_size=64),
        max_size=5,
    ),
    cache=st.binary(max_size=16),
)
def test_the_digest_is_the_documented_one_and_ignores_only_pycache(monkeypatch, files, cache):
    """Any tree of files: the documented digest over every file but those in __pycache__ folders, whatever
    they hold."""
    files = files | {"__init__.py": b""}
    with tempfile.TemporaryDirectory() as root:
        name = f"pinned_{uuid.uuid4().hex[:12]}"
        for relative, data in files.items():
            path = Path(root, name, relative)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (Path(root, name, "__pycache__")).mkdir(exist_ok=True)
        (Path(root, name, "__pycache__", "x.cpython-311.pyc")).write_bytes(cache)
        monkeypatch.syspath_prepend(root)
        assert source_digest(parse_pinned(f"{name}:f")) == reference_digest(files)
        assert name not in sys.modules


def test_a_single_file_module_is_pinned_by_that_file(tmp_path, monkeypatch):
    (tmp_path / "lonely_model_mod.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = reference_digest({"lonely_model_mod.py": b"raise SystemExit('imported')\n"})
    assert source_digest(parse_pinned("lonely_model_mod:f")) == expected


@pytest.mark.parametrize(
    "source",
    [
        "from torch.nn import Linear as tiny\n",
        "tiny = lambda num_classes: None\n",
        "from elsewhere import *\n",  # binds names this reading cannot see: left to the round start
        "def __getattr__(name):\n    return None\n",
    ],
)
def test_a_factory_bound_other_than_by_def_is_pinned(tmp_path, monkeypatch, source):
    (tmp_path / "bound_model_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "bound_model_mod:tiny" in pin_line("bound_model_mod:tiny")


def test_models_pin_prints_the_policy_item_without_importing(packages, capsys):
    package = packages()
    assert silo_main(["models", "pin", package.entry()]) == 0
    line = capsys.readouterr().out.strip()
    digest = source_digest(parse_pinned(package.entry()))
    assert line == f'{{ entry = "{package.entry()}", sha256 = "{digest}" }}'
    assert not package.imported


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("os:system", "os is built into Python"),
        ("builtins:eval", "builtins is built into Python"),
        ("no_such_package_here.nets:tiny", "no installed module or package named 'no_such_package_here'"),
        ("tiny", "'tiny' is not an entry point 'package.module:factory'"),
        ("{pkg}.absent:tiny", "has no module {pkg}.absent"),
        ("{pkg}.nets:tiny_typo", "{pkg}.nets ("),  # a misspelt factory, caught when pinned, not at round 1
        ("{pkg}.nets:tiny_typo", "defines no 'tiny_typo' at its top level"),
    ],
)
def test_models_pin_says_in_one_line_why_it_cannot_pin(packages, capsys, entry, error):
    package = packages()
    assert silo_main(["models", "pin", entry.format(pkg=package.name)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert error.format(pkg=package.name) in err
    assert not package.imported


# --- admission: the silo's policy decides what code runs ---------------------------------------------------


SILOS = ["silo-0", "silo-1", "silo-2"]


def agent_with_pins(root: Path, configs: list[Path], pins: list[str]) -> SiloAgent:
    """silo-0's agent as registration leaves it, its policy pinning `pins` (entry points)."""
    items = ", ".join(pin_line(entry) for entry in pins)
    text = configs[0].read_text().replace("[policy]\n", f"[policy]\nmodels = [{items}]\n")
    configs[0].write_text(text)
    agent = SiloAgent(load_silo_config(configs[0]))
    agent.standing.silo_id = "silo-0"
    agent.standing.aggregator_pem = (root / "pki" / "aggregator.pem").read_bytes()
    agent.keys.registered(SiloTransport(RefusalStub()), pb.RegisterResponse(silo_id="silo-0"))
    return agent


def spec_naming(root: Path, model: str) -> round_pb2.SignedRoundSpec:
    """The RoundSpec an aggregator signs for PLAN with its model replaced by `model` (the schema is PLAN's:
    a plan refused at admission never reaches the schema check)."""
    plan = replace(PLAN, model=replace(PLAN.model, name=model)).to_toml()
    schema = PLAN.build_method().schema(PLAN.build_method().init_state(seed=0))
    spec = round_pb2.RoundSpec(
        consortium_id="test-consortium",
        round=1,
        attempt=1,
        round_id="r1.a1.x",
        method=PLAN.method.name,
        method_config=plan,
        schema=schema_to_pb(schema),
        config_sha256=hashlib.sha256(plan.encode()).hexdigest(),
        privacy="secagg",
        participants=SILOS,
        secagg=round_pb2.SecAggParameters(k_min=2),
    )
    blob = spec.SerializeToString()
    signature = sign(root / "pki" / "aggregator.key", blob, context=ROUNDSPEC_CONTEXT)
    return round_pb2.SignedRoundSpec(spec=blob, signature=signature)


class RefusalStub:
    """Takes refusals and nothing else: a refused round sends nothing but its refusal."""

    def __init__(self) -> None:
        self.refusals: list[pb.RefuseRequest] = []

    def Refuse(self, request: pb.RefuseRequest, timeout=None) -> pb.RefuseResponse:  # noqa: N802 (gRPC's)
        self.refusals.append(request)
        return pb.RefuseResponse(round_id=request.round_id)

    def __getattr__(self, name: str):
        raise AssertionError(f"the silo called {name} for a round it should have refused")


@pytest.fixture
def kit(tmp_path):
    return tmp_path, write_kit(tmp_path)


def refused(agent: SiloAgent, signed: round_pb2.SignedRoundSpec) -> pb.RefuseRequest:
    stub = RefusalStub()
    assert agent.admission.admit(SiloTransport(stub), signed) is None
    (told,) = stub.refusals
    return told


@pytest.mark.parametrize("model", ["os:system", "builtins:eval", "subprocess:run", "importlib:import_module"])
def test_an_aggregator_naming_python_itself_as_the_model_is_refused(kit, packages, model):
    """A malicious aggregator names any callable of the silo's Python as the model's factory."""
    root, configs = kit
    agent = agent_with_pins(root, configs, [packages().entry()])
    told = refused(agent, spec_naming(root, model))
    assert told.code == pb.REFUSAL_CODE_POLICY
    assert f"model {model!r} is not an entry point policy.models allows" in told.text


def test_an_unlisted_model_package_is_refused_and_never_imported(kit, packages):
    root, configs = kit
    allowed, other = packages(), packages()
    agent = agent_with_pins(root, configs, [allowed.entry()])
    for model in (
        other.entry(),
        allowed.entry("Declared"),
    ):  # another package; another factory of the pinned one
        told = refused(agent, spec_naming(root, model))
        assert told.code == pb.REFUSAL_CODE_POLICY
        assert "is not an entry point policy.models allows" in told.text
    assert not other.imported
    assert not allowed.imported


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (p.root / p.name / "nets.py").write_text((p.root / p.name / "nets.py").read_text() + "\n#"),
        lambda p: (p.root / p.name / "helper.py").write_text("import os\n"),
        lambda p: (p.root / p.name / "__init__.py").write_text("from .nets import tiny\n"),
    ],
    ids=["a line added", "a file added", "another file of the package changed"],
)
def test_a_pinned_model_whose_code_changed_after_pinning_is_refused_and_never_imported(kit, packages, change):
    root, configs = kit
    package = packages()
    agent = agent_with_pins(root, configs, [package.entry()])
    change(package)
    told = refused(agent, spec_naming(root, package.entry()))
    assert told.code == pb.REFUSAL_CODE_POLICY
    assert "the installed code no longer has the digest policy.models pins" in told.text
    assert not package.imported


def test_a_pinned_model_since_removed_is_refused_without_telling_the_aggregator_the_silos_paths(
    kit, packages, caplog
):
    root, configs = kit
    package = packages()
    agent = agent_with_pins(root, configs, [package.entry()])
    (package.root / package.name / "nets.py").rename(package.root / "elsewhere.py")
    told = refused(agent, spec_naming(root, package.entry()))
    assert told.code == pb.REFUSAL_CODE_POLICY
    assert "its installed code cannot be found or read" in told.text
    assert str(package.root) not in told.text
    assert f"has no module {package.name}.nets" in caplog.text
    assert not package.imported


def test_a_pinned_model_is_admitted_without_importing_and_built_once_the_round_starts(kit, packages):
    root, configs = kit
    package = packages()
    agent = agent_with_pins(root, configs, [package.entry()])
    stub = RefusalStub()
    admitted = agent.admission.check(SiloTransport(stub), spec_naming(root, package.entry()))
    assert stub.refusals == []
    assert not package.imported
    method = agent.admission.plans.method(admitted.plan, admitted.spec.config_sha256)
    assert method.working_model().feature_dim == 16
    assert package.imported


def test_a_built_in_model_needs_no_pin(kit):
    root, configs = kit
    agent = agent_with_pins(root, configs, [])
    assert agent.admission.check(SiloTransport(RefusalStub()), spec_naming(root, "cnn-small")).plan == PLAN


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (
            '{ entry = "os" , sha256 = "' + "0" * 64 + '" }',
            "policy.models[0].entry: 'os' is not an entry point",
        ),
        ('{ entry = "a.b:c", sha256 = "abc" }', "policy.models[0].sha256: expected 64 lowercase hex digits"),
        ('{ entry = "a.b:c" }', "policy.models[0]: expected { entry ="),
        ('{ entry = "a.b:c", sha256 = "' + "0" * 64 + '", extra = 1 }', "policy.models[0]: expected"),
        ('"a.b:c"', "policy.models: expected a list of dict"),
    ],
)
def test_a_malformed_pin_is_a_clear_error_when_the_silo_config_is_read(kit, item, problem):
    _, configs = kit
    configs[0].write_text(configs[0].read_text().replace("[policy]\n", f"[policy]\nmodels = [{item}]\n"))
    with pytest.raises(ConfigError) as err:
        load_silo_config(configs[0])
    assert problem in str(err.value)


def test_an_entry_point_listed_twice_is_a_clear_error(kit):
    _, configs = kit
    item = '{ entry = "a.b:c", sha256 = "' + "0" * 64 + '" }'
    configs[0].write_text(
        configs[0].read_text().replace("[policy]\n", f"[policy]\nmodels = [{item}, {item}]\n")
    )
    with pytest.raises(ConfigError, match=r"policy.models\[1\].entry: 'a.b:c' is listed twice"):
        load_silo_config(configs[0])


# --- an outside package's model trains, reproducibly, in the simulator and in a real consortium ------------


def simulated(tmp_path: Path, entry: str, method: MethodChoice, rounds: int, run: str):
    """The simulator's Python API, with the factory's default options."""
    config = SimConfig(
        seed=0,
        privacy="secagg",
        rounds=rounds,
        data=RECIPE,
        model=ModelChoice(entry),
        train=PLAN.train,
        method=method,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(SILO_THREADS)
    try:
        return run_simulation(config, tmp_path / run, echo=lambda _: None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "method",
    [MethodChoice(), MethodChoice("creff", METHODS["creff"].Options(match_steps=10))],
    ids=["fedavg", "creff"],
)
def test_an_outside_model_trains_in_the_simulator_bit_identically_twice(tmp_path, packages, method):
    entry = packages().entry()
    first = simulated(tmp_path, entry, method, rounds=2, run="a")
    second = simulated(tmp_path, entry, method, rounds=2, run="b")
    assert first.state.round == second.state.round == 2
    assert first.state.digest() == second.state.digest()
    assert set(first.state.model) == {
        "encoder.1.weight",
        "encoder.1.bias",
        "classifier.weight",
        "classifier.bias",
    }
    if method.name == "fedavg":  # CReFF's re-trained head needs more than two rounds (the built-ins' too)
        assert first.metrics["rounds"][-1]["accuracy"] > 0.3
    else:  # its federated features, matched to the gradients of the outside model's classifier
        assert first.state.extra


def test_the_simulators_config_file_names_an_outside_model_with_its_options(tmp_path, packages):
    entry = packages().entry()
    path = tmp_path / "sim.toml"
    path.write_text(f'[model]\nname = "{entry}"\n\n[model.options]\nhidden = 8\n')
    config = load_sim_config(str(path), {})
    assert (config.model.name, config.model.options.to_table()) == (entry, {"hidden": 8})
    path.write_text('[model]\nname = "auto"\n\n[model.options]\nhidden = 8\n')
    with pytest.raises(ConfigError, match="auto picks a built-in model, which takes none"):
        load_sim_config(str(path), {})
    path.write_text('[model]\nname = "no such model"\n')
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'no such model'"):
        load_sim_config(str(path), {})


def test_a_consortium_with_an_outside_model_under_secagg_matches_the_simulator_bit_for_bit(
    tmp_path, packages, monkeypatch
):
    """The issue's Done-when, for the model part: the package installed at every silo and the aggregator
    (here: on their PYTHONPATH), pinned in every silo's policy, named in the plan."""
    package = packages()
    paths = [str(package.root), *filter(None, [ENV.get("PYTHONPATH")])]
    monkeypatch.setitem(ENV, "PYTHONPATH", os.pathsep.join(paths))
    plan = replace(PLAN, model=replace(PLAN.model, name=package.entry()))
    consortium = Consortium.create(tmp_path / "consortium", rounds=1, min_silos=3, plan=plan)
    item = pin_line(package.entry())
    for config in consortium.silo_configs:
        config.write_text(config.read_text().replace("[policy]\n", f"[policy]\nmodels = [{item}]\n"))
    try:
        consortium.start()
        assert consortium.wait_aggregator(timeout=180) == 0
        final = consortium.final_state()
    finally:
        consortium.stop()
    expected = simulated(tmp_path, package.entry(), PLAN.method, rounds=1, run="sim").state
    assert final.round == expected.round == 1
    assert set(final.model) == set(expected.model)
    assert all(torch.equal(final.model[k], expected.model[k]) for k in expected.model)


# --- MONAI's networks, where MONAI is installed (pip install monai --no-deps) ------------------------------


MONAI_WRAPPER = '''
from monai.networks.nets import DenseNet121


def densenet121(num_classes, in_channels=1):
    """MONAI's networks take `out_channels`; fedlt's contract passes `num_classes`."""
    return DenseNet121(spatial_dims=2, in_channels=in_channels, out_channels=num_classes)
'''


def test_a_monai_densenet_splits_at_its_class_layers_output(tmp_path, monkeypatch):
    pytest.importorskip("monai")
    (tmp_path / "monai_wrapper_for_tests.py").write_text(textwrap.dedent(MONAI_WRAPPER))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = build_model(
            "monai_wrapper_for_tests:densenet121", input_shape=(1, 32, 32), num_classes=10, seed=0
        )
    finally:
        sys.modules.pop("monai_wrapper_for_tests", None)
    assert (model.feature_dim, model.num_classes) == (1024, 10)
    assert isinstance(model.encoder.class_layers.out, torch.nn.Identity)
    model.eval()
    x = torch.rand(2, 1, 32, 32)
    assert model.encoder(x).shape == (2, 1024)
