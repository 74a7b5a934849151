# Targets named in README.md and docs/development.md. PY points at the project venv made by `make setup`.
PY ?= .venv/bin/python
PIP_TORCH = torch==2.14.1 torchvision==0.29.1

.PHONY: setup lint format test bench bench-quick demo tiny clean host test-host test-all browser-deps bundled train calibrate \
	quality quality-quick official-goldens figures thumbnails

setup: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PY) -m pip install -q $(PIP_TORCH)
	$(PY) -m pip install -q -e '.[test,offload,batch,ray,docs]'
	touch $@

# The unit suite on TEST_WORKERS processes (pytest-xdist; tests of one xdist_group share a worker), each running
# torch on one thread (tests/conftest.py): one process per core.
TEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadgroup
# The slowest tests are listed at the end of each run (where the suite's time goes, in every CI log).
DURATIONS = --durations=12
test: setup lint
	$(PY) -m pytest $(PYTEST_PARALLEL) $(DURATIONS) tests

# Lint, format and type checks (ruff and mypy, pinned in pyproject's test extra; mypy's files are in pyproject)
# and the architecture's import rules (import-linter's lint-imports over [tool.importlinter] in pyproject.toml);
# `make format` rewrites the files.
LINT_IMPORTS = $(dir $(PY))lint-imports
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(LINT_IMPORTS) --no-cache

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: setup
	$(PY) -m benchmarks.kv_attention --json out/kv_attention.json

bench-quick: setup
	$(PY) -m benchmarks.kv_attention --quick --json out/kv_attention_quick.json

# --- ComfyUI host (tools/install_comfyhost.sh, tools/comfyhost.py; docs/host.md) ---
HOST_DIR ?= .comfyhost
export COMFYHOST_DIR = $(abspath $(HOST_DIR))
BUNDLED = models/bagel/bagel-tiny
SHAPES = models/bagel/unicache-shapes
DEMO_OUT ?= out/demo
BROWSER_DIR = tests/host/browser

host: setup
	tools/install_comfyhost.sh $(HOST_DIR)

# The pack's model folder: the trained default $(SHAPES) ships in git (checked here); the tiny random test
# checkpoint $(BUNDLED) is written (ignored by git).
bundled: $(BUNDLED)/ema.safetensors
	@test -f $(SHAPES)/ema.safetensors || { echo "missing $(SHAPES) (shipped in git; or run make train)" >&2; exit 1; }
$(BUNDLED)/ema.safetensors: | setup
	$(PY) -m training.tiny $(BUNDLED)

# Debian chromium and playwright-core (pinned in tests/host/browser/package-lock.json) for the browser test.
browser-deps:
	test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }
	cd $(BROWSER_DIR) && npm ci --no-audit --no-fund --loglevel=error

# Host and browser tests only (a real ComfyUI server per session).
test-host: host bundled browser-deps
	$(PY) -m pytest $(DURATIONS) tests/host -m "host or browser"

# Everything: the unit suite (in parallel) plus the host and browser tests (in one process: one shared ComfyUI
# server, and the modules that need other host options start their own) (the README's test command; .ci/run).
test-all: lint host bundled browser-deps
	$(PY) -m pytest $(PYTEST_PARALLEL) $(DURATIONS) tests; unit=$$?; \
	$(PY) -m pytest $(DURATIONS) tests/host -m "host or browser"; hosted=$$?; \
	if [ $$unit -ne 0 ]; then exit $$unit; fi; exit $$hosted

# Main job: every shipped API workflow in a headless host on the bundled default checkpoint;
# outputs (images, texts, summary.json per workflow) land in $(DEMO_OUT)/. Seed 42 is the workflows' own.
demo: host bundled
	$(PY) tools/comfyhost.py start --name demo
	rc=0; for wf in workflows/api/*.json; do \
	  n=$$(basename $$wf .json); \
	  $(PY) -m tools.batch $$wf --host $$($(PY) tools/comfyhost.py status --name demo --url) --count 1 \
	    --seed-start 42 --out $(DEMO_OUT)/$$n --summary $(DEMO_OUT)/$$n/summary.json || rc=1; \
	done; $(PY) tools/comfyhost.py stop --name demo; exit $$rc

# The README's pictures and generated table: the plot of KV bytes and the Pareto figure of fidelity against bytes
# from docs/results (tools/kv_plot.py, tools/pareto.py), the
# "what fits on your card" table from the memory plan (tools/card_table.py), and the workflow thumbnails from
# make demo's outputs (tools/thumbnails.py: strips into docs/images/, template cards workflows/<name>.jpg).
figures: setup
	$(PY) -m tools.kv_plot
	$(PY) -m tools.pareto
	$(PY) -m tools.card_table --write

thumbnails: demo
	$(PY) -m tools.thumbnails --demo $(DEMO_OUT)

# The bundled model: the full training run (about 60 min on 2 cores; resumable: run it again after a stop),
# its UniCache calibration, and the quality benchmark (docs/shapes.md).
TRAIN_WORK ?= .train/unicache-shapes
train: setup
	$(PY) -m training $(SHAPES) --work $(TRAIN_WORK) --threads 2

calibrate: setup
	$(PY) -m training.calibration $(SHAPES)

quality: setup
	$(PY) -m benchmarks.quality --json out/quality.json

quality-quick: setup
	$(PY) -m benchmarks.quality --quick --json out/quality_quick.json

# Record tests/goldens/official/ again with the official BAGEL code (docs/equivalence.md): OFFICIAL is a checkout of
# ByteDance-Seed/Bagel at the commit tools/official_reference.py pins; its own venv is .refcheck/venv.
official-goldens: setup
	@test -n "$(OFFICIAL)" || { echo "give OFFICIAL=DIR, a checkout of ByteDance-Seed/Bagel (docs/equivalence.md)" >&2; exit 1; }
	tools/install_refcheck.sh
	$(PY) -m training.tiny .refcheck/bagel-tiny
	.refcheck/venv/bin/python tools/official_reference.py --official $(OFFICIAL) --checkpoint .refcheck/bagel-tiny

tiny: setup
	$(PY) -m training.tiny .tiny/bagel-tiny

clean:
	rm -rf .venv out .tiny .pytest_cache $(HOST_DIR) $(BROWSER_DIR)/node_modules
