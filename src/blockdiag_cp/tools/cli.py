"""Command line: ``blockdiag-cp demo | bench | verify | plan`` (also ``python -m blockdiag_cp``).

This module imports only argparse-level things and the torch-free registry and config, so
``blockdiag-cp --help`` (and a bad argument) answers without importing torch; each
subcommand's implementation (torch, transformers, matplotlib) is imported by its handler,
after the arguments are parsed and checked. Help texts are plain text: argparse prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import blockdiag_cp  # the package root is lazy: this imports no torch

from ..config import ENTRY_LAYOUT, CPConfig
from ..registry import EXCHANGES, KERNELS, LAYOUTS

#: the folder demo and bench write their files into, unless --out names another
OUT_DIR = "blockdiag_cp_out"

DESCRIPTION = ("Block-diagonal (per-document) context parallelism for packed sequences. "
               "python -m blockdiag_cp works the same.")

#: each subcommand's one-line description (its --help and the list in blockdiag-cp --help)
COMMANDS = MappingProxyType({
    "demo": ("Train a tiny Llama under CP beside transformers alone in one process; compare the per-step losses, "
             "and the balanced layout's rank work and step time with the contiguous one's."),
    "verify": "Compare CP attention (output and gradients) with a float64 oracle for your settings.",
    "bench": "Time, peak memory, bytes sent and balance of one configuration.",
    "plan": "Size a run too big for this machine: bytes, work and predicted time per scheme.",
})


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _add_attention_args(p: argparse.ArgumentParser, world_help: str, layout_help: str = "",
                        layout: str | None = None) -> None:
    """--world, --exchange, --layout, --kernel: shared by demo, verify and bench (defaults as CPConfig(),
    the layout `layout` where given)."""
    defaults = CPConfig()
    gpu_only = " and ".join(KERNELS.gpu_only)
    p.add_argument("--world", type=_positive, default=2, help=world_help)
    p.add_argument("--exchange", choices=EXCHANGES.choices, default=defaults.kv_exchange,
                   help="how each rank gets the K/V rows its queries need. " + EXCHANGES.help())
    p.add_argument("--layout", choices=LAYOUTS.choices, default=defaults.layout if layout is None else layout,
                   help="which positions each rank owns" + layout_help + ". " + LAYOUTS.help())
    p.add_argument("--kernel", choices=KERNELS.choices, default=defaults.kernel,
                   help=f"the local attention kernel ({gpu_only}: only verify under torchrun on CUDA GPUs). "
                        + KERNELS.help())


def _add_out_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--out", default=OUT_DIR, metavar="FOLDER",
                   help=f"the folder to write {what} into, created if missing")


def _parsers() -> tuple[argparse.ArgumentParser, Mapping[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's parser (whose usage line a bad argument prints)."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="blockdiag-cp", description=DESCRIPTION, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"blockdiag-cp {blockdiag_cp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands", description="blockdiag-cp COMMAND --help shows its options")
    commands = {name: sub.add_parser(name, help=line, description=line, formatter_class=formatter)
                for name, line in COMMANDS.items()}

    demo = commands["demo"]
    _add_attention_args(demo, "CP ranks, spawned as gloo processes on CPU",
                        " (the verdict's run; the same rows are also trained under contiguous, the seed's layout, "
                        "or under balanced when it is contiguous, and both are shown)", layout=ENTRY_LAYOUT)
    demo.add_argument("--steps", type=_positive, default=20, help="training steps, one packed row each")
    demo.add_argument("--seq-len", type=_positive, default=1024, help="tokens of each packed row")
    demo.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="model and attention dtype")
    _add_out_arg(demo, "demo.png (loss curves; per-rank attention work and bytes sent, and step times, of both "
                       "layouts)")

    verify = commands["verify"]
    _add_attention_args(verify, "CP ranks, spawned as gloo processes on CPU; under torchrun the launched ranks")
    verify.add_argument("--segments", type=_segments, default="300,700,-20,500,24",
                        help="the packed row: document lengths, comma-separated; a negative n is n padding tokens")
    verify.add_argument("--heads", type=_positive, default=8, help="query heads")
    verify.add_argument("--kv-heads", type=_positive, default=2, help="K/V heads (divides --heads)")
    verify.add_argument("--head-dim", type=_positive, default=32, help="head dimension")
    verify.add_argument("--dtype", choices=("float64", "float32", "bfloat16", "float16"), default="float64",
                        help="q/k/v dtype (below float64 the tolerance is twice the dense reference's own error)")
    verify.add_argument("--checkpoint", choices=("none", "reentrant", "non_reentrant"), default="none",
                        help="run the attention under activation checkpointing of this kind")

    bench = commands["bench"]
    _add_attention_args(bench, "CP ranks, spawned as gloo processes on CPU")
    bench.add_argument("--seq-len", type=_positive, default=32768, help="tokens of the packed row")
    bench.add_argument("--docs", default="powerlaw:300",
                       help="document lengths a,b,c (rest padded) or a distribution: uniform:N, powerlaw:N "
                            "(N Pareto lengths: the packed-SFT row), one, mixed")
    bench.add_argument("--heads", type=_positive, default=8, help="query heads")
    bench.add_argument("--kv-heads", type=_positive, default=8, help="K/V heads (divides --heads)")
    bench.add_argument("--head-dim", type=_positive, default=64, help="head dimension")
    bench.add_argument("--repeats", type=_positive, default=3, help="timed forward+backward calls (after one warm-up)")
    bench.add_argument("--reference", choices=("auto", "yes", "no"), default="auto",
                       help="also run the seed's nemo-automodel reference (auto: when it is importable, up to "
                            "S = 8192)")
    _add_out_arg(bench, "bench.md (the table) and bench.png")

    from .plan import add_plan_args  # torch-free: the planning itself is imported by run_plan

    add_plan_args(commands["plan"], _positive)
    return parser, MappingProxyType(commands)


def build_parser() -> argparse.ArgumentParser:
    """The ``blockdiag-cp`` argument parser."""
    return _parsers()[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    command = commands[args.command]
    # Every error below is the subcommand's usage line and one line on stderr, exit code 2,
    # before anything runs.
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    problem = settings_problem(args)
    if problem is not None:
        command.error(problem)
    return HANDLERS[args.command](args)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _verify(args: argparse.Namespace) -> int:
    from .verify import run_verify

    return run_verify(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def _plan(args: argparse.Namespace) -> int:
    from .plan import run_plan

    return run_plan(args)


#: each subcommand's handler: it imports the implementation (torch and the rest) when it runs
HANDLERS: Mapping[str, Callable[[argparse.Namespace], int]] = MappingProxyType(
    {"demo": _demo, "verify": _verify, "bench": _bench, "plan": _plan})


def settings_problem(args: argparse.Namespace) -> str | None:
    """Why these settings cannot run (checked before any work starts), or None.

    Creates the ``--out`` folder, so a finished run never loses its result.
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
        if os.path.exists(out) and not os.path.isdir(out):
            return f"--out {out!r} is a file; --out names a folder"
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as exc:
            return f"--out {out!r}: cannot create the folder {os.path.abspath(out)!r} ({exc.strerror})"
        if not os.access(out, os.W_OK):
            return f"--out {out!r}: the folder {os.path.abspath(out)!r} is not writable"
    return None


def _launched_on_gpus(args: argparse.Namespace) -> bool:
    """verify under torchrun on a CUDA machine runs on the GPUs; everything else spawns CPU ranks."""
    import torch

    return args.command == "verify" and int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
