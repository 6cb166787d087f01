#!/usr/bin/env bash
# Set up .venv (pinned CPU torch, mindspore, numpy<2, test tools) and run one task.
#   bash tools/bootstrap.sh demo   -> 2-rank CPU data-parallel ResNet-50 training
#   bash tools/bootstrap.sh test   -> the whole test suite
#   bash tools/bootstrap.sh setup  -> only the environment
set -euo pipefail
cd "$(dirname "$0")/.."
task="${1:-test}"
shift || true

PYTHON="${PYTHON:-python3}"
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# Reinstall only when the pinned requirements or the package metadata change.
stamp="$VENV/.collective-ops-setup"
want="$("$PYTHON" -c 'import hashlib; print(hashlib.sha256(open("requirements/dev.txt","rb").read() + open("pyproject.toml","rb").read()).hexdigest())')"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check -r requirements/dev.txt
    "$VENV/bin/python" -m pip install -qq --disable-pip-version-check --no-deps -e .
    echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"   # msrun starts workers with the python on PATH
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

case "$task" in
    setup) ;;
    demo)
        exec torchrun --nproc-per-node 2 --master-port "${MASTER_PORT:-29531}" examples/train_resnet.py \
            --steps 30 --image-size 32 --num-classes 10 "$@" ;;
    test)
        exec python -m pytest -q "$@" ;;
    *)
        echo "usage: bash tools/bootstrap.sh {demo|test|setup} [args...]" >&2; exit 2 ;;
esac
