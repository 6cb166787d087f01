"""The package's layout, read from the source (AST: no framework is imported): dependencies run one way.

- the framework-free core imports no framework (torch, mindspore), at module or function level;
- no import circle among the library's modules (module-level imports), and no function-level import that
  closes one (a "back-edge") beyond the ones listed with their reason;
- nothing in the library outside ``tools/`` imports ``collective_ops.tools``;
- ``collective_ops.torch`` never imports ``collective_ops.mindspore``, nor the reverse;
- a private torch or MindSpore name (``torch.x._y``, ``from mindspore... import _z``, an attribute the
  frameworks keep private, ``sys._getframe``) only in that framework's ``_compat.py``.

Modules are split by concept, not by a line count: there is no size cap.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "collective_ops"
FRAMEWORKS = ("torch", "mindspore")

# The framework-free core: packages (every module under them) and modules.
CORE_PACKAGES = ("collective_ops.bucketing",)
CORE_MODULES = (
    "collective_ops.adapter",
    "collective_ops.comm",
    "collective_ops.comm.base",
    "collective_ops.comm.measure",
    "collective_ops.consistency",
    "collective_ops.ddp_keywords",
    "collective_ops.frameworks",
    "collective_ops.online_tune",
    "collective_ops.ops",
    "collective_ops.options",
)

# Function-level imports that close an import circle or cross between the framework packages, with the reason
# each is there for now (importer, imported) -> reason.
ALLOWED_BACK_EDGES: dict[tuple[str, str], str] = {}

ALLOWED_CROSSINGS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a library module, or an outside top-level name (torch, numpy, ...)
    line: int
    in_function: bool


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def library_files(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement under ``node``, with whether it runs inside a function (``if TYPE_CHECKING:``
    blocks skipped: they never run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield from _walk_one(other, in_function)
            continue
        yield from _walk_one(child, in_function)


def _walk_one(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.AST, bool]]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, in_function
        return
    inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
    yield from _walk(node, inside)


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    """What module ``name`` (at ``path``) imports: library modules by full name, others by top-level name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node, in_function in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import sub" imports the submodule pkg.sub where there is one, else names of pkg
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        for target in targets:
            resolved = _library_module(target, modules)
            out.append(Import(name, resolved or target.split(".")[0], node.lineno, in_function))
    return out


