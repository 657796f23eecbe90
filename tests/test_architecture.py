"""The shape of the tree as tests: the dependency order of the folders (.importlinter), no import cycle between files,
no source file over 600 lines, and a repository that explains itself (no pointer outside it).

import-linter reads a package from its folder, and minite.kernels / minite.megatron_patches live in the top-level
kernels/ and megatron_patches/ (setup.py's package_dir), so the tests copy the three folders into the layout they
have once installed and point the linter at the copy.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("minite", "kernels", "megatron_patches", "tools", "tests", "examples")


def _installed_layout(dest: Path) -> Path:
    tree = dest / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")

    def ignore_links(folder: str, names: list) -> set:
        # the links minite/kernels and minite/megatron_patches that tools/gpu_acceptance.sh makes in a checkout
        # (git ignores them) would collide with the copies below
        links = {"kernels", "megatron_patches"} if Path(folder) == ROOT / "minite" else set()
        return set(ignore(folder, names)) | (links & set(names))

    shutil.copytree(ROOT / "minite", tree / "minite", ignore=ignore_links)
    shutil.copytree(ROOT / "kernels", tree / "minite" / "kernels", ignore=ignore)
    shutil.copytree(ROOT / "megatron_patches", tree / "minite" / "megatron_patches", ignore=ignore)
    return tree


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(ROOT / ".importlinter")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def _lint_cmd_available() -> bool:
    try:
        import importlinter.cli  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _lint_cmd_available(), reason="import-linter is not installed (tools/setup.sh "
                                                                    "installs it with the dev extra)")


def test_layers_contract_is_kept(tmp_path):
    out = _lint(_installed_layout(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract can fail: the format importing the RL loop (the top layer) must be reported."""
    tree = _installed_layout(tmp_path)
    victim = tree / "minite" / "nvfp4" / "tensor.py"
    victim.write_text(victim.read_text() + "\n\ndef _upward():\n    from minite.rl import loop  # noqa: F401\n")
    out = _lint(tree)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "minite.nvfp4.tensor -> minite.rl.loop" in out.stdout


def _import_graph(tree: Path) -> dict[str, set[str]]:
    code = ("import grimp, json; g = grimp.build_graph('minite'); "
            "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, timeout=300, check=True)
    import json
    return {m: set(deps) for m, deps in json.loads(out.stdout).items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop(); on_stack.discard(m); comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_between_files(tmp_path):
    cycles = _cycles(_import_graph(_installed_layout(tmp_path)))
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _source_files():
    for folder in SOURCE_DIRS:
        yield from (p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_source_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in _source_files() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by role: {long}"


def test_the_repository_points_nowhere_outside_itself():
    """Facts the code relies on live in docs/, not in a file beside the checkout."""
    outside = ("../" + "shared", "shared/" + "NOTES", "shared/" + "STYLE", "NOTES" + ".md")  # split: no self-match
    pattern = re.compile("|".join(re.escape(p) for p in outside))
    other = [p for folder in ("tools", ".ci", "examples") for p in (ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in (".sh", ".txt", ".yaml", ".sbatch", "") and "__pycache__" not in p.parts]
    files = list(_source_files()) + other + list((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, f"pointers outside the repository: {hits}"
