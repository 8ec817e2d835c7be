#!/usr/bin/env bash
# Make sure a Redis answers at $REVAL_TEST_REDIS_URL's host:port (default 127.0.0.1:6379): the
# buffer tests run against a real server. Starts a throw-away one (no persistence) when none
# answers and redis-server is installed; fails loudly otherwise.
set -euo pipefail
HOST=127.0.0.1
PORT=6379
if [[ -n "${REVAL_TEST_REDIS_URL:-}" ]]; then
  hp="${REVAL_TEST_REDIS_URL#redis://}"; hp="${hp%%/*}"
  HOST="${hp%%:*}"; [[ "$hp" == *:* ]] && PORT="${hp##*:}"
fi
ping() { redis-cli -h "$HOST" -p "$PORT" ping 2>/dev/null | grep -q PONG; }
if ping; then
  exit 0
fi
if ! command -v redis-server >/dev/null; then
  echo "ensure_redis: no Redis answers at $HOST:$PORT and redis-server is not installed" >&2
  exit 1
fi
echo "ensure_redis: starting redis-server on $HOST:$PORT for the tests" >&2
redis-server --bind "$HOST" --port "$PORT" --daemonize yes --save "" --appendonly no \
  --logfile /tmp/reval-test-redis.log
for _ in $(seq 50); do
  ping && exit 0
  sleep 0.1
done
echo "ensure_redis: redis-server did not answer on $HOST:$PORT" >&2
exit 1
