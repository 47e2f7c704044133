"""The installed package exposes one import name with passes and models under it."""
import fxmem
import fxmem.models
import fxmem.passes


def test_one_import_name():
    assert fxmem.passes.__name__ == "fxmem.passes"
    assert fxmem.models.__name__ == "fxmem.models"
    assert callable(fxmem.plan) and callable(fxmem.optimize)


def test_solvers_import_no_torch():
    """Every module under fxmem/solve (and the problem they read) loads without torch."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(fxmem.__file__).parent
    names = ["fxmem.solve.problem"] + sorted(
        "fxmem." + ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for p in (root / "solve").rglob("*.py"))
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imports torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(names) > 10


def test_import_is_light():
    """`import fxmem` does not load torch: the public names load on first use."""
    import subprocess
    import sys

    code = "import sys, fxmem; assert 'torch' not in sys.modules; fxmem.plan; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
PACKAGES = {"fxmem": "fxmem", "passes": "fxmem.passes", "models": "fxmem.models"}
MAX_LINES = 450  # files stay small enough to read whole


def _modules() -> dict:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            mods[".".join([package, *parts]).removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path) -> set:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found |= {base, *(f"{base}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_imports_point_one_way():
    """No import loop among the project's modules, counting imports made inside functions too."""
    import networkx as nx

    mods = _modules()
    graph = nx.DiGraph()
    for name, path in mods.items():
        graph.add_edges_from((name, other) for other in _imports(name, path) if other in mods and other != name)
    assert list(nx.simple_cycles(graph)) == []


MAX_FLOORS = 12  # floors of imports, a folder counted as one room (scripts/ too)
MAX_TOP_MODULES = 15  # modules directly in fxmem/: the doors and the ground they share


def _room(name: str) -> str:
    """The room a module stands in: its folder under fxmem/ (`fxmem.price`), or the module itself at the top."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else name


def _rooms():
    import networkx as nx

    mods = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(_room(n) for n in mods)
    for name, path in mods.items():
        graph.add_edges_from((_room(name), _room(o)) for o in _imports(name, path) if o in mods and _room(o) != _room(name))
    for path in (ROOT / "scripts").glob("*.py"):
        graph.add_edges_from(("scripts", _room(o)) for o in _imports("scripts." + path.stem, path) if o in mods)
    return graph


def test_folders_import_one_way():
    """No two folders (or top-level modules) import each other, even through others: no import points up."""
    import networkx as nx

    assert list(nx.simple_cycles(_rooms())) == []


def test_floors_of_imports():
    """Read bottom-up, at most MAX_FLOORS floors, the doors on top and the torch-free solvers near the ground."""
    import networkx as nx

    graph, floor = _rooms(), {}
    for room in reversed(list(nx.topological_sort(graph))):
        floor[room] = 1 + max((floor[o] for o in graph.successors(room)), default=0)
    assert max(floor.values()) <= MAX_FLOORS, sorted(floor.items(), key=lambda kv: -kv[1])
    assert floor["fxmem.solve"] < floor["fxmem.trace"] < floor["fxmem.price"] < floor["fxmem.passes"] \
        < floor["fxmem.planner"] < floor["fxmem.run"] < floor["fxmem.api"]


def test_the_top_of_the_package_keeps_its_doors():
    top = sorted(p.name for p in (ROOT / "fxmem").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    assert {"api.py", "backend.py", "fsdp.py", "measure.py", "errors.py"} <= set(top)


def test_nothing_inside_imports_the_compile_door():
    """`fxmem.backend` is what `torch.compile(backend="fxmem")` enters by; the engine shares what lies below it."""
    mods = _modules()
    assert sorted(n for n, path in mods.items() if "fxmem.backend" in _imports(n, path)) == []


def test_tests_mirror_the_folders():
    folders = {p.name for p in (ROOT / "fxmem").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    tests = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert tests <= folders | {"passes"}, tests - folders
    assert {"trace", "price", "solve", "planner", "run", "tools", "cli", "passes"} <= tests


def test_files_stay_small():
    files = [p for folder in (*PACKAGES, "scripts", "tests") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_benchmarks_hold_todays_figures():
    """BENCHMARKS.md holds the latest figure for each claim (older tables live in git), and speaks of fxmem."""
    import re

    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= 400
    assert not re.search(r"\b(session|helper|sub-?agent)s?\b", text, re.I)
