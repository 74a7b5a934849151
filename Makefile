# Targets named in README.md. PY points at the project venv made by `make setup`.
PY ?= .venv/bin/python
PIP_TORCH = torch==2.14.1 torchvision==0.29.1

.PHONY: setup test bench bench-quick demo tiny clean

setup: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3.11 -m venv .venv || python3 -m venv .venv
	$(PY) -m pip install -q $(PIP_TORCH)
	$(PY) -m pip install -q -e '.[test,offload]'
	touch $@

test: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) -m benchmarks.kv_attention --json out/kv_attention.json

bench-quick: setup
	$(PY) -m benchmarks.kv_attention --quick --json out/kv_attention_quick.json

# Main job on the embedded default: the KV-attention benchmark (until the node pack lands).
demo: bench

tiny: setup
	$(PY) -m unicache_core.bagel.tiny .tiny/bagel-tiny

clean:
	rm -rf .venv out .tiny .pytest_cache
