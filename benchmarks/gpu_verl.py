"""verl on one GPU: the block-diagonal CP engine at cp 1 against verl's own FSDP engine, on CUDA with verl's own
platform (no CPU fixture), through the same workers and steps as tests/stacks/test_verl.py.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_verl.py [--out verl_gpu.json]

Needs verl 0.9.1 importable (``pip install -e ".[verl]"``; benchmarks/gpu_session.sh runs this only then). Two PPO
steps (GAE with the critic where flash-attn is installed, else GRPO; dynamic batch size, gradient checkpointing,
float32) of the tiny Qwen2 with 6 heads over
3 KV heads, once per engine in this process; prints and writes the largest differences of the per-token outputs,
the logged losses and grad norms and the final parameters, and exits non-zero when one is beyond the tolerances of
tests/stacks/test_verl.py. What it checks that a CPU cannot: verl's CUDA platform and NCCL under the engine, the
engine's kernel choice on CUDA (``CPConfig(kernel="auto")``: flash-attn where installed, else SDPA), pinned-memory
offload of the reference model and verl's own critic loader (flash attention 2 where installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "stacks"), str(HERE.parent / "tests")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from test_verl import assert_same_training
    from verl_runs import Run, one_run, write_model

    # verl loads critics with flash attention 2: PPO with the critic where flash-attn is installed, else GRPO
    estimator = "gae" if importlib.util.find_spec("flash_attn") else "grpo"
    with tempfile.TemporaryDirectory() as root:
        run = Run("qwen2_6h", estimator=estimator)
        write_model(pathlib.Path(root), run.family, value=run.critic)
        verl_engine = one_run(run, root)
        ours = one_run(Run("qwen2_6h", estimator=estimator, engine=True), root)
    report = {"engines": [verl_engine["engines"], ours["engines"]], "per_token": {}, "params": {}}
    for key in ("old_log_probs", "entropys", "ref_log_prob", "values", "advantages")[:5 if run.critic else 3]:
        report["per_token"][key] = max(float((a[key] - b[key]).abs().max())
                                       for a, b in zip(ours["steps"], verl_engine["steps"]))
    for key in ("actor_params", "critic_params")[:2 if run.critic else 1]:
        report["params"][key] = max(float((ours[key][n] - verl_engine[key][n]).abs().max()) for n in ours[key])
    try:
        assert_same_training(ours, verl_engine)
        report["exact"] = True
    except AssertionError as exc:
        report["exact"], report["failure"] = False, repr(exc)
    print(json.dumps(report, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["exact"] else 1


if __name__ == "__main__":
    os.environ.setdefault("LOCAL_RANK", "0")
    sys.exit(main())
