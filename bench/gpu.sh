#!/usr/bin/env bash
# The benchmark suite at real sizes in bf16 on one GPU (ViT-B/16, DeBERTa-v3-base, TUPE-R and
# BERT-A base vs Hugging Face; disentangled attention to L = 4096; compile time; input
# pipelines), within a wall-clock budget (default 600 s: about 10 minutes in all).
#
#   bench/gpu.sh [OUT.md] [BUDGET_SECONDS]
#
# Needs CUDA builds of jax (pip install "jax[cuda12]==<the pinned jax version>") and torch on
# the GPU machine, with the rest of requirements.txt. An ML image that already has CUDA jax,
# torch, transformers, flax, optax and orbax lacks only grain, array-record, portpicker and
# ml-collections for this suite (BENCHMARKS.md, "GPU": installing them on a host without
# internet). Paste the tables from OUT.md into BENCHMARKS.md ("GPU" section), with the plots
# drawn beside it (OUT_throughput.png, OUT_attention.png).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-gpu-results.md}"
budget="${2:-600}"
python=$(command -v python || command -v python3) || { echo "gpu.sh: needs python or python3 on the PATH" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec "$python" -m bench --gpu --budget "$budget" --out "$out"
