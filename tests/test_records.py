"""The package builds its records (NamedTuples, dataclasses) by field name once a call would
pass more than 4 of their fields by position: a record read by position is one that a new
or reordered field breaks without a word."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "diloco_jax"
MOST_POSITIONAL = 4


def _is_record(node: ast.ClassDef) -> bool:
    bases = [ast.unparse(b) for b in node.bases]
    decorators = [ast.unparse(d) for d in node.decorator_list]
    built = any("NamedTuple" in b for b in bases) or any("dataclass" in d for d in decorators)
    own_init = any(isinstance(b, ast.FunctionDef) and b.name == "__init__" for b in node.body)
    return built and not own_init and not any("init=False" in d for d in decorators)


def positional_records(sources: dict[str, str]) -> list[str]:
    """Each call in `sources` (a name -> its source), as "name:line Class", that builds one of
    their record classes (by its name, as module.Class, or as `cls` in its own methods) with
    more than MOST_POSITIONAL positional arguments."""
    trees = {name: ast.parse(src) for name, src in sources.items()}
    records = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and _is_record(node)
    }
    found = []
    for name, tree in trees.items():
        owner = {}  # a call inside a record class -> that class (for `cls(...)`)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in records:
                owner |= {id(n): node.name for n in ast.walk(node) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= MOST_POSITIONAL:
                continue
            f = node.func
            callee = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if callee == "cls":
                callee = owner.get(id(node))
            if callee in records and not any(isinstance(a, ast.Starred) for a in node.args):
                found.append(f"{name}:{node.lineno} {callee}")
    return sorted(found, key=lambda x: (x.split(":")[0], int(x.split(":")[1].split()[0])))


def test_no_record_of_the_package_is_built_from_more_than_4_positional_arguments():
    sources = {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert positional_records(sources) == []


def test_the_check_finds_a_record_built_by_position():
    source = (
        "import dataclasses\n"
        "from typing import NamedTuple\n"
        "class R(NamedTuple):\n"
        "    a: int\n    b: int\n    c: int\n    d: int\n    e: int\n"
        "    @classmethod\n"
        "    def of(cls):\n"
        "        return cls(1, 2, 3, 4, 5)\n"
        "@dataclasses.dataclass\n"
        "class D:\n"
        "    a: int\n    b: int\n    c: int\n    d: int\n    e: int\n"
        "x = R(1, 2, 3, 4, 5)\n"
        "y = R(1, 2, 3, 4, e=5)\n"
        "z = D(*range(5))\n"
        "w = D(1, 2, 3, 4, 5)\n"
    )
    assert positional_records({"m.py": source}) == ["m.py:11 R", "m.py:19 R", "m.py:22 D"]
