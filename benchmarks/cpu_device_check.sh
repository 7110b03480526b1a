#!/usr/bin/env bash
# Sluice against llama.cpp on another host's CPU (the device machine's, an AVX-512 Xeon), where
# neither the model store nor a package index can be reached: from a copy of the tree with .whl/
# beside it (git-ignored, carried: the wheels the image lacks; cpu/llama-src.tgz, llama.cpp's
# sources from the pinned llama-cpp-python sdist less models, docs and tests; cpu/<model>.header,
# a model's GGUF header from benchmarks/random_gguf.py), it
#   1. writes the model's GGUF with random weights of its real shapes (benchmarks/random_gguf.py),
#   2. builds llama.cpp there (-DGGML_NATIVE=ON: that host's ISA) while Sluice's CPU kernels build,
#   3. runs benchmarks/cpu_decode_bench.py on that GGUF, same run, turn about, on THREADS threads,
#      at QUANTS with the layer kernels CPU_KERNELS (both by default; one device call holds the
#      1.5B at one of each).
# Results go to benchmarks/results/cpu_decode_bench-<isa>-<model>.json (and $OUT when set).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
THREADS=${THREADS:-2}
QUANTS=${QUANTS:-int8-dot int4}
CPU_KERNELS=${CPU_KERNELS:-off on}
export PYTHONUNBUFFERED=1 SLUICE_CACHE=${SLUICE_CACHE:-/tmp/sluice-cache}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sluice-site .whl/*.whl
export PYTHONPATH=/tmp/sluice-site:$PWD PATH=/tmp/sluice-site/bin:$PATH
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400

gguf=/tmp/$MODEL.gguf
$PY benchmarks/random_gguf.py fill ".whl/cpu/$MODEL.header" "$gguf"
mkdir -p "$SLUICE_CACHE/llama.cpp/0.3.36"
tar xzf .whl/cpu/llama-src.tgz -C "$SLUICE_CACHE/llama.cpp/0.3.36"
start=$SECONDS
(cd benchmarks && $PY -c "import cpu_decode_bench as b; print('llama.cpp built:', b.llama_cpp())") &
build=$!
$PY -c "from kernels import layer_cpu; assert layer_cpu.load() is not None, 'layer kernels did not build'"
wait $build
echo "builds took $((SECONDS - start)) s"

isa=$($PY -c "import torch; print('avx512' if torch.cpu._is_avx512_supported() else 'avx2')")
out=benchmarks/results/cpu_decode_bench-$isa-$MODEL.json
$PY benchmarks/cpu_decode_bench.py --models "$gguf" --quants $QUANTS --cpu-kernels $CPU_KERNELS \
    --threads "$THREADS" --out "$out"
if [ -n "${OUT:-}" ]; then cp "$out" "$OUT/"; fi
