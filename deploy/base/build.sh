#!/usr/bin/env bash
# The image's base, built from Debian's packages where no registry image can be pulled (docs/deploy.md, 1A).
#
#   sudo deploy/base/build.sh [OUT]        # OUT defaults to build/base
#
# mmdebstrap makes a minimal Debian 12 (bookworm) root file system with CPython 3.11 and venv; this script
# wraps it as a one-layer OCI image whose config has a fixed creation time, and loads it into podman as
# localhost/fedlt-base:bookworm. With SOURCE_DATE_EPOCH fixed, the same package versions give the same
# bytes, so the same digest: deploy/base/packages.txt lists the versions the pinned digest was built from,
# and the build says so when the mirror has moved on (then pin the new digest in deploy/Dockerfile).
# Needs root, mmdebstrap, podman and python3, and Debian's mirrors.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:-build/base}"
SUITE=bookworm
INCLUDE=python3,python3-venv
export SOURCE_DATE_EPOCH=1735689600 # 2025-01-01T00:00:00Z: every file's mtime and the image's created time
MIRRORS=(
    "deb http://deb.debian.org/debian $SUITE main"
    "deb http://deb.debian.org/debian $SUITE-updates main"
    "deb http://deb.debian.org/debian-security $SUITE-security main"
)

mkdir -p "$OUT"
rm -f "$OUT/rootfs.tar"
# minbase: Essential packages and apt only. The hooks record the versions installed, then drop what differs
# between two builds of the same packages: logs, apt's caches, and its package lists, which change with the
# mirror every day (`apt-get update` brings them back in a container that needs them). mmdebstrap's own
# cleanup is skipped: run as root on a host whose apt has hooks of its own, it emptied the host's package
# lists (seen where this was written); the hook below touches the new root alone.
# shellcheck disable=SC2016 # "$1" in a hook is the new root, expanded by mmdebstrap's shell, not this one
mmdebstrap --mode=root --variant=minbase --include="$INCLUDE" --format=tar --skip=cleanup/apt \
    --customize-hook='chroot "$1" dpkg-query -W -f="\${Package}=\${Version}\n" > "$1/tmp/packages.txt"' \
    --customize-hook="sync-out /tmp $OUT/manifest" \
    --customize-hook='rm -rf "$1"/tmp/* "$1"/var/log/* "$1"/var/cache/ldconfig/aux-cache "$1"/etc/machine-id' \
    --customize-hook='find "$1"/var/lib/apt/lists "$1"/var/cache/apt -type f -delete' \
    "$SUITE" "$OUT/rootfs.tar" "${MIRRORS[@]}"
sort "$OUT/manifest/packages.txt" > "$OUT/packages.txt"
rm -rf "$OUT/manifest"

built="$(python3 "$HERE/oci.py" "$OUT/rootfs.tar" "$OUT/fedlt-base.oci.tar" "$SOURCE_DATE_EPOCH")"
podman pull --quiet "oci-archive:$OUT/fedlt-base.oci.tar" > /dev/null   # named by the archive: fedlt-base:bookworm
digest="$(podman image inspect --format '{{.Digest}}' localhost/fedlt-base:bookworm)"
if [ "$digest" != "$built" ]; then
    echo "podman stored the base as $digest, not as the archive's $built" >&2
    exit 1
fi
echo "localhost/fedlt-base:bookworm@$digest"

if ! diff -u "$HERE/packages.txt" "$OUT/packages.txt" > "$OUT/packages.diff"; then
    echo "the mirror has other package versions than deploy/base/packages.txt ($OUT/packages.diff):" \
        "this base has another digest; pin it in deploy/Dockerfile and copy $OUT/packages.txt over it" >&2
    exit 3
fi
