"""The CKKS layer's costs at ResNet-8 size: encryption, the homomorphic sum, decryption, bytes, a whole sum.

    python benchmarks/ckks.py [--silos 3 10] [--repeats 5] [--model resnet8] [--json FILE]

Everything runs in this process, on the FedAvg contribution of the model on the embedded 1×28×28 data (its
float entries and n: 1,229,131 numbers for ResNet-8, built by `secagg.py`'s functions). Each of the layer's
steps (`privacy.ckks`) is paired with raw TenSEAL calls on the same data, with the same key, parameters and
scale; after a warm-up the sides take turns in an order that rotates from one repeat to the next, each repeat
gives a ratio, and the tables give medians. Errors are against the float64 sum, over the fields with a
fractional grid (both secure layers round the count n to whole numbers). For each n:
- encryption: one silo half's `start` (`SecretContext.encrypt`: a seeded ciphertext per 4,096 values through
  `tenseal.sealapi`, each wrapped as a TenSEAL vector, then framed) against the layer's previous, expanded
  form (a `ckks_vector` per 4,096 values, each serialized, then framed) and against `ts.ckks_vector` +
  `serialize` over the same slices (raw TenSEAL, expanded: it has no seeded form);
- sum: the aggregator half taking the n seeded uploads (parse, expanding the seeds, add as they arrive) and
  closing (serializing the sum) against the previous form's sum of the same values (`PublicContext.add`
  over expanded uploads: the same parse, add and serialize) and against `ckks_vector_from` + `add_` +
  `serialize` of the same seeded ciphertexts (raw TenSEAL, the same work);
- consistency: a silo half's step on the encrypted sum (SHA-256 of the ciphertext, an ECDSA P-256 signature
  over it and the survivors), which has no raw counterpart;
- decryption: a silo half's step on the survivors' signatures (n ECDSA verifications, parse, decrypt, each
  field rounded to its grid) against `ckks_vector_from` + `decrypt`; the grid rounding (`on_grid`) is also
  timed alone;
- a whole sum through `make_layer(name).aggregate` for plaintext, secagg and ckks on the same n
  contributions (each layer's keys made in the sum, every silo's part run one after another here, the ckks
  consistency step included), in a rotating order, with each layer's largest error against the float64 sum.
Once, at the first n's scale:
- bytes: an upload (seeded), the previous expanded upload and the sum against float32 (4 bytes a number);
  zlib on the upload; the SEAL compression mode the upload carries; other coefficient-modulus chains (in
  TenSEAL's expanded form);
- batching: a `ckks_vector` per 4,096 values (the layer's way) against one `ckks_tensor` batching the same
  values into 4,096 slots: conversion, encryption, serialization, bytes, decryption.
Progress goes to stderr, the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import secagg  # benchmarks/secagg.py: the contribution's schema and values, the machine line, medians
import tenseal as ts
import torch
from cryptography.hazmat.primitives.asymmetric import ec

from fedlt.aggregation import Schema, make_layer
from fedlt.aggregation.halves import SumSpec
from privacy.ckks.halves import CkksAggregatorHalf, CkksSiloHalf, EncryptedSum, SumSignatures, on_grid
from privacy.ckks.keys import (
    MAX_SCALE_BITS,
    MIN_SCALE_BITS,
    POLY_MODULUS_DEGREE,
    SLOTS,
    Ciphertext,
    SecretContext,
    frame,
    scale_bits,
)
from privacy.peers import KeyPeers, Signed
from privacy.pki.signing import sign

LAYERS = ("plaintext", "secagg", "ckks")
CHAINS = ((60, 60), (60, 40, 40, 60), (40, 40))  # the layer's; TenSEAL's tutorials'; a smaller data prime
COMPRESSION = {0: "none", 1: "zlib", 2: "zstd"}  # SEAL's compr_mode_type


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine() -> str:
    return f"{secagg.machine()}, tenseal {ts.__version__}"


def seconds(action: Callable[[], object]) -> float:
    return secagg.timed(action)[1]


def rotating(repeat: int, sides: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Every side's seconds, the order rotated by one each repeat: a drift of the machine favours none."""
    names = list(sides)
    at = repeat % len(names)
    return {name: sides[name]() for name in names[at:] + names[:at]}


def no_objection(_: tuple[str, ...]) -> None:
    """The release check a silo half asks; nothing to refuse here."""


