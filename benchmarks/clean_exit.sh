#!/usr/bin/env bash
# How many 2-rank runs of a script that never calls shutdown exit non-zero (SIGABRT at interpreter exit).
#   bash benchmarks/clean_exit.sh 25            # the README's training loop on collective_ops, 25 x 2 runs
#   bash benchmarks/clean_exit.sh 15 ddp        # a plain torch DDP script without destroy_process_group()
#   COLLECTIVE_OPS_TRACE=1 bash benchmarks/clean_exit.sh 25   # with tracing on
#   bash benchmarks/clean_exit.sh 50 readme     # the README's train.py (which calls co.shutdown()), 50 x 2 runs
set -u
cd "$(dirname "$0")/.."
runs="${1:-25}"
kind="${2:-collective_ops}"
python="${PYTHON:-.venv/bin/python}"
if [ "$kind" = ddp ]; then
    script='
import torch, torch.distributed as dist
dist.init_process_group("gloo")
m = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
for s in range(3):
    m(torch.randn(4, 8)).sum().backward()
'
elif [ "$kind" = readme ]; then
    script=$("$python" -c 'import re, sys
blocks = re.findall(r"```python\n(.*?)```", open("README.md").read(), flags=re.S)
sys.stdout.write(next(b for b in blocks if b.startswith("# train.py\n")))')
else
    script='
import torch, collective_ops as co
co.init()
m = co.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), bucket_size_mb=0.0001)
for s in range(3):
    m(torch.randn(4, 8)).sum().backward()
'
fi
trace_dir=$(mktemp -d)
failed=0
aborted=0
log=$(mktemp)
for _ in $(seq 1 "$runs"); do
    port=$((30000 + RANDOM % 20000))
    for rank in 0 1; do
        COLLECTIVE_OPS_TRACE_DIR="$trace_dir" RANK=$rank WORLD_SIZE=2 DEVICE_ID=$rank MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port PYTHONPATH="$PWD" "$python" -c "$script" > /dev/null 2>> "$log" &
    done
    for _ in 1 2; do
        wait -n || failed=$((failed + 1))
    done
done
aborted=$(grep -c "terminate called without an active exception" "$log")
rm -rf "$trace_dir" "$log"
echo "$kind: $failed of $((2 * runs)) runs did not exit 0 ($aborted aborted at exit: 'terminate called without an active exception')"
