"""Where a party computes: `[train] device` in the simulator, `[compute] device` in a silo's silo.toml.

The device is each party's own choice and never part of a plan (a plan's text leaves it out), so a hospital
without a GPU joins the same plan as one with eight. State stays on the CPU — the global state, contributions
and a method's working model between rounds — and the device is used inside compute: the model and each
batch move there for local training, DP-SGD, silo-side feature statistics and evaluation, and the results
come back. Server steps stay on the CPU: where silos step the model (ckks) every silo must compute the same
state to the bit, whatever hardware each has. On "cpu" nothing moves, so the CPU path is the one it always
was.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fedlt.errors import FedltError

CPU = torch.device("cpu")
DEVICE_FORM = '"auto", "cpu", "cuda" or "cuda:N"'
GPU_INSTALL = (
    f"install the CUDA build of torch {torch.__version__.split('+')[0]} into the venv from the index "
    "https://pytorch.org/get-started names for this machine's CUDA (docs/bring-your-own.md, GPU)"
)
_FORM = re.compile(r"auto|cpu|cuda(?::(?P<index>[0-9]+))?")


class DeviceError(FedltError):
    """A device setting names hardware this machine's torch cannot use."""


def device_problem(name: object) -> str | None:
    """Why `name` is not a device setting, or None; only its form is checked, nothing of this machine."""
    if not isinstance(name, str) or _FORM.fullmatch(name) is None:
        return f"expected {DEVICE_FORM}, got {name!r}"
    return None


def device_checked(table: Mapping[str, Any], where: str, problems: list[str]) -> Mapping[str, Any]:
    """A config table whose `device` has the right form, or `table` without it (the default kept) and the
    problem added to `problems`, so a section's `from_table` reports it with the rest."""
    problem = device_problem(table.get("device", "auto"))
    if problem is None:
        return table
    problems.append(f"{where}.device: {problem}")
    return {k: v for k, v in table.items() if k != "device"}


def resolve_device(name: str, *, setting: str = "device") -> torch.device:
    """The torch device `name` asks for on this machine: "auto" is the first GPU where torch sees one, else
    the CPU; a GPU torch cannot use is refused in one line that says what there is (`setting` names the
    configuration key in it)."""
    problem = device_problem(name)
    if problem is not None:
        raise DeviceError(f"{setting}: {problem}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return CPU
    if name == "auto":
        return torch.device("cuda", 0)
    if not torch.cuda.is_available():
        raise DeviceError(f"{setting} = {name!r}, but {_no_gpu()}")
    index = int(_FORM.fullmatch(name)["index"] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        there = "1 GPU here (cuda:0 only" if count == 1 else f"{count} GPUs here (cuda:0 to cuda:{count - 1}"
        raise DeviceError(
            f"{setting} = {name!r}, but torch sees {there}; CUDA_VISIBLE_DEVICES narrows what it sees)"
        )
    return torch.device("cuda", index)


def _no_gpu() -> str:
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is the CPU build; {GPU_INSTALL}"
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU: check the NVIDIA driver "
        "(nvidia-smi) and CUDA_VISIBLE_DEVICES"
    )


def model_device(model: nn.Module) -> torch.device:
    """Where `model`'s parameters are, so that its inputs go there too."""
    return next(model.parameters()).device


@contextmanager
def placed(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """`model` on `device` for the block, then back on the CPU (also when the block raises), where a
    method's working model lives between rounds; on the CPU nothing moves."""
    if device.type == "cpu":
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to(CPU)
