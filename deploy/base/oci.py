"""Wrap a root file system tarball as a one-layer OCI image archive, with nothing in it that depends on when
or where it was made: `podman import` would stamp the current time into the config, and so give every
build another digest.

    python3 deploy/base/oci.py ROOTFS.tar OUT.oci.tar SOURCE_DATE_EPOCH
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
import tarfile
from datetime import UTC, datetime
from pathlib import Path

LAYER = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
REF = "fedlt-base:bookworm"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _json(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def _descriptor(media_type: str, digest: str, size: int) -> dict:
    return {"mediaType": media_type, "digest": digest, "size": size}


def _add(archive: tarfile.TarFile, name: str, data: bytes, epoch: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), epoch, 0o644
    archive.addfile(info, io.BytesIO(data))


def build(rootfs: Path, out: Path, epoch: int) -> str:
    """Write the archive; return the manifest's digest, the one a FROM line pins."""
    layer = _sha256(rootfs)
    created = datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": created,
            "config": {
                "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
                "Cmd": ["/bin/bash"],
            },
            "rootfs": {"type": "layers", "diff_ids": [layer]},
            "history": [{"created": created, "created_by": "deploy/base/build.sh (mmdebstrap, Debian 12)"}],
        }
    )
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": _descriptor(CONFIG, config_digest, len(config)),
            "layers": [_descriptor(LAYER, layer, rootfs.stat().st_size)],
        }
    )
    manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    index = _json(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    **_descriptor(MANIFEST, manifest_digest, len(manifest)),
                    "annotations": {"org.opencontainers.image.ref.name": REF},
                }
            ],
        }
    )
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as archive:
        _add(archive, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}), epoch)
        _add(archive, "index.json", index, epoch)
        _add(archive, f"blobs/sha256/{manifest_digest[7:]}", manifest, epoch)
        _add(archive, f"blobs/sha256/{config_digest[7:]}", config, epoch)
        info = archive.gettarinfo(rootfs, f"blobs/sha256/{layer[7:]}")
        info.mtime, info.uid, info.gid, info.uname, info.gname = epoch, 0, 0, "", ""
        with rootfs.open("rb") as f:
            archive.addfile(info, f)
    return manifest_digest


if __name__ == "__main__":
    rootfs_tar, out_tar, source_date_epoch = sys.argv[1:]
    print(build(Path(rootfs_tar), Path(out_tar), int(source_date_epoch)))
