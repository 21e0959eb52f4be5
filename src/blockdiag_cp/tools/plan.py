"""``blockdiag-cp plan``: size a CP run too big for this machine, from the real shard plan.

For each scheme (all-gather, needed-only, hybrid at every degree that divides the
group and the heads, pure Ulysses) it prints per-rank bytes on intra- and inter-node
links, the attention work on the busiest rank against the mean, and a predicted
time per layer (links at the given bandwidths, attention at the given rate, no
overlap), then what ``ulysses_degree="auto"`` would choose (Note [Scheme costs]).
Nothing of size S x S is built: 1M tokens at world 64 plans in seconds.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..registry import AUTO, EXCHANGES, LAYOUTS

if TYPE_CHECKING:
    from ..plan.cost import SchemeCost

# The planning modules import torch: they are imported inside the functions that plan, so
# that `add_plan_args` (what ``blockdiag-cp --help`` needs) imports nothing heavy.

#: the exchanges `plan` sizes between head-parallel groups: every one but ring
PLAN_EXCHANGES = tuple(e for e in EXCHANGES.choices if e != "ring")
DTYPE_BYTES = MappingProxyType({"bfloat16": 2, "float16": 2, "float32": 4})


@dataclass(frozen=True)
class Scheme:
    name: str
    degree: int
    exchange: str


def schemes(world: int, heads: int, exchange: str, degree: str = "all") -> list[Scheme]:
    """All-gather and needed-only (degree 1), hybrid at each degree between (only `degree` when
    it is a number), pure Ulysses."""
    from ..plan.cost import candidate_degrees

    out = [Scheme("allgather", 1, "allgather"), Scheme(f"needed-only ({exchange})", 1, exchange)]
    for u in candidate_degrees(world, heads):
        if 1 < u < world and (not degree.isdigit() or u == int(degree)):
            out.append(Scheme(f"hybrid u={u}", u, exchange))
    if heads % world == 0 and world > 1:
        out.append(Scheme(f"ulysses u={world}", world, exchange))
    return out


def plan_costs(args: argparse.Namespace) -> tuple[list[tuple[Scheme, SchemeCost]], float]:
    """Each scheme's cost for the row `args` describes, and the seconds planning took."""
    from ..plan import make_plan
    from ..plan.cost import scheme_cost
    from ..testing import doc_ids_from_lengths
    from .bench import doc_lengths

    t0 = time.perf_counter()
    ids = doc_ids_from_lengths(doc_lengths(args.docs, args.seq_len))
    plan = make_plan(ids, args.world, args.layout)
    costs = [(s, scheme_cost(plan, ids, s.degree, (args.heads, args.kv_heads), args.head_dim,
                             DTYPE_BYTES[args.dtype], s.exchange, args.gpus_per_node, v_head_dim(args)))
             for s in schemes(args.world, args.heads, args.exchange, args.ulysses_degree)]
    return costs, time.perf_counter() - t0


def table(args: argparse.Namespace, costs: list[tuple[Scheme, SchemeCost]]) -> list[str]:
    lines = ["| scheme | MB/rank intra-node | MB/rank inter-node | work max/mean | predicted ms/layer |",
             "|---|---|---|---|---|"]
    for scheme, cost in costs:
        seconds = cost.seconds(args.intra_gbps, args.inter_gbps, args.head_dim, args.tflops, v_head_dim(args))
        intra = float((cost.ulysses_intra + cost.kv_intra).max()) / 1e6
        inter = float((cost.ulysses_inter + cost.kv_inter).max()) / 1e6
        work = cost.work
        imbalance = float(work.max() / work.mean()) if float(work.mean()) > 0 else 1.0
        lines.append(f"| {scheme.name} | {intra:.2f} | {inter:.2f} | {imbalance:.3f} | {float(seconds.max()) * 1e3:.3f} |")
    return lines


def auto_choice(costs: list[tuple[Scheme, SchemeCost]], args: argparse.Namespace) -> tuple[str, str]:
    """What ``ulysses_degree='auto'`` takes (`cost.pick_degree` over the degrees of `--exchange`), and the
    fastest predicted scheme."""
    from ..plan.cost import pick_degree

    candidates = [(s, c) for s, c in costs if s.exchange == args.exchange]
    degree = pick_degree([c for _, c in candidates]).degree
    by_bytes = next(s for s, c in candidates if s.degree == degree)
    by_time = min(costs, key=lambda sc: float(sc[1].seconds(args.intra_gbps, args.inter_gbps, args.head_dim,
                                                             args.tflops, v_head_dim(args)).max()))
    return by_bytes.name, by_time[0].name


