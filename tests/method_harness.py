"""Three tiny silos of 8×8 images over four classes (class 3 held by none), and one plaintext round of a
method over them: enough to walk a method through its phases in a unit test."""

import numpy as np

from fedlt.aggregation.plaintext import PlaintextSum
from fedlt.data.arrays import LabeledData
from fedlt.methods import ModelSpec, ServerContext, SiloContext

SPEC = ModelSpec("cnn-small", (1, 8, 8), 4)


def tiny_silos() -> list[LabeledData]:
    rng = np.random.default_rng(0)
    labels = [[0, 0, 1, 1, 0, 1, 0, 1], [1, 1, 2, 2, 2, 1], [0, 2, 2, 0, 2, 0, 0]]
    return [
        LabeledData(
            rng.random((len(y), 1, 8, 8), dtype=np.float32), np.array(y, dtype=np.int64), tuple("abcd")
        )
        for y in labels
    ]


def plaintext_step(method, state, silos, round_number):
    """Every silo's contribution for `state`, summed in the clear, and the method's server step on the sum."""
    schema = method.schema(state)
    contributions = [
        method.local_round(state, data, SiloContext(round_number, f"silo-{k}", 0))
        for k, data in enumerate(silos)
    ]
    return method.server_step(
        state, PlaintextSum().aggregate(schema, contributions), ServerContext(round_number, 0)
    )
