#!/usr/bin/env bash
# The stacks' own tests (issues #48, #53, #55), each in a venv of its own: axolotl, LLaMA-Factory, torchtitan, NeMo
# AutoModel and verl pin transformers / trl / accelerate / datasets versions that cannot share the main test venv
# (and each other's).
#
#   bash tests/stacks/run.sh [axolotl] [llamafactory] [torchtitan] [automodel] [verl]    # default: all five
#
# Per stack: .venv-<stack> (made once, reused), torch pinned first (never let pip pick torch: it would fetch a
# CUDA build), the stack's extra from pyproject.toml, then `pytest tests/stacks/test_<stack>*.py`. Exit status: the
# first failure's (every stack still runs). Install and test seconds are printed per stack.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
TORCH=${TORCH_PIN:-torch==2.13.0}

install() {  # install <stack>: venv, torch pinned, the extra (and whatever the stack needs beyond pip's reach)
    local stack=$1 venv=.venv-$1
    [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" || return 1
    echo "$TORCH" > "$venv/torch-pin.txt"
    "$venv/bin/pip" install --quiet "$TORCH" || return 1
    local try
    for try in 1 2; do  # a second try where the registry failed the first
        "$venv/bin/pip" install --quiet -c "$venv/torch-pin.txt" -e ".[$stack]" pytest hypothesis && break
        [ "$try" -eq 2 ] && return 1
    done
    if [ "$stack" = llamafactory ]; then
        # PyPI's torchvision / torchaudio are CUDA builds that do not load beside the CPU torch; LLaMA-Factory's text
        # SFT path never calls them (docs/llamafactory.md): torchvision out, torchaudio without its native library
        "$venv/bin/pip" uninstall --quiet -y torchvision
        rm -f "$venv"/lib/python3*/site-packages/torchaudio/lib/*.so
    fi
    if [ "$stack" = automodel ]; then
        # nemo-automodel's own requirements include CUDA-only packages; its CP and recipe modules are pure Python
        "$venv/bin/pip" install --quiet --no-deps nemo-automodel==0.7.0 || return 1
    fi
}

status=0
for stack in "${@:-axolotl llamafactory torchtitan automodel verl}"; do
    for s in $stack; do
        t0=$SECONDS
        if ! install "$s"; then
            echo "stacks: $s: install failed" >&2
            [ "$status" -eq 0 ] && status=1
            continue
        fi
        t1=$SECONDS
        PYTHONPATH=src:tests ".venv-$s/bin/python" -m pytest -q -p no:cacheprovider tests/stacks/test_"$s"*.py  # its own file and its extensions (test_torchtitan_pp.py)
        rc=$?
        echo "stacks: $s: install $((t1 - t0)) s, tests $((SECONDS - t1)) s, exit $rc"
        [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
    done
done
exit "$status"
