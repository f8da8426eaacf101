"""The rules of the house, checked by reading the source of `mpishard/` (no import of it).

Each test enforces one rule and, when it fails, lists every offender as `file:line  import`:

- no import cycles among the package's modules;
- no import of the package's own modules inside a function (lazy imports are only for
  optional third-party packages: cupy, torch, matplotlib, sklearn);
- layering: validate < comm < health < nn < parallel < hfmap < models < costs < engine < train
  < checkpoint < hf < cli; a module never imports a later layer (checkpoint may import train,
  train never imports
  checkpoint; hf, the Hugging Face converters, may import checkpoint, never the reverse);
  the top-level `__init__.py` and `__main__.py` may import anything;
- no underscore name imported from another module of the package (`from .x import _y`);
- no private API of other libraries (`MPI._typedict`, argparse's `_subparsers`, ...);
- no file over 400 lines;
- the only top-level modules are `__init__.py`, `__main__.py`, `engine.py` and `validate.py`;
  everything else lives in a package (comm/, health/, nn/, parallel/, hfmap/, models/, costs/,
  train/, checkpoint/, hf/, cli/);
- a layout is parsed where its text enters (the engine, the mesh, the CLI) and travels as a
  `Layout`: nn/, parallel/ and train/ never call `parse_layout`.

The helpers take the package folder as an argument, so `benchmarks/structure_report.py`
measures any tree (e.g. an older commit) with the same definitions.
"""
from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mpishard"

# Lower layers first; a module may import its own layer and the layers before it.
LAYERS = ["validate", "comm", "health", "nn", "parallel", "hfmap", "models", "costs", "engine",
          "train", "checkpoint", "hf", "serve", "cli"]
TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "engine.py", "validate.py"}
MAX_LINES = 400
# argparse internals that are tempting to reach for; flagged on any object.
ARGPARSE_INTERNALS = {"_subparsers", "_group_actions", "_option_string_actions", "_actions",
                      "_print_message"}
# Packages a parsed Layout travels through: they take the object, never the text.
LAYOUT_TAKERS = ("nn", "parallel", "train")


# ---------------------------------------------------------------- reading the package

@dataclass
class Import:
    """One `import` / `from ... import` statement, resolved against the package."""
    path: str            # file, relative to the package's parent folder
    importer: str        # dotted name of the importing module
    node: ast.stmt       # the ast.Import / ast.ImportFrom
    targets: list        # the package's modules it loads (empty for other libraries)
    in_function: bool    # nested in a def body

    @property
    def names(self):
        """The names a `from X import a, b` takes out of X; empty for `import X`."""
        return [a.name for a in self.node.names] if isinstance(self.node, ast.ImportFrom) else []

    def where(self):
        return f"{self.path}:{self.node.lineno}  {ast.unparse(self.node)}"


def module_files(package=PACKAGE):
    """{dotted module name: file} for every .py file below the package folder."""
    package = Path(package)
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def is_package(module, files):
    return files[module].name == "__init__.py"


def import_base(node, importer, files):
    """The dotted module a `from ... import` statement reads from (absolute or relative)."""
    if node.level == 0:
        return node.module
    package = importer if is_package(importer, files) else importer.rpartition(".")[0]
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def known_module(name, files):
    """The longest prefix of a dotted name that is one of the package's modules, or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in files:
            return ".".join(parts[:end])
    return None


def import_targets(node, importer, files):
    """The package's modules an import statement loads. `from . import x` loads the submodule
    x when there is one, else the package's `__init__`."""
    if isinstance(node, ast.Import):
        found = (known_module(alias.name, files) for alias in node.names)
        return sorted({m for m in found if m})
    base = import_base(node, importer, files)
    targets = set()
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in files:
            targets.add(submodule)
        elif base in files:
            targets.add(base)
    return sorted(targets)


