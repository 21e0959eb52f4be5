"""``blockdiag-cp plan``: size a CP run too big for this machine, from the real shard plan.

For each scheme (all-gather, needed-only, hybrid at every degree that divides the
group and the heads, pure Ulysses) it prints per-rank bytes on intra- and inter-node
links, the attention work on the busiest rank against the mean, and a predicted
time per layer (links at the given bandwidths, attention at the given rate, no
overlap), then what ``ulysses_degree="auto"`` would choose (Note [Scheme costs]).
Nothing of size S x S is built: 1M tokens at world 64 plans in seconds.

With ``--whole-batch`` it projects a data-parallel run instead (Note [Projecting a whole-batch
step]): documents of a length distribution packed into rows of ``--row-len`` tokens (best fit
decreasing), ``--dp`` rows per micro-batch, each replica's row on its ``--cp`` ranks against
one grouped plan over all ``dp x cp`` ranks, with the step's cost model of ``--model``: the
step time of both, the per-rank spread, bytes per link class and the planning time.
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


def schemes(world: int, heads: int, exchange: str, degree: str = "all", layout: str = "balanced") -> list[Scheme]:
    """All-gather and needed-only (degree 1), hybrid at each degree between (only `degree` when
    it is a number), pure Ulysses (none under the grouped layout: its shards differ in length)."""
    from ..plan.cost import candidate_degrees

    out = [Scheme("allgather", 1, "allgather"), Scheme(f"needed-only ({exchange})", 1, exchange)]
    if layout == "grouped":
        return out
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
    from ..plan import PlanOptions

    plan = make_plan(ids, args.world, args.layout, PlanOptions(ranks_per_node=args.gpus_per_node))
    costs = [(s, scheme_cost(plan, ids, s.degree, (args.heads, args.kv_heads), args.head_dim,
                             DTYPE_BYTES[args.dtype], s.exchange, args.gpus_per_node, v_head_dim(args)))
             for s in schemes(args.world, args.heads, args.exchange, args.ulysses_degree, args.layout)]
    return costs, time.perf_counter() - t0


def table(args: argparse.Namespace, costs: list[tuple[Scheme, SchemeCost]]) -> list[str]:
    lines = ["| scheme | MB/rank intra-node | MB/rank inter-node | work max/mean | predicted ms/layer |",
             "|---|---|---|---|---|"]
    for scheme, cost in costs:
        seconds = cost.seconds(layer_costs(args))
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
    per_layer = layer_costs(args)
    by_time = min(costs, key=lambda sc: float(sc[1].seconds(per_layer).max()))
    return by_bytes.name, by_time[0].name


def run_plan(args: argparse.Namespace) -> int:
    if args.whole_batch:
        return run_whole_batch(args)
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


def layer_costs(args: argparse.Namespace):
    """The `StepCosts` a layer's predicted time is costed with: a pair of one head at ``--head-dim`` /
    ``--v-head-dim`` and ``--tflops``, links at ``--intra-gbps`` / ``--inter-gbps``."""
    from ..plan.step_costs import StepCosts

    return StepCosts.for_attention(head_dim=args.head_dim, v_head_dim=v_head_dim(args), tflops=args.tflops,
                                   intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps)


def v_head_dim(args: argparse.Namespace) -> int:
    """The values' head dim: ``--v-head-dim``, else ``--head-dim``."""
    return args.head_dim if args.v_head_dim is None else args.v_head_dim


def head_dims(args: argparse.Namespace) -> str:
    """``"128"``, or ``"192 (values 128)"`` when the values' head dim differs (MLA)."""
    dv = v_head_dim(args)
    return f"{args.head_dim}" if dv == args.head_dim else f"{args.head_dim} (values {dv})"


def plan_problem(args: argparse.Namespace) -> str | None:
    """Why these ``plan`` settings cannot be planned (None if they can)."""
    if args.whole_batch:
        return whole_batch_problem(args)
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
    add_whole_batch_args(p, positive)


# ---------------------------------------------------------------------------
# --whole-batch: fixed rows against the grouped plan (Note [Projecting a whole-batch step])

#: model presets of ``--model`` (a path to a config.json works too): StepCosts.for_transformer's sizes
MODELS = MappingProxyType({
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256),
    "llama-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    "qwen3-30b-a3b": dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=768, vocab=151936,
                          active_experts=8),
})
LENGTHS_HELP = ("lognormal[:MU:SIGMA] (default 7.0:1.2, median 1.1k tokens: SFT), powerlaw[:A] (Pareto from 64 "
                "tokens, shape A, default 1.3), longmix (SFT lengths with 5%% long documents of a quarter to two "
                "rows), or file:PATH (one length per line)")


