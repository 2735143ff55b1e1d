"""The package's import structure: folders that are layers, no circle, no upward import.

Read from the source with ``ast`` (nothing is imported): every ``geoscale_fx`` module lives
in one of ``FOLDERS`` (bottom-up) or at the package's top; a module imports only modules of
its own folder or of a folder below, only at the top of its file, and the imports form no cycle. ``if TYPE_CHECKING:`` blocks
are ignored (they never run). Third-party modules may be imported inside a function only
when they are optional or missing from some torch builds (``LAZY_THIRD_PARTY``).

Run ``python tests/test_layering.py`` for the module graph's numbers (cycles, imports below
module level, upward edges).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "geoscale_fx"

#: The package's folders, bottom-up: a module imports only from its own folder (subfolders
#: included) or from a folder below it. Modules at the package's top (``cli``, ``__main__``)
#: sit above every folder. A new module needs no edit here; a new folder does.
FOLDERS = (
    "core",        # math on numbers and tensors: bounds, formats, spectral norms
    "testing",     # models at test size: shrunk Hugging Face configs, the paper's models
    "sites",       # plain data: the attention site, its terms, its scaling state
    "options",     # GeoscaleOptions, recipes, the rules between options
    "numerics",    # per-site numerics: head weights, logit and q/k/v entry bounds, estimators
    "kernels",     # the attention the rewritten graph calls (FP8 logits, FP8 q/k/v)
    "planning",    # plans and the per-step scaling policies
    "analysis",    # capture and the FX analysis: sites traced back to the weights
    "runtime",     # the host side of a compiled graph: refresh, change records, key trust
    "kv_cache",    # KV-cache scales from the weights, FP8/NVFP4 cache layers, generate's cache
    "compile",     # the rewrite, ATen traces and their cache, the backend, attachment
    "api",         # what users call on a model: apply_, wrap, blocks, calibrate, report, state
    "export",      # scales for serving engines, from live models or saved checkpoints
    "",            # the package's top: the command line
)
RANK = {folder: rank for rank, folder in enumerate(FOLDERS)}
#: most modules a folder (its subfolders apart) may hold
FOLDER_LIMIT = 15


def folder_of(module: str) -> str:
    """``"analysis.fx.graph_ops"`` -> ``"analysis"``; a top-level module -> ``""``."""
    return module.split(".")[0] if "." in module else ""


#: Third-party modules a library function may import when it runs, and why not at the top.
LAZY_THIRD_PARTY = {
    "transformers": "optional: the [zoo] and [hf] extras",
    "safetensors": "optional: the [hf] extra",
    "torch.distributed": "absent from torch builds without distributed support; only tensor "
                         "parallelism and DCP checkpoints need it",
    "torch.nn.attention": "FA3's FP8 entry points exist in some torch builds only (the "
                          "import is the availability check)",
    "torch._inductor": "loaded only when compiler='inductor' compiles a graph (slow to import)",
}

#: Repository tools that the installed library must never import.
REPOSITORY_TOOLS = {"models_zoo", "bench"}


@dataclass(frozen=True)
class Import:
    module: str        # importing module, relative to the package ("compile.rewrite")
    target: str        # imported module, absolute ("geoscale_fx.numerics.logit_bounds", "torch.fx")
    line: int
    top: bool          # a statement of the module body itself


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{"compile.rewrite": (path, is_package)}``; the package itself is ``""``."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(node: ast.stmt, module: str, is_package: bool, known: set[str]) -> list[str]:
    """Absolute names of the modules ``node`` imports, each once: ``from geoscale_fx import
    logit_bounds`` imports the module ``geoscale_fx.numerics.logit_bounds``, ``from
    geoscale_fx.numerics.logit_bounds import f, g`` the module ``geoscale_fx.numerics.logit_bounds``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = ["geoscale_fx", *module.split(".")] if module else ["geoscale_fx"]
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    return list(dict.fromkeys(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known
                              else base for alias in node.names))


