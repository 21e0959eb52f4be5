"""The command line: clear argument errors (the subcommand's usage line), defaults in every
--help, --version, files in --out, a --help that imports no torch, and the demo's parity verdict
on a short run."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import blockdiag_cp
from blockdiag_cp.testing import hang_timeout
from blockdiag_cp.tools.cli import COMMANDS, OUT_DIR, build_parser, main

HEAVY = ("torch", "transformers", "matplotlib")


def run_python(*args: str) -> subprocess.CompletedProcess:
    """A fresh interpreter (nothing imported yet), with this checkout's src/ first on the path."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=hang_timeout(120), env=env, check=False)


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
    assert doc_lengths("powerlaw:50:1.2", 4096) == doc_lengths("powerlaw:50", 4096)  # 1.2: the default shape
    heavy, light = doc_lengths("powerlaw:300:1.1", 32768), doc_lengths("powerlaw:300:2.0", 32768)
    assert sum(heavy) == sum(light) == 32768 and max(heavy) > max(light)  # the smaller shape, the heavier tail
    for bad in ("powerlaw:50:0", "powerlaw:50:x", "uniform:5:2"):
        with pytest.raises(ValueError, match="--docs"):
            doc_lengths(bad, 100)


@pytest.mark.slow  # spawns fresh ranks (seconds); the parity it prints is the fast loop's own
def test_verify_passes_on_spawned_ranks(capsys):
    code = main(["verify", "--world", "2", "--segments", "20,-3,31,2,9", "--heads", "4", "--kv-heads", "1",
                 "--head-dim", "8", "--layout", "balanced", "--exchange", "ring"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and out.count("[ok]") == 2


def test_python_dash_m_runs_the_same_command_line(capsys, monkeypatch):
    import runpy

    monkeypatch.setattr("sys.argv", ["blockdiag_cp", "--version"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("blockdiag_cp", run_name="__main__")
    assert stopped.value.code in (0, None) and capsys.readouterr().out.startswith("blockdiag-cp ")


#: the demo's line for each rank of the verdict's layout: its attention work over the mean
RANK_WORK_RE = re.compile(r"^  rank (\d+): attention work \d+ \(([\d.]+)x mean\)", flags=re.M)
#: the demo's line for the layout it compares with, on the same rows
COMPARED_RE = re.compile(r"^the same rows, layout=(\w+) .*: attention work per rank ([\d. /]+) of the mean", flags=re.M)
#: the demo's measured step time of each layout
STEP_TIME_RE = re.compile(r"^measured step time .*: balanced ([\d.]+) ms, contiguous ([\d.]+) ms", flags=re.M)


def run_demo_command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockdiag_cp", "demo", *argv], capture_output=True, text=True,
                          timeout=hang_timeout(600), check=False)


@pytest.mark.slow
def test_demo_short_run_matches_reference_and_writes_into_out(tmp_path):
    out = tmp_path / "new" / "folder"  # created by the CLI
    result = run_demo_command("--steps", "3", "--seq-len", "256", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verdict: MATCH" in result.stdout and result.stdout.count(" match") == 3
    assert "layout=balanced" in result.stdout and COMPARED_RE.search(result.stdout).group(1) == "contiguous"
    png = out / "demo.png"
    assert png.stat().st_size > 10_000 and f"wrote {png}" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["demo.png"]


@pytest.mark.slow
def test_demo_at_world_4_balances_every_rank_and_shows_what_contiguous_would_do(tmp_path):
    """The defaults at --world 4 (fewer, shorter steps): every rank's attention work within 5% of the mean,
    both layouts match the reference, and the seed's contiguous shards of the same rows are out of balance."""
    result = run_demo_command("--world", "4", "--steps", "2", "--seq-len", "512", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().splitlines()[-1].startswith("verdict: MATCH (balanced and contiguous;")
    ratios = {int(rank): float(ratio) for rank, ratio in RANK_WORK_RE.findall(result.stdout)}
    assert sorted(ratios) == [0, 1, 2, 3] and all(abs(r - 1) <= 0.05 for r in ratios.values()), ratios
    compared = COMPARED_RE.search(result.stdout)
    assert compared.group(1) == "contiguous" and max(map(float, compared.group(2).split(" / "))) > 1.2
    assert STEP_TIME_RE.search(result.stdout), result.stdout  # measured, both; no absolute time asserted


def test_the_demo_defaults_to_balanced_beside_contiguous(tmp_path, monkeypatch, capsys):
    """The demo's default run, its ranks' logs made from the real plans of its rows (no model trained, no
    ranks spawned): the layouts it trains, the report of both (work, bytes, step times, the plot), and a
    verdict that needs both to match. verify and bench keep CPConfig()'s layout."""
    from blockdiag_cp import CPConfig
    from blockdiag_cp.tools import demo

    parser = build_parser()
    assert parser.parse_args(["demo"]).layout == "balanced"
    assert parser.parse_args(["verify"]).layout == parser.parse_args(["bench"]).layout == CPConfig().layout
    assert demo.compared_layouts("contiguous") == ("contiguous", "balanced")
    spawned, off = {}, {}

    def spawn(fn, world, rows, dtype_name, layouts, exchange, kernel, reference, timeout):
        spawned.update(fn=fn, world=world, layouts=layouts)
        return [{layout: [planned_step(row, world, layout, loss + off.get(layout, 0.0))
                          for row, loss in zip(rows, reference)] for layout in layouts} for _ in range(world)]

    monkeypatch.setattr("blockdiag_cp.testing.spawn", spawn)
    monkeypatch.setattr(demo, "reference_losses", lambda rows, dtype: [3.0 - 0.5 * i for i in range(len(rows))])
    argv = ["demo", "--world", "4", "--steps", "2", "--seq-len", "256", "--out", str(tmp_path)]
    off["contiguous"] = 0.1  # the compared run off the reference: the verdict says so
    assert main(argv) == 1 and capsys.readouterr().out.rstrip().splitlines()[-1].startswith("verdict: MISMATCH")
    off.clear()
    assert main(argv) == 0
    assert spawned == {"fn": demo.cp_worker, "world": 4, "layouts": ("balanced", "contiguous")}
    out = capsys.readouterr().out
    assert "layout=balanced" in out and out.rstrip().splitlines()[-1].startswith("verdict: MATCH")
    ratios = [float(ratio) for _, ratio in RANK_WORK_RE.findall(out)]
    assert len(ratios) == 4 and all(abs(r - 1) <= 0.05 for r in ratios), out
    compared = COMPARED_RE.search(out)
    assert compared.group(1) == "contiguous" and max(map(float, compared.group(2).split(" / "))) > 1.2, out
    assert STEP_TIME_RE.search(out).groups() == ("20.0", "30.0"), out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "demo.png").stat().st_size > 10_000


def planned_step(row, world: int, layout: str, loss: float) -> dict:
    """A rank's log of one demo step: the real plan's work per rank, the reference's loss, made-up bytes and times."""
    import torch

    from blockdiag_cp import plan_shards
    from blockdiag_cp.plan.shard_plan import attention_work

    doc_ids = torch.repeat_interleave(torch.arange(1, len(row.lengths) + 1), torch.tensor(row.lengths))
    work = attention_work(plan_shards(doc_ids, world, layout), doc_ids).tolist()
    seconds = 0.02 if layout == "balanced" else 0.03
    return {"loss": loss, "sent_bytes": 1000, "work": work, "kv_bytes_planned": 900, "seconds": seconds,
            "exchange": "a2a", "kernel": "sdpa"}


@pytest.mark.parametrize("argv, message", [
    (["plan", "--world", "8", "--ulysses-degree", "3"], "must divide --world 8"),
    (["plan", "--world", "8", "--heads", "4", "--kv-heads", "1", "--ulysses-degree", "8"], "and --heads 4"),
    (["plan", "--ulysses-degree", "some"], "use all, auto or a positive integer"),
    (["plan", "--docs", "powerlaw:0"], "--docs"),
    (["plan", "--inter-gbps", "0"], "must be positive"),
    (["plan", "--whole-batch", "--lengths", "gamma"], "--lengths 'gamma'"),
    (["plan", "--whole-batch", "--lengths", "lognormal:7:x"], "--lengths"),
    (["plan", "--whole-batch", "--lengths", "powerlaw:-1"], "shape must be positive"),
    (["plan", "--whole-batch", "--lengths", "file:/no/such/file"], "no such file"),
    (["plan", "--whole-batch", "--model", "gpt-17"], "--model 'gpt-17'"),
    (["plan", "--whole-batch", "--token-cap", "0.5"], "--token-cap"),
    (["plan", "--whole-batch", "--dp", "0"], "--dp"),
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


def test_plan_whole_batch_projects_fixed_rows_against_the_grouped_plan(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [30000, 12000, 900, 300, 70, 5, 2000, 4500] * 40))
    assert main(["plan", "--whole-batch", "--lengths", f"file:{lengths}", "--dp", "4", "--cp", "2", "--row-len",
                 "32768", "--batches", "2", "--gpus-per-node", "4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| ") and "step ms" not in line}
    fixed, grouped = rows["fixed rows (each replica's row on its 2 ranks)"], rows["grouped over all 8 ranks"]
    assert float(grouped[0]) < float(fixed[0])  # the step, ms
    assert 0.9 < float(grouped[1]) < 1.1  # x ideal
    assert float(grouped[3]) <= 1.25 + 1e-3  # tokens max/mean under the cap
    assert "Projected: the grouped plan is" in out and "x faster than fixed rows" in out
    host = [line for line in out.splitlines() if line.startswith("Host work per rank: ")]
    assert len(host) == 1 and float(host[0].split()[4]) > 0


def test_plan_counts_mla_values_at_their_own_head_dim(capsys):
    """``--v-head-dim 128`` beside ``--head-dim 192`` (DeepSeek-V3): every scheme's bytes are (192 + 128) / (2 x 192)
    of the equal-width run's (K/V rows and head all-to-alls alike), so is its predicted time (the pairs' FLOPs
    scale with Dk + Dv too), and the header names both dims."""
    tables, times = [], []
    for extra in ([], ["--v-head-dim", "128"]):
        assert main(["plan", "--world", "4", "--seq-len", "8192", "--heads", "16", "--kv-heads", "16",
                     "--head-dim", "192", "--docs", "one", *extra]) == 0
        out = capsys.readouterr().out
        rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "scheme" not in line]
        tables.append({row[1].strip(): float(row[2]) + float(row[3]) for row in rows})
        times.append({row[1].strip(): float(row[5]) for row in rows})
    assert "heads of 192 (values 128)" in out and tables[0].keys() == tables[1].keys()
    for name, equal in tables[0].items():
        assert abs(tables[1][name] - equal * 320 / 384) <= 0.02, (name, equal, tables[1][name])
        assert abs(times[1][name] - times[0][name] * 320 / 384) <= 0.002, (name, times[0][name], times[1][name])


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"blockdiag-cp {blockdiag_cp.__version__}\n"


def option_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in a --help text (its lines up to the next option)."""
    entries, name = {}, None
    for line in help_text.splitlines():
        match = re.match(r"^  (-[\w-]+)", line)
        if match:
            name = match.group(1)
            entries[name] = line
        elif name and line.startswith("    "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_help_shows_its_usage_description_and_every_default(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: blockdiag-cp {command} ")
    assert " ".join(COMMANDS[command].split()) in " ".join(text.split())  # the one-line description
    entries = option_entries(text)
    assert len(entries) > 3 and "-h" in entries
    undocumented = [name for name, entry in entries.items() if name != "-h" and "(default: " not in entry]
    assert not undocumented, undocumented
    assert "`" not in text and "**" not in text and ":class:" not in text


def test_top_level_help_lists_every_subcommand_in_plain_text(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: blockdiag-cp ") and "--version" in text
    assert all(re.search(rf"^    {name}\s+\S", text, flags=re.MULTILINE) for name in COMMANDS)
    assert "`" not in text and "**" not in text


@pytest.mark.parametrize("argv, message", [
    (["demo", "--world", "0"], "argument --world: must be a positive integer"),  # argparse's own check
    (["verify", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["bench", "--heads", "3", "--kv-heads", "2"], "must be a multiple of --kv-heads"),  # checked after parsing
    (["plan", "--world", "8", "--ulysses-degree", "3"], "must divide --world 8"),
])
def test_a_bad_argument_prints_the_subcommand_usage_and_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: blockdiag-cp {argv[0]} ")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [err.splitlines()[-1]] and errors[0].startswith(f"blockdiag-cp {argv[0]}: error: ")
    assert message in errors[0]


def test_the_cli_module_and_every_help_import_no_torch():
    code = ("import sys, blockdiag_cp.tools.cli as cli\n"
            f"heavy = {HEAVY!r}\n"
            "assert not [m for m in heavy if m in sys.modules], 'imported by the cli module'\n"
            "parser = cli.build_parser()\n"
            "for command in (None, *cli.COMMANDS):\n"
            "    try:\n"
            "        parser.parse_args([command, '--help'] if command else ['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "assert not [m for m in heavy if m in sys.modules], 'imported by --help'\n")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert "usage: blockdiag-cp plan" in result.stdout


def test_the_package_root_is_lazy_and_its_public_names_import():
    code = ("import sys, blockdiag_cp\n"
            "assert 'torch' not in sys.modules, 'import blockdiag_cp imported torch'\n"
            "assert set(dir(blockdiag_cp)) >= set(blockdiag_cp.__all__)\n"
            "from blockdiag_cp import CPConfig, plan_shards, cp_blockdiag_sdpa\n"
            "assert 'torch' in sys.modules and CPConfig().layout == 'contiguous'\n"
            "assert cp_blockdiag_sdpa.__module__ == 'blockdiag_cp.attention' and callable(plan_shards)\n"
            "assert all(getattr(blockdiag_cp, name) is not None for name in blockdiag_cp.__all__)\n"
            "try:\n"
            "    blockdiag_cp.no_such_name\n"
            "except AttributeError as exc:\n"
            "    assert 'no_such_name' in str(exc)\n"
            "else:\n"
            "    raise AssertionError('no AttributeError')\n")
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr


def test_the_lazy_table_is_the_public_face():
    from types import MappingProxyType

    homes = blockdiag_cp._HOMES
    assert isinstance(homes, MappingProxyType) and set(homes) == set(blockdiag_cp.__all__)


def fake_bench(monkeypatch):
    """bench's measurements replaced by fixed numbers: what is left is the CLI and the files it writes."""
    from blockdiag_cp.tools import bench

    def run_spec(spec, timeout=900):
        ranks = [1.0] * spec.world
        return bench.BenchResult(spec, 0.01, ranks, ranks, ranks, [10] * spec.world, "a2a", "sdpa")

    monkeypatch.setattr(bench, "run_spec", run_spec)
    monkeypatch.setattr(bench, "limit_seconds", lambda spec, *a, **k: 0.005)


@pytest.mark.parametrize("out", [None, "made/by/the/cli"])
def test_bench_files_land_in_out(out, tmp_path, monkeypatch, capsys):
    fake_bench(monkeypatch)
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--seq-len", "64", "--docs", "uniform:2", "--reference", "no"]
    assert main(argv + (["--out", out] if out else [])) == 0
    folder = out or OUT_DIR
    plots = importlib.util.find_spec("matplotlib") is not None
    assert sorted(p.name for p in (tmp_path / folder).iterdir()) == ["bench.md", "bench.png"][: 1 + plots]
    assert "| blockdiag_cp | 64 | 2 | 2 | a2a | sdpa |" in (tmp_path / folder / "bench.md").read_text()
    md, png = os.path.join(folder, "bench.md"), os.path.join(folder, "bench.png")
    assert f"wrote {md}" + (f" and {png}" if plots else " (no plot written") in capsys.readouterr().out


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--out", str(blocker)])
    assert exc.value.code == 2
    assert "is a file; --out names a folder" in capsys.readouterr().err
