#!/usr/bin/env bash
# engine.sh - install (apt) and start the Docker engine without systemd. Idempotent.
# Env: DOCKER_LOG (default /var/log/dockerd-rolltap.log), DOCKER_PIDFILE (default /var/run/dockerd-rolltap.pid)
#      DOCKER_STORAGE_DRIVER (default: let dockerd pick; overlay2 works on ext4 here)
#      DOCKER_MTU (default: MTU of the default-route interface, e.g. 1400)
set -euo pipefail
T0=$(date +%s%N)
ts() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[engine %4d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }

DOCKER_LOG=${DOCKER_LOG:-/var/log/dockerd-rolltap.log}
DOCKER_PIDFILE=${DOCKER_PIDFILE:-/var/run/dockerd-rolltap.pid}
export DEBIAN_FRONTEND=noninteractive

# 1. packages (docker.io = dockerd 20.10 + containerd + runc + iptables + tini; mmdebstrap/debootstrap for base images)
#    --no-install-recommends: skips apparmor/criu/needrestart/git (no AppArmor in this kernel)
need=()
command -v dockerd     >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v mmdebstrap  >/dev/null 2>&1 || need+=(mmdebstrap)
if ((${#need[@]})); then
  ts "apt-get install ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  ts "apt install done"
else
  ts "packages already installed"
fi

# 2. daemon config: docker0 MTU = host MTU (eth0 is 1400 here). Precaution only: on this host a 1500-MTU
#    network also downloaded a 17 MB wheel fine. (daemon "mtu" affects docker0 only, not compose networks.)
if [ ! -s /etc/docker/daemon.json ]; then
  dev=$(ip route show default 2>/dev/null | awk '{for(i=1;i<=NF;i++) if($i=="dev") print $(i+1); exit}')
  mtu=${DOCKER_MTU:-$(cat /sys/class/net/${dev:-eth0}/mtu 2>/dev/null || echo 1500)}
  mkdir -p /etc/docker
  printf '{\n  "mtu": %s\n}\n' "$mtu" > /etc/docker/daemon.json
  ts "wrote /etc/docker/daemon.json (mtu $mtu)"
fi

# 3. start dockerd unless a daemon already answers
if docker info >/dev/null 2>&1; then
  ts "dockerd already running (pid $(cat "$DOCKER_PIDFILE" 2>/dev/null || pidof dockerd || echo '?'))"
else
  args=()
  [ -n "${DOCKER_STORAGE_DRIVER:-}" ] && args+=(--storage-driver "$DOCKER_STORAGE_DRIVER")
  ts "starting dockerd ${args[*]:-} (log $DOCKER_LOG)"
  nohup dockerd "${args[@]}" >>"$DOCKER_LOG" 2>&1 &
  echo $! > "$DOCKER_PIDFILE"
  for i in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    if ! kill -0 "$(cat "$DOCKER_PIDFILE")" 2>/dev/null; then
      echo "dockerd died; last log lines:" >&2; tail -30 "$DOCKER_LOG" >&2; exit 1
    fi
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not come up in 60 s" >&2; tail -30 "$DOCKER_LOG" >&2; exit 1; }
  ts "dockerd up, pid $(cat "$DOCKER_PIDFILE")"
fi

docker version --format 'client {{.Client.Version}} (API {{.Client.APIVersion}}) / server {{.Server.Version}} (API {{.Server.APIVersion}})'
docker info --format 'storage={{.Driver}} cgroup={{.CgroupDriver}} v{{.CgroupVersion}} root={{.DockerRootDir}}'
ts "done"