def add_whole_batch_args(p: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    group = p.add_argument_group("whole batch (--whole-batch)")
    group.add_argument("--whole-batch", action="store_true",
                       help="project fixed rows (each replica's row on its cp ranks) against one grouped plan over "
                            "all dp x cp ranks, from a length distribution")
    group.add_argument("--lengths", default="lognormal", help="document lengths: " + LENGTHS_HELP)
    group.add_argument("--dp", type=positive, default=8, help="data-parallel replicas (rows per micro-batch)")
    group.add_argument("--cp", type=positive, default=4, help="CP ranks per replica")
    group.add_argument("--row-len", type=positive, default=32768, help="tokens per packed row")
    group.add_argument("--model", default="llama-1b",
                       help=f"the cost model: {', '.join(MODELS)}, or a path to a transformers config.json")
    group.add_argument("--batches", type=positive, default=8, help="micro-batches projected (averaged)")
    group.add_argument("--token-cap", type=float, default=1.25, help="a rank's tokens at most this times the mean")
    group.add_argument("--seed", type=int, default=0, help="seed of the lengths and of the row shuffle")


def whole_batch_problem(args: argparse.Namespace) -> str | None:
    """Why these ``--whole-batch`` settings cannot be projected (None if they can)."""
    import os

    kind, _, rest = args.lengths.partition(":")
    numbers = rest.split(":") if rest else []
    if kind == "file":
        if not os.path.isfile(rest):
            return f"--lengths {args.lengths!r}: no such file"
    elif kind not in ("lognormal", "powerlaw", "longmix") or (kind == "longmix" and numbers) or \
            len(numbers) > {"lognormal": 2, "powerlaw": 1}.get(kind, 0) or not all(_is_number(n) for n in numbers):
        return f"--lengths {args.lengths!r}: use {LENGTHS_HELP.replace('%%', '%')}"
    if kind == "powerlaw" and numbers and float(numbers[0]) <= 0:
        return f"--lengths {args.lengths!r}: the shape must be positive"
    if args.model not in MODELS and not os.path.isfile(args.model):
        return f"--model {args.model!r}: use one of {', '.join(MODELS)} or a path to a config.json"
    if args.dp * args.cp > 65536:
        return f"--dp x --cp = {args.dp * args.cp} ranks: at most 65536"
    if not args.token_cap >= 1.0:
        return f"--token-cap {args.token_cap}: must be >= 1 (a multiple of the mean tokens per rank)"
    if min(args.intra_gbps, args.inter_gbps, args.tflops) <= 0:
        return "--intra-gbps, --inter-gbps and --tflops must be positive"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def sample_lengths(spec: str, tokens: int, row_len: int, seed: int):
    """Document lengths (numpy int64) of `spec` until they hold at least `tokens` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    kind, _, rest = spec.partition(":")
    if kind == "file":
        with open(rest) as f:
            pool = np.array([int(line) for line in f if line.strip()], dtype=np.int64)
        if pool.size == 0 or pool.min() < 1:
            raise ValueError(f"--lengths {spec!r}: the file must hold positive lengths, one per line")
        repeats = -(-tokens // int(pool.sum()))
        return np.tile(pool, repeats)
    numbers = [float(n) for n in rest.split(":")] if rest else []
    count = max(16, int(2 * tokens / 1000))
    if kind == "lognormal":
        mu, sigma = (numbers + [7.0, 1.2][len(numbers):])[:2]
        lengths = rng.lognormal(mu, sigma, count)
    elif kind == "powerlaw":
        shape = numbers[0] if numbers else 1.3
        lengths = 64 * (1 + rng.pareto(shape, count))
    else:  # longmix
        lengths = np.where(rng.random(count) < 0.05, rng.uniform(row_len / 4, 2 * row_len, count),
                           rng.lognormal(6.5, 1.0, count))
    lengths = np.maximum(1, lengths).astype(np.int64)
    keep = int(np.searchsorted(np.cumsum(lengths), tokens)) + 1
    return lengths[:keep] if keep <= lengths.size else np.concatenate(
        [lengths, sample_lengths(spec, tokens - int(lengths.sum()), row_len, seed + 1)])


def model_costs(args: argparse.Namespace):
    """The `StepCosts` of ``--model`` at ``--tflops`` and the link speeds."""
    import json
    from types import SimpleNamespace

    from ..plan.step_costs import StepCosts

    links = dict(tflops=args.tflops, intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps)
    if args.model in MODELS:
        return StepCosts.for_transformer(**MODELS[args.model], **links)
    with open(args.model) as f:
        config = json.load(f)
    text = config.get("text_config") or config
    return StepCosts.from_config(SimpleNamespace(**text), **links)


def run_whole_batch(args: argparse.Namespace) -> int:
    import numpy as np

    from ..plan.options import PlanOptions
    from ..plan.whole_batch import micro_batches, pack_rows, project

    costs = model_costs(args)
    lengths = sample_lengths(args.lengths, int(1.2 * args.dp * args.batches * args.row_len), args.row_len, args.seed)
    batches = micro_batches(pack_rows(lengths, args.row_len), args.dp, args.seed)[: args.batches]
    if not batches:
        print(f"blockdiag-cp plan: the lengths filled fewer than --dp {args.dp} rows")
        return 1
    options = PlanOptions(ranks_per_node=args.gpus_per_node, token_cap=args.token_cap, costs=costs)
    projections = [project(batch, args.cp, options) for batch in batches]
    world = args.dp * args.cp
    print(f"blockdiag-cp plan --whole-batch: dp {args.dp} x cp {args.cp} = {world} ranks ({args.gpus_per_node} per "
          f"node), rows of {args.row_len} tokens, lengths {args.lengths}, model {args.model} (a token costs "
          f"{costs.pairs_per_token:.0f} attention pairs), links {args.intra_gbps} / {args.inter_gbps} GB/s, "
          f"{args.tflops} TFLOP/s, {len(batches)} micro-batches")
    print("\n".join(whole_batch_table(projections, batches, args.cp, world)))
    fixed = sum(p.fixed_seconds for p in projections)
    grouped = sum(p.grouped.step_seconds for p in projections)
    ideal = sum(p.grouped.ideal for p in projections)
    tokens = np.mean([sum(int(r.sum()) for r in batch) for batch in batches])
    print(f"\nProjected: the grouped plan is {fixed / grouped:.2f}x faster than fixed rows, {grouped / ideal:.3f}x "
          f"the ideal (every document whole, no links, perfectly balanced). Planning: at most "
          f"{max(p.plan_seconds for p in projections):.2f} s per micro-batch of {tokens / 1e6:.2f}M tokens over "
          f"{world} ranks (one core).")
    print(host_work_line(batches[0], args, options))
    return 0


def host_work_line(batch, args: argparse.Namespace, options) -> str:
    """The host work of one rank's step for the first micro-batch: its state and token route built in this
    process (`WorldStepPlan.rank_step`), the max over rank 0 and the rank holding the most positions."""
    import time

    import torch

    from ..config import CPConfig
    from ..step.world_plan import plan_world_step

    rows = [r.tolist() + ([-(args.row_len - int(r.sum()))] if r.sum() < args.row_len else []) for r in batch]
    world_plan = plan_world_step(rows, args.dp, args.cp, CPConfig(layout="grouped", plan=options))
    lens = world_plan.plan.offsets[1:] - world_plan.plan.offsets[:-1]
    seconds = []
    for rank in dict.fromkeys([0, int(torch.argmax(lens))]):
        t0 = time.perf_counter()
        world_plan.rank_step(rank)
        seconds.append(time.perf_counter() - t0)
    return (f"Host work per rank: {max(seconds) * 1e3:.0f} ms per step (its step state and token route from the "
            f"global row, the max of ranks 0 and the fullest; every rank builds its own, beside the planning).")


def whole_batch_table(projections, batches, cp: int, world: int) -> list[str]:
    """The two plans' means over the micro-batches (fixed rows: every row balanced over its cp ranks, links free)."""
    import numpy as np

    def mean(values):
        return float(np.mean(list(values)))

    ideal = mean(p.grouped.ideal for p in projections)
    g = [p.grouped for p in projections]
    row_tokens = [np.array([r.sum() for r in batch]) for batch in batches]
    lines = ["| plan | step ms | x ideal | rank time max/mean | tokens max/mean | MB/rank intra | MB/rank inter | "
             "documents cut | planning s |", "|---|---|---|---|---|---|---|---|---|",
             f"| fixed rows (each replica's row on its {cp} ranks) | {mean(p.fixed_seconds for p in projections) * 1e3:.1f} "
             f"| {mean(p.fixed_seconds for p in projections) / ideal:.3f} | "
             f"{mean(p.fixed_seconds / p.grouped.ideal for p in projections):.3f} | "
             f"{mean(t.max() / t.mean() for t in row_tokens):.3f} | not modeled (free) | not modeled (free) | "
             "(a row's own) | - |",
             f"| grouped over all {world} ranks | {mean(x.step_seconds for x in g) * 1e3:.1f} | "
             f"{mean(x.step_seconds for x in g) / ideal:.3f} | {mean(x.seconds.max() / x.seconds.mean() for x in g):.3f} | "
             f"{mean(x.tokens.max() / x.tokens.mean() for x in g):.3f} | {mean(x.intra_bytes.max() for x in g) / 1e6:.1f} | "
             f"{mean(x.inter_bytes.max() for x in g) / 1e6:.1f} | {mean(x.split_documents for x in g):.1f} | "
             f"{max(p.plan_seconds for p in projections):.2f} |"]
    return lines
