"""The command line: clear argument errors, and the demo's parity verdict on a short run."""

import subprocess
import sys

import pytest

from blockdiag_cp.tools.cli import build_parser, main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["verify", "--world", "0"], "positive"),
        (["verify", "--segments", "3,x"], "comma-separated integers"),
        (["verify", "--segments", "-4"], "at least one document"),
        (["demo", "--exchange", "teleport"], "invalid choice"),
        (["bench", "--layout", "zigzag"], "invalid choice"),
        ([], "required"),
    ],
)
def test_argument_errors_are_clear(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_rejects_bad_document_spec():
    from blockdiag_cp.tools.bench import doc_lengths

    with pytest.raises(ValueError, match="--docs"):
        doc_lengths("lots", 100)
    assert sum(doc_lengths("uniform:7", 100)) == 100
    assert doc_lengths("30,40", 100) == (30, 40, -30)


def test_verify_passes_on_spawned_ranks(capsys):
    code = main(["verify", "--world", "3", "--segments", "20,-3,31,2,9", "--heads", "4", "--kv-heads", "1",
                 "--head-dim", "8", "--layout", "balanced", "--exchange", "ring"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and out.count("[ok]") == 3


def test_demo_short_run_matches_reference(tmp_path):
    png = tmp_path / "demo.png"
    result = subprocess.run(
        [sys.executable, "-m", "blockdiag_cp", "demo", "--steps", "3", "--seq-len", "256", "--out", str(png)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: MATCH" in result.stdout and result.stdout.count(" match") == 3
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("argv, message", [
    (["plan", "--world", "8", "--ulysses-degree", "3"], "must divide --world 8"),
    (["plan", "--world", "8", "--heads", "4", "--kv-heads", "1", "--ulysses-degree", "8"], "and --heads 4"),
    (["plan", "--ulysses-degree", "some"], "use all, auto or a positive integer"),
    (["plan", "--docs", "powerlaw:0"], "--docs"),
    (["plan", "--inter-gbps", "0"], "must be positive"),
])
def test_plan_settings_errors_are_one_line_before_planning(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_sizes_a_million_tokens_at_world_64_and_names_the_auto_choice(capsys):
    assert main(["plan", "--world", "64", "--seq-len", str(1 << 20), "--docs", "one"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "scheme" not in line]
    names = [row.split("|")[1].strip() for row in rows]
    assert names[:2] == ["allgather", "needed-only (auto)"] and "hybrid u=8" in names
    assert "ulysses u=64" in names[-1] and "n/a" in rows[-1]  # 32 heads do not split over 64 ranks
    # one document over 8 nodes: the hybrid keeps the heavy traffic inside nodes
    inter = {name: float(row.split("|")[3]) for name, row in zip(names, rows) if "n/a" not in row}
    assert inter["hybrid u=8"] < inter["needed-only (auto)"] / 4
    assert "ulysses_degree='auto' (fewest bytes on the busiest rank): hybrid u=8" in out