def run_plan(args: argparse.Namespace) -> int:
    costs, seconds = plan_costs(args)
    print(f"blockdiag-cp plan: world {args.world} ({args.gpus_per_node} per node), S = {args.seq_len}, "
          f"docs {args.docs}, layout {args.layout}, {args.heads}/{args.kv_heads} heads of {head_dims(args)}, "
          f"{args.dtype}; links {args.intra_gbps} / {args.inter_gbps} GB/s, attention {args.tflops} TFLOP/s")
    print("\n".join(table(args, costs)))
    if args.world > 1 and args.heads % args.world:
        print(f"| ulysses u={args.world} | n/a: {args.heads} query heads do not split over {args.world} ranks | | | |")
    bytes_pick, time_pick = auto_choice(costs, args)
    print(f"\nulysses_degree='auto' (fewest bytes on the busiest rank): {bytes_pick}; "
          f"fastest predicted: {time_pick}. Planned in {seconds:.1f} s.")
    return 0


def v_head_dim(args: argparse.Namespace) -> int:
    """The values' head dim: ``--v-head-dim``, else ``--head-dim``."""
    return args.head_dim if args.v_head_dim is None else args.v_head_dim


def head_dims(args: argparse.Namespace) -> str:
    """``"128"``, or ``"192 (values 128)"`` when the values' head dim differs (MLA)."""
    dv = v_head_dim(args)
    return f"{args.head_dim}" if dv == args.head_dim else f"{args.head_dim} (values {dv})"


def plan_problem(args: argparse.Namespace) -> str | None:
    """Why these ``plan`` settings cannot be planned (None if they can)."""
    degree = args.ulysses_degree
    if degree not in ("all", "auto") and not degree.isdigit():
        return f"--ulysses-degree {degree!r}: use all, auto or a positive integer"
    if degree.isdigit() and (int(degree) < 1 or args.world % int(degree) or args.heads % int(degree)):
        return f"--ulysses-degree {degree} must divide --world {args.world} and --heads {args.heads}"
    if min(args.intra_gbps, args.inter_gbps, args.tflops) <= 0:
        return "--intra-gbps, --inter-gbps and --tflops must be positive"
    return None


def add_plan_args(p: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    """The ``plan`` subcommand's options (positive: the CLI's positive-integer parser)."""
    exchanges = "; ".join([f"{AUTO}: the step picks (see docs)"]
                          + [f"{s.name}: {s.summary}" for s in EXCHANGES if s.name in PLAN_EXCHANGES])
    p.add_argument("--world", type=positive, default=64, help="CP ranks of the run being sized")
    p.add_argument("--gpus-per-node", type=positive, default=8, help="ranks per node (the links among them are intra-node)")
    p.add_argument("--ulysses-degree", default="all",
                   help="the rows to show: all (every scheme), auto (what ulysses_degree='auto' picks) or a degree")
    p.add_argument("--seq-len", type=positive, default=1 << 20, help="tokens of the packed row")
    p.add_argument("--docs", default="powerlaw:300",
                   help="document lengths, as for bench: a,b,c (rest padded), one, mixed, uniform:N or powerlaw:N")
    p.add_argument("--layout", choices=LAYOUTS.choices, default="balanced",
                   help="which positions each rank owns. " + LAYOUTS.help())
    p.add_argument("--exchange", choices=PLAN_EXCHANGES, default=AUTO,
                   help="the exchange between head-parallel groups (ring is not planned). " + exchanges)
    p.add_argument("--heads", type=positive, default=32, help="query heads")
    p.add_argument("--kv-heads", type=positive, default=8, help="K/V heads (divides --heads)")
    p.add_argument("--head-dim", type=positive, default=128, help="head dimension of queries and keys")
    p.add_argument("--v-head-dim", type=positive, default=None,
                   help="head dimension of values and the output (default: --head-dim; MLA models: e.g. 192 / 128)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16", help="K/V dtype on the wire")
    p.add_argument("--intra-gbps", type=float, default=400.0, help="per-GPU intra-node bandwidth, GB/s")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="per-GPU inter-node bandwidth, GB/s")
    p.add_argument("--tflops", type=float, default=400.0, help="attention throughput per GPU, TFLOP/s")
