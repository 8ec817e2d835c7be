#!/usr/bin/env bash
# Start or stop a Docker engine for the stack test (make test-docker), without systemd.
#   scripts/docker_engine.sh start STATE_DIR   # starts dockerd unless one answers already
#   scripts/docker_engine.sh stop STATE_DIR    # stops only the dockerd that `start` started
# `start` records what it started in STATE_DIR (dockerd.pid, the iptables rules and ip_forward
# from before): dockerd sets the FORWARD policy to DROP, turns ip_forward on and adds its chains
# and NAT rules; `stop` ends that dockerd by its PID and puts those back. Needs root; installs
# Debian's docker.io, docker-compose (v1, the stack test's) and debootstrap when missing.
set -euo pipefail
cmd=${1:?usage: docker_engine.sh start|stop STATE_DIR}
state=${2:?usage: docker_engine.sh start|stop STATE_DIR}
mkdir -p "$state"
case $cmd in
start)
  missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  if [[ ${#missing[@]} -gt 0 ]]; then
    echo "docker_engine: installing ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
      >"$state/apt.log" 2>&1 || { tail -20 "$state/apt.log" >&2; exit 1; }
  fi
  if docker info >/dev/null 2>&1; then
    echo "docker_engine: a Docker engine already answers; leaving it alone" >&2
    exit 0
  fi
  # Both tables by name: a table never used yet is missing from a plain iptables-save, and a
  # restore without it would leave dockerd's chains in place.
  { iptables-save -t filter && iptables-save -t nat; } >"$state/iptables.rules"
  cat /proc/sys/net/ipv4/ip_forward >"$state/ip_forward"
  dockerd --pidfile "$state/dockerd.pid.docker" >"$state/dockerd.log" 2>&1 &
  echo $! >"$state/dockerd.pid"
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && exit 0
    kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null || break
    sleep 0.5
  done
  echo "docker_engine: dockerd did not start; its log:" >&2
  tail -20 "$state/dockerd.log" >&2
  exit 1
  ;;
stop)
  [[ -f $state/dockerd.pid ]] || exit 0 # not ours
  pid=$(cat "$state/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$state/dockerd.pid"
  iptables-restore <"$state/iptables.rules"
  cat "$state/ip_forward" >/proc/sys/net/ipv4/ip_forward
  ip link delete docker0 2>/dev/null || true
  ;;
*)
  echo "docker_engine: unknown command $cmd (start|stop)" >&2
  exit 2
  ;;
esac
