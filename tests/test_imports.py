"""The package's import arrows: the engine never imports the LM app, and no module of the LM
app imports one that imports it back (imports inside functions count: they are arrows too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diloco_jax"


def _imported(path: Path, package: str) -> set[str]:
    """The modules of `package` (dotted names) that the file imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith(package + ".")}


def _graph(folder: Path, package: str) -> dict[str, set[str]]:
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {m: _imported(p, package) & set(modules) - {m} for m, p in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a list of modules, the first again at the end), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_a_circle_is_found():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_lm_app_has_no_import_circle():
    graph = _graph(PACKAGE / "lm", "diloco_jax.lm")
    assert "diloco_jax.lm.args" in graph["diloco_jax.lm.elastic"]  # function-level imports seen
    assert _circle(graph) is None, _circle(graph)


def test_the_engine_never_imports_the_lm_app():
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "__main__.py":  # `python -m diloco_jax` is the app's command
            continue
        lm = {n for n in _imported(path, "diloco_jax") if n.startswith("diloco_jax.lm")}
        assert not lm, f"{path.name} imports {sorted(lm)}"


def test_no_module_of_the_package_is_hidden_by_one_of_its_names():
    """`import diloco_jax.X as x` gives module X wherever `dj.X` exists: an exported name
    never shares a module's name (`dj.cgad` the function, `diloco_jax.cgad_outer` its
    module)."""
    import importlib
    import pkgutil
    import types

    import diloco_jax as dj

    for module in pkgutil.walk_packages(dj.__path__, "diloco_jax."):
        parent, _, name = module.name.rpartition(".")
        value = getattr(importlib.import_module(parent), name, None)
        assert value is None or isinstance(value, types.ModuleType), (
            f"{module.name} is hidden by {parent}.{name}, a {type(value).__name__}"
        )
