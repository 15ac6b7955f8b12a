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


def _top_level_names(path: Path) -> set[str]:
    """What a module defines itself: its functions, classes and assigned names (those under ``if``/``try`` too)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for sub in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
            if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(sub.name)
            elif isinstance(sub, ast.Assign | ast.AnnAssign):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_name_is_imported_from_the_module_that_defines_it():
    """No re-export shim: a name is imported from where it is defined, not through a module that imports it
    itself (a package's ``__init__``, its public surface, aside), in the package, its tests and its scripts."""
    defined = {mod: _top_level_names(path) for mod, path in MODULES.items()}
    files = [*SRC.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    through = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module in MODULES):
                continue
            if MODULES[node.module].name == "__init__.py":
                continue
            for alias in node.names:
                if f"{node.module}.{alias.name}" not in MODULES and alias.name not in defined[node.module]:
                    through.append(f"{path.relative_to(ROOT)}: {alias.name} through {node.module}")
    assert not through, "import these from the module that defines them:\n" + "\n".join(through)


# Each cluster target lives in a package of its own; the code every target shares reaches one only through the
# registry, which imports it by name.
TARGET_PACKAGES = {"eks", "kubernetes"}
# Where a target's name may be compared: the targets, and the configuration's check of each target's settings.
NAME_CHECKS_ALLOWED = {"config_cluster", "config_layers"}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PKG


def test_no_code_outside_the_targets_imports_a_target_package():
    problems = [
        f"{mod} imports {dep}"
        for mod, path in sorted(MODULES.items())
        if _unit(mod) not in TARGET_PACKAGES
        for dep in sorted(imports_of(path))
        if _unit(dep) in TARGET_PACKAGES
    ]
    assert not problems, "ask the target (raytrain_eks.deploy.target.target_for) instead:\n" + "\n".join(problems)


def test_the_registry_names_every_target_the_config_accepts_and_its_package():
    from typing import get_args

    from raytrain_eks.config_cluster import ClusterConfig
    from raytrain_eks.targets import IMPLEMENTATIONS

    assert set(IMPLEMENTATIONS) == set(get_args(ClusterConfig.model_fields["target"].annotation))
    for name, (module, _) in IMPLEMENTATIONS.items():
        assert _unit(module) in TARGET_PACKAGES, f"{name}: {module} is not in a target package"


def _names_a_target(node: ast.AST, names: set[str]) -> bool:
    """A string literal (or a tuple, list or set of them) naming a target."""
    if isinstance(node, ast.Constant):
        return node.value in names
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(_names_a_target(e, names) for e in node.elts)


def _target_name_branches(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines comparing ``<x>.target`` with a string, or ``<x>.name`` with a target's name, or matching on
    ``<x>.target``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Match) and isinstance(node.subject, ast.Attribute) and node.subject.attr == "target":
            found.append(node.lineno)
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        attrs = {s.attr for s in sides if isinstance(s, ast.Attribute)}
        strings = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
        if ("target" in attrs and strings) or (
            attrs & {"target", "name"} and any(_names_a_target(s, names) for s in sides)
        ):
            found.append(node.lineno)
    return found


def test_no_code_outside_the_targets_branches_on_a_targets_name():
    from raytrain_eks.targets import IMPLEMENTATIONS

    names = set(IMPLEMENTATIONS)
    problems = [
        f"{path.relative_to(ROOT)}:{line}"
        for mod, path in sorted(MODULES.items())
        if _unit(mod) not in TARGET_PACKAGES and mod.rpartition(".")[2] not in NAME_CHECKS_ALLOWED
        for line in _target_name_branches(ast.parse(path.read_text()), names)
    ]
    assert not problems, "put the difference behind the ClusterTarget interface:\n" + "\n".join(problems)


def test_the_branch_check_sees_the_branches_it_forbids():
    names = {"eks", "kubernetes"}
    caught = [
        'if cfg.cluster.target == "eks": pass',
        'x = 1 if c.target != "kubernetes" else 0',
        'if target.name in ("eks",): pass',
        "match cfg.cluster.target:\n    case 'eks': pass",
    ]
    assert all(_target_name_branches(ast.parse(src), names) for src in caught)
    assert not _target_name_branches(ast.parse('if node.name == "gpu-0" or cfg.cluster.target is None: pass'), names)


# `Any` per 1,000 lines of the package (every mention, as `grep -ow Any` counts them), at most. The aim is 10, the
# upper end of typed projects of this kind; lower this as the package's types take the place of `Any`.
ANY_PER_THOUSAND_LINES = 13.0


def test_any_stays_rare_in_the_package():
    texts = {mod: path.read_text() for mod, path in MODULES.items()}
    uses = {mod: len(re.findall(r"\bAny\b", text)) for mod, text in texts.items()}
    lines = sum(len(text.splitlines()) for text in texts.values())
    per_thousand = 1000 * sum(uses.values()) / lines
    most = ", ".join(f"{mod} {n}" for mod, n in sorted(uses.items(), key=lambda kv: -kv[1])[:8])
    assert per_thousand <= ANY_PER_THOUSAND_LINES, (
        f"`Any` {per_thousand:.1f} per 1,000 lines (at most {ANY_PER_THOUSAND_LINES}): say what flows instead (a "
        f"TypedDict, a Protocol, the library's own type, `object` for a value only passed on); most in {most}"
    )
