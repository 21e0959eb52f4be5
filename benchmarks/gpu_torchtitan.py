"""torchtitan on one GPU: blockdiag-cp's trainer against torchtitan's own run without CP (docs/torchtitan.md).

    python benchmarks/gpu_torchtitan.py [--wheels .whl] [--out benchmarks/results/gpu_torchtitan.json]

On CPU the tests compare BlockDiagCPTrainer at cp 2 with itself at cp 1 (FlexAttention has no CPU backward, so
torchtitan's own attention cannot train there). This script runs, each as one torchrun process on the GPU
(NCCL cannot put two ranks on one GPU, so no cp 2 here), torchtitan's unmodified entry path (no CPU launcher):

* ``titan``: torchtitan's own Trainer, its FlexAttention with the block-causal mask from ``positions``;
* ``ours``: `BlockDiagCPTrainer` at ``cp_degree`` 1 (the routed attention, the step, the loss reduction);

from the same initial weights (tests/stacks/torchtitan_run.py), 3 AdamW steps of a 2-layer llama3 debugmodel on
torchtitan's packed text rows, float32. It prints and saves the per-step losses, grad norms and the largest
parameter difference, and the leak probe of ``ours`` (first document perturbed: the other documents' token
losses), and exits 1 when a loss differs by more than 1e-4 relative or a document leaks.

torchtitan 0.3.0 and its pure-Python dependencies missing from the GPU image are installed from `--wheels`
(``pip install --no-deps --no-index``) into a folder put first on ``PYTHONPATH``.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "stacks"))
from torchtitan_assets import config_module, write_assets  # noqa: E402

STEPS = 3
SEQ_LEN = 256


def install_wheels(wheels: pathlib.Path, target: pathlib.Path) -> None:
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"no wheels in {wheels}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), *found], check=True)


def launch(root: pathlib.Path, name: str, config_fn: str, pythonpath: list[str]) -> tuple[dict, float]:
    cfg_dir = root / f"cfg_{name}"
    cfg_dir.mkdir()
    (cfg_dir / "tt_tiny_config.py").write_text(config_module(root, seq_len=SEQ_LEN, steps=STEPS, dump=root / f"out_{name}"))
    out = root / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(cfg_dir), *pythonpath]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(root / "hf_cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(ROOT / "tests" / "stacks" / "torchtitan_run.py"), str(out), str(root / "data_perturbed"),
           "--module", "tt_tiny_config", "--config", config_fn]
    start = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    wall = time.perf_counter() - start
    if run.returncode:
        print(run.stdout[-3000:], run.stderr[-6000:], sep="\n")
        raise SystemExit(f"{name} failed (exit {run.returncode})")
    return torch.load(out, weights_only=False), wall


def compare(ours: dict, titan: dict) -> dict:
    rel = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], titan["losses"])]
    params = max((ours["params"][k].float() - titan["params"][k].float()).abs().max().item() for k in ours["params"])
    probe, other = ours["probe"], ours["probe_other"]
    first = probe["doc_ids"] == 1
    others = ~first & (probe["labels"] != -100)
    leak = (other["nll"][others] - probe["nll"][others]).abs().max().item()
    moved = (other["nll"][first] - probe["nll"][first]).abs().max().item()
    return {"losses_ours": ours["losses"], "losses_titan": titan["losses"], "loss_rel_diff_max": max(rel),
            "grad_norms_ours": ours["grad_norms"], "grad_norms_titan": titan["grad_norms"],
            "param_abs_diff_max": params, "leak_other_docs_max": leak, "perturbed_doc_moved": moved,
            "documents_in_probe_row": int(probe["doc_ids"].max())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_torchtitan.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        site = root / "site"
        try:
            import torchtitan  # noqa: F401
        except ImportError:
            install_wheels(pathlib.Path(args.wheels), site)
        pythonpath = [str(site), str(ROOT / "src"), *sys.path]
        sys.path[:0] = [str(site)]
        write_assets(root)
        ours, ours_wall = launch(root, "ours", "tiny_llama3", pythonpath)
        titan, titan_wall = launch(root, "titan", "tiny_llama3_titan", pythonpath)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": STEPS, "seq_len": SEQ_LEN,
              "wall_s": {"titan": round(titan_wall, 1), "ours": round(ours_wall, 1)}, **compare(ours, titan)}
    print(json.dumps(result, indent=1))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    ok = result["loss_rel_diff_max"] < 1e-4 and result["leak_other_docs_max"] < 1e-5 and result["perturbed_doc_moved"] > 1e-3
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
