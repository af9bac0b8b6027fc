#!/usr/bin/env bash
# CI stage: the serving proof in real vllm-omni servers (tests/serve), in the [omni] environment.
#   .ci/omni-serve.sh [VENV_DIR [PYTEST_ARGS...]]   e.g. .ci/omni-serve.sh .venv-omni (default: the active
#   environment); PYTEST_ARGS select a part of the proof, e.g. -k "test_serve_images and qwen"
# Builds tiny pipelines -- Wan2.2 with two LoRAs (test_serve_proof.py); FLUX.1, Qwen-Image and Z-Image with one
# LoRA each (test_serve_images.py); a 2-rank Wan2.2 server whose LoRAs are swapped at runtime
# (test_serve_lora_swap.py) -- starts `vllm serve DIR --omni` servers one at a time on 127.0.0.1 (the CPU
# platform of this package on a CPU-only host) and compares their videos / images; then `vllm-diffusion demo
# --serve` (test_serve_demo.py). Fails on any test failure, on pytest collecting or running no test, and on the
# stage timeout. Prints, per family, time-to-ready per server, bytes read per rank per weight-load strategy, the
# pixel distances and the proof's wall time, then the stage's.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-$(dirname "$(dirname "$(command -v python3)")")}   # default: the active environment
shift $(( $# > 0 ? 1 : 0 ))
PYTHON="$VENV/bin/python"
[ -x "$PYTHON" ] || { echo "omni-serve: $PYTHON not found" >&2; exit 1; }
[ -x "$VENV/bin/vllm" ] || { echo "omni-serve: $VENV/bin/vllm not found (install .[omni,test])" >&2; exit 1; }
"$PYTHON" -c 'from importlib.metadata import version as v; print("omni-serve: vllm", v("vllm"), "vllm-omni", v("vllm-omni"))'

TIMEOUT=${OMNI_SERVE_TIMEOUT:-1800}   # seconds for the whole proof (~21 min on a quiet 2-core host: 907 s + ~340 s of store faults)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/omni-serve.XXXXXX")
start=$(date +%s)

set +e
VLLM_DIFFUSION_SERVE_PROOF=1 VLLM_DIFFUSION_SERVE_PROOF_DIR="$WORK" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    timeout --kill-after=60 "$TIMEOUT" "$PYTHON" -m pytest tests/serve -m serve -p no:cacheprovider -rA -s \
    -W "ignore::DeprecationWarning" --durations=15 --junitxml="$WORK/junit.xml" "$@"
status=$?
set -e

"$PYTHON" - "$WORK" <<'PY' || true
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
paths = sorted(work.rglob("summary*.json"))  # summary.json (Wan2.2), <family>/summary-<family>.json
if not paths:
    print(f"omni-serve: no summary under {work}")
for path in paths:
    s = json.loads(path.read_text())
    tag = path.stem.removeprefix("summary").strip("-") or "wan2.2"
    print(f"omni-serve: [{tag}] checkpoints built in {s.get('build_s')} s; DiT tensors {s.get('dit_bytes')} bytes; "
          f"tolerance {s.get('tolerance')}")
    for name, server in s.get("servers", {}).items():
        print(f"omni-serve: [{tag}] server {name:<24} {server}")
    for strategy, per_rank in s.get("bytes_per_rank", {}).items():
        print(f"omni-serve: [{tag}] bytes read per rank, {strategy:<10} {per_rank}")
    for name, d in s.get("distances", {}).items():
        print(f"omni-serve: [{tag}] distance {name:<40} mean |diff| {d['mean_abs']:.3f}, max |diff| {d['max_abs']}, "
              f"identical bytes {d['identical_bytes']}")
    print(f"omni-serve: [{tag}] proof wall time {s.get('stage_s')} s (logs under {path.parent / 'logs'})")
PY
echo "omni-serve: stage wall time $(( $(date +%s) - start ))s"

if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "omni-serve: exceeded ${TIMEOUT}s" >&2; exit 1
fi
if [ "$status" -eq 5 ]; then echo "omni-serve: pytest collected no tests: failing" >&2; exit 1; fi
if [ "$status" -ne 0 ]; then exit "$status"; fi
ran=$("$PYTHON" - "$WORK/junit.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
PY
)
if [ "$ran" -le 0 ]; then echo "omni-serve: no serving test ran (all skipped?): failing" >&2; exit 1; fi
echo "omni-serve: $ran serving tests passed"
