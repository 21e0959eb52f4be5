"""The README stays short, its own-loop snippet is examples/own_loop.py, and what it names exists."""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from blockdiag_cp.testing import hang_timeout

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OWN_LOOP = ROOT / "examples" / "own_loop.py"

#: repository paths the README names: examples, benchmarks, docs, tests, src files
PATH_RE = re.compile(r"(?<![\w./-])((?:examples|benchmarks|docs|tests|src)/[\w./-]*\w\.(?:py|md|sh))")
#: markdown link targets inside the repository (anchors dropped)
LINK_RE = re.compile(r"\]\((?!https?://)([^)#\s]+)(?:#[^)\s]*)?\)")
#: dotted names under the package, not preceded by another dotted name (nemo_automodel....blockdiag_cp.batch) nor
#: by a dash (a stack's command-line key: torchtitan's --blockdiag_cp.cp_degree)
DOTTED_RE = re.compile(r"(?<![\w./-])blockdiag_cp(?:\.[A-Za-z_]\w*)+")


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_is_at_most_300_lines():
    assert len(README.splitlines()) <= 300


def test_own_loop_block_is_the_example_file():
    code = OWN_LOOP.read_text()
    blocks = [b for b in code_blocks(README, "python") if "examples/own_loop.py" in b.splitlines()[0]]
    assert len(blocks) == 1, "the README has exactly one code block starting with the own_loop.py launch line"
    assert blocks[0].strip("\n") == code.strip("\n")


def test_every_named_repository_path_exists():
    names = set(PATH_RE.findall(README)) | {t for t in LINK_RE.findall(README)}
    assert any(n.startswith("docs/") for n in names) and any(n.startswith("examples/") for n in names)
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert not missing, f"README names paths that do not exist: {missing}"


def test_docs_pages_link_to_existing_files():
    missing = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in LINK_RE.findall(page.read_text()):
            if not (page.parent / target).resolve().exists():
                missing.append(f"{page.name}: {target}")
    assert not missing, missing


def resolve_dotted(name: str) -> None:
    """Import the longest module prefix of `name`; the rest must be attributes of it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the module exists but one of its imports does not
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what is missing
        return
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("name", sorted(set(DOTTED_RE.findall(README))))
def test_named_module_paths_import(name):
    pytest.importorskip("transformers")
    if name.startswith("blockdiag_cp.integrations."):  # a stack's way in imports the stack (its own venv)
        pytest.importorskip(name.split(".")[2].removesuffix("_cpu"))
    resolve_dotted(name)


def test_readme_names_some_module_paths():
    assert "blockdiag_cp.trainer" in set(DOTTED_RE.findall(README))


@pytest.mark.slow  # a torchrun launch (the fast loop, -m "not slow", skips it)
def test_own_loop_runs_under_torchrun_on_gloo():
    pytest.importorskip("transformers")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(OWN_LOOP), "--steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_timeout(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+/2\s+loss (\S+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 2, proc.stdout
    assert all(math.isfinite(v) for v in losses)
