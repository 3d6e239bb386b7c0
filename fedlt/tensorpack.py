"""A pickle-free byte format for named tensors: the global state on the wire and on disk.

Layout: the magic b"FLTPACK1", a little-endian uint32 header length, a JSON header listing each tensor's name,
dtype and shape in order, then the tensors' raw little-endian bytes back to back. Unpacking trusts nothing:
unknown dtypes, sizes that do not add up and trailing bytes are refused, so a peer can send only tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import numpy as np
import torch

from fedlt.errors import FedltError

MAGIC = b"FLTPACK1"
_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class PackError(FedltError):
    """Bytes that are not a valid tensor pack."""


def pack(tensors: Mapping[str, torch.Tensor]) -> bytes:
    header, blobs = [], []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in _NAMES:
            raise PackError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        header.append({"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape)})
        blobs.append(t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes())
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *blobs])


def unpack(data: bytes) -> dict[str, torch.Tensor]:
    if len(data) < len(MAGIC) + 4 or not data.startswith(MAGIC):
        raise PackError("not a tensor pack (bad magic)")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + head_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PackError(f"unreadable header: {exc}") from None
    offset = start + head_len
    out: dict[str, torch.Tensor] = {}
    for entry in header if isinstance(header, list) else [None]:
        name, dtype, shape = _entry(entry)
        if name in out:
            raise PackError(f"tensor {name!r} appears twice")
        size = math.prod(shape) * _DTYPES[dtype].itemsize
        if offset + size > len(data):
            raise PackError(f"tensor {name!r} needs {size} bytes, only {len(data) - offset} left")
        array = np.frombuffer(
            data, dtype=np.dtype(dtype).newbyteorder("<"), count=math.prod(shape), offset=offset
        )
        out[name] = torch.from_numpy(array.astype(np.dtype(dtype), copy=True)).reshape(shape)
        offset += size
    if offset != len(data):
        raise PackError(f"{len(data) - offset} trailing bytes after the last tensor")
    return out


def _entry(entry: object) -> tuple[str, str, list[int]]:
    if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape"}:
        raise PackError("header entries must be {name, dtype, shape}")
    name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or dtype not in _DTYPES:
        raise PackError(f"bad name or dtype in header entry {entry!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 2**40 for d in shape):
        raise PackError(f"bad shape in header entry {entry!r}")
    return name, dtype, shape