def imports_in(tree, path, importer, files):
    """Every import statement of a parsed file, each marked with whether it sits in a def."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = import_targets(child, importer, files)
                found.append(Import(path, importer, child, targets, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


def parse_package(package=PACKAGE):
    """{module: (file relative to the package's parent, parsed tree, imports)}."""
    package = Path(package)
    files = module_files(package)
    parsed = {}
    for module, path in files.items():
        rel = str(path.relative_to(package.parent))
        tree = ast.parse(path.read_text(), filename=rel)
        parsed[module] = (rel, tree, imports_in(tree, rel, module, files))
    return parsed


def all_imports(parsed):
    return [imp for _, _, imports in parsed.values() for imp in imports]


# ---------------------------------------------------------------- the measurements

def import_graph(parsed, with_functions=False):
    """{module: modules it imports at module level (and inside functions, if asked)}."""
    graph = {module: set() for module in parsed}
    for imp in all_imports(parsed):
        if with_functions or not imp.in_function:
            graph[imp.importer].update(t for t in imp.targets if t != imp.importer)
    return graph


def reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def shortest_cycle(graph, start, within):
    """The shortest path start -> ... -> start through modules in `within`."""
    paths = deque([[start]])
    while paths:
        path = paths.popleft()
        for nxt in sorted(graph[path[-1]] & within):
            if nxt == start:
                return path + [start]
            if nxt not in path:
                paths.append(path + [nxt])
    return [start]


def import_groups(parsed, with_functions=False):
    """The groups of modules that import each other, directly or through others, as
    (graph, sorted list of groups). `with_functions` also counts imports inside functions:
    the cycles such imports were written to dodge."""
    graph = import_graph(parsed, with_functions)
    reach = {module: reachable(graph, module) for module in graph}
    groups = {frozenset(m for m in reach[module] if module in reach[m])
              for module in graph if module in reach[module]}
    return graph, sorted(sorted(group) for group in groups)


def import_cycles(parsed, with_functions=False):
    """One cycle per group of modules that import each other: a list of module names that
    starts and ends with the same module."""
    graph, groups = import_groups(parsed, with_functions)
    return [shortest_cycle(graph, group[0], set(group)) for group in groups]


def package_imports_in_functions(parsed):
    return [imp for imp in all_imports(parsed) if imp.in_function and imp.targets]


def layer_of(module):
    """Index in LAYERS of the module's top-level name; None for the top-level __init__ and
    __main__ (they may import anything); "unknown" for a name that is in no layer."""
    parts = module.split(".")[1:]
    if not parts or parts[0] == "__main__":
        return None
    return LAYERS.index(parts[0]) if parts[0] in LAYERS else "unknown"


def layering_violations(parsed):
    """Imports of a later layer, and modules whose top-level name is in no layer."""
    found = [f"{rel}: {module} is in no layer (layers: {', '.join(LAYERS)})"
             for module, (rel, _, _) in parsed.items() if layer_of(module) == "unknown"]
    for imp in all_imports(parsed):
        own = layer_of(imp.importer)
        if own is None or own == "unknown":
            continue
        for target in imp.targets:
            theirs = layer_of(target)
            if theirs is None or (theirs != "unknown" and theirs > own):
                found.append(f"{imp.where()}   ({imp.importer} imports {target})")
    return found


def is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def underscore_imports(parsed):
    """`from .x import _y`: a private name taken from another module of the package."""
    return [imp for imp in all_imports(parsed)
            if imp.targets and any(is_private(n) for n in imp.names)]


def third_party_names(imports, package_name):
    """Names a file binds by importing a library that is neither the stdlib nor the package."""
    def outside(module):
        return module.split(".")[0] not in sys.stdlib_module_names | {package_name}

    names = set()
    for imp in imports:
        node = imp.node
        if isinstance(node, ast.Import):
            names.update(a.asname or a.name.split(".")[0] for a in node.names if outside(a.name))
        elif node.level == 0 and outside(node.module):
            names.update(a.asname or a.name for a in node.names)
    return names


def root_name(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def attribute_uses(tree):
    """(line, object expression, attribute) for `obj.attr`, `getattr(obj, "attr")` and
    `def attr` inside a class (an override of the base class's method)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in {"getattr", "setattr", "hasattr"} and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node.lineno, node.args[0], node.args[1].value
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item.lineno, None, item.name


def private_api_uses(parsed):
    """`lib._name` on a third-party library's object, and argparse internals on anything."""
    found = []
    for module, (rel, tree, imports) in parsed.items():
        libraries = third_party_names(imports, module.split(".")[0])
        for line, obj, attr in attribute_uses(tree):
            on_library = obj is not None and root_name(obj) in libraries and is_private(attr)
            if on_library or attr in ARGPARSE_INTERNALS:
                shown = ast.unparse(obj) + "." if obj is not None else "def "
                found.append(f"{rel}:{line}  {shown}{attr}")
    return found


def line_counts(parsed, package=PACKAGE):
    """{file relative to the package's parent: number of lines}, longest first."""
    root = Path(package).parent
    counts = {rel: len((root / rel).read_text().splitlines()) for rel, _, _ in parsed.values()}
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def layout_parses(parsed):
    """`parse_layout` named (imported or called) in a module of LAYOUT_TAKERS."""
    found = []
    for module, (rel, tree, _) in parsed.items():
        if module.split(".")[1:2] and module.split(".")[1] in LAYOUT_TAKERS:
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.ImportFrom)
                         else [node.id] if isinstance(node, ast.Name)
                         else [node.attr] if isinstance(node, ast.Attribute) else [])
                if "parse_layout" in names:
                    found.append(f"{rel}:{node.lineno}  {ast.unparse(node)}")
    return found


def top_level_modules(package=PACKAGE):
    return sorted(p.name for p in Path(package).glob("*.py"))


# ---------------------------------------------------------------- the rules

def report(rule, offenders):
    return f"{rule}: {len(offenders)} offender(s)\n  " + "\n  ".join(map(str, offenders))


def test_no_import_cycles():
    cycles = [" -> ".join(cycle) for cycle in import_cycles(parse_package())]
    assert not cycles, report("modules that import each other (module-level imports)", cycles)


def test_no_package_imports_inside_functions():
    nested = [imp.where() for imp in package_imports_in_functions(parse_package())]
    assert not nested, report("package modules imported inside a function; import them at the "
                              "top (lazy imports are for optional third-party packages)", nested)


def test_lower_layers_never_import_higher_ones():
    found = layering_violations(parse_package())
    assert not found, report(f"imports of a later layer (order: {' < '.join(LAYERS)})", found)


def test_no_underscore_names_imported_across_modules():
    found = [imp.where() for imp in underscore_imports(parse_package())]
    assert not found, report("private names imported from another module; make them public "
                             "or keep them where they are used", found)


def test_no_private_api_of_other_libraries():
    found = private_api_uses(parse_package())
    assert not found, report("private API of another library (use mpi4py.util.dtlib."
                             "from_numpy_dtype, public argparse API)", found)


def test_no_file_over_400_lines():
    long = [f"{rel}: {n} lines" for rel, n in line_counts(parse_package()).items() if n > MAX_LINES]
    assert not long, report(f"files over {MAX_LINES} lines", long)


def test_test_module_names_are_unique():
    """pyproject puts every tests/<package>/ folder on sys.path, so two test files with one
    basename make pytest refuse to collect the second (and with it the whole run)."""
    seen = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    twice = [" and ".join(paths) for paths in seen.values() if len(paths) > 1]
    assert not twice, report("test modules sharing a basename", twice)


def test_tests_outside_hf_import_torch_only_through_importorskip():
    """`make test`'s venv has no torch or transformers (the `hf` extra): a test module outside
    tests/hf that imports them at its top stops pytest collecting the whole suite there."""
    optional = {"torch", "transformers"}
    found = []
    for path in sorted((PACKAGE.parent / "tests").rglob("*.py")):
        if "hf" in path.relative_to(PACKAGE.parent / "tests").parts[:1]:
            continue
        for node in ast.parse(path.read_text()).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in optional for n in names):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, report("top-level torch/transformers imports outside tests/hf (use "
                             "pytest.importorskip)", found)


