#!/usr/bin/env bash
# `make test` after lint (what .ci/run runs; README, "Tests"): the main suite, then the vLLM,
# floors, peers and Docker lanes, with the time each lane starts.
#
# The main suite leaves about half of the two cores idle, waiting on its processes; what the
# later lanes need is made in that room, at the lowest priority:
#   - the vLLM, floors and peers venvs (about 10 min of pip), log .venvs-build.log;
#   - a Docker engine and the CPU stack's images (scripts/docker_engine.sh, scripts/make_images.sh:
#     about 8 min cold, seconds warm), log .images-build.log. dockerd starts niced, so the image
#     builds' containers (its grandchildren) are niced too.
# A lane waits for what it needs and prints its log when that failed. On any exit the Docker
# engine this script started is stopped and the iptables rules it changed are put back.
set -euo pipefail
cd "$(dirname "$0")/.."
MAKE=${MAKE:-make}
export DOCKER_STATE=${DOCKER_STATE:-/tmp/reval-docker-engine}
t0=$SECONDS
lane() { echo "== $1: $(date +%T) ($(((SECONDS - t0) / 60)) min $(((SECONDS - t0) % 60)) s in)"; }

# wait_for NAME: block until the background job NAME wrote NAME.rc; its log on failure.
wait_for() {
  while [[ ! -f .$1.rc ]]; do sleep 5; done
  tail -3 ".$1.log"
  if [[ $(cat ".$1.rc") != 0 ]]; then
    echo "== $1 failed (rc $(cat ".$1.rc")); its log:" >&2
    cat ".$1.log" >&2
    exit 1
  fi
}

scripts/ensure_redis.sh
scripts/ensure_tools.sh
rm -f .venvs-build.rc .images-build.rc
trap 'scripts/docker_engine.sh stop "$DOCKER_STATE" || true' EXIT
(
  rc=0
  nice -n 19 "$MAKE" --no-print-directory venv-vllm venv-floors venv-peers \
    >.venvs-build.log 2>&1 || rc=$?
  echo $rc >.venvs-build.rc
) &
(
  rc=0
  nice -n 19 sh -c 'scripts/docker_engine.sh start "$DOCKER_STATE" && scripts/make_images.sh' \
    >.images-build.log 2>&1 || rc=$?
  echo $rc >.images-build.rc
) &

lane "main suite (the venvs and the images build beside it, niced)"
REVAL_REQUIRE_REDIS=${REVAL_REQUIRE_REDIS:-1} .venv/bin/python -m pytest -q --durations=30
wait_for venvs-build
lane "vLLM lane"
"$MAKE" --no-print-directory test-vllm
lane "floors lane"
"$MAKE" --no-print-directory test-floors
lane "peers lane"
"$MAKE" --no-print-directory test-peers
wait_for images-build
lane "Docker lane"
"$MAKE" --no-print-directory test-docker
lane done
