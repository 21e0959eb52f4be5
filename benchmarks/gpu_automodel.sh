#!/usr/bin/env bash
# NeMo AutoModel's whole fine-tuning recipe with blockdiag-cp as its sharder, cp 2 beside cp 1, on a GPU machine
# (docs/automodel.md). Needs 2 GPUs, nemo-automodel 0.7.0 (its container or `pip install nemo-automodel`), this
# package (`pip install -e ".[hf]"`) and access to the config's model and dataset. Prints both runs' per-step losses;
# in bf16 they agree to bf16's precision, not bit for bit.
#
#   bash benchmarks/gpu_automodel.sh [config.yaml]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-examples/automodel/llama3_2_1b_blockdiag_cp2.yaml}
OUT=${OUT:-automodel_gpu_out}
mkdir -p "$OUT"
for cp in 2 1; do
    torchrun --standalone --nproc-per-node 2 -m nemo_automodel.recipes.llm.train_ft -c "$CONFIG" \
        --distributed.cp_size "$cp" --checkpoint.checkpoint_dir "$OUT/cp$cp" 2>&1 | tee "$OUT/cp$cp.log"
done
for cp in 2 1; do
    echo "== cp $cp"
    grep -o "'loss': [0-9.]*\|\"loss\": [0-9.]*\|loss [0-9.]*" "$OUT/cp$cp.log" | head -20 || true
done
