"""Core benchmark: this library beside the seed's reference (nemo-automodel 0.7.0), same run.

Workload (issue "core library"): S=8192 tokens in 4 documents (1500, 3000, 2500, 1192),
cp=2 over gloo, fp32, 8 query and 8 K/V heads of 64, forward+backward, one thread per
rank; then S=65536 in 8 documents at cp=4 (this library only: the reference is killed
for memory at 16384 on cp=2). Prints a markdown table and writes docs/bench_core.md.

    pip install --no-deps nemo-automodel==0.7.0   # optional: the reference
    python benchmarks/core_vs_seed.py
"""

from __future__ import annotations

import pathlib
import sys

from blockdiag_cp.tools.bench import BenchSpec, format_table, limit_seconds, run_spec, seed_available


def main() -> int:
    small = BenchSpec((1500, 3000, 2500, 1192), world=2, repeats=5)
    big = BenchSpec((9000, 4000, 12000, 7000, 10536, 8000, 6000, 9000), world=4, repeats=2)
    results = [run_spec(small)]
    if seed_available():
        results.append(run_spec(BenchSpec(small.segments, impl="seed", world=2, repeats=3)))
    else:
        print("nemo-automodel not importable: the reference column is skipped", file=sys.stderr)
    limit_small = limit_seconds(small)
    lines = [format_table(results, limit_small), f"\nlimit (one process alone / 2): {limit_small:.3f} s"]
    if len(results) == 2:
        ours, ref = results
        lines.append(
            f"\nblockdiag-cp / reference: time {ours.seconds / ref.seconds:.3f} "
            f"(target <= 0.10), peak RSS per rank {max(ours.peak_rss_gb) / max(ref.peak_rss_gb):.3f} (target <= 0.20), "
            f"step peak per rank {max(ours.step_peak_gb) / max(ref.step_peak_gb):.3f}"
        )
    big_result = run_spec(big)
    limit_big = limit_seconds(big, repeats=1)
    lines += ["", format_table([big_result], limit_big), f"\nlimit (one process alone / 4): {limit_big:.3f} s"]
    text = "\n".join(lines)
    print(text)
    out = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bench_core.md"
    out.write_text("# Core benchmark (CPU, gloo, fp32, 8 heads of 64)\n\n" + text + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
