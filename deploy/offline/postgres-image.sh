#!/usr/bin/env bash
# postgres-image.sh - build a stand-in for the official postgres image (no registry): local base + Debian postgresql-15.
# Honours POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB (+ HOST_AUTH_METHOD, INITDB_ARGS, initdb.d); has a pg_isready HEALTHCHECK.
# Idempotent: skips if the tag exists (FORCE=1 rebuilds).
# Env: PG_TAGS (default "local/postgres:15 postgres:15"; add e.g. postgres:16 so unmodified compose files resolve
#      locally - it is still PostgreSQL 15 inside), BASE (default local/python:3.11-bookworm)
set -euo pipefail
T0=$(date +%s%N)
ts() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[postgres %4d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }
HERE=$(cd "$(dirname "$0")" && pwd)
PG_TAGS=${PG_TAGS:-"local/postgres:15 postgres:15"}
BASE=${BASE:-local/python:3.11-bookworm}
first_tag=${PG_TAGS%% *}

if [ -z "${FORCE:-}" ] && docker image inspect "$first_tag" >/dev/null 2>&1; then
  ts "$first_tag exists; FORCE=1 to rebuild"
else
  docker image inspect "$BASE" >/dev/null 2>&1 || { echo "missing base $BASE: run deploy/offline/base-image.sh first" >&2; exit 1; }
  ts "docker build (classic builder) $first_tag from $BASE"
  # DOCKER_BUILDKIT=0: works with any docker CLI even without the buildx plugin
  DOCKER_BUILDKIT=0 docker build -q --network host --build-arg BASE="$BASE" -t "$first_tag" "$HERE/postgres" 2>&1 \
    | grep -vE 'DEPRECATED|legacy builder|BuildKit is currently disabled|environment-variable\.|^\s*$' || true
  docker image inspect "$first_tag" >/dev/null
  ts "built"
fi
for t in $PG_TAGS; do docker tag "$first_tag" "$t"; done

# smoke test: start, wait healthy, query, remove
cid=$(docker run -d --rm -e POSTGRES_USER=smoke -e POSTGRES_PASSWORD=smoke -e POSTGRES_DB=smokedb "$first_tag")
for i in $(seq 1 60); do
  [ "$(docker inspect -f '{{.State.Health.Status}}' "$cid")" = healthy ] && break; sleep 1
done
docker exec "$cid" psql -U smoke -d smokedb -tAc 'select version()'
docker rm -f -v "$cid" >/dev/null   # -v: also drop the anonymous PGDATA volume
docker image ls local/postgres
ts "done (tags: $PG_TAGS)"
