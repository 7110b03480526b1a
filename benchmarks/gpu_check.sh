#!/usr/bin/env bash
# The one prepared device check (issue 35), sized for a lent GPU's few minutes: from a fresh copy
# of the tree on a machine with no network, install what the image lacks from wheels kept beside
# the tree (.whl/, git-ignored: msgspec, gguf, transformers), then
#   1. tests/test_gpu.py                 the engine and every Triton kernel on CUDA against their twins
#   2. benchmarks/gpu_kernels.py         each way to run a linear layer (fp8 on torch._scaled_mm
#                                        and bf16 on the Triton GEMV among them), and decode
#                                        attention, per shape; from them the batch-bucket table
#                                        (kernel or dense bf16 per precision and decode batch; GEMV
#                                        or cuBLAS per bf16 layer kind), written to
#                                        engine/precision_buckets.json
#   3. benchmarks/gpu_bench.py           both Qwen shapes, bf16/int8/int4/fp8, batch 1/16/64 (the
#                                        engine reading that table), with a per-kernel profile of a
#                                        decode step at batch 1 and 64, and issue 53's targets
#   4. benchmarks/step_overhead.py       the engine's host work per step there, the model stubbed
# Results go to benchmarks/results/ (and to $OUT when the device tool sets it, with the table),
# with gpu_check-<device>.json naming the device and saying what ran, passed, failed or was
# skipped, the table's picks, fp8 against bf16, the GGUF files'
# layers against bf16 (issue 52) and the targets. The whole run keeps within
# $GPU_CHECK_SECONDS (510): a step's limit is cut to what is left, and a step with nothing left
# is skipped. Without a GPU it says what it skipped and exits 0, so it can be dry-run anywhere.
# Arguments name the steps to run (tests kernels bench host; all by default), so a step that
# failed can be run again alone.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

device=$($PY -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')")
if [ -z "$device" ]; then
    echo "gpu_check: torch sees no CUDA GPU here; skipped tests/test_gpu.py, benchmarks/gpu_kernels.py and" \
         "benchmarks/gpu_bench.py (tests/test_device.py and the interpreted kernel tests cover this code on the CPU)"
    exit 0
fi
# The wheels are for the device image's Python, so they are installed only where a GPU is.
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sluice-site .whl/*.whl \
        || { echo "gpu_check: installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/sluice-site:$PWD
fi
slug=$(echo "$device" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-|-$//g')
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>/dev/null

wanted=" ${*:-tests kernels bench host} "
total=${GPU_CHECK_SECONDS:-510}
declare -A status
step() {    # step NAME SECONDS COMMAND...: run with a time limit, record its exit status
    local name=$1 limit=$2; shift 2
    [[ $wanted == *" $name "* ]] || return 0
    local left=$((total - SECONDS))
    if ((left < 10)); then
        echo "== gpu_check: $name skipped: ${total}s spent"; status[$name]="skipped 0"; return 0
    fi
    ((left < limit)) && limit=$left
    echo "== gpu_check: $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@"
    status[$name]="$? $((SECONDS - start))"
}
# The tests' CPU references load Sluice's four compiled CPU kernels: built here at once, a process
# each (the test session builds them one after another before its first test), then loaded from
# torch's extension cache as the session starts.
if [[ $wanted == *" tests "* ]]; then
    for k in quant_matmul_cpu layer_cpu gguf_cpu; do $PY -c "from kernels import $k; $k.load()" & done
    $PY -c "from kernels.cpu_build import CSRC, build; build('sluice_decoder', [CSRC / 'decoder.cpp'], 'its twin')" &
    wait
    echo "== gpu_check: compiled CPU kernels built in ${SECONDS}s"
fi
step tests 300 $PY -m pytest -q -p no:cacheprovider -o addopts= --durations=12 --junitxml="$RESULTS/gpu_tests-$slug.xml" tests/test_gpu.py
# The decode buckets' rows only (the table's input): with 256 as well it outran 120 s on an H200.
step kernels 140 $PY benchmarks/gpu_kernels.py --rows 1 2 4 8 16 32 64
step bench 280 $PY benchmarks/gpu_bench.py --hf-batches --models qwen2.5-coder-1.5b qwen2.5-coder-0.5b
step host 40 $PY benchmarks/step_overhead.py --device cuda --out "$RESULTS/step_overhead-$slug.json"

steps=$(for k in "${!status[@]}"; do echo "$k ${status[$k]}"; done)
STEPS="$steps" DEVICE="$device" SLUG="$slug" $PY - <<'EOF'
import json, os, xml.etree.ElementTree as ET
from pathlib import Path
results = Path("benchmarks/results")
steps = {name: {"exit": int(code) if code.isdigit() else code, "seconds": int(secs)}
         for name, code, secs in (line.split() for line in os.environ["STEPS"].splitlines())}
tests = {}
xml = results / f"gpu_tests-{os.environ['SLUG']}.xml"
if xml.exists():
    for case in ET.parse(xml).iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        tests[f"{case.get('classname')}::{case.get('name')}"] = outcome
summary = {"device": os.environ["DEVICE"], "steps": steps, "tests": tests,
           "counts": {o: sum(v == o for v in tests.values()) for o in ("passed", "failure", "error", "skipped")}}
table = Path("engine/precision_buckets.json")
if table.exists():      # the batch-bucket picks gpu_kernels.py measured here, which gpu_bench.py ran with
    summary["buckets"] = json.loads(table.read_text())["devices"].get(os.environ["DEVICE"])
kernels = results / f"gpu_kernels-{os.environ['SLUG']}.json"
if kernels.exists():    # issue 52: a step's linear layers on the GGUF files' blocks against bf16, 1 row
    summary["gguf_vs_bf16"] = json.loads(kernels.read_text()).get("gguf_step")
bench = results / f"gpu_bench-{os.environ['SLUG']}.json"
if bench.exists():
    b = json.loads(bench.read_text())
    summary["fp8_vs_bf16"] = {
        model: {batch: {"bf16_tok_s": q["none"]["decode"][batch]["tok_s"], "fp8_tok_s": d["tok_s"],
                        "ratio": d["tok_s"] / q["none"]["decode"][batch]["tok_s"]}
                for batch, d in q["fp8"]["decode"].items() if batch in q["none"]["decode"]}
        for model, r in b["models"].items() if "fp8" in (q := r["quants"]) and "none" in q}
    summary["targets"] = b.get("targets", {})
(results / f"gpu_check-{os.environ['SLUG']}.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({"device": summary["device"], "steps": steps, "counts": summary["counts"],
                  "fp8_vs_bf16": summary.get("fp8_vs_bf16"), "gguf_vs_bf16": summary.get("gguf_vs_bf16"),
                  "buckets": summary.get("buckets")}))
EOF
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS"/*-"$slug".json "$RESULTS/gpu_tests-$slug.xml" engine/precision_buckets.json "$OUT"/ 2>/dev/null
fi
