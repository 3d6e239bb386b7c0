"""Seeded symmetric CKKS ciphertexts: a silo's upload at half the bytes of TenSEAL's own form.

A fresh symmetric ciphertext is (c0, c1) with c1 uniformly random. SEAL can draw c1 from a PRNG seed and write
the seed in its place (`Encryptor.encrypt_symmetric` returning a `Serializable`), so 4,096 values take one
polynomial of N 64-bit coefficients instead of two: 4× float32 instead of 8×. Loading expands the seed
(SEAL's `Ciphertext::load`) without any key, so the aggregator reads an upload with the public context as
before, and the sums it makes are ordinary, expanded ciphertexts.

TenSEAL's vectors always hold the expanded form. `tenseal.sealapi` reaches the seeded one, but binds
`Serializable::save` to a file path only (no stream, no bytes). So each ciphertext goes through a file: an
anonymous one in memory (memfd, Linux) or, where there is none, one in a private temporary directory. The
file holds a ciphertext, never a key or a plaintext. Its bytes are then wrapped in TenSEAL's own vector
message (`CKKSVectorProto` of tenseal/proto/tensors.proto), which `ts.ckks_vector_from` loads like any
vector's.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import tenseal as ts
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from tenseal import sealapi


def _vector_message() -> type:
    """TenSEAL's `CKKSVectorProto` (tenseal/proto/tensors.proto), which its Python package does not export."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="fedlt/ckks/tenseal_tensors.proto", package="tenseal", syntax="proto3"
    )
    message = proto.message_type.add(name="CKKSVectorProto")
    kind = descriptor_pb2.FieldDescriptorProto
    message.field.add(name="sizes", number=1, type=kind.TYPE_UINT32, label=kind.LABEL_REPEATED)
    message.field.add(name="ciphertexts", number=2, type=kind.TYPE_BYTES, label=kind.LABEL_REPEATED)
    message.field.add(name="scale", number=3, type=kind.TYPE_DOUBLE, label=kind.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tenseal.CKKSVectorProto"))


CKKSVectorProto = _vector_message()


class _MemoryFile:
    """An anonymous in-memory file, reached by SEAL through /proc/self/fd."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("fedlt-ckks", os.MFD_CLOEXEC)
        self.path = f"/proc/self/fd/{self._fd}"

    def read(self) -> bytes:
        return os.pread(self._fd, os.fstat(self._fd).st_size, 0)

    def close(self) -> None:
        os.close(self._fd)


class _PrivateFile:
    """A file in a temporary directory only this user can enter (mkdtemp makes it 0700)."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="fedlt-ckks-")
        self.path = os.path.join(self._directory.name, "ciphertext")

    def read(self) -> bytes:
        return Path(self.path).read_bytes()

    def close(self) -> None:
        self._directory.cleanup()


@contextmanager
def _save_target() -> Iterator[_MemoryFile | _PrivateFile]:
    memory = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
    target = _MemoryFile() if memory else _PrivateFile()
    try:
        yield target
    finally:
        target.close()


class SeededEncryptor:
    """Encrypts with the secret key of a TenSEAL context through SEAL's own encoder and encryptor (the same
    encoding TenSEAL's `ckks_vector` uses: the context's first parameters, at the scale given)."""

    def __init__(self, context: ts.Context) -> None:
        seal = context.seal_context().data
        self._encoder = sealapi.CKKSEncoder(seal)
        self._encryptor = sealapi.Encryptor(seal, context.secret_key().data)

    def encrypt(self, chunks: Iterable[np.ndarray], *, scale: float) -> list[bytes]:
        """One TenSEAL vector's bytes per chunk (at most a ciphertext's slots each), its ciphertext seeded."""
        with _save_target() as target:
            return [self._one(chunk, scale, target) for chunk in chunks]

    def _one(self, values: np.ndarray, scale: float, target: _MemoryFile | _PrivateFile) -> bytes:
        plain = sealapi.Plaintext()
        self._encoder.encode(values, scale, plain)
        self._encryptor.encrypt_symmetric(plain).save(target.path)
        message = CKKSVectorProto(sizes=[len(values)], ciphertexts=[target.read()], scale=scale)
        return message.SerializeToString()
