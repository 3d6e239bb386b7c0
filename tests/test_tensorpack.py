import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlt import tensorpack
from fedlt.methods import ModelSpec
from fedlt.methods.state import GlobalState, pack_state, unpack_state
from fedlt.tensorpack import PackError, pack, unpack

DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8]


@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=5),
    dtype_index=st.integers(0, len(DTYPES) - 1),
)
@settings(max_examples=40, deadline=None)
def test_round_trip(shapes, dtype_index):
    dtype = DTYPES[dtype_index]
    tensors = {f"t{i}": (torch.rand(s) * 100).to(dtype) for i, s in enumerate(shapes)}
    back = unpack(pack(tensors))
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype
        assert torch.equal(back[name], t)


def test_state_round_trip_keeps_digest():
    model = ModelSpec("cnn-small", (1, 8, 8), 10).build(0).state_dict()
    state = GlobalState(3, model, {"features": torch.randn(4, 5)})
    again = unpack_state(pack_state(state), 3)
    assert again.digest() == state.digest()


def _header(entries):
    import json

    head = json.dumps(entries).encode()
    return tensorpack.MAGIC + struct.pack("<I", len(head)) + head


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"PK\x03\x04 not a pack", "bad magic"),
        (_header([{"name": "a", "dtype": "float32", "shape": [4]}]) + b"\0" * 8, "needs 16 bytes"),
        (_header([{"name": "a", "dtype": "float32", "shape": [1]}]) + b"\0" * 8, "4 trailing bytes"),
        (_header([{"name": "a", "dtype": "object", "shape": [1]}]), "bad name or dtype"),
        (_header([{"name": "a", "dtype": "float32", "shape": [-1]}]), "bad shape"),
        (_header({"name": "a"}), "header entries"),
        (_header([{"name": "a", "dtype": "uint8", "shape": [1]}] * 2) + b"\0\0", "appears twice"),
        (tensorpack.MAGIC + struct.pack("<I", 3) + b"\xff\xfe{", "unreadable header"),
    ],
)
def test_malformed_packs_are_refused(blob, message):
    with pytest.raises(PackError, match=message):
        unpack(blob)


def test_packed_state_with_foreign_tensor_names_is_refused():
    with pytest.raises(PackError, match="unexpected tensor"):
        unpack_state(pack({"weights": torch.zeros(1)}), 0)
