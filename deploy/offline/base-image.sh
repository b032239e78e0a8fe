#!/usr/bin/env bash
# base-image.sh - build a "python:3.11-slim" stand-in from Debian bookworm with mmdebstrap/debootstrap + docker import.
# No registry pull. Idempotent: skips if the tag exists (FORCE=1 rebuilds).
# Env: BASE_TAGS (default "python:3.11-slim local/python:3.11-bookworm"), MIRROR (default: host apt mirror),
#      SUITE (default bookworm), BOOTSTRAP (debootstrap|mmdebstrap), ROOTFS (default /dev/shm/rootfs-python if tmpfs has room), FORCE
set -euo pipefail
T0=$(date +%s%N)
ts() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[base %4d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }

BASE_TAGS=${BASE_TAGS:-"python:3.11-slim local/python:3.11-bookworm"}
SUITE=${SUITE:-bookworm}
# Measured here (rootfs on tmpfs): mmdebstrap 25-57 s, debootstrap 73-103 s (its dependency resolution alone ~30 s).
# Same package set, same 191 MB image.
BOOTSTRAP=${BOOTSTRAP:-$(command -v mmdebstrap >/dev/null && echo mmdebstrap || echo debootstrap)}
# dpkg fsyncs every file; on this VM's disk (~3 ms per fsync) that makes debootstrap 2-3 min.
# Building the rootfs on tmpfs (/dev/shm, 24 GB here) avoids it.
if [ -z "${ROOTFS:-}" ]; then
  if [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2{print $4}')" -gt 1500000 ] 2>/dev/null; then ROOTFS=/dev/shm/rootfs-python
  else ROOTFS=/var/tmp/rootfs-python; fi
fi
first_tag=${BASE_TAGS%% *}

if [ -z "${FORCE:-}" ] && docker image inspect "$first_tag" >/dev/null 2>&1; then
  ts "$first_tag exists ($(docker image inspect -f '{{.Size}}' "$first_tag") bytes); FORCE=1 to rebuild"
  for t in $BASE_TAGS; do docker tag "$first_tag" "$t"; done
  exit 0
fi

# Same mirror the host's apt uses (deb822 debian.sources or classic sources.list)
if [ -z "${MIRROR:-}" ]; then
  MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '$1=="deb" && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
ts "$BOOTSTRAP --variant=minbase $SUITE from $MIRROR into $ROOTFS"

PKGS=python3,python3-venv,python3-pip,python-is-python3,ca-certificates
safe_rm() { if grep -q " $ROOTFS[/ ]" /proc/mounts; then echo "mounts left under $ROOTFS; not removing" >&2; exit 1; fi; rm -rf "$ROOTFS"; }
safe_rm
if [ "$BOOTSTRAP" = mmdebstrap ]; then
  command -v mmdebstrap >/dev/null || apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  # merged-usr hook: avoids pulling usrmerge+perl (+47 MB) the way debootstrap does (usr-is-merged)
  mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr --include="$PKGS" "$SUITE" "$ROOTFS" "$MIRROR" > /var/tmp/bootstrap-python.log 2>&1 \
    || { tail -30 /var/tmp/bootstrap-python.log >&2; exit 1; }
else
  mkdir -p "$ROOTFS"
  debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOTFS" "$MIRROR" 2>&1 \
    | awk '{ print strftime("%T"), $0; fflush() }' > /var/tmp/bootstrap-python.log \
    || { tail -30 /var/tmp/bootstrap-python.log >&2; exit 1; }
fi
ts "$BOOTSTRAP done"

# apt inside the image: same sources as the host (incl. -updates and -security)
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  cp /etc/apt/sources.list.d/debian.sources "$ROOTFS/etc/apt/sources.list.d/debian.sources"
  rm -f "$ROOTFS/etc/apt/sources.list"
fi

# Host CA certificates (this network re-signs TLS with its own CA, which the host trusts) -> image trust store
cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$ROOTFS" update-ca-certificates >/dev/null 2>&1 || cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"

# pip: allow system-wide installs like the official image; point pip at the system CA bundle.
rm -f "$ROOTFS"/usr/lib/python3*/EXTERNALLY-MANAGED
{
  echo "[global]"
  echo "cert = /etc/ssl/certs/ca-certificates.crt"
  echo "root-user-action = ignore"
  # carry over only the host's *network* index settings (file:// paths and constraints do not exist in the image)
  if [ -n "${PIP_INDEX_URL:-}" ]; then echo "index-url = $PIP_INDEX_URL"; fi
  if [ -n "${PIP_TRUSTED_HOST:-}" ]; then echo "trusted-host = $PIP_TRUSTED_HOST"; fi
  for k in index-url trusted-host; do
    v=$(pip config get "global.$k" 2>/dev/null || true)
    if [ -n "$v" ]; then echo "$k = $v"; fi
  done
} | awk '!seen[$1]++' > "$ROOTFS/etc/pip.conf"

# like the official Debian images: no fsync in dpkg, no .deb cache kept (speeds up apt in docker build)
echo 'force-unsafe-io' > "$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-apt-speedup"
cat > "$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOC'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOC
echo 'APT::Install-Recommends "false";' > "$ROOTFS/etc/apt/apt.conf.d/docker-no-recommends"

# slim down
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log "$ROOTFS"/root/.cache
ts "rootfs prepared ($(du -sh "$ROOTFS" | cut -f1))"

tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "$BOOTSTRAP $SUITE minbase + python3 (rolltap deploy/offline/base-image.sh)" \
  - "$first_tag" >/dev/null
for t in $BASE_TAGS; do docker tag "$first_tag" "$t"; done
safe_rm
ts "imported as: $BASE_TAGS"
docker run --rm "$first_tag" sh -c 'python --version; pip --version'
docker image ls "${first_tag%%:*}"
ts "done"
