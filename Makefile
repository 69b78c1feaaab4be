# Two commands: `make demo` and `make test`. Both create .venv in the repo root when it is missing.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-slow gpu-check gpu-wheels lint venv clean

venv: $(STAMP)

# The repository's own package (grit, grit_io) goes in too, editable: the examples import it from anywhere.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) demo.py

# Two workers, a test file each at a time (module fixtures build once per file).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadfile

# The slow tests (about 75 min here): the downstream chain from a tiny pre-training must beat chance on
# held-out splits; the 3-seed GRIT vs random-batch comparison and, from 36-epoch GRIT pre-trainings, its
# downstream chain (issue 11; test_grit_helps alone took 56 min next to other runs); the micro pipelines
# of tools.efficiency and tools.ablate's tables 2 and 5, inductor in the GPU tests' CPU mode, the SIGTERM
# run requeued on three processes. docs/testing.md says what runs where.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# Everything CUDA-specific (tools/gpu_check.py): the GPU-marked tests, the step benchmark at the paper's
# sizes, GRIT's grouping cost, a tiny pre-training on the GPU; one JSON report. Without CUDA: skips, exit 0.
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check

# For a CUDA machine without a package registry (docs/speed-and-scale.md, "The GPU check"): the packages the
# GPU check needs beyond torch and numpy, at this venv's versions, as wheels for CPython 3.12 on x86-64 in
# .whl/ (about 19 MB). There: pip install --no-index --no-deps --target /tmp/site .whl/*.whl, then
# PYTHONPATH=/tmp/site python3 -m tools.gpu_check --quick.
GPU_WHEELS := transformers tokenizers huggingface_hub ruamel.yaml wids webdataset braceexpand timm
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $$($(PY) -c "import importlib.metadata as m; \
		print(' '.join(f'{p}=={m.version(p)}' for p in '$(GPU_WHEELS)'.split()))")

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf output/demo data/synthetic
