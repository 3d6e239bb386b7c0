import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_plaintext_warning(caplog):
    """The plaintext layer warns on purpose; tests that check it read caplog themselves."""
    caplog.set_level(logging.ERROR, logger="fedlt.aggregation.plaintext")
