"""One onnxruntime: every install the README gives (base, [test], [bench], [cuda]) leaves
exactly one wheel providing the `onnxruntime` module. Two wheels (onnxruntime beside
onnxruntime-gpu) write one folder, and which one a user gets depends on install order."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Wheels that ship the `onnxruntime` module, and those that require one of them
# (onnxruntime-genai requires the CPU `onnxruntime`).
ORT_WHEELS = {"onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino",
              "onnxruntime-qnn", "onnxruntime-training", "ort-nightly", "ort-nightly-gpu"}
PULLS_ORT = {"onnxruntime-genai", "onnxruntime-genai-cuda", "optimum-onnx", "optimum"}
README_EXTRAS = ("test", "bench", "cuda")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _requirements(extra: str | None, project: dict) -> set[str]:
    """The names an install of `shapetuner[extra]` asks for, self-references followed."""
    reqs = list(project["dependencies"])
    if extra:
        reqs += project["optional-dependencies"][extra]
    names = set()
    for r in reqs:
        name = _name(r)
        if name == "shapetuner":
            inner = re.search(r"\[(.*?)\]", r)
            for e in (inner.group(1).split(",") if inner else []):
                names |= _requirements(e.strip(), project)
        else:
            names.add(name)
    return names


def test_every_readme_install_asks_for_one_onnxruntime_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra in (None, *README_EXTRAS):
        names = _requirements(extra, project)
        ort = names & ORT_WHEELS
        assert ort == {"onnxruntime-gpu"}, (extra, ort)
        assert not names & PULLS_ORT, f"[{extra}] pulls a second onnxruntime: {names & PULLS_ORT}"


def test_this_environment_holds_one_onnxruntime_wheel():
    providers = sorted({d.metadata["Name"] for d in metadata.distributions()
                        if any(str(f).replace("\\", "/") == "onnxruntime/__init__.py"
                               for f in (d.files or ()))})
    assert len(providers) == 1, f"wheels providing the onnxruntime module: {providers}"


def test_the_checker_sees_a_second_wheel():
    """The liar: a project whose bench extra pulls onnxruntime-genai fails the check."""
    project = {"dependencies": ["onnxruntime-gpu>=1.20"],
               "optional-dependencies": {"bench": ["onnxruntime-genai>=0.18,<0.19"],
                                         "test": ["shapetuner[bench]", "onnxruntime"]}}
    assert _requirements("bench", project) & PULLS_ORT == {"onnxruntime-genai"}
    assert _requirements("test", project) & ORT_WHEELS == {"onnxruntime", "onnxruntime-gpu"}