class Identities:
    """Every silo's signing key for the consistency step, and the peers check that knows them all."""

    def __init__(self, silos: Sequence[str]) -> None:
        self.keys = {u: ec.generate_private_key(ec.SECP256R1()) for u in silos}
        self.peers = KeyPeers({u: key.public_key() for u, key in self.keys.items()})

    def half(self, spec: SumSpec, silo: str, secret: SecretContext) -> CkksSiloHalf:
        key = self.keys[silo]
        return CkksSiloHalf(
            spec,
            silo,
            secret,
            sign=lambda data, *, context: sign(key, data, context=context),
            peers=self.peers,
            may_release=no_objection,
        )


def fractional(schema: Schema) -> torch.Tensor:
    """Where the vector holds fields with a fractional grid: errors are measured there, since secagg and ckks
    round a count field (frac_bits 0) to whole numbers, and the benchmark's random counts are not whole."""
    return torch.cat([torch.full((f.size,), f.frac_bits > 0) for f in schema.fields])


def summary(samples: dict[str, list[float]]) -> dict:
    """Medians of each side, and the layer's ratio to raw TenSEAL (and to its previous form, where timed)."""
    out: dict = {f"{side}_s": secagg.median(times) for side, times in samples.items()}
    for side, key in (("raw", "ratio"), ("before", "ratio_to_before")):
        if side in samples:
            ratios = [a / b for a, b in zip(samples["layer"], samples[side], strict=True)]
            out[key] = secagg.median(ratios, 3)
            out[f"{key}s"] = [round(r, 3) for r in ratios]
    return out


# --- raw TenSEAL: what the layer's steps are measured against ----------------------------------------------


def expanded_encrypt(context: ts.Context, values: np.ndarray, bits: int) -> bytes:
    """The layer's upload before it was seeded: TenSEAL's vectors, expanded, in the layer's frame."""
    return frame(raw_encrypt(context, values, bits))


def raw_encrypt(context: ts.Context, values: np.ndarray, bits: int) -> list[bytes]:
    return [
        ts.ckks_vector(context, values[i : i + SLOTS], scale=2.0**bits).serialize()
        for i in range(0, len(values), SLOTS)
    ]


def raw_add(context: ts.Context, uploads: Sequence[list[bytes]]) -> list[bytes]:
    totals = [ts.ckks_vector_from(context, chunk) for chunk in uploads[0]]
    for upload in uploads[1:]:
        for total, chunk in zip(totals, upload, strict=True):
            total.add_(ts.ckks_vector_from(context, chunk))
    return [total.serialize() for total in totals]


def raw_decrypt(context: ts.Context, chunks: list[bytes]) -> list[list[float]]:
    return [ts.ckks_vector_from(context, chunk).decrypt() for chunk in chunks]


