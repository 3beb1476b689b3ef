"""The supported stacks: the oldest one `make` installs (constraints/oldest.txt) is exactly
pyproject.toml's floors, the golden replay's recorded XLA is that stack's, and the README names
both stacks."""

import pathlib
import re
import tomllib

from conftest import RECORDED_JAXLIB
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
PINNED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex")


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints" / "oldest.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {name.strip(): version.strip() for name, version in pins}


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = {}
    for text in project["dependencies"]:
        requirement = Requirement(text)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                floors[requirement.name] = spec.version
    return floors


def test_the_oldest_stack_is_the_declared_floors():
    pins, floors = _pins(), _floors()
    assert set(pins) == set(PINNED)
    assert {name: floors[name] for name in PINNED} == pins


def test_the_recorded_bits_are_the_oldest_stacks_xla():
    assert _pins()["jaxlib"] == RECORDED_JAXLIB


def test_the_readme_names_the_tested_stacks():
    readme = (ROOT / "README.md").read_text()
    stacks = " ".join(readme[readme.index("### Supported stacks") :].split())  # lines joined
    for name, version in _pins().items():
        assert f"{name} {version}" in stacks, name
    classifiers = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["classifiers"]
    pythons = [re.search(r"3\.\d+$", c).group(0) for c in classifiers if "Python :: 3." in c]
    assert f"Python {pythons[0]}" in stacks and f"Python {pythons[-1]}" in stacks
