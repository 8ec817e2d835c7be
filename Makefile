# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch-free packages that mypy checks strictly.
LIGHT := reval/config.py reval/rewards.py reval/metrics.py buffer

.PHONY: demo test lint unit venv clean oneshot ablations

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU wheel first, so the range in pyproject.toml is already met and no CUDA build is pulled.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/reval train

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

test: lint
	scripts/ensure_redis.sh
	scripts/ensure_tools.sh
	REVAL_REQUIRE_REDIS=$${REVAL_REQUIRE_REDIS:-1} $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
