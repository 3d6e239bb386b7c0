import logging
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_plaintext_warning(caplog):
    """The plaintext layer warns on purpose; tests that check it read caplog themselves."""
    caplog.set_level(logging.ERROR, logger="fedlt.aggregation.plaintext")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a whole module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`),
    its module-scoped fixtures included: the machine's other core stays free, results do not depend on the
    number of cores, and small models train faster than with threads competing for busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
