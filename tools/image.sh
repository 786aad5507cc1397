#!/usr/bin/env bash
# Builds the pdmesh image from deploy/Containerfile without an image registry.
#   tools/image.sh [TAG]          (default pdmesh:dev; as root)
# 1. The base: a Debian 12 root filesystem from `debootstrap --variant=minbase bookworm`,
#    kept as a tarball in $PDMESH_IMAGE_CACHE (default /var/tmp/pdmesh-image-cache) and
#    imported as localhost/pdmesh-base:bookworm; both are reused while they exist.
# 2. `buildah bud` of deploy/Containerfile with that base as its BASE build argument.
# Prints the image's size. The flags are the ones this machine kind needs (crun fails with
# cgroups in hybrid mode: runc; podman's default rlimits fail without CAP_SYS_RESOURCE:
# explicit ones); see docs/deployment.md.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=${1:-pdmesh:dev}
cache=${PDMESH_IMAGE_CACHE:-/var/tmp/pdmesh-image-cache}
base=localhost/pdmesh-base:bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Explicit rlimits, well under the hard ones: podman's defaults fail here (no
# CAP_SYS_RESOURCE), and so does an nproc at the caller's own hard limit (runc: "error
# setting rlimit type 6: operation not permitted"; 32768 works, 65536 does not).
ulimits=(--ulimit nofile=16384:16384 --ulimit nproc=16384:16384)
podman=(podman --runtime runc --cgroup-manager cgroupfs --events-backend file)

for t in buildah podman runc debootstrap; do
  if ! command -v "$t" >/dev/null; then
    echo "image: $t not found (make deps installs it)" >&2
    exit 1
  fi
done
if [ "$(id -u)" -ne 0 ]; then
  echo "image: needs root (debootstrap, buildah)" >&2
  exit 1
fi

if ! "${podman[@]}" image exists "$base"; then
  tarball=$cache/debian-bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    mkdir -p "$cache"
    rootfs=$(mktemp -d "$cache/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    echo "image: debootstrap --variant=minbase bookworm ($mirror)"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
      { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
    trap - EXIT
  fi
  echo "image: importing $tarball as $base"
  "${podman[@]}" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' "$tarball" "$base" >/dev/null
fi

echo "image: buildah bud -f deploy/Containerfile -t $tag (base $base)"
# The build stage fetches the model from PyPI with pip: it trusts what this host trusts (these
# machines reach PyPI through a proxy that re-signs TLS with a CA of their own).
secret=()
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$ca" ] && secret=(--secret "id=pip-ca,src=$ca")
buildah bud --runtime runc --isolation oci --layers "${ulimits[@]}" "${secret[@]}" \
  --build-arg "BASE=$base" -f deploy/Containerfile -t "$tag" .
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$tag")
echo "image: $tag: $(((size + 500000) / 1000000)) MB" \
  "(base cache: $(du -sh "$cache" | cut -f1) in $cache)"
