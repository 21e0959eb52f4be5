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
