#!/usr/bin/env bash
# Build the CPU stack's images without a container registry (docs/operations.md, "The CPU stack"):
#   reval-local/debian:bookworm   debootstrap --variant=minbase + docker import, with this host's
#                                 apt configuration and CA certificates (pip and apt inside work
#                                 where a proxy intercepts TLS)
#   reval-local/python:3.11       Debian's python3, a venv in /opt/venv with the CPU torch wheel
#   reval-local/redis:7           Debian's redis-server        (for REVAL_REDIS_IMAGE)
#   reval-local/prometheus:2      Debian's prometheus          (for REVAL_PROMETHEUS_IMAGE)
#   reval-local/python-deps:HASH  that and reval's dependencies (HASH: of their list)
#   reval:cpu                     deploy/docker/Dockerfile.cpu FROM reval-local/python-deps
# Grafana has no Debian package: the CPU stack has none.
# Cached between runs: the rootfs tarball, the torch wheel and a wheelhouse in $REVAL_IMAGE_CACHE
# (default /var/cache/reval-images), the images (one that exists is not rebuilt;
# REVAL_REBUILD_BASE=1 rebuilds them) and Docker's layer cache (an unchanged tree is a no-op).
# REVAL_IMAGE_TREE=head builds reval:cpu from the last commit (git archive HEAD) instead of the
# working tree: a tree with uncommitted work of others in it may not run.
# Needs root, a running Docker engine (scripts/docker_engine.sh) and, on Debian, installs
# debootstrap when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${REVAL_IMAGE_CACHE:-/var/cache/reval-images}
suite=${REVAL_DEBIAN_SUITE:-bookworm}
mirror=${REVAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
torch_spec=${REVAL_TORCH:-torch==2.13.0}
mkdir -p "$cache"
t0=$SECONDS
say() { echo "make_images: $* ($((SECONDS - t0)) s)" >&2; }
have() { [[ ${REVAL_REBUILD_BASE:-0} != 1 ]] && docker image inspect "$1" >/dev/null 2>&1; }

if ! have reval-local/debian:$suite; then
  tarball=$cache/debian-$suite-minbase.tar
  if [[ ! -f $tarball ]]; then
    command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends debootstrap >/dev/null
    root=$(mktemp -d "$cache/rootfs.XXXXXX")
    say "debootstrap $suite"
    debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 ||
      { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # This host's apt settings (proxies, mirrors' options) and CA certificates; no service
    # starts inside an image build; no apt lists or caches in the image.
    cp -a /etc/apt/apt.conf.d/. "$root/etc/apt/apt.conf.d/"
    mkdir -p "$root/usr/local/share/ca-certificates"
    cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
    chroot "$root" sh -c 'apt-get install -y -q --no-install-recommends ca-certificates \
      >/dev/null && apt-get clean && rm -rf /var/lib/apt/lists/*'
    tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$root"
  fi
  say "docker import $tarball"
  docker import -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    -c 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    "$tarball" "reval-local/debian:$suite" >/dev/null
fi

build() { # TAG DOCKERFILE CONTEXT [ARGS...]
  local tag=$1 file=$2 ctx=$3
  shift 3
  say "build $tag"
  docker build -q -t "$tag" -f "$file" --build-arg "DEBIAN_IMAGE=reval-local/debian:$suite" \
    "$@" "$ctx" >/dev/null
}

if ! have reval-local/python:3.11; then
  wheels=$cache/wheels
  if ! ls "$wheels"/torch-*.whl >/dev/null 2>&1; then
    # The CPU wheel: from this host's pip configuration where it has one (a wheel directory, a
    # mirror), else from PyTorch's CPU index.
    mkdir -p "$wheels"
    say "pip download $torch_spec"
    pip_ok() { python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "$@"; }
    pip_ok "$torch_spec" 2>/dev/null && ls "$wheels"/torch-*+cpu*.whl >/dev/null 2>&1 ||
      { rm -f "$wheels"/torch-*.whl
        pip_ok "$torch_spec" --index-url https://download.pytorch.org/whl/cpu; }
  fi
  build reval-local/python:3.11 deploy/docker/local/Dockerfile.python "$wheels"
fi
have reval-local/redis:7 ||
  build reval-local/redis:7 deploy/docker/local/Dockerfile.redis deploy/docker/local
have reval-local/prometheus:2 ||
  build reval-local/prometheus:2 deploy/docker/local/Dockerfile.prometheus deploy/docker/local
tree=.
if [[ ${REVAL_IMAGE_TREE:-worktree} == head ]]; then
  tree=$(mktemp -d)
  trap 'rm -rf "$tree"' EXIT
  git archive HEAD | tar -x -C "$tree"
fi
# reval's dependencies on top, in an image named after their list (an edit to pyproject.toml
# that leaves the list alone reuses it), installed from a wheelhouse mounted from $cache/wheelhouse
# (a docker build here has no cache mounts, and pip's HTTP cache stays empty behind a proxy that
# says no-store): `pip download` fetches only the files it does not have. Not torch: the base's
# CPU wheel is the one (PyPI's is the CUDA build, 3 GB with its nvidia-* wheels).
deps=$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("'"$tree"'/pyproject.toml", "rb"))
  ["project"]["dependencies"]))')
deps_tag=reval-local/python-deps:$(printf '%s' "$deps" | sha256sum | cut -c1-12)
if ! have "$deps_tag"; then
  say "pip install the dependencies into $deps_tag"
  mkdir -p "$cache/wheelhouse"
  name=reval-deps-$$
  docker run --name "$name" -v "$cache/wheelhouse:/wheelhouse" -e "DEPS=$deps" \
    reval-local/python:3.11 sh -c 'echo "$DEPS" | grep -v "^torch" >/tmp/deps.txt &&
      pip download -q -d /wheelhouse -r /tmp/deps.txt &&
      pip install -q --no-index --find-links /wheelhouse -r /tmp/deps.txt' \
    >"$cache/deps.log" 2>&1 ||
    { docker rm -f "$name" >/dev/null; tail -20 "$cache/deps.log" >&2; exit 1; }
  docker commit -c 'CMD ["python3"]' "$name" "$deps_tag" >/dev/null
  docker rm "$name" >/dev/null
fi
# reval:cpu always goes through docker build: its layer cache makes an unchanged tree a no-op.
build reval:cpu "$tree/deploy/docker/Dockerfile.cpu" "$tree" --build-arg "BASE_IMAGE=$deps_tag"
say "done"
# What the compose files need to use these images instead of the official ones.
echo "export REVAL_REDIS_IMAGE=reval-local/redis:7 REVAL_PROMETHEUS_IMAGE=reval-local/prometheus:2"
echo "export REVAL_BASE_IMAGE=reval-local/python:3.11"