def test_top_level_holds_only_the_public_face():
    extra = [f"mpishard/{name}" for name in top_level_modules() if name not in TOP_LEVEL_MODULES]
    assert not extra, report(f"top-level modules besides {sorted(TOP_LEVEL_MODULES)}; move them "
                             "into the package of their concern", extra)


def test_layout_is_parsed_once_where_it_enters():
    found = layout_parses(parse_package())
    assert not found, report("parse_layout in a package a parsed Layout travels through "
                             f"({', '.join(LAYOUT_TAKERS)}); take the Layout the engine or the "
                             "CLI parsed instead", found)


# ---------------------------------------------------------------- the checker checks itself

def test_checker_finds_each_kind_of_offence(tmp_path):
    """A tiny package with one offence of each kind, so a rule cannot pass by seeing nothing."""
    pkg = tmp_path / "mpishard"
    (pkg / "comm").mkdir(parents=True)
    sources = {
        "__init__.py": "from .engine import Engine\n",
        "comm/__init__.py": "from . import mesh\n",
        "comm/mesh.py": ("from mpi4py import MPI\n"
                         "from ..engine import _helper\n"       # later layer, private name
                         "def f(parser):\n"
                         "    from . import mesh\n"             # package import in a def
                         "    import numpy\n"                   # lazy third-party: allowed
                         "    return MPI._typedict, parser._actions\n"),
        "engine.py": "from .comm import mesh\nclass Engine:\n    pass\n",
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    parsed = parse_package(pkg)

    cycle = ["mpishard.comm.mesh", "mpishard.engine", "mpishard.comm.mesh"]
    assert import_cycles(parsed) == [cycle]
    assert [imp.node.lineno for imp in package_imports_in_functions(parsed)] == [4]
    assert layering_violations(parsed) == [
        "mpishard/comm/mesh.py:2  from ..engine import _helper   "
        "(mpishard.comm.mesh imports mpishard.engine)"]
    assert [imp.node.lineno for imp in underscore_imports(parsed)] == [2]
    assert private_api_uses(parsed) == ["mpishard/comm/mesh.py:6  MPI._typedict",
                                        "mpishard/comm/mesh.py:6  parser._actions"]


def test_checker_finds_a_layout_parsed_again(tmp_path):
    pkg = tmp_path / "mpishard"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "comm").mkdir()
    sources = {
        "__init__.py": "",
        "comm/__init__.py": "",
        "comm/mesh.py": "def parse_layout(text):\n    return text\n",      # where it lives
        "engine.py": "from .comm.mesh import parse_layout\n",              # an entry: allowed
        "parallel/__init__.py": "",
        "parallel/stages.py": ("from ..comm import mesh\n"
                               "def f(layout):\n"
                               "    return mesh.parse_layout(layout)\n"),
    }
    for name, text in sources.items():
        (pkg / name).write_text(text)
    assert layout_parses(parse_package(pkg)) == [
        "mpishard/parallel/stages.py:3  mesh.parse_layout"]
