#!/usr/bin/env bash
# Run a bench module on a bare machine with Python 3.12 and no network (the 16-core device):
# Python wheels from .whl/ and Debian packages (wrk) from .debs/, both prepared beside the checkout:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl fastapi starlette uvicorn httptools sqlalchemy asyncpg psycopg psycopg-binary alembic mako \
#     orjson pydantic pydantic_core pydantic-settings python-dotenv greenlet aiosqlite typing-inspection \
#     annotated-types typing-extensions pgserver fasteners platformdirs      (versions as in .venv)
#   (cd .debs && apt-get download wrk libluajit-5.1-2 libluajit-5.1-common)
# PostgreSQL comes from the `pgserver` wheel (its bundled initdb/pg_ctl); as root, a `postgres`
# user is made for it. Usage: bash bench/device.sh scaling --workers 1,2,4,8 --out FILE
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export PATH=/tmp/site/pgserver/pginstall/bin:$PATH
if [ -d .debs ]; then
  mkdir -p /tmp/debs && for f in .debs/*.deb; do dpkg -x "$f" /tmp/debs; done
  export PATH=/tmp/debs/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
fi
if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then useradd -r -m postgres; fi
module=$1; shift
exec python3 -m "bench.$module" "$@"
