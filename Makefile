# Two commands: `make demo` and `make test`. Both create .venv in the repo root when it is missing.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-slow gpu-check lint venv clean

venv: $(STAMP)

$(STAMP): requirements.txt
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) demo.py

# Two workers, a test file each at a time (module fixtures build once per file): 8 min -> 5 min here.
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadfile

# The slow tests (about 70 min here): the downstream chain from a tiny pre-training must beat chance on
# held-out splits; the 3-seed GRIT vs random-batch comparison and, from 36-epoch GRIT pre-trainings, its
# downstream chain (issue 11; test_grit_helps alone took 56 min next to other runs).
test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# Everything CUDA-specific (tools/gpu_check.py): the GPU-marked tests, the step benchmark at the paper's
# sizes, GRIT's grouping cost, a tiny pre-training on the GPU; one JSON report. Without CUDA: skips, exit 0.
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf output/demo data/synthetic
