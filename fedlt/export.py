"""The trained model, taken home: its weights in safetensors and a model card, written and loaded back.

An export folder holds three files: `model.safetensors` (the weights of the model the consortium evaluates,
by tensor name), `model-card.json` (what a program reads: the plan that trained it, the state digest silos
checked, the file's SHA-256, accuracy, what silos reported) and `MODEL_CARD.md` (the same for a person).
safetensors holds raw tensors and a JSON header, so loading it runs no code, unlike a pickled checkpoint
(`torch.load` without `weights_only`). The weights are those of `Method.eval_model`: for a method whose
server step fits the classifier (CReFF, CCVR) that is the fitted head, not the one silos trained.

The card records the state digest every silo checked (under ckks, signed); where the weights are the whole
state (no method tensors beside the model), the digest is recomputed from the file's tensors, so the file is
bound to the state the silos signed, not only to the card's own hash.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from fedlt.atomic import atomic_write, atomic_write_text
from fedlt.config import as_table
from fedlt.errors import ConfigError, FedltError
from fedlt.methods import GlobalState, Method
from fedlt.plan import RoundPlan

WEIGHTS = "model.safetensors"
CARD = "model-card.json"
README = "MODEL_CARD.md"
FORMAT = "fedlt-model-card/1"
# what `load_exported` reads of a card, by section
LOADED = {
    "plan": ("toml", "sha256"),
    "state": ("round", "digest"),
    "weights": ("sha256", "digest_checks_weights"),
}


class ExportError(FedltError):
    """An export that cannot be written or read as asked; the message says what to do instead."""


def check_out_dir(out: Path) -> None:
    """An export goes to a new or empty folder, so it never mixes with or replaces other files."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; name a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"--out {out} is not empty; name a new or empty folder for the export")


def model_weights(method: Method, state: GlobalState) -> dict[str, torch.Tensor]:
    """The evaluated model's tensors, each its own contiguous copy (safetensors refuses shared storage)."""
    model = method.eval_model(state)
    return {name: t.detach().cpu().contiguous().clone() for name, t in model.state_dict().items()}


def accuracy_by_class(entry: Mapping[str, Any], classes: Sequence[str]) -> dict[str, Any]:
    """A metrics entry (`fedlt.metrics`) with its per-class accuracies keyed by the plan's class names."""
    per_class = entry.get("per_class") or []
    if len(per_class) != len(classes):
        raise ExportError(
            f"the metrics of round {entry.get('round')} have {len(per_class)} per-class accuracies for "
            f"{len(classes)} classes of the plan"
        )
    return {
        "accuracy": entry.get("accuracy"),
        **{group: entry.get(group) for group in ("many", "medium", "few")},
        "per_class": dict(zip(classes, per_class, strict=True)),
    }


