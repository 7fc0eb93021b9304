"""A plain `pip install shapetuner` (what the Dockerfile installs) holds every third-party
module that tuner/ and serving/ import, but for those that only an extra's feature needs
(each named below, with the extra): a module imported by code the base install runs and
provided by no base dependency fails on a user's machine, not in this environment, where
the test extra brings it in anyway."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("tuner", "serving", "models")  # the packages the wheel itself holds
# modules only an extra's feature imports (lazily, with a message naming the extra)
OPTIONAL = {"grpc_tools": "test (regenerating serving/wire/_generated)",
            "tensorrt": "trt", "torch": "probe / models"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(packages=("tuner", "serving")) -> dict[str, str]:
    """Top-level third-party modules imported anywhere in `packages` -> one file doing so."""
    out: dict[str, str] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        out.setdefault(top, str(path.relative_to(ROOT)))
    return out


def base_closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` install, their own requirements followed through
    this environment's metadata (extras' requirements left out, markers evaluated)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(req.name) or ()]
        except metadata.PackageNotFoundError:
            pass  # not installed here (a platform marker's): nothing more to follow
    return seen


def missing(modules: dict[str, str], installed: set[str]) -> dict[str, str]:
    """Modules no distribution in `installed` provides (OPTIONAL ones aside): module -> file."""
    providers = metadata.packages_distributions()
    return {m: f for m, f in modules.items() if m not in OPTIONAL
            and not {_norm(d) for d in providers.get(m, ())} & installed}


def test_the_base_install_holds_what_tuner_and_serving_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gaps = missing(imported_modules(), base_closure(project["dependencies"]))
    assert not gaps, f"imported but not in the base install (pyproject dependencies): {gaps}"


def test_the_checker_sees_a_missing_dependency():
    """The liar: a base install without tokenizers, which serving/tokenizer.py imports."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    without = [r for r in project["dependencies"] if _norm(Requirement(r).name) != "tokenizers"]
    assert "tokenizers" in missing(imported_modules(), base_closure(without))
    assert "torch" not in missing({"torch": "tuner/plan/probe.py"}, set())  # optional
