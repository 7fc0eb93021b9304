"""The shape of the house (docs/design.md, "The shape of the code"): stage packages, data
flowing one way, no import circles, and a README Layout that names every module. Read from the
code's own imports (function-level ones included), so that a change that breaks a rule fails
here with the offending import named."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What each package of tuner/ may import from the others. A package absent from a set may not
# be imported; the order of the stages is inspect (graph) -> plan -> rewrite -> gate -> measure
# -> select -> serve, and the foundations (errors, util, hardware facts) sit under everything.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "util": {"errors"},
    "hardware": {"errors"},
    "graph": {"errors"},
    "rewrite": {"errors", "graph"},
    "runtime": {"errors", "util", "graph", "hardware"},
    "gate": {"errors", "util", "graph", "runtime"},
    "measure": {"errors", "util"},
    "plan": {"errors", "util", "graph", "hardware", "measure", "runtime"},
    "artifact": {"errors", "util", "graph", "runtime"},
    "design": {"errors", "util", "graph", "hardware", "measure", "plan"},
    "jobs": {"errors", "util", "graph", "hardware", "rewrite", "runtime", "gate", "measure",
             "plan", "artifact"},
    "cli": {"errors", "util", "graph", "hardware", "rewrite", "runtime", "gate", "measure",
            "plan", "artifact", "design", "jobs", "serving"},
}
# serving reads an artifact and runs it; never the planning, rewriting or measuring code.
SERVING_MAY_USE = {"errors", "util", "graph", "artifact", "runtime", "gate"}
# ...and of measure/ only the bucket rule, which optimize and the server must share
# (tuner.measure.buckets.fit_bucket: one answer past the largest bucket), and of hardware/
# only the cores this process may keep busy (its affinity and its container's CPU quota)
SERVING_MAY_USE_MODULES = {"tuner.measure.buckets", "tuner.hardware.detect"}
LOOSE_MODULES_ALLOWED = {"__init__.py", "__main__.py", "errors.py"}
GRPC = ("grpc", "grpc_health", "grpc_reflection")


def _modules(root: Path = ROOT, tops: tuple[str, ...] = ("tuner", "serving")) -> dict[str, Path]:
    out = {}
    for top in tops:
        for p in sorted((root / top).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()
# the circle checks cover the reference models too (`python -m models.build` is a command of
# its own, so the library rules below do not apply there)
EVERY_MODULE = _modules(tops=("tuner", "serving", "models"))


def _imports(name: str, path: Path, modules: dict[str, Path] = MODULES) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            # `from tuner.graph import io`: the submodule is what is imported
            found += [(f"{module}.{a.name}", node.lineno) for a in node.names
                      if f"{module}.{a.name}" in modules]
    return found


def _project_edges(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for module, _ in _imports(name, path, modules):
            if module in modules and module != name:
                edges[name].add(module)
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("serving", "models"):
        return parts[0]
    return parts[1] if len(parts) > 1 else "tuner"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_modules():
    assert _cycles(_project_edges(EVERY_MODULE)) == []


def test_no_import_circle_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for a, bs in _project_edges(EVERY_MODULE).items():
        for b in bs:
            if _package(a) != _package(b):
                packages[_package(a)].add(_package(b))
    assert _cycles(packages) == []


def _against_the_flow(modules: dict[str, Path] = MODULES) -> list[str]:
    wrong = []
    for name, path in modules.items():
        if not name.startswith("tuner.") or _package(name) not in ALLOWED:
            continue
        mine = _package(name)
        for module, line in _imports(name, path, modules):
            if module.startswith("serving") and mine != "cli":
                wrong.append(f"{path.name}:{line} imports {module}")
            elif module.startswith("tuner.") and _package(module) != mine \
                    and _package(module) not in ALLOWED[mine]:
                wrong.append(f"{path.name}:{line} imports {module} "
                             f"({mine} may use {sorted(ALLOWED[mine])})")
    return wrong


def test_each_package_imports_only_what_its_stage_may():
    assert _against_the_flow() == []


def test_serving_runs_an_artifact_through_artifact_runtime_and_gate_only():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for name, path in MODULES.items() if name.startswith("serving")
             for module, line in _imports(name, path)
             if module.startswith("tuner.") and _package(module) not in SERVING_MAY_USE
             and module not in SERVING_MAY_USE_MODULES]
    assert wrong == []


def test_nothing_under_tuner_imports_grpc():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for name, path in MODULES.items() if name.startswith("tuner.")
             for module, line in _imports(name, path)
             if module.startswith(GRPC) and _package(name) != "cli"]
    assert wrong == []


def test_only_the_wire_layer_and_the_server_import_grpc():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for name, path in MODULES.items() if name.startswith("serving")
             and not name.startswith(("serving.wire", "serving.server"))
             for module, line in _imports(name, path) if module.startswith(GRPC)]
    assert wrong == []


def test_tuner_holds_stage_packages_not_loose_modules():
    loose = sorted(p.name for p in (ROOT / "tuner").glob("*.py")
                   if p.name not in LOOSE_MODULES_ALLOWED)
    assert loose == []
    assert set(ALLOWED) == {p.name for p in (ROOT / "tuner").iterdir()
                            if (p / "__init__.py").is_file()} | {"errors"}


def _in_main_block(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


def test_only_the_cli_and_the_server_touch_argv_stdout_and_signals():
    """Libraries return values; the commands print them. A `python -m` block may print."""
    wrong = []
    for name, path in MODULES.items():
        if name.startswith(("tuner.cli", "serving.server")) or name == "tuner.__main__":
            continue
        tree = ast.parse(path.read_text())
        main = _in_main_block(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if getattr(node, "lineno", 0) in main:
                continue
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.argv":
                wrong.append(f"{where} reads sys.argv")
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    (a.name if isinstance(node, ast.Import) else node.module) == "signal"
                    for a in node.names):
                wrong.append(f"{where} imports signal")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "print" \
                    and not any(k.arg == "file" for k in node.keywords):
                wrong.append(f"{where} prints to stdout")
    assert wrong == []


def test_the_rules_catch_a_circle_and_an_import_against_the_flow(tmp_path):
    """The checks above can fail: a small tree with a circle (plan.a <-> plan.b) and a graph
    module that imports a job is caught by both."""
    files = {"tuner/__init__.py": "", "tuner/plan/__init__.py": "", "tuner/graph/__init__.py": "",
             "tuner/jobs/__init__.py": "", "tuner/jobs/run.py": "",
             "tuner/plan/a.py": "from tuner.plan import b\n",
             "tuner/plan/b.py": "def f():\n    from tuner.plan.a import x\n",
             "tuner/graph/walk.py": "from tuner.jobs.run import go\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    fake = _modules(tmp_path)
    assert _cycles(_project_edges(fake)) == [["tuner.plan.a", "tuner.plan.b"]]
    assert [w.split(" (")[0] for w in _against_the_flow(fake)] == [
        "walk.py:1 imports tuner.jobs.run"]


# ---------------------------------------------------------------------------------------------
# The README's Layout and the tree agree

LAYOUT_TOPS = ("tuner", "serving", "models")
_PACKAGE_LINE = re.compile(r"^( *)([A-Za-z_]\w*)/(\s|$)")


def _layout_blocks(readme: str) -> dict[str, str]:
    """The Layout section's tree as {package path: the words written for it}: a line
    `    name/    text` opens a package (nested by indent), deeper lines continue its text."""
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    current = None
    for line in section.splitlines():
        if not line.startswith("    ") or not line.strip():
            continue
        head = _PACKAGE_LINE.match(line)
        if head:
            indent = len(head.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = "/".join([p for _, p in stack] + [head.group(2)])
            stack.append((indent, head.group(2)))
            current = path
            blocks[path] = line[head.end():]
        elif current is not None:
            blocks[current] += " " + line.strip()
    return blocks


def _missing_from_layout(root: Path, readme: str) -> list[str]:
    """Every module and package of LAYOUT_TOPS the Layout does not name, as messages."""
    blocks = _layout_blocks(readme)
    missing = []
    for top in LAYOUT_TOPS:
        folders = [root / top] + sorted(p for p in (root / top).rglob("*")
                                        if p.is_dir() and (p / "__init__.py").is_file())
        for folder in folders:
            rel = folder.relative_to(root).as_posix()
            if rel not in blocks:
                missing.append(f"package {rel}/ has no line in the README's Layout")
                continue
            if "_generated" in rel:  # generated stubs: the folder is named, not its files
                continue
            for f in sorted(folder.glob("*.py")):
                if f.stem == "__init__":
                    continue
                if not re.search(rf"(?<![\w.]){re.escape(f.stem)}(?![\w])", blocks[rel]):
                    module = ".".join([*rel.split("/"), f.stem])
                    missing.append(f"{module} is missing from the README's Layout (add it to "
                                   f"the line of {rel}/)")
    return missing


def test_the_readme_layout_names_every_module():
    assert _missing_from_layout(ROOT, (ROOT / "README.md").read_text(encoding="utf-8")) == []


def test_every_package_in_the_readme_layout_exists():
    gone = [p for p in _layout_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
            if p.split("/")[0] in LAYOUT_TOPS and not (ROOT / p).is_dir()]
    assert gone == []


def test_the_layout_check_names_the_module_it_misses(tmp_path):
    """The check can fail, and says which module is missing where."""
    for rel in ("tuner/__init__.py", "tuner/gate/__init__.py", "tuner/gate/verify.py",
                "tuner/gate/entry.py", "serving/__init__.py", "models/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    readme = ("## Layout\n\n    tuner/\n      gate/   verify (the comparator)\n"
              "    serving/   the server\n    models/   reference models\n\n## Next\n")
    assert _missing_from_layout(tmp_path, readme) == [
        "tuner.gate.entry is missing from the README's Layout (add it to the line of "
        "tuner/gate/)"]


LONG = 400  # lines; a module past this states why at its top (docs/design.md, the house rules)


def _long_without_reason(root: Path) -> list[str]:
    out = []
    for top in ("tuner", "serving", "models", "bench", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            if "_generated" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            doc = ast.get_docstring(ast.parse(text)) or ""
            if text.count("\n") > LONG and f"{LONG} lines" not in doc:
                out.append(f"{path.relative_to(root)}: {text.count(chr(10))} lines and no reason "
                           f"at its top (say why it is over {LONG} lines in its docstring)")
    return out


def test_every_module_over_400_lines_says_why():
    assert _long_without_reason(ROOT) == []


def test_the_long_module_check_names_the_module(tmp_path):
    (tmp_path / "tuner").mkdir()
    (tmp_path / "tuner" / "big.py").write_text('"""A module."""\n' + "x = 1\n" * 401)
    (tmp_path / "tuner" / "ok.py").write_text(
        '"""A module.\n\nOver 400 lines on purpose: one table."""\n' + "x = 1\n" * 401)
    assert _long_without_reason(tmp_path) == [
        "tuner/big.py: 402 lines and no reason at its top (say why it is over 400 lines in "
        "its docstring)"]
