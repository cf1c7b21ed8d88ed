# ddp-lab: `make train` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
EXPERIMENT ?= toy
# Processes per node (NPROC): make's command line, else the environment, else .env (as the experiments read
# it); empty means every visible GPU, or 2 CPU processes (gloo) without one. Counted when the recipe runs
# (ddp_core/process/nproc.py), i.e. after `setup` has installed torch on a fresh machine.
NPROC ?=
ARGS ?=
TB_PORT ?= 6006
N ?= 200
RUNS_DIR ?= runs

.PHONY: setup train test test-quick lint test-hosts slurm-check bench stress tensorboard runs new-experiment contract reference clean

# The virtual environment .venv: Python 3.11 and the pinned requirements (about 80 s the first time).
setup: $(VENV)/.installed

# Re-installs when a requirements file changes. The pinned versions live in requirements*.txt only.
$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-heal.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: install Python 3.11 or run make PYTHON=/path/to/python3.11"; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' || { echo "error: $(PYTHON) is not Python 3.11"; exit 2; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setup: installing torch and the pinned requirements into $(VENV) (about 80 s the first time)"
	$(BIN)/python -m pip install --quiet -r requirements.txt -r requirements-dev.txt -r requirements-heal.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# The experiment EXPERIMENT (toy) under ddp_core.torchrun on NPROC processes, with ARGS.
train: setup
	nproc=$$($(BIN)/python -m ddp_core.process.nproc) && \
	$(BIN)/python -m ddp_core.torchrun --standalone --nproc-per-node=$$nproc -m experiments.$(EXPERIMENT) $(ARGS)

# The suite writes bytecode (__pycache__, git-ignored) even where PYTHONDONTWRITEBYTECODE is set, as in many
# containers: its hundreds of interpreters would each compile ddp_core from source, and each pytest worker rewrite
# every test module again (docs/decisions.md, "The suite writes bytecode").
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

# Two parts, each with its own summary line: everything that needs no engine and no root on one pytest worker per
# core (TEST_WORKERS=0: none), each test module whole in one worker (it shares its runs); then what needs the
# machine's own engines and root (Docker, the real Slurm, hosts made of network namespaces), one test at a time,
# since they share one engine, one cluster and the host's network. Exit 5 (nothing selected) is no failure there.
TEST_WORKERS ?= auto
test: setup
	$(PYTEST) -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not docker and not slurm and not hosts" $(PYTEST_ARGS)
	$(PYTEST) -m "docker or slurm or hosts" $(PYTEST_ARGS) || test $$? -eq 5

# The edit-test loop: the unit tests and one 2-process torchrun toy run
# whose run directory (manifest, metrics, TensorBoard events, checkpoint) is checked.
test-quick: setup
	$(PYTEST) -n $(TEST_WORKERS) --dist loadscope tests/unit tests/e2e/test_toy.py::test_run_directory_contract -q $(PYTEST_ARGS)

# One formatter and linter for the whole tree (pyproject.toml's [tool.ruff]); `ruff format .` fixes the format.
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Only the jobs across hosts made of network namespaces (tests/hosts; root and iproute2; about 4 minutes).
# `make test` runs them too, in its second part.
test-hosts: setup
	$(PYTEST) tests/hosts $(PYTEST_ARGS)

# docker/slurm-cpu.sbatch on a real one-node Slurm (root; installs slurm-wlm and munge with apt, starts
# them: tests/slurm/cluster.py): preempted and at its time limit, the toy is requeued and resumes bitwise
# (about 3 minutes). `make test` runs these only with REQUIRE_SLURM=1, as CI does.
slurm-check: setup
	$(PYTEST) tests/slurm -m slurm $(PYTEST_ARGS)

# The benchmarks' ratios, side by side (docs/benchmarks.md).
bench: setup
	$(BIN)/python -m bench

# N four-process toy runs and N plain-torch control runs, alternating: how many end in gloo's teardown abort.
stress: setup
	$(BIN)/python -m bench.stress --runs $(N)

# What a failure costs: a random worker killed every few seconds under --max-restarts against the same run
# without faults, the toy and CIFAR10 small at 3 processes (minutes; docs/faults.md), after what a checkpoint
# save stalls training, in the background and in place (seconds). RECOVERY_ARGS: e.g. --json.
.PHONY: recovery
recovery: setup
	$(BIN)/python -m bench.checkpoint_stall
	$(BIN)/python -m bench.recovery $(RECOVERY_ARGS)

# Everything a GPU box should run first, as one table (runs/gpu-check/<UTC timestamp>/results.md); on a
# machine without CUDA, one line and exit 0. GPU_CHECK_ARGS: e.g. --out DIR.
.PHONY: gpu-check
gpu-check: setup
	$(BIN)/python -m bench.gpu_check $(GPU_CHECK_ARGS)

# TensorBoard over runs/ at http://127.0.0.1:TB_PORT (6006).
tensorboard: setup
	$(BIN)/tensorboard --logdir runs --host 127.0.0.1 --port $(TB_PORT)

# Every run under RUNS_DIR, newest first: status, world, seed, commit, headline metrics, wall time.
# Two runs side by side: .venv/bin/python -m ddp_core.runs --compare RUN RUN
runs: setup
	$(BIN)/python -m ddp_core.runs $(RUNS_DIR)

# A new experiment from ddp_core's template: `make new-experiment NAME=mine` writes experiments/mine.py
# (docs/new-experiment.md). NAME is checked when the Makefile is read: a missing one is one line, exit 2.
ifneq ($(filter new-experiment,$(MAKECMDGOALS)),)
ifeq ($(strip $(NAME)),)
$(error NAME is missing: make new-experiment NAME=mine writes experiments/mine.py)
endif
endif
new-experiment: setup
	@$(BIN)/python -m ddp_core.new "$$NAME"

# The contract of experiments.$(EXPERIMENT) at 1, 2 and 3 CPU processes: one PASS/FAIL line per property.
# ARGS go to every run (e.g. ARGS="--data-dir data" for cifar10); CONTRACT_ARGS to the checker (--only resume).
contract: setup
	$(BIN)/python -m tools.contract experiments.$(EXPERIMENT) $(CONTRACT_ARGS) $(if $(strip $(ARGS)),-- $(ARGS))

# docs/reference.md from the code (tools/reference.py); tests/unit/test_reference.py checks it.
reference: setup
	$(BIN)/python -m tools.reference

# Removes .venv, pytest's cache and the bytecode the suite wrote.
clean:
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
