"""The toy layer of tests/plugins, installed for one test: its folder on the import path (with the dist-info
whose entry point registers it), in this process and in the processes the test starts."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedlt.aggregation import layers
from privacy import wire
from tests.consortium_harness import ENV

PLUGINS = Path(__file__).parent / "plugins"


@contextmanager
def toy_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    path = os.pathsep.join(filter(None, [str(PLUGINS), ENV.get("PYTHONPATH")]))
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setitem(ENV, "PYTHONPATH", path)
    layers.cache_clear()
    wire.tables.cache_clear()
    try:
        yield
    finally:  # the registry forgets it here; monkeypatch takes the folder off the path after the test
        layers.cache_clear()
        wire.tables.cache_clear()