def _imports(module: str, source: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import statement of a module's source outside ``if TYPE_CHECKING:``."""
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(module, t, child.lineno, top)
                             for t in _targets(child, module, is_package, known))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
            else:
                visit(child, False)

    visit(ast.parse(source), True)
    return found


def _all_imports() -> list[Import]:
    modules = _modules()
    known = {f"geoscale_fx.{m}" if m else "geoscale_fx" for m in modules}
    return [imp for m, (path, is_package) in modules.items()
            for imp in _imports(m, path.read_text(), is_package, known)]


def _internal(target: str) -> str | None:
    """The package module ``target`` names (relative), or None for a third-party one."""
    if target == "geoscale_fx":
        return ""
    return target[len("geoscale_fx."):] if target.startswith("geoscale_fx.") else None


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in _modules()}
    for imp in imports:
        target = _internal(imp.target)
        if target is not None and target != imp.module:
            graph[imp.module].add(target)
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of one module without a self-edge are
    left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
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
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return components


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module: ``[a, b, …, a]``."""
    start = component[0]
    members = set(component)
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        if start in nxt and len(path) > 1 or nxt == [start]:
            return [*path, start]
        step = next((n for n in nxt if n not in seen), None)
        if step is None:       # dead end inside the component: back up
            path.pop()
            continue
        path.append(step)
        seen.add(step)


def _nested_internal(imports: list[Import]) -> list[str]:
    return [f"{imp.module}:{imp.line} imports {imp.target}" for imp in imports
            if not imp.top and _internal(imp.target) is not None]


def _lazy_allowed(target: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in LAZY_THIRD_PARTY)


def _upward(imports: list[Import]) -> list[str]:
    edges = set()
    for imp in imports:
        target = _internal(imp.target)
        if not target or target == imp.module:
            continue
        mine, theirs = folder_of(imp.module), folder_of(target)
        if mine in RANK and theirs in RANK and RANK[theirs] > RANK[mine]:
            edges.add(f"{imp.module} ({mine or 'top'}) imports {target} ({theirs or 'top'})")
    return sorted(edges)


# ---- the checks ------------------------------------------------------------------------

def test_the_package_has_no_import_cycle():
    graph = _graph(_all_imports())
    cycles = [" -> ".join(_cycle_in(c, graph)) for c in strongly_connected_components(graph)]
    assert cycles == []


def test_tarjan_finds_a_cycle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert strongly_connected_components(graph) == [["a", "b", "c"], ["e"]]
    assert _cycle_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert strongly_connected_components({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_only_at_module_level():
    imports = _all_imports()
    assert _nested_internal(imports) == []
    lazy = sorted(f"{imp.module}:{imp.line} imports {imp.target}" for imp in imports
                  if not imp.top and _internal(imp.target) is None
                  and not _lazy_allowed(imp.target))
    assert lazy == []


def test_every_lazy_third_party_reason_is_still_used():
    used = {p for imp in _all_imports() if not imp.top for p in LAZY_THIRD_PARTY
            if imp.target == p or imp.target.startswith(p + ".")}
    assert used == set(LAZY_THIRD_PARTY)


def test_the_import_scan_sees_nested_and_type_checking_imports():
    """On made-up module names (``layer.x`` importing its sibling and ``low.bound``)."""
    known = {"geoscale_fx", "geoscale_fx.low.bound", "geoscale_fx.layer",
             "geoscale_fx.layer.ops"}
    source = ("from typing import TYPE_CHECKING\nfrom geoscale_fx.low import bound\n"
              "from . import ops\nif TYPE_CHECKING:\n    import geoscale_fx.cli\n"
              "else:\n    import os\nclass C:\n    import json\n"
              "def f():\n    from geoscale_fx.low.bound import g\n")
    found = _imports("layer.x", source, False, known)
    assert [(i.target, i.line, i.top) for i in found] == [
        ("typing", 1, True), ("geoscale_fx.low.bound", 2, True),
        ("geoscale_fx.layer.ops", 3, True), ("os", 7, False), ("json", 9, False),
        ("geoscale_fx.low.bound", 11, False)]
    assert _nested_internal(found) == ["layer.x:11 imports geoscale_fx.low.bound"]


def test_package_inits_import_nothing_of_the_package():
    """Importing any submodule runs its packages' ``__init__``: they stay lazy, so they add
    no hidden edge to the graph (``geoscale_fx.__getattr__`` loads the public names)."""
    inits = [m for m, (_, is_package) in _modules().items() if is_package]
    assert "" in inits and len(inits) > 1
    imports = [imp for imp in _all_imports() if imp.module in inits]
    assert [i for i in imports if _internal(i.target) is not None] == []


def test_every_module_is_in_a_known_folder_and_no_folder_is_crowded():
    modules = {m for m, (_, is_package) in _modules().items() if not is_package}
    assert sorted(m for m in modules if folder_of(m) not in RANK) == []
    assert {folder_of(m) for m in modules} == set(FOLDERS)
    per_folder: dict[str, int] = {}
    for m in modules:
        per_folder[m.rpartition(".")[0]] = per_folder.get(m.rpartition(".")[0], 0) + 1
    assert {f: n for f, n in per_folder.items() if n > FOLDER_LIMIT} == {}


def test_every_folder_says_what_it_holds():
    """Each package ``__init__`` has a docstring (what it holds; the top folders also what
    they may import)."""
    for module, (path, is_package) in _modules().items():
        if is_package and module:
            doc = ast.get_docstring(ast.parse(path.read_text()))
            assert doc and len(doc.split()) >= 10, f"{module}/__init__.py says nothing"
            if "." not in module:
                assert "import" in doc.lower(), f"{module}/__init__.py: what may it import?"


def test_no_module_imports_a_higher_layer():
    assert _upward(_all_imports()) == []


def test_a_higher_layer_import_is_reported():
    imports = [Import("numerics.logit_bounds", "geoscale_fx.compile.dynamo_backend", 1, True),
               Import("compile.dynamo_backend", "geoscale_fx.numerics.logit_bounds", 2, True),
               Import("analysis.fx.graph_ops", "geoscale_fx.analysis.capture", 3, True),
               Import("core.fp8", "geoscale_fx.cli", 4, True)]
    assert _upward(imports) == [
        "core.fp8 (core) imports cli (top)",
        "numerics.logit_bounds (numerics) imports compile.dynamo_backend (compile)"]


# ---- the installed library never imports the repository's tools ------------------------

def _imported_top_level(source: str) -> set[str]:
    """Top-level packages a module imports: import statements, and ``importlib.import_module``
    / ``__import__`` of a literal name."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) \
                and getattr(node.func, "attr", getattr(node.func, "id", None)) \
                in ("import_module", "__import__"):
            names.add(node.args[0].value.split(".")[0])
    return names


