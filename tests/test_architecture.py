"""The package map in docs/architecture.md is the code's: each package imports only what the map allows, and no
module of ``raytrain_eks`` imports itself back through others (no import cycles). The test reads every import
statement, including those inside functions, so a lazy import cannot slip past the map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "raytrain_eks"
PKG = "raytrain_eks"


def package_map() -> dict[str, set[str]]:
    """``unit -> units it may import`` from docs/architecture.md's fenced block under '## Architecture'."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Architecture", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/architecture.md's Architecture section has no ```text block with the package map"
    rules: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        if "->" not in line:
            continue
        unit, _, allowed = line.partition("->")
        allowed = allowed.split("#", 1)[0].strip()
        rules[unit.strip()] = set() if allowed in ("", "-") else {a.strip() for a in allowed.split(",")}
    return rules


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """The ``raytrain_eks`` modules that ``path`` imports (``from x import y`` counts ``x.y`` when it is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PKG}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != PKG:
                continue
            found.add(mod)
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
    found.discard(here)
    return {m for m in found if m in MODULES}


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def unit_of(module: str, rules: dict[str, set[str]]) -> str:
    """The map's unit holding ``module``: its package or top-level module under raytrain_eks."""
    parts = module.split(".")
    if len(parts) == 1:
        return PKG
    unit = parts[1]
    assert unit in rules, f"{module}: '{unit}' is not in docs/architecture.md's package map; add it with its imports"
    return unit


def test_every_package_imports_only_what_the_map_allows():
    rules = package_map()
    problems = []
    for mod, path in sorted(MODULES.items()):
        unit = unit_of(mod, rules)
        if unit == PKG:  # the package's __init__: its version, nothing else
            continue
        allowed = rules[unit]
        if "*" in allowed:
            continue
        for dep in sorted(imports_of(path)):
            dep_unit = unit_of(dep, rules)
            if dep_unit in (unit, PKG):
                continue
            if dep_unit not in allowed:
                problems.append(f"{mod} imports {dep}: '{unit}' may import only {sorted(allowed) or 'nothing'}")
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    graph = {mod: imports_of(path) for mod, path in MODULES.items()}
    # A package's __init__ importing its own modules is how a package exposes them, not a cycle.
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not mod.startswith(d + ".")}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_map_names_only_packages_that_exist():
    rules = package_map()
    units = {unit_of(m, rules) for m in MODULES} - {PKG}
    assert set(rules) <= units, sorted(set(rules) - units)


def test_no_module_is_too_long_to_read():
    long = {mod: n for mod, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 900}
    assert not long, f"split these along their seams: {long}"


def test_the_shipped_package_holds_no_test_fakes():
    from raytrain_eks.k8s.job import package_files

    assert not [name for name in package_files() if "fake" in name.rsplit("/", 1)[-1]]