def _library_module(target: str, modules: set[str]) -> str | None:
    """The library module ``target`` names (or the closest enclosing one), None outside the library."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph(root: Path = ROOT) -> list[Import]:
    files = library_files(root)
    return [imp for name, path in files.items() for imp in imports_of(name, path, set(files))]


def is_core(name: str) -> bool:
    return name in CORE_MODULES or any(name == p or name.startswith(p + ".") for p in CORE_PACKAGES)


def framework_imports_in_core(graph: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in graph
        if is_core(i.importer) and i.target.split(".")[0] in FRAMEWORKS
    ]


def module_level_circles(graph: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over module-level library imports."""
    edges: dict[str, set[str]] = {}
    for i in graph:
        if not i.in_function and i.target.startswith(PACKAGE) and i.target != i.importer:
            edges.setdefault(i.importer, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in edges.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def function_level_back_edges(graph: list[Import]) -> set[tuple[str, str]]:
    """Function-level imports A -> B where B imports A back through module-level imports (a circle deferred)."""
    edges: dict[str, set[str]] = {}
    for i in graph:
        if not i.in_function and i.target.startswith(PACKAGE):
            edges.setdefault(i.importer, set()).add(i.target)
    return {
        (i.importer, i.target)
        for i in graph
        if i.in_function and i.target.startswith(PACKAGE) and _reaches(edges, i.target, i.importer)
    }


def tools_imported_outside_tools(graph: list[Import]) -> list[str]:
    tools = f"{PACKAGE}.tools"
    return [
        f"{i.importer}:{i.line} imports {i.target}"
        for i in graph
        if (i.target == tools or i.target.startswith(tools + "."))
        and not (i.importer == tools or i.importer.startswith(tools + "."))
    ]


def framework_crossings(graph: list[Import]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where one framework package imports the other's."""
    packages = [f"{PACKAGE}.{f}" for f in FRAMEWORKS]

    def package_of(name: str) -> str | None:
        return next((p for p in packages if name == p or name.startswith(p + ".")), None)

    return {
        (i.importer, i.target)
        for i in graph
        if package_of(i.importer) and package_of(i.target) and package_of(i.importer) != package_of(i.target)
    }


# The one module per framework allowed its private APIs (each listed there, each checked by tests/test_compat.py).
COMPAT_MODULES = {f"{PACKAGE}.torch._compat", f"{PACKAGE}.mindspore._compat"}
FRAMEWORK_ROOTS = {"torch", "dist", "nn", "mindspore", "ms", "sys"}  # names the library binds the frameworks to
# Private members of the frameworks' objects the library reads through ``_compat`` (any receiver)
PRIVATE_MEMBERS = {
    "_version",
    "_per_optimizer_states",
    "_opt_called",
    "_modules",
    "_parameters",
    "_buffers",
    "_params",
    "_execution_engine",
    "_config_level",
    "_active_ddp_module",
    "_world",
    "_getframe",
    "_disable_dynamo",
}


def _dotted(node: ast.AST) -> list[str]:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_framework_uses(root: Path = ROOT) -> list[str]:
    """Each use of a framework's private API outside its ``_compat.py``, as ``module:line what``."""
    found = []
    for name, path in library_files(root).items():
        if name in COMPAT_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            what = None
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                top = node.module.split(".")[0]
                names = [a.name for a in node.names]
                if top in FRAMEWORKS and (
                    any(map(_is_private, node.module.split("."))) or any(map(_is_private, names))
                ):
                    what = f"from {node.module} import {', '.join(names)}"
            elif isinstance(node, ast.Import):
                private = [
                    a.name
                    for a in node.names
                    if a.name.split(".")[0] in FRAMEWORKS and any(map(_is_private, a.name.split(".")))
                ]
                what = f"import {', '.join(private)}" if private else None
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                parts = _dotted(node)
                if parts[:1] in (["self"], ["cls"]):  # the library's own objects
                    continue
                if node.attr in PRIVATE_MEMBERS or (parts and parts[0] in FRAMEWORK_ROOTS):
                    what = ".".join(parts) or node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
                name_arg = node.args[1]
                if node.func.id in ("getattr", "hasattr", "setattr") and isinstance(name_arg, ast.Constant):
                    attr, parts = str(name_arg.value), _dotted(node.args[0])
                    if _is_private(attr) and (attr in PRIVATE_MEMBERS or parts[:1] and parts[0] in FRAMEWORK_ROOTS):
                        what = f"{node.func.id}({'.'.join(parts)}, {attr!r})"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                dotted = node.value.split(".")
                if dotted[0] in FRAMEWORKS and len(dotted) > 1 and any(map(_is_private, dotted)):
                    what = repr(node.value)
            if what:
                found.append(f"{name}:{node.lineno} {what}")
    return sorted(set(found))


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    return import_graph()


def test_the_core_imports_no_framework(graph) -> None:
    core = [name for name in library_files() if is_core(name)]
    assert len(core) > 10, core  # (the core was found: a renamed folder must not make this pass vacuously)
    assert framework_imports_in_core(graph) == []


def test_no_import_circle(graph) -> None:
    assert module_level_circles(graph) == []


def test_function_level_back_edges_are_the_listed_ones(graph) -> None:
    found = function_level_back_edges(graph)
    assert found <= set(ALLOWED_BACK_EDGES), sorted(found - set(ALLOWED_BACK_EDGES))


def test_the_library_never_imports_its_tools(graph) -> None:
    assert tools_imported_outside_tools(graph) == []


def test_the_framework_packages_do_not_import_each_other(graph) -> None:
    found = framework_crossings(graph)
    assert found <= set(ALLOWED_CROSSINGS), sorted(found - set(ALLOWED_CROSSINGS))


def test_private_framework_apis_only_in_compat() -> None:
    assert private_framework_uses() == []


def test_the_checks_see_what_they_look_for(tmp_path) -> None:
    """Each check finds its violation in a small package built for it (so a check that parses nothing, or
    resolves imports wrongly, cannot pass silently)."""
    pkg = tmp_path / PACKAGE
    files = {
        "__init__.py": "",
        "bucketing/__init__.py": "from .a import x\n",
        "bucketing/a.py": "from ..b import y\nx = 1\n",
        "b.py": "from .bucketing import a\ny = 2\ndef f():\n    import torch\n",
        "ops.py": "def g():\n    from mindspore import nn\n",
        "c.py": "def h():\n    from .d import z\n",
        "d.py": "from . import c\nz = 3\n",
        "e.py": "from .tools.bench import run\n",
        "tools/__init__.py": "",
        "tools/bench.py": "from ..options import x\n",
        "torch/__init__.py": "",
        "torch/w.py": "def k():\n    from ..mindspore import optim\n",
        "mindspore/__init__.py": "",
        "mindspore/optim.py": "if TYPE_CHECKING:\n    import torch\n",
        "torch/p.py": "import torch\nfrom torch.distributed import _x\ndef f(t):\n    return t._version, torch._C\n",
        "torch/_compat.py": "import torch\ny = torch._C\n",
        "torch/q.py": "import sys, torch\nz = getattr(torch, '_w', sys.modules.get('torch._dynamo'))\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = import_graph(tmp_path)
    assert framework_imports_in_core(found) == [f"{PACKAGE}.ops:2 imports mindspore"]
    assert module_level_circles(found) == [[f"{PACKAGE}.b", f"{PACKAGE}.bucketing.a"]]
    assert function_level_back_edges(found) == {(f"{PACKAGE}.c", f"{PACKAGE}.d")}
    assert tools_imported_outside_tools(found) == [f"{PACKAGE}.e:1 imports {PACKAGE}.tools.bench"]
    assert framework_crossings(found) == {(f"{PACKAGE}.torch.w", f"{PACKAGE}.mindspore.optim")}
    assert private_framework_uses(tmp_path) == [
        f"{PACKAGE}.torch.p:2 from torch.distributed import _x",
        f"{PACKAGE}.torch.p:4 t._version",
        f"{PACKAGE}.torch.p:4 torch._C",
        f"{PACKAGE}.torch.q:2 'torch._dynamo'",
        f"{PACKAGE}.torch.q:2 getattr(torch, '_w')",
    ]
