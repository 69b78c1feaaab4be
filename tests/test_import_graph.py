"""The import graph (every module parsed with ast, nothing imported): no cycle; models/, grit/ and dataset/
import none of each other nor training/; no package imports a script; tools start scripts by module, never
by a file name relative to the working directory."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = {"models", "grit", "dataset"}
SCRIPTS = {"Pretrain", "Retrieval", "NLVR", "VQA", "demo"}
SKIP = {".venv", "tests", "data", "output", "docs", "configs", ".git"}


def project_modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py of the project outside tests/."""
    mods = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return mods


def import_edges(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (relative imports resolved, names mapped to modules)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".") if package else []
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                found = resolve(target)
                if found and found != mod:
                    edges[mod].add(found)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_checker_sees_cycles_and_arrows():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges = import_edges(project_modules())
    assert {"training.cli", "training.checkpoints"} <= edges["training.trainer"]
    assert "grit.sampler" in edges["grit"]  # a package's __init__ importing its modules


def test_no_import_cycle():
    assert cycles(import_edges(project_modules())) == []


def test_core_packages_import_none_of_each_other_nor_training_and_no_package_imports_a_script():
    bad = []
    for mod, targets in import_edges(project_modules()).items():
        top = mod.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if top in CORE and other != top and (other in CORE or other == "training"):
                bad.append(f"{mod} -> {target}")
            if "." in mod and target in SCRIPTS:
                bad.append(f"{mod} -> {target} (a script)")
    assert bad == []


def test_tools_start_scripts_by_module_not_by_file_name():
    mods = project_modules()
    bad = []
    for mod, path in mods.items():
        if not (mod.startswith("tools") or mod == "demo"):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value in {f"{s}.py" for s in SCRIPTS}:
                bad.append(f"{mod}: {node.value!r}")
    assert bad == []
