"""The project as a library: the wheel `pip` builds from pyproject.toml holds the project's own names
alone, `grit` and its file reader `grit_io`; it installs into an empty folder and imports from another
directory in a fresh interpreter that cannot see the repository nor import the training stack (timm,
transformers, torchvision, ...); and examples/clip_grit.py (a CLIP loop with GritSampler, nothing of
models/) runs from another working directory with only the installed package on the path, its GRIT
batches harder than random ones."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import HANG_GUARD_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["pyproject.toml", "grit", "grit_io.py", "models", "dataset", "training", "tools", "Pretrain.py",
           "README.md"]
# What the training code imports and the library must not: the repository's other packages and the
# training stack beyond torch and numpy.
BLOCKED = ("models", "dataset", "training", "tools", "files", "timm", "transformers", "torchvision", "wids",
           "webdataset", "ruamel", "PIL", "tqdm", "matplotlib")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel `pip wheel` builds from a copy of the sources (the build writes into its source folder)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--no-build-isolation", "--wheel-dir", str(out), str(src)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = [os.path.join(out, f) for f in os.listdir(out) if f.endswith(".whl")]
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> str:
    """The wheel installed into an empty folder: the folder."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                           str(target), wheel], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(target)


def _env(site: str) -> dict:
    """Only the installed packages on the path: not the repository (no PYTHONPATH to it, another cwd)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, PYTHONPATH=site, OMP_NUM_THREADS="1")


def test_the_wheel_installs_only_the_projects_own_names(wheel, installed):
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"grit", "grit_io.py"}, tops
    assert {f"grit/strategies/{m}.py" for m in ("__init__", "grit", "b3", "gcbs", "rwr", "_graph")} <= set(
        z.namelist())  # every batch-construction strategy ships with the sampler
    names = {n for n in os.listdir(installed) if not n.endswith(".dist-info")}
    assert names - {"__pycache__"} == {"grit", "grit_io.py"}, names
    # pip compiles the top-level module into __pycache__ beside it: that one module's bytecode only
    assert all(n.startswith("grit_io.") for n in os.listdir(os.path.join(installed, "__pycache__")))


def test_grit_imports_alone_in_a_fresh_interpreter(installed, tmp_path):
    """Outside the repository, with every import of the training stack refused: grit imports, its sampler
    deals an epoch and reads a warm-start index array (grit_io)."""
    code = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Refuse())
import json, torch, grit
from grit import GritSampler, load_index_array
with open("order.json", "w") as f:
    json.dump(list(range(23, -1, -1)), f)
s = GritSampler(24, num_replicas=1, rank=0, batch_size=4, queue_size=12, search_space=8, dim=8,
                warmstart_indices="order.json")
s.set_epoch(0)
array = load_index_array("order.json", 24).tolist()
print(json.dumps({{"file": grit.__file__, "epoch": list(s), "array": array}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=_env(installed),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["file"].startswith(installed) and out["array"] == list(range(23, -1, -1))
    # the warm-start epoch: every index once, each batch a chunk of 4 of the array (chunk order shuffled)
    batches = [out["epoch"][i:i + 4] for i in range(0, 24, 4)]
    assert sorted(out["epoch"]) == list(range(24))
    assert all(b == list(range(b[0], b[0] - 4, -1)) and b[0] % 4 == 3 for b in batches), batches


def test_clip_example_runs_after_install_and_its_grit_batches_are_harder(installed, tmp_path, in_repo):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "clip_grit.py"), "--data",
                           os.path.join(ROOT, "data", "synthetic")], cwd=str(tmp_path), env=_env(installed),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hardness of its batches" in proc.stdout
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["batch_hardness"]
    assert len(rows) == 8
    assert abs(rows[0]["grit_batches"] - rows[0]["random_batches"]) < 0.02  # epoch 0: random in both
    # from the third epoch on, the groups GRIT formed are harder than random batches under the same weights
    for row in rows[3:]:
        assert row["grit_batches"] > row["random_batches"] + 0.05, row


def test_the_clip_example_takes_another_strategy_by_one_flag(installed, tmp_path, in_repo):
    """The same loop with B3's communities (grit.strategies.b3, scipy and pymetis from the environment):
    its batches too are harder than random ones under the same weights once the features carry
    information."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "clip_grit.py"), "--data",
                           os.path.join(ROOT, "data", "synthetic"), "--strategy", "b3", "--epochs", "4"],
                          cwd=str(tmp_path), env=_env(installed), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["strategy"] == "b3"
    for row in out["batch_hardness"][2:]:
        assert row["grit_batches"] > row["random_batches"] + 0.03, row