def write_export(
    out: Path, *, plan: RoundPlan, method: Method, state: GlobalState, facts: Mapping[str, Any]
) -> dict[str, Any]:
    """Write the weights, then the card (JSON and Markdown) naming their SHA-256; returns the card.

    `facts` is what the exporting side knows beyond the plan and the state: `consortium`, `exported_by`,
    `privacy`, `rounds` ({committed: int or None, planned}), `state` (facts added to its round and digest),
    `evaluation` (`accuracy_by_class` plus `on`, or {accuracy: None, why}), `silos` ({note,
    epsilon_remaining: {silo: ε or None}}) and `attestations` (None, or {note, counted, signatures})."""
    check_out_dir(out)
    weights = model_weights(method, state)
    # one metadata key only: safetensors writes a map's keys in a random order, and the same state must give
    # the same bytes at every silo, so their cards' SHA-256 can be compared
    data = save_safetensors(weights, metadata={"format": "pt"})
    card = {
        "format": FORMAT,
        "exported_at": utc(time.time()),
        **facts,
        "method": plan.method.name,
        "plan": {"sha256": plan.sha256(), "toml": plan.to_toml()},
        "model": _model_facts(plan),
        "dp": as_table(plan.dp),
        "state": {**facts.get("state", {}), "round": state.round, "digest": state.digest()},
        "weights": {
            "file": WEIGHTS,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "tensors": len(weights),
            # the signed digest covers the file itself only where the weights are the whole state
            "digest_checks_weights": GlobalState(state.round, weights).digest() == state.digest(),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda fh: fh.write(data))
    atomic_write_text(out / CARD, json.dumps(card, indent=1, ensure_ascii=False) + "\n")
    atomic_write_text(out / README, render_card(card))
    return card


def load_exported(directory: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """The exported model, rebuilt from the card's plan and holding the file's weights, and the card.

    Refuses (ExportError) a weights file whose SHA-256 is not the card's, a plan whose text is not its
    recorded hash, and, where the card says the digest covers the weights, tensors whose state digest is not
    the card's. The model comes back in eval mode, on the CPU."""
    directory = Path(directory)
    card = _read_card(directory)
    path = directory / WEIGHTS
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ExportError(f"cannot read the exported weights {path}: {exc.strerror}") from None
    if hashlib.sha256(data).hexdigest() != card["weights"]["sha256"]:
        raise ExportError(
            f"{path} is not the file its card describes (its SHA-256 differs from {CARD}'s): it was replaced "
            "or damaged after the export; export again"
        )
    try:
        weights = load_safetensors(data)
    except SafetensorError as exc:
        raise ExportError(f"{path} is not a safetensors file: {exc}") from None
    if card["weights"]["digest_checks_weights"]:
        digest = GlobalState(card["state"]["round"], weights).digest()
        if digest != card["state"]["digest"]:
            raise ExportError(f"the weights in {path} are not the state {card['state']['digest'][:16]}")
    try:
        model = _plan_of(card, directory).build_method().network(0)
    except ConfigError as exc:  # a model named by entry point whose package is not installed here
        raise ExportError(
            f"{exc}\n(the card's model {card['model']['name']} is named by entry point: install its package "
            "where you load the model)"
        ) from None
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise ExportError(f"the weights in {path} do not fit the card's model: {exc}") from None
    return model.eval(), card


def _read_card(directory: Path) -> dict[str, Any]:
    path = directory / CARD
    try:
        card = json.loads(path.read_text())
    except OSError as exc:
        raise ExportError(f"{path}: {exc.strerror}; is {directory} an export folder?") from None
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path} is not JSON: {exc}") from None
    if not isinstance(card, dict) or card.get("format") != FORMAT:
        raise ExportError(f"{path} is not a fedlt model card of format {FORMAT}")
    missing = [
        f"{section}.{key}"
        for section, keys in LOADED.items()
        for key in keys
        if not isinstance(card.get(section), dict) or key not in card[section]
    ]
    if missing:
        raise ExportError(f"{path} lacks {', '.join(missing)}; export again")
    return card


def _plan_of(card: Mapping[str, Any], directory: Path) -> RoundPlan:
    text = card["plan"]["toml"]
    if hashlib.sha256(text.encode()).hexdigest() != card["plan"]["sha256"]:
        raise ExportError(f"the plan in {directory / CARD} does not match its recorded SHA-256")
    try:
        return RoundPlan.from_toml(text, f"the plan in {directory / CARD}")
    except ConfigError as exc:
        raise ExportError(f"{exc}\n(this fedlt cannot build the model that plan names)") from None


def _model_facts(plan: RoundPlan) -> dict[str, Any]:
    """The network and its input: images of a shape, or table rows, naming their encoded features in order."""
    model: dict[str, Any] = {"name": plan.model.name}
    if plan.data.table is None:
        model["image_shape"] = list(plan.model.image_shape)
    else:
        model["features"] = list(plan.data.table.layout().features)
    return {**model, "classes": list(plan.model.classes)}


def _input_line(model: Mapping[str, Any]) -> str:
    if "features" in model:
        return (
            f"{model['name']}, input float32 table rows of {len(model['features'])} features in [0, 1], "
            "encoded by the plan's [data.table] (`fedlt.data.table.read_table(path).features(schema)`); its "
            "first layer standardises the numeric ones with the consortium's pooled means and deviations"
        )
    shape = ", ".join(str(s) for s in model["image_shape"])
    return f"{model['name']}, input float32 images in [0, 1] (8-bit pixels / 255), shape (N, {shape})"


def render_card(card: Mapping[str, Any]) -> str:
    """The card for a person: what the model is, how well it does, who vouches for it, how to load it."""
    model, state, weights = card["model"], card["state"], card["weights"]
    rounds = card["rounds"]
    committed = "not known" if rounds["committed"] is None else rounds["committed"]
    rows = [
        ("consortium", card["consortium"]),
        ("exported by", f"{card['exported_by']}, {card['exported_at']}"),
        ("method", card["method"]),
        ("privacy layer", card["privacy"]),
        ("differential privacy", _dp_line(card["dp"])),
        (
            "model",
            f"{_input_line(model)}; {len(model['classes'])} classes, the output's index k is the plan's k-th "
            "class",
        ),
        (
            "round exported",
            f"{state['round']}; rounds committed: {committed} (the plan's training rounds: "
            f"{rounds['planned']}, besides any opening or closing round of the method)",
        ),
        ("state digest", f"`{state['digest']}`"),
        ("weights", f"`{weights['file']}`, SHA-256 `{weights['sha256']}`, {weights['bytes']} bytes"),
        ("plan", f"SHA-256 `{card['plan']['sha256']}` (its text is below)"),
    ]
    if state.get("contributors"):
        rows.append(("silos counted", ", ".join(state["contributors"])))
    lines = [
        f"# Model card: {card['method']} over {card['privacy']}, consortium {card['consortium']!r}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        *_accuracy_lines(card["evaluation"], model["classes"], state["round"]),
        *_silo_lines(card["silos"]),
        *_attestation_lines(card.get("attestations"), state["digest"]),
        *_loading_lines(),
        "## Plan",
        "",
        "```toml",
        card["plan"]["toml"].rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def _dp_line(dp: Mapping[str, Any]) -> str:
    if not dp["enabled"]:
        return "off"
    sigma = dp["noise_multiplier"] or "chosen by each silo"
    return f"on: ε = {dp['epsilon']:g} per silo over the plan, δ = {dp['delta']:g}, DP-SGD σ = {sigma}"


def _accuracy_lines(evaluation: Mapping[str, Any], classes: Sequence[str], round_number: int) -> list[str]:
    lines = [f"## Accuracy after round {round_number}", ""]
    if evaluation.get("accuracy") is None:
        return [*lines, f"Not known: {evaluation['why']}", ""]
    groups = ", ".join(f"{g} {_percent(evaluation[g])}" for g in ("many", "medium", "few"))
    lines += [
        f"{_percent(evaluation['accuracy'])} overall ({groups}), on {evaluation['on']}.",
        "",
        "| class | accuracy |",
        "|---|---|",
    ]
    lines += [f"| {name} | {_percent(evaluation['per_class'][name])} |" for name in classes]
    return [*lines, ""]


def _silo_lines(silos: Mapping[str, Any]) -> list[str]:
    lines = ["## Privacy budgets", "", silos["note"], ""]
    if not silos["epsilon_remaining"]:
        return lines
    lines += ["| silo | ε left, as the silo reported it |", "|---|---|"]
    for silo, reported in sorted(silos["epsilon_remaining"].items()):
        lines.append(f"| {silo} | {'not reported' if reported is None else f'{reported:.3g}'} |")
    return [*lines, ""]


def _attestation_lines(attestations: Mapping[str, Any] | None, digest: str) -> list[str]:
    if attestations is None:
        return []
    lines = ["## Attestations", "", attestations["note"], ""]
    lines += [
        f"- {s['silo']}: signature `{s['signature']}` over `{digest[:16]}…`"
        for s in attestations["signatures"]
    ]
    return [*lines, ""]


def _loading_lines() -> list[str]:
    return [
        "## Loading",
        "",
        "With fedlt installed (checks the file's SHA-256 and rebuilds the plan's network):",
        "",
        "```python",
        "from fedlt.export import load_exported",
        'model, card = load_exported("THIS_FOLDER")',
        "```",
        "",
        "In PyTorch with safetensors (the network's code is fedlt's; the plan names it):",
        "",
        "```python",
        "import json",
        "from safetensors.torch import load_file",
        "from fedlt.plan import RoundPlan",
        'card = json.load(open("THIS_FOLDER/model-card.json"))',
        'model = RoundPlan.from_toml(card["plan"]["toml"], "card").build_method().network(0)',
        'model.load_state_dict(load_file("THIS_FOLDER/model.safetensors"))',
        "model.eval()",
        "```",
        "",
    ]


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def utc(seconds: float) -> str:
    """A time as the card writes times: UTC, ISO 8601, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
