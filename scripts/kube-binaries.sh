#!/usr/bin/env bash
# kube-apiserver and kube-controller-manager (v1.20.2) for the controller's real-apiserver tests,
# in .cache/k8s/bin. Idempotent: present binaries are kept. They come from the prebuilt copies in
# ../shared/k8s/*.xz when that folder exists (seconds), else are built from Debian's source
# package by scripts/build-kube-from-debian-source.sh (about 6.5 minutes, once).
# REINS_K8S_PREBUILT=DIR points at another folder of *.xz copies.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.cache/k8s/bin"
PREBUILT="${REINS_K8S_PREBUILT:-$ROOT/../shared/k8s}"
NAMES=(kube-apiserver kube-controller-manager)

have_all() {
    for name in "${NAMES[@]}"; do
        [ -x "$OUT/$name" ] || return 1
    done
}

if have_all; then
    exit 0
fi
mkdir -p "$OUT"
if [ -f "$PREBUILT/kube-apiserver.xz" ] && [ -f "$PREBUILT/kube-controller-manager.xz" ]; then
    for name in "${NAMES[@]}"; do
        [ -x "$OUT/$name" ] && continue
        echo "kube: decompressing $PREBUILT/$name.xz" >&2
        python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)' "$PREBUILT/$name.xz" "$OUT/$name.part"
        chmod +x "$OUT/$name.part"
        mv -f "$OUT/$name.part" "$OUT/$name"
    done
else
    echo "kube: no prebuilt copies in $PREBUILT; building from Debian's source package" >&2
    bash "$ROOT/scripts/build-kube-from-debian-source.sh" "$ROOT/.cache/k8s/build" "$OUT"
    rm -rf "$ROOT/.cache/k8s/build"
fi
have_all
"$OUT/kube-apiserver" --version >&2