def test_the_tool_import_scan_sees_every_form():
    source = ("import models_zoo\nfrom bench.runner import run\nimport os, bench.lms\n"
              "def f():\n    import importlib\n    importlib.import_module('models_zoo.x')\n"
              "    __import__('bench')\n")
    assert _imported_top_level(source) == {"models_zoo", "bench", "os", "importlib"}
    assert _imported_top_level("from . import capture\nx = 'models_zoo'\n") == set()


def test_library_never_imports_models_zoo_or_bench():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    offenders = {str(f.relative_to(PACKAGE)): sorted(_imported_top_level(f.read_text())
                                                     & REPOSITORY_TOOLS)
                 for f in files}
    assert {f: names for f, names in offenders.items() if names} == {}


if __name__ == "__main__":
    found = _all_imports()
    module_graph = _graph(found)
    components = strongly_connected_components(module_graph)
    print(f"import cycles: {len(components)} (sizes {[len(c) for c in components]})")
    for c in components:
        print("  " + " -> ".join(_cycle_in(c, module_graph)), f"(component of {len(c)})")
    nested = _nested_internal(found)
    print(f"package imports below module level: {len(nested)}")
    print("".join(f"  {n}\n" for n in nested), end="")
    upward = _upward(found)
    print(f"upward imports: {len(upward)}")
    print("".join(f"  {u}\n" for u in upward), end="")
    sys.exit(1 if components or nested or upward else 0)
