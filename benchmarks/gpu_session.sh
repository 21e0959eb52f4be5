#!/usr/bin/env bash
# The whole device check in one call (about 6 minutes on one H200, plus torchtitan where .whl/ holds it, verl where
# it imports and axolotl's QLoRA where axolotl and 2 GPUs are present): the CUDA tests,
# benchmarks/gpu_check.py, then FSDP2 through the Trainer (benchmarks/gpu_fsdp2_trainer.py).
# Run from the repository root; logs go to $OUT (or ./gpu_out).
# The project runs from src/ on PYTHONPATH: nothing is installed.
set -u
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
python3 - <<'PY' 2>&1 | tee -a "$out/machine.txt"
import importlib.util, inspect, torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
for name in ("transformers", "flash_attn", "transformer_engine", "triton"):
    spec = importlib.util.find_spec(name)
    print(name, getattr(__import__(name), "__version__", "?") if spec else "not installed")
try:
    from torch.nn.attention.varlen import varlen_attn
    print("torch varlen_attn", inspect.signature(varlen_attn))
except ImportError as exc:
    print("torch varlen_attn: none", exc)
PY
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" --timeout 90 \
    tests/gpu/test_cuda_kernels.py 2>&1 | tee "$out/test_gpu.log"
timeout "${CHECK_TIMEOUT:-300}" python3 benchmarks/gpu_check.py 2>&1 | tee "$out/gpu_check.md"
timeout "${FSDP2_TIMEOUT:-180}" torchrun --standalone --nproc-per-node 1 benchmarks/gpu_fsdp2_trainer.py 2>&1 \
    | tee "$out/fsdp2_trainer.log"
# torchtitan 0.3.0 (issue #48): its own run vs BlockDiagCPTrainer at cp 1; wheels carried in .whl/ (docs/torchtitan.md)
if [ -d .whl ] && ls .whl/torchtitan-*.whl >/dev/null 2>&1; then
    timeout "${TORCHTITAN_TIMEOUT:-300}" python3 benchmarks/gpu_torchtitan.py --wheels .whl \
        --out "$out/gpu_torchtitan.json" 2>&1 | tee "$out/gpu_torchtitan.log"
fi
# axolotl's QLoRA under BlockDiagCPPlugin (issue #52; refused on CPU, docs/axolotl.md): where axolotl is installed and
# 2 GPUs are visible, cp 2 against axolotl's single-GPU run of the same YAML
if python3 -c "import sys, torch, axolotl; sys.exit(torch.cuda.device_count() < 2)" 2>/dev/null; then
    PYTHONPATH=$PWD/src:$PWD/tests:$PWD/tests/stacks timeout "${AXOLOTL_TIMEOUT:-600}" python3 -m pytest -q -rs \
        -p no:cacheprovider -o addopts="" tests/stacks/test_axolotl.py -k qlora_on_gpus 2>&1 \
        | tee "$out/axolotl_qlora.log"
fi
# verl 0.9.1 (issue #53): the block-diagonal CP engine at cp 1 against verl's own FSDP engine on one GPU, where verl
# imports (it needs transformers >= 5.5.3, < 5.11, ray and tensordict: docs/verl.md#gpu says what a GPU run must check)
if python3 -c "import verl, ray, tensordict" >/dev/null 2>&1; then
    timeout "${VERL_TIMEOUT:-300}" torchrun --standalone --nproc-per-node 1 benchmarks/gpu_verl.py \
        --out "$out/gpu_verl.json" 2>&1 | tee "$out/gpu_verl.log"
else
    echo "verl not importable here (pip install -e '.[verl]' beside this torch): no verl run" | tee "$out/gpu_verl.log"
fi
