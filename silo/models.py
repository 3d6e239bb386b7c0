"""Which model code this silo runs: the entry points its policy lists, each pinned by a digest of the
installed source, checked before anything of it is imported.

A plan may name a model as `package.module:factory` (`fedlt.models.entry`); the aggregator never ships
code, so the code is whatever this silo's administrator installed. `[policy] models` lists the entry points
the silo allows, each with the SHA-256 of its top-level package's source as `python -m silo models pin`
computed it. A RoundSpec naming any other entry point, or one whose installed source no longer has the
pinned digest, is refused at admission; built-in names need no pin.

What is hashed (`source_digest`), located without importing anything: `importlib.util.find_spec` of the
TOP-LEVEL name only (a dotted name would import its parents) gives
- for a regular package, the folder of its `__init__.py`: every regular file under it, at any depth, except
  those in `__pycache__` folders (Python rewrites them; a sourceless `.pyc` outside them is hashed), data
  files included, since a factory may read them;
- for a single-file module (`.py`, or an extension module), that file.
The digest is SHA-256 over b"fedlt model source v1\\0" and then, for each file in the order of its
relative POSIX path (Python's string order), the path in UTF-8, a zero byte, the file's length as 8 bytes
big-endian, and its bytes. Refused: a name Python builds in or freezes (`os`, `builtins`: no installed
source to pin), a namespace package (its portions can come from anywhere on the path), a package holding a
symbolic link to a folder (code the digest would not cover).

The digest pins the top-level package the entry point is in, not the packages it imports (torch,
torchvision): those are the silo's environment, as fedlt itself is. It is checked at every admission; once
imported, a module is the one the process runs until it restarts.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from fedlt.errors import FedltError
from fedlt.models import MODELS
from fedlt.models.entry import ENTRY_FORM, EntryPoint, parse_entry

DIGEST_PREFIX = b"fedlt model source v1\0"

log = logging.getLogger("silo")


class UnpinnableModel(FedltError):
    """An entry point whose source cannot be located or hashed without importing it."""


def entry_point(text: str) -> EntryPoint:
    entry = parse_entry(text)
    if entry is None:
        raise UnpinnableModel(f"{text!r} is not an entry point {ENTRY_FORM}")
    return entry


def source_digest(entry: EntryPoint) -> str:
    """The SHA-256 of the installed source of `entry`'s top-level package, as the module docstring says."""
    digest = hashlib.sha256(DIGEST_PREFIX)
    try:
        for relative, path in _source_files(entry):
            data = path.read_bytes()
            digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    except OSError as exc:
        raise UnpinnableModel(f"{entry.top_level} cannot be read: {exc}") from None
    return digest.hexdigest()


def pin_line(text: str) -> str:
    """The `[policy] models` item that allows `text`, as `python -m silo models pin` prints it; refused
    where the module's source plainly defines no such factory (read, never imported)."""
    entry = entry_point(text)
    digest = source_digest(entry)
    _check_defined(entry)
    return f'{{ entry = "{entry}", sha256 = "{digest}" }}'


def model_refusals(name: str, pins: Mapping[str, str]) -> list[str]:
    """Why this silo will not build the plan's model `name` ([] where it will): an entry point its policy
    does not list, or one whose installed source lost its pinned digest. Nothing is imported, and an
    unlisted name is not even looked up."""
    if name in MODELS:
        return []
    if name not in pins:
        return [
            f"model {name!r} is not an entry point policy.models allows (after reviewing its code, pin it: "
            f"python -m silo models pin {name})"
        ]
    try:
        digest = source_digest(entry_point(name))
    except UnpinnableModel as exc:  # the detail names this silo's paths: its log has it, the refusal not
        log.error("model %r cannot be checked against its pin: %s", name, exc)
        return [
            f"model {name!r} is pinned, but its installed code cannot be found or read (see the silo's log)"
        ]
    if digest != pins[name]:
        return [
            f"model {name!r}: the installed code no longer has the digest policy.models pins; after "
            f"checking the change, re-pin it (python -m silo models pin {name}) and restart the agent"
        ]
    return []


def _source_files(entry: EntryPoint) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of every file the digest covers, sorted by the relative path."""
    top = entry.top_level
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise UnpinnableModel(f"{top} cannot be located: {exc}") from None
    if spec is None:
        raise UnpinnableModel(f"no installed module or package named {top!r} (for {entry})")
    if spec.origin is None and spec.submodule_search_locations is not None:
        raise UnpinnableModel(f"{top} is a namespace package (no __init__.py); pin a regular package")
    if not spec.has_location or spec.origin is None:
        raise UnpinnableModel(
            f"{top} is built into Python ({spec.origin}): there is no installed source to pin"
        )
    origin = Path(spec.origin)
    if spec.submodule_search_locations is None:
        if entry.module != top:
            raise UnpinnableModel(
                f"{top} is a single module ({origin}), so it has no submodule {entry.module}"
            )
        return [(origin.name, origin)]
    root = origin.parent
    _check_submodule(root, entry)
    files = []
    for folder, subfolders, names in os.walk(root):
        linked = [d for d in subfolders if os.path.islink(os.path.join(folder, d))]
        if linked:
            raise UnpinnableModel(
                f"{top} holds a symbolic link to a folder ({Path(folder, linked[0])}), which its digest "
                "would not cover; copy the folder in"
            )
        subfolders[:] = [d for d in subfolders if d != "__pycache__"]
        for name in names:
            path = Path(folder, name)
            if path.is_file():
                files.append((path.relative_to(root).as_posix(), path))
    return sorted(files)


def _check_submodule(root: Path, entry: EntryPoint) -> None:
    """That the entry point's module is a file or package inside the top-level package, read from the
    folder (finding it the import system's way would import its parents)."""
    inner = entry.module.split(".")[1:]
    if not inner:
        return
    *parents, last = inner
    folder = root.joinpath(*parents)
    candidates = [folder / last / "__init__.py"] + [
        folder / f"{last}{suffix}" for suffix in importlib.machinery.all_suffixes()
    ]
    if not any(path.is_file() for path in candidates):
        raise UnpinnableModel(f"the package {entry.top_level} at {root} has no module {entry.module}")


def _check_defined(entry: EntryPoint) -> None:
    """That the module's Python source binds the factory's name at its top level (a def, a class, an
    assignment or an import), so a misspelt factory is refused when pinned, not at the first round. Source
    that binds names in ways not read here (`from x import *`, a module `__getattr__`) or is not Python
    source passes: the round start still checks."""
    source = _module_source(entry)
    if source is None:
        return
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (OSError, SyntaxError, ValueError):
        return
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return
            names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    if entry.factory not in names and "__getattr__" not in names:
        raise UnpinnableModel(f"{entry.module} ({source}) defines no {entry.factory!r} at its top level")


def _module_source(entry: EntryPoint) -> Path | None:
    """The .py file of the entry point's module, found without importing it; None if it has none."""
    spec = importlib.util.find_spec(entry.top_level)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    inner = entry.module.split(".")[1:]
    if not inner:  # a single-file module, or the package's __init__.py
        return Path(spec.origin)
    target = Path(spec.origin).parent.joinpath(*inner)
    return next((c for c in (target / "__init__.py", target.with_suffix(".py")) if c.is_file()), None)
