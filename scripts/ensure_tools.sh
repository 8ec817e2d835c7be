#!/usr/bin/env bash
# Make sure the operations tools the tests use are installed: promtool and prometheus (the
# Debian package `prometheus`: metrics, config and rules checks, the scrape test) and
# docker-compose (validates docker-compose.yml; no Docker engine needed) and bubblewrap (`bwrap`:
# the sandbox model-written code runs in, rollout/grading/sandbox.py). Installs them with
# apt-get when they are missing and this runs as root; fails loudly otherwise.
set -euo pipefail
missing=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v bwrap >/dev/null || missing+=(bubblewrap)
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "ensure_tools: missing ${missing[*]} (Debian/Ubuntu: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
echo "ensure_tools: installing ${missing[*]}" >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
  >/tmp/reval-ensure-tools.log 2>&1 || {
  apt-get update -q >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}
