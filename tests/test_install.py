"""The project as a library: it installs (pip, from pyproject.toml), its packages import from any directory,
and examples/clip_grit.py (a CLIP loop with GritSampler, nothing of models/) runs from another working
directory with only the installed packages on the path, its GRIT batches harder than random ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["pyproject.toml", "files.py", "grit", "models", "dataset", "training", "tools"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """`pip install --target` of a copy of the sources (the build writes into its source folder): the
    folder the packages went to."""
    src, target = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("site")
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--target", str(target), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(target)


def _env(site: str) -> dict:
    """Only the installed packages on the path: not the repository (no PYTHONPATH to it, another cwd)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=site, OMP_NUM_THREADS="1")


def test_packages_import_from_another_directory(installed, tmp_path):
    code = ("import grit, models, dataset, training, tools, files; from grit import GritSampler; "
            "print(grit.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=_env(installed),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(installed)


def test_clip_example_runs_after_install_and_its_grit_batches_are_harder(installed, tmp_path, in_repo):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "clip_grit.py"), "--data",
                           os.path.join(ROOT, "data", "synthetic")], cwd=str(tmp_path), env=_env(installed),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hardness of its batches" in proc.stdout
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["batch_hardness"]
    assert len(rows) == 8
    assert abs(rows[0]["grit_batches"] - rows[0]["random_batches"]) < 0.02  # epoch 0: random in both
    # from the third epoch on, the groups GRIT formed are harder than random batches under the same weights
    for row in rows[3:]:
        assert row["grit_batches"] > row["random_batches"] + 0.05, row
