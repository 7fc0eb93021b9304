#!/usr/bin/env bash
# One GPU session's device run, prepared ahead: every GPU check this project has, in one
# command, with its results as a few flat files under $OUT.
#
#   bash bench/gpu_session.sh            # on the GPU machine (OUT set by the device tool)
#   bash bench/gpu_session.sh --smoke    # the same steps on a CPU, tiny sizes, < 1 minute
#   PY=.venv/bin/python OUT=/tmp/x bash bench/gpu_session.sh --smoke
#
# Steps, each under its own time limit, each allowed to fail without stopping the next (its
# exit code goes into summary.txt; 124 means it ran past its limit):
#   facts     nvidia-smi, Python and library versions, python -m tuner.hardware.detect
#   pytest    the tests marked gpu (python -m pytest -m gpu over the files that have them)
#   gpu_check bench/gpu_check.py: GEMM probe, torch end to end, ORT/TensorRT where present
#   design    tuner design for the GPT-3 2.7B / Pythia-2.8B shape at seq 2048, batch 8
#
# Files written directly under $OUT (8): session.log (everything), summary.txt, facts.txt,
# pytest_gpu.txt, gpu_check.txt, design.md, design.json, design.png.
#
# Needs only what the GPU image has (torch with CUDA, onnx, CPU onnxruntime, transformers,
# pytest): shapetuner runs from the repo root through PYTHONPATH, nothing is installed.
# Expected time on an H200: well under 3 minutes; the step limits add up to 8 minutes.

set -u
set -o pipefail

SMOKE=0
case "${1:-}" in
    --smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: bash bench/gpu_session.sh [--smoke]" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/.cache/gpu-session}"  # .cache/ is git-ignored
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
PY="${PY:-python3}"
export PY
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Step limits in seconds (override through the environment); they sum to 480 s.
T_FACTS="${T_FACTS:-45}" T_PYTEST="${T_PYTEST:-120}" T_CHECK="${T_CHECK:-180}"
T_DESIGN="${T_DESIGN:-135}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-session.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

SUMMARY="$OUT/summary.txt"
FAILED=0

# step NAME FILE LIMIT_S CMD...: header, run with a time limit, output to the terminal (and so
# session.log) and to $OUT/FILE (none when FILE is -), exit code and seconds to summary.txt.
step() {
    local name=$1 file=$2 limit=$3
    shift 3
    local t0=$SECONDS rc dest="$OUT/$file"
    [ "$file" = - ] && dest=/dev/null
    echo
    echo "===== [$name] $(date -u +%H:%M:%S) limit ${limit}s: $* ====="
    if command -v timeout >/dev/null; then
        timeout -k 10 "$limit" "$@" 2>&1 | tee "$dest"
    else
        "$@" 2>&1 | tee "$dest"
    fi
    rc=${PIPESTATUS[0]}
    echo "===== [$name] exit $rc after $((SECONDS - t0)) s ====="
    printf '%-10s exit %-4s %5s s  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$file" >>"$SUMMARY"
    [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
}

facts() {
    echo "--- date, host, python"
    date -u
    uname -a
    command -v "$PY"
    "$PY" --version
    echo "--- nvidia-smi"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
            --format=csv
    else
        echo "nvidia-smi: not on the PATH"
    fi
    echo "--- packages"
    "$PY" - <<'EOF'
from importlib import metadata
for name in ("torch", "onnx", "onnx-ir", "onnxruntime", "onnxruntime-gpu", "onnxscript",
             "transformers", "numpy", "typer", "rich", "matplotlib", "prometheus-client",
             "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "pytest",
             "hypothesis", "tensorrt"):
    try:
        print(f"{name:24} {metadata.version(name)}")
    except metadata.PackageNotFoundError:  # a missing package is a fact to print
        print(f"{name:24} not installed")
try:
    import torch
    print("torch.cuda", torch.cuda.is_available(), torch.version.cuda,
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers())
except Exception as e:  # noqa: BLE001
    print("torch/onnxruntime facts failed:", type(e).__name__, e)
EOF
    echo "--- python -m tuner.hardware.detect"
    "$PY" -m tuner.hardware.detect
}

# The test files with gpu-marked tests; --continue-on-collection-errors so that one module
# that cannot import on this image does not stop the others.
gpu_tests() {
    local files
    files=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
    echo "files: $files"
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --continue-on-collection-errors $files
}

design() {
    if [ "$SMOKE" = 1 ]; then
        "$PY" -m tuner design --hidden 128 --heads 4 --ffn-size 512 --layers 2 --vocab 1000 \
            --family gpt_neox --device cpu --batch 1 --seq 16 --rounds 3 --max-candidates 4 \
            --quiet -o "$WORK/design"
    else
        "$PY" -m tuner design --hidden 2560 --heads 32 --ffn-size 10240 --layers 32 \
            --vocab 50257 --family gpt_neox --seq 2048 --batch 8 --device auto --quiet \
            -o "$WORK/design"
    fi
    local rc=$?
    for f in design.md design.json design.png; do
        [ -f "$WORK/design/$f" ] && cp "$WORK/design/$f" "$OUT/$f"
    done
    return $rc
}
export -f facts gpu_tests design
export SMOKE WORK

main() {
    : >"$SUMMARY"
    echo "gpu_session $( [ "$SMOKE" = 1 ] && echo '--smoke ')in $ROOT, OUT=$OUT, PY=$PY"
    step facts facts.txt "$T_FACTS" bash -c facts
    step pytest pytest_gpu.txt "$T_PYTEST" bash -c gpu_tests
    if [ "$SMOKE" = 1 ]; then
        step gpu_check gpu_check.txt "$T_CHECK" "$PY" bench/gpu_check.py --smoke
    else
        step gpu_check gpu_check.txt "$T_CHECK" "$PY" bench/gpu_check.py --budget-s 100
    fi
    # design's terminal table goes to session.log only; it writes design.{md,json,png}
    step design - "$T_DESIGN" bash -c design
    echo
    echo "===== summary ($FAILED failed) ====="
    cat "$SUMMARY"
    echo "files: $(cd "$OUT" && ls | tr '\n' ' ')"
    return "$FAILED"
}

main 2>&1 | tee "$OUT/session.log"
exit "${PIPESTATUS[0]}"
