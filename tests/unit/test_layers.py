"""The layer rule of docs/architecture.md, checked on the source: every import of a slime module inside
`slime/` goes to the importer's own layer or to one the table lets it import, no slime module imports a facade
(slime's import paths kept for plugins, which only re-export), no import cycle exists between files, and no
slime module is imported inside a function (the usual way to hide a cycle)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO_ROOT, "slime")

# (layer, module prefixes, layers it may import besides itself): the table of docs/architecture.md.
LAYERS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("floor", ("slime.utils",), ()),
    ("algorithm", ("slime.algorithm",), ("floor",)),
    ("weight sync", ("slime.weight_sync",), ("floor",)),
    ("engines", ("slime.backends.server_engine", "slime.backends.hf_engine", "slime.backends.sglang_utils"),
     ("floor", "weight sync")),
    ("observability", ("slime.observability",), ("floor", "algorithm")),
    ("training", ("slime.backends.training", "slime.backends.fsdp_utils", "slime.backends.megatron_utils"),
     ("floor", "algorithm", "weight sync", "observability")),
    ("rollout", ("slime.rollout",), ("floor", "algorithm")),
    # slime.agent: the coding-agent plugins' adapters, trajectories, sandboxes and harnesses (rollout-side).
    ("agent", ("slime.agent",), ("floor",)),
    ("orchestration", ("slime.ray",),
     ("floor", "algorithm", "weight sync", "engines", "training", "rollout", "observability")),
    ("configuration", ("slime.config",),
     ("floor", "algorithm", "weight sync", "engines", "training", "rollout", "orchestration", "observability")),
]
# Facades: modules at slime's import paths whose code lives in a layer's folder; they only re-export it, may import
# any layer, and no slime module imports them (plugins written for slime do).
FACADES = ("slime.utils.ppo_utils", "slime.utils.dp_schedule", "slime.utils.arguments",
           "slime.backends.megatron_utils.cp_utils")
LAYERS.append(("facades", FACADES, tuple(name for name, _, _ in LAYERS)))
# Package markers that import nothing and belong to no layer of their own.
NEUTRAL = {"slime", "slime.backends"}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    path: str
    line: int
    in_function: bool


def module_files(root: str = PACKAGE) -> dict[str, str]:
    """slime module name -> file path."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(root)).replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def _resolve(modules: dict[str, str], importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The slime modules an import statement loads (a `from pkg import name` naming a module counts as it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".")
            if not modules[importer].endswith("__init__.py"):
                package = package[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name.startswith("slime"):
            found.append(name)
    return found


def imports_of(modules: dict[str, str]) -> list[Import]:
    out = []
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _resolve(modules, module, child):
                        if target != module:
                            out.append(Import(module, target, path, child.lineno, in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
    return out


def layer_of(module: str) -> str | None:
    """The layer whose longest prefix matches `module` (so slime.utils.arguments is configuration, not floor)."""
    matches = [(len(p), name) for name, prefixes, _ in LAYERS for p in prefixes
               if module == p or module.startswith(p + ".")]
    return max(matches)[1] if matches else None


def violations(imports: list[Import]) -> list[str]:
    allowed = {name: set(below) | {name} for name, _, below in LAYERS}
    problems = []
    for imp in imports:
        src, dst = layer_of(imp.importer), layer_of(imp.target)
        if imp.importer in NEUTRAL or imp.target in NEUTRAL:
            continue
        if dst == "facades":
            problems.append(f"{os.path.relpath(imp.path, REPO_ROOT)}:{imp.line}: {imp.importer} imports the facade "
                            f"{imp.target} (slime's path, kept for plugins); import the module it re-exports from")
        elif dst not in allowed[src]:
            problems.append(f"{os.path.relpath(imp.path, REPO_ROOT)}:{imp.line}: {imp.importer} ({src}) imports "
                            f"{imp.target} ({dst}); {src} may import only {sorted(allowed[src])}")
    return problems


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        # a package's __init__ importing its own submodules is how packages re-export; not a cycle of files
        if not imp.target.startswith(imp.importer + "."):
            graph.setdefault(imp.importer, set()).add(imp.target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, str], list[Import]]:
    modules = module_files()
    return modules, imports_of(modules)


def test_every_module_has_a_layer(graph):
    modules, _ = graph
    missing = sorted(m for m in modules if m not in NEUTRAL and layer_of(m) is None)
    assert not missing, f"modules in no layer of docs/architecture.md (add them to a layer's folder): {missing}"


def test_no_import_runs_upward(graph):
    _, imports = graph
    problems = violations(imports)
    assert not problems, "imports against the layer rule of docs/architecture.md:\n" + "\n".join(problems)


def test_no_import_cycle_between_files(graph):
    _, imports = graph
    assert not cycles(imports), f"import cycles between files: {cycles(imports)}"


def test_no_slime_import_inside_a_function(graph):
    _, imports = graph
    inside = [f"{os.path.relpath(i.path, REPO_ROOT)}:{i.line}: {i.target}" for i in imports if i.in_function]
    assert not inside, "slime modules imported inside functions (import them at the top; a cycle or an upward " \
                       "import is what usually makes one move there):\n" + "\n".join(inside)


def test_facades_exist_and_only_re_export(graph):
    """A facade's body is its docstring, imports and `__all__`: the code it offers lives in a layer's folder."""
    modules, _ = graph
    problems = []
    for facade in FACADES:
        if facade not in modules:
            problems.append(f"{facade}: listed as a facade but no such module")
            continue
        with open(modules[facade]) as f:
            tree = ast.parse(f.read(), modules[facade])
        for i, node in enumerate(tree.body):
            docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            exported = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
            # the name made an alias of its home module (what is set on it is what the code reads), and for
            # sglang_rollout the training / eval rollouts' names added to that module
            alias = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["sys.modules[__name__]"]
            added = isinstance(node, ast.Expr) and ast.unparse(node).startswith("vars(generation).update(")
            if not (docstring or exported or alias or added or isinstance(node, (ast.Import, ast.ImportFrom))):
                problems.append(f"{os.path.relpath(modules[facade], REPO_ROOT)}:{node.lineno}: a facade only "
                                "re-exports; move this into the module it re-exports from")
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_look_for():
    """The rule itself: an upward import, a cycle and an in-function import are each reported."""
    upward = Import("slime.utils.misc", "slime.ray.rollout", "slime/utils/misc.py", 1, False)
    assert violations([upward]) and "floor" in violations([upward])[0]
    sideways = Import("slime.backends.hf_engine.server", "slime.backends.fsdp_utils.actor", "x.py", 1, False)
    assert violations([sideways])
    down = Import("slime.ray.rollout", "slime.utils.misc", "slime/ray/rollout.py", 1, False)
    assert not violations([down])
    # a facade may import any layer, but no slime module may import a facade, even from the floor
    assert not violations([Import("slime.utils.arguments", "slime.config.arguments", "slime/utils/arguments.py", 1,
                                  False)])
    into_facade = violations([Import("slime.algorithm.loss", "slime.utils.ppo_utils", "slime/algorithm/loss.py", 33,
                                     False)])
    assert into_facade and into_facade[0].startswith("slime/algorithm/loss.py:33: ")
    assert violations([Import("slime.utils.misc", "slime.utils.ppo_utils", "slime/utils/misc.py", 2, False)])
    assert layer_of("slime.utils.dp_schedule") == "facades" and layer_of("slime.utils.types") == "floor"
    loop = [Import("slime.a", "slime.b", "a.py", 1, False), Import("slime.b", "slime.a", "b.py", 1, False)]
    assert cycles(loop) == [["slime.a", "slime.b"]]
