"""Command line: ``blockdiag-cp demo | bench | verify | plan`` (also ``python -m blockdiag_cp``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from ..registry import EXCHANGES, KERNELS, LAYOUTS



def _segments(text: str) -> tuple[int, ...]:
    """``"1500,3000,-4,1192"`` -> segment lengths (negative = padding tokens)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"segments must be comma-separated integers, got {text!r}") from exc
    if not values or any(v == 0 for v in values) or not any(v > 0 for v in values):
        raise argparse.ArgumentTypeError("segments need at least one document (n > 0) and no zeros")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _add_attention_args(p: argparse.ArgumentParser, *, world: int = 2) -> None:
    p.add_argument("--world", type=_positive, default=world, help="CP ranks (spawned gloo processes on CPU)")
    p.add_argument("--exchange", choices=EXCHANGES.choices, default="auto")
    p.add_argument("--layout", choices=LAYOUTS.choices, default="contiguous")
    p.add_argument("--kernel", choices=KERNELS.choices, default="auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockdiag-cp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a tiny Llama under CP beside the single-process reference")
    _add_attention_args(demo)
    demo.add_argument("--steps", type=_positive, default=20)
    demo.add_argument("--seq-len", type=_positive, default=1024)
    demo.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    demo.add_argument("--out", default="blockdiag_cp_demo.png", help="where to write the PNG")

    verify = sub.add_parser("verify", help="compare CP attention with a float64 oracle for your settings")
    _add_attention_args(verify)
    verify.add_argument("--segments", type=_segments, default=_segments("300,700,-20,500,24"),
                        help="document lengths, comma-separated; a negative n is n padding tokens")
    verify.add_argument("--heads", type=_positive, default=8)
    verify.add_argument("--kv-heads", type=_positive, default=2)
    verify.add_argument("--head-dim", type=_positive, default=32)
    verify.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default="float64")
    verify.add_argument("--checkpoint", choices=("none", "reentrant", "non_reentrant"), default="none")

    bench = sub.add_parser("bench", help="time, memory, bytes and balance of one configuration")
    _add_attention_args(bench)
    bench.add_argument("--seq-len", type=_positive, default=32768)
    bench.add_argument("--docs", default="powerlaw:300",
                       help="document lengths (comma list) or a distribution: uniform:N, powerlaw:N, one, mixed "
                            "(default: 300 power-law documents, the packed-SFT row)")
    bench.add_argument("--heads", type=_positive, default=8)
    bench.add_argument("--kv-heads", type=_positive, default=8)
    bench.add_argument("--head-dim", type=_positive, default=64)
    bench.add_argument("--repeats", type=_positive, default=3)
    bench.add_argument("--reference", choices=("auto", "yes", "no"), default="auto",
                       help="also run the seed's nemo-automodel reference (auto: when it is importable)")
    bench.add_argument("--out", default="blockdiag_cp_bench", help="prefix of the .md and .png written")

    from .plan import add_plan_args

    plan = sub.add_parser("plan", help="size a run too big for this machine: bytes, work and time per scheme")
    add_plan_args(plan, _positive, (EXCHANGES.choices, LAYOUTS.choices))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = settings_problem(args)
    if problem is not None:
        parser.error(problem)  # one line on stderr, exit code 2, before anything runs
    if args.command == "verify":
        from .verify import run_verify

        return run_verify(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "plan":
        from .plan import run_plan

        return run_plan(args)
    from .bench import run_bench

    return run_bench(args)


def settings_problem(args: argparse.Namespace) -> Optional[str]:
    """Why these settings cannot run (checked before any work starts), or None.

    Creates the folder that ``--out`` writes into, so a finished run never loses its result.
    """
    if getattr(args, "heads", 1) % getattr(args, "kv_heads", 1):
        return f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}"
    if getattr(args, "kernel", None) in KERNELS.gpu_only and not _launched_on_gpus(args):
        return f"--kernel {args.kernel} needs CUDA GPUs (launch verify with torchrun on GPUs); use auto, sdpa or dense"
    if args.command in ("bench", "plan"):
        from .bench import doc_lengths

        try:
            doc_lengths(args.docs, args.seq_len)
        except ValueError as exc:
            return str(exc)
    if args.command == "plan":
        from .plan import plan_problem

        return plan_problem(args)
    out = getattr(args, "out", None)
    if out is not None:
        folder = os.path.dirname(os.path.abspath(out))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return f"--out {out!r}: cannot create the folder {folder!r} ({exc.strerror})"
        if not os.access(folder, os.W_OK):
            return f"--out {out!r}: the folder {folder!r} is not writable"
    return None


def _launched_on_gpus(args: argparse.Namespace) -> bool:
    """verify under torchrun on a CUDA machine runs on the GPUs; everything else spawns CPU ranks."""
    import torch

    return args.command == "verify" and int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
