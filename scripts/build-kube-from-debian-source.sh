#!/usr/bin/env bash
# Builds kube-apiserver and kube-controller-manager v1.20.2 offline from Debian bookworm's
# `kubernetes` *source* package (the full upstream tree with vendor/), with Debian's golang-go.
# No registry ships these binaries (nor kind, k3s or envtest assets), and only Debian's archive
# is reachable, so this is how the controller's real-apiserver tests get them. About 6.5 minutes
# and 1.4 GB of memory cold. Mirrors ../shared/k8s/build-from-debian-source.sh.
#
# Usage: scripts/build-kube-from-debian-source.sh WORKDIR OUTDIR
set -euo pipefail
W=${1:-/tmp/reins-k8s-build}
OUT=${2:-$W/bin}
mkdir -p "$W/apt/lists/partial" "$W/apt/etc" "$OUT"
W=$(cd "$W" && pwd)
OUT=$(cd "$OUT" && pwd)
SUDO=""
if [ "$(id -u)" != 0 ]; then
    SUDO="sudo"
fi
echo "kube: installing golang-go, rsync, jq, make (Debian)..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    golang-go rsync jq make patch >/dev/null
# deb-src entries in a private apt config (/etc/apt is left as it is), on the Debian archive
# this machine's apt already uses: read from its sources, never named here.
MIRROR=$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' \
    | grep -v security | head -n 1)
[ -n "$MIRROR" ] || MIRROR=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' \
    /etc/apt/sources.list 2>/dev/null)
[ -n "$MIRROR" ] || { echo "kube: no Debian archive found in the apt sources" >&2; exit 1; }
cat > "$W/apt/etc/src.sources" <<SRC
Types: deb-src
URIs: $MIRROR
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
APTOPT=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$W/apt/etc"
        -o "Dir::State::Lists=$W/apt/lists")
apt-get "${APTOPT[@]}" update >/dev/null
echo "kube: fetching the kubernetes source package..." >&2
cd "$W"
apt-get "${APTOPT[@]}" source --download-only kubernetes=1.20.5+really1.20.2-1.1+deb12u1 \
    >/dev/null 2>&1
rm -rf kubernetes-1.20.2 debian
tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz
tar xJf kubernetes_*.debian.tar.xz
cd kubernetes-1.20.2
while read -r p; do
    [ -n "$p" ] && patch -p1 -s < "../debian/patches/$p"
done < ../debian/patches/series
export GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS= GOCACHE="$W/gocache" GOPATH="$W/gopath"
echo "kube: generating the OpenAPI code..." >&2
make gen_openapi >/dev/null
mkdir -p "$GOPATH/src/k8s.io"
ln -sfn "$W/kubernetes-1.20.2" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"
V=k8s.io/kubernetes/vendor/k8s.io
LDF="-s -w -X $V/component-base/version.gitVersion=v1.20.2 -X $V/client-go/pkg/version.gitVersion=v1.20.2"
for c in kube-apiserver kube-controller-manager; do
    echo "kube: building $c..." >&2
    go build -ldflags "$LDF" -o "$OUT/$c" "./cmd/$c"
done
ls -la "$OUT" >&2
