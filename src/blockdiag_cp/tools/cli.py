"""Command line: ``blockdiag-cp demo | bench | verify`` (also ``python -m blockdiag_cp``)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..config import KERNELS, KV_EXCHANGES, LAYOUTS


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
    p.add_argument("--exchange", choices=KV_EXCHANGES, default="auto")
    p.add_argument("--layout", choices=LAYOUTS, default="contiguous")
    p.add_argument("--kernel", choices=KERNELS, default="auto")


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
    bench.add_argument("--seq-len", type=_positive, default=8192)
    bench.add_argument("--docs", default="1500,3000,2500,1192",
                       help="document lengths (comma list) or a distribution: uniform:N, powerlaw:N, one")
    bench.add_argument("--heads", type=_positive, default=8)
    bench.add_argument("--kv-heads", type=_positive, default=8)
    bench.add_argument("--head-dim", type=_positive, default=64)
    bench.add_argument("--repeats", type=_positive, default=3)
    bench.add_argument("--reference", choices=("auto", "yes", "no"), default="auto",
                       help="also run the seed's nemo-automodel reference (auto: when it is importable)")
    bench.add_argument("--out", default="blockdiag_cp_bench", help="prefix of the .md and .png written")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        from .verify import run_verify

        return run_verify(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    from .bench import run_bench

    return run_bench(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