def parts_of(blob: bytes) -> list[bytes]:
    """The TenSEAL vectors' bytes in the layer's frame (magic, count, then a length before each), as sent."""
    (count,) = struct.unpack_from("<I", blob, 4)
    parts, offset = [], 8
    for _ in range(count):
        (length,) = struct.unpack_from("<I", blob, offset)
        parts.append(blob[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return parts


def chunks_of(context: ts.Context, blob: bytes) -> list[bytes]:
    """The layer's framed ciphertext as TenSEAL's own bytes, one entry per 4,096 values."""
    return [chunk.serialize() for chunk in Ciphertext.parse(context, blob).chunks]


def framed(chunks: list[int]) -> int:
    """Bytes of chunks of these sizes in the layer's framing (magic, count, a length each)."""
    return 8 + sum(4 + size for size in chunks)


# --- items 1–3 and 6: per n --------------------------------------------------------------------------------


def per_silos(n: int, repeats: int, schema: Schema, secret: SecretContext, flats: list[torch.Tensor]) -> dict:
    silos = tuple(f"silo-{k:02d}" for k in range(n))
    spec = SumSpec(f"bench-{n}", "contribution", silos, schema)
    bits = scale_bits(schema, n)
    secret_raw = ts.context_from(secret.secret_bytes())  # the same key and parameters, through TenSEAL alone
    public_raw = ts.context_from(secret.public.serialized)
    vectors = dict(zip(silos, flats, strict=False))
    mine = vectors[silos[0]]
    values = mine.numpy()
    truth = torch.stack(list(vectors.values())).sum(dim=0)
    graded = fractional(schema)

    progress(f"n={n}: encrypting the {n} uploads")
    identities = Identities(silos)
    uploads = {u: identities.half(spec, u, secret).start(v)[0] for u, v in vectors.items()}
    raw_uploads = [parts_of(uploads[u].blob) for u in silos]  # seeded, as the layer sends them
    expanded_uploads = [frame(chunks_of(public_raw, uploads[u].blob)) for u in silos]
    aggregator = CkksAggregatorHalf(spec, secret.public, lambda _: b"")
    for u in silos:
        aggregator.receive(u, uploads[u])
    aggregator.close()
    step = EncryptedSum(aggregator.summed, silos)
    signatures = SumSignatures(
        {u: Signed(identities.half(spec, u, secret).step(step)[0].signature) for u in silos}
    )
    raw_sum = raw_add(public_raw, raw_uploads)
    decrypted = secret.decrypt(aggregator.summed, schema.size)
    expanded_encrypt(secret_raw, values, bits)  # warm-ups: the layer's steps ran just above
    secret.public.add(expanded_uploads)
    raw_decrypt(secret_raw, raw_sum)

    def encrypt_layer() -> float:
        half = identities.half(spec, silos[0], secret)
        return seconds(lambda: half.start(mine))

    def add_layer() -> float:
        half = CkksAggregatorHalf(spec, secret.public, lambda _: b"")

        def run() -> object:
            for u in silos:
                half.receive(u, uploads[u])
            return half.close()

        return seconds(run)

    def decrypt_layer() -> float:
        half = identities.half(spec, silos[0], secret)
        half.step(step)
        return seconds(lambda: half.step(signatures))

    def consistency_layer() -> float:
        half = identities.half(spec, silos[0], secret)
        return seconds(lambda: half.step(step))

    steps: dict[str, dict[str, Callable[[], float]]] = {
        "encrypt": {
            "layer": encrypt_layer,
            "before": lambda: seconds(lambda: expanded_encrypt(secret_raw, values, bits)),
            "raw": lambda: seconds(lambda: raw_encrypt(secret_raw, values, bits)),
        },
        "add": {
            "layer": add_layer,
            "before": lambda: seconds(lambda: secret.public.add(expanded_uploads)),
            "raw": lambda: seconds(lambda: raw_add(public_raw, raw_uploads)),
        },
        "decrypt": {
            "layer": decrypt_layer,
            "raw": lambda: seconds(lambda: raw_decrypt(secret_raw, raw_sum)),
        },
    }
    timings = {name: {side: [] for side in sides} for name, sides in steps.items()}
    grid: list[float] = []
    signing: list[float] = []
    for repeat in range(repeats):
        progress(f"n={n}: encryption, sum, consistency, decryption, repeat {repeat + 1}/{repeats}")
        for name, sides in steps.items():
            for side, took in rotating(repeat, sides).items():
                timings[name][side].append(took)
        grid.append(seconds(lambda: on_grid(spec, decrypted)))
        signing.append(consistency_layer())
    half = identities.half(spec, silos[0], secret)
    half.step(step)
    half.step(signatures)
    assert half.result is not None

    rounds = whole_sums(n, repeats, schema, silos, flats[:n], truth, graded)
    return {
        "silos": n,
        "scale_bits": bits,
        "encrypt": summary(timings["encrypt"]),
        "add": summary(timings["add"]),
        "consistency_s": secagg.median(signing),
        "decrypt": summary(timings["decrypt"]) | {"grid_s": secagg.median(grid)},
        "ckks_error_max": float((half.result - truth)[graded].abs().max()),
        "bytes": {
            "upload": len(uploads[silos[0]].blob),
            "expanded_upload": len(expanded_uploads[0]),
            "sum": len(aggregator.summed),
            "float32": 4 * schema.size,
            "float64": 8 * schema.size,
        },
        "whole_sum": rounds,
    }


def whole_sums(
    n: int,
    repeats: int,
    schema: Schema,
    silos: tuple[str, ...],
    flats: list[torch.Tensor],
    truth: torch.Tensor,
    graded: torch.Tensor,
) -> dict:
    """`SumLayer.aggregate` as the simulator calls it, each layer in turn, the order rotating by repeat."""
    contributions = [schema.contribution(**schema.unflatten(v)) for v in flats]
    layers = {name: make_layer(name) for name in LAYERS}
    times: dict[str, list[float]] = {name: [] for name in LAYERS}
    errors: dict[str, float] = {}
    progress(f"n={n}: whole sums, warm-up")
    for layer in layers.values():
        layer.aggregate(schema, contributions, silos=silos)
    for repeat in range(repeats):
        progress(f"n={n}: whole sums, repeat {repeat + 1}/{repeats}")
        for k in range(len(LAYERS)):
            name = LAYERS[(repeat + k) % len(LAYERS)]
            started = time.perf_counter()
            sums = layers[name].aggregate(schema, contributions, silos=silos)
            times[name].append(time.perf_counter() - started)
            error = float((schema.flatten(sums) - truth)[graded].abs().max())
            errors[name] = max(errors.get(name, 0.0), error)
    out: dict = {
        "median_s": {name: secagg.median(times[name]) for name in LAYERS},
        "samples_s": {name: [round(t, 4) for t in times[name]] for name in LAYERS},
        "max_error": errors,
    }
    out["ratio_to_plaintext"] = {
        name: secagg.median((t / p for t, p in zip(times[name], times["plaintext"], strict=True)), 2)
        for name in LAYERS[1:]
    }
    return out


# --- item 4: bytes -----------------------------------------------------------------------------------------


def seal_header(chunk: bytes) -> dict:
    """SEAL's version and compression mode, from the header inside a TenSEAL ciphertext's bytes."""
    at = chunk.find(b"\x5e\xa1")  # SEAL's magic, little-endian 0xA15E
    return {"seal": f"{chunk[at + 3]}.{chunk[at + 4]}", "compression": COMPRESSION.get(chunk[at + 5], "?")}


def compression(blob: bytes) -> dict:
    """What zlib makes of an upload (the SEAL coefficients are uniform below a 60-bit prime)."""
    out = {}
    for level in (1, 9):
        started = time.perf_counter()
        size = len(zlib.compress(blob, level))
        out[f"zlib_{level}"] = {"bytes": size, "s": round(time.perf_counter() - started, 3)}
    return out


def chains(values: np.ndarray, schema: Schema, n: int) -> list[dict]:
    """Bytes and precision of one encrypted vector under other coefficient-modulus chains, each at the largest
    scale the layer's rule would allow with that chain's data primes (all but the last)."""
    bound = max(f.bound for f in schema.fields)
    out = []
    for chain in CHAINS:
        data_bits = sum(chain[:-1])
        room = data_bits - 2 - math.ceil(math.log2(n * bound))
        bits = min(MAX_SCALE_BITS, room)
        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            POLY_MODULUS_DEGREE,
            coeff_mod_bit_sizes=list(chain),
            encryption_type=ts.ENCRYPTION_TYPE.SYMMETRIC,
        )
        started = time.perf_counter()
        chunks = raw_encrypt(context, values, bits)
        took = time.perf_counter() - started
        back = np.concatenate([np.asarray(c, dtype=np.float64) for c in raw_decrypt(context, chunks)])
        out.append(
            {
                "chain": list(chain),
                "data_bits": data_bits,
                "scale_bits": bits,
                "layer_would_refuse": bits < MIN_SCALE_BITS,
                "bytes": framed([len(c) for c in chunks]),
                "encrypt_s": round(took, 3),
                "error_max": float(np.abs(back - values).max()),
            }
        )
    return out


# --- item 5: 4,096-slot vectors against one batched tensor ----------------------------------------------


def batching(values: np.ndarray, bits: int, secret: SecretContext, repeats: int) -> dict:
    """The layer's 4,096-value `ckks_vector`s against one `ckks_tensor` with batch=True (the same 4,096-slot
    ciphertexts, made by TenSEAL's thread pool, one thread per core by default; also with one thread)."""
    contexts = {
        "vector": ts.context_from(secret.secret_bytes()),
        "tensor": ts.context_from(secret.secret_bytes()),
        "tensor_1_thread": ts.context_from(secret.secret_bytes(), n_threads=1),
    }
    chunks = math.ceil(len(values) / SLOTS)
    padded = np.zeros(chunks * SLOTS)
    padded[: len(values)] = values
    matrix = padded.reshape(chunks, SLOTS).T  # slots first: batch=True packs the first axis into the slots
    times: dict[str, dict[str, list[float]]] = {
        side: {step: [] for step in ("plain", "encrypt", "serialize", "decrypt")} for side in contexts
    }
    sizes: dict[str, int] = {}
    errors: dict[str, float] = {}

    def timing(side: str, step: str, action: Callable[[], object]) -> object:
        started = time.perf_counter()
        result = action()
        times[side][step].append(time.perf_counter() - started)
        return result

    def vectors(side: str) -> None:
        context = contexts[side]
        times[side]["plain"].append(0.0)  # nothing to convert: ckks_vector takes numpy slices
        encrypted = timing(
            side,
            "encrypt",
            lambda: [
                ts.ckks_vector(context, values[i : i + SLOTS], scale=2.0**bits)
                for i in range(0, len(values), SLOTS)
            ],
        )
        blobs = timing(side, "serialize", lambda: [v.serialize() for v in encrypted])
        back = timing(side, "decrypt", lambda: np.concatenate(raw_decrypt(context, blobs)))
        sizes[side] = framed([len(b) for b in blobs])
        errors[side] = float(np.abs(back - values).max())

    def tensor(side: str) -> None:
        context = contexts[side]
        plain = timing(side, "plain", lambda: ts.plain_tensor(matrix))
        encrypted = timing(
            side, "encrypt", lambda: ts.ckks_tensor(context, plain, scale=2.0**bits, batch=True)
        )
        blob = timing(side, "serialize", encrypted.serialize)
        back = timing(
            side, "decrypt", lambda: np.asarray(ts.ckks_tensor_from(context, blob).decrypt().tolist())
        )
        sizes[side] = len(blob)
        errors[side] = float(np.abs(back.T.reshape(-1)[: len(values)] - values).max())

    sides = {"vector": vectors, "tensor": tensor, "tensor_1_thread": tensor}
    order = list(sides)
    for repeat in range(repeats):
        progress(f"ckks_vector chunks against one ckks_tensor, repeat {repeat + 1}/{repeats}")
        for side in order[repeat % 3 :] + order[: repeat % 3]:
            sides[side](side)
    out: dict = {
        side: {step: secagg.median(samples) for step, samples in steps.items()}
        for side, steps in times.items()
    }
    for side in ("tensor", "tensor_1_thread"):
        out[side]["encrypt_ratio_to_vector"] = secagg.median(
            (t / v for t, v in zip(times[side]["encrypt"], times["vector"]["encrypt"], strict=True)), 3
        )
    return out | {"bytes": sizes, "error_max": errors}


def wire(values: np.ndarray, schema: Schema, secret: SecretContext, n: int) -> dict:
    progress("bytes: the layer's upload, zlib, SEAL's header")
    silos = tuple(f"silo-{k:02d}" for k in range(n))
    spec = SumSpec("bench-bytes", "contribution", silos, schema)
    blob = Identities(silos).half(spec, silos[0], secret).start(torch.from_numpy(values))[0].blob
    chunks = chunks_of(ts.context_from(secret.public.serialized), blob)
    progress("bytes: other coefficient-modulus chains")
    return {
        "silos": n,
        "upload": len(blob),
        "chunk": len(parts_of(blob)[0]),
        "expanded": framed([len(c) for c in chunks]),
        "expanded_chunk": len(chunks[0]),
        "float32": 4 * schema.size,
        "header": seal_header(blob),
        "zlib": compression(blob),
        "chains": chains(values, schema, n),
    }


# --- tables ------------------------------------------------------------------------------------------------


def x32(size: int, numbers: int) -> str:
    return f"{size / (4 * numbers):.2f}×"


def against_before(step: dict) -> str:
    return (
        f"{step['layer_s']:.3f} s / {step['before_s']:.3f} s / {step['raw_s']:.3f} s, "
        f"**{step['ratio_to_before']:.2f}×**, {step['ratio']:.2f}×"
    )


def tables(result: dict) -> str:
    numbers = result["numbers"]
    lines = [
        f"Machine: {result['machine']}.",
        f"Command: `{result['command']}`; {numbers:,} numbers; medians of {result['repeats']} repeats.",
        "",
        "| n | scale "
        "| encryption: layer (seeded) / before (expanded) / raw TenSEAL (expanded), layer ÷ before, ÷ raw "
        "| sum at the aggregator: layer / before / raw TenSEAL (of the seeded uploads), the same ratios "
        "| consistency signature "
        "| decryption (signatures checked): layer / raw (grid alone) "
        "| upload (before) / sum bytes | largest error of the sum |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["by_silos"]:
        e, a, d, b = r["encrypt"], r["add"], r["decrypt"], r["bytes"]
        lines.append(
            f"| {r['silos']} | 2^{r['scale_bits']} | {against_before(e)} | {against_before(a)} "
            f"| {r['consistency_s']:.3f} s "
            f"| {d['layer_s']:.3f} s / {d['raw_s']:.3f} s, **{d['ratio']:.2f}×** ({d['grid_s']:.3f} s) "
            f"| {b['upload']:,} B, {x32(b['upload'], numbers)} float32 "
            f"({b['expanded_upload']:,} B, {x32(b['expanded_upload'], numbers)}) / {b['sum']:,} B "
            f"| {r['ckks_error_max']:.2g} |"
        )
    lines += [
        "",
        "| n | plaintext | secagg | ckks | largest error: secagg / ckks |",
        "|---|---|---|---|---|",
    ]
    for r in result["by_silos"]:
        w = r["whole_sum"]
        s, ratio, err = w["median_s"], w["ratio_to_plaintext"], w["max_error"]
        lines.append(
            f"| {r['silos']} | {s['plaintext']:.3f} s | {s['secagg']:.3f} s ({ratio['secagg']:.1f}×) "
            f"| {s['ckks']:.3f} s ({ratio['ckks']:.1f}×) | {err['secagg']:.2g} / {err['ckks']:.2g} |"
        )
    w = result["wire"]
    up = w["upload"]
    lines += [
        "",
        f"Bytes of one upload at n = {w['silos']} (SEAL {w['header']['seal']} writes each ciphertext with "
        f"compression `{w['header']['compression']}`):",
        "",
        "| form | bytes | × float32 | note |",
        "|---|---|---|---|",
        f"| the layer's upload: seeded, chain (60, 60) | {up:,} | **{x32(up, numbers)}** "
        f"| {w['chunk']:,} B a ciphertext |",
        f"| the same, expanded (the upload before; the sum's form) | {w['expanded']:,} "
        f"| {x32(w['expanded'], numbers)} | {w['expanded_chunk']:,} B a ciphertext |",
    ]
    for level, z in w["zlib"].items():
        lines.append(
            f"| {level.replace('_', ' -')} on the upload | {z['bytes']:,} | {x32(z['bytes'], numbers)} "
            f"| {z['s']:.2f} s |"
        )
    for c in w["chains"]:
        refused = ", below 2^20: the layer would refuse it" if c["layer_would_refuse"] else ""
        lines.append(
            f"| chain {tuple(c['chain'])} | {c['bytes']:,} | {x32(c['bytes'], numbers)} "
            f"| scale 2^{c['scale_bits']}{refused}; largest error {c['error_max']:.2g}; "
            f"{c['encrypt_s']:.2f} s to encrypt |"
        )
    bt = result["batching"]
    lines += [
        "",
        "| batching | to plaintext | encryption (× vectors) | serialization | bytes | decryption |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "vector": "a `ckks_vector` per 4,096 values (the layer's sums; its uploads before seeding)",
        "tensor": "one `ckks_tensor`, batch=True",
        "tensor_1_thread": "one `ckks_tensor`, batch=True, context with 1 thread",
    }
    for side, name in names.items():
        t = bt[side]
        ratio = f" ({t['encrypt_ratio_to_vector']:.2f}×)" if "encrypt_ratio_to_vector" in t else ""
        plain = "—" if side == "vector" else f"{t['plain']:.3f} s"  # vectors take the numpy slices
        lines.append(
            f"| {name} | {plain} | {t['encrypt']:.3f} s{ratio} | {t['serialize']:.3f} s "
            f"| {bt['bytes'][side]:,} | {t['decrypt']:.3f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="resnet8")
    parser.add_argument("--json", default="", help="also write every measurement to this file")
    args = parser.parse_args()
    started = time.monotonic()
    schema = secagg.contribution_schema(args.model)
    flats = [secagg.contribution(schema, seed=k) for k in range(max(args.silos))]
    secret = SecretContext.new()
    values = flats[0].numpy()
    result = {
        "machine": machine(),
        "command": " ".join(["python benchmarks/ckks.py", *sys.argv[1:]]),
        "model": args.model,
        "numbers": schema.size,
        "repeats": args.repeats,
        "by_silos": [per_silos(n, args.repeats, schema, secret, flats) for n in args.silos],
        "batching": batching(values, scale_bits(schema, args.silos[0]), secret, args.repeats),
        "wire": wire(values, schema, secret, args.silos[0]),
    }
    result["wall_s"] = round(time.monotonic() - started, 1)
    progress(f"done in {result['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(tables(result))


if __name__ == "__main__":
    main()
