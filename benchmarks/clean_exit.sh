#!/usr/bin/env bash
# How many 2-rank runs of a script that never calls shutdown exit non-zero (SIGABRT at interpreter exit).
#   bash benchmarks/clean_exit.sh 25            # the README's training loop on collective_ops, 25 x 2 runs
#   bash benchmarks/clean_exit.sh 15 ddp        # a plain torch DDP script without destroy_process_group()
#   COLLECTIVE_OPS_TRACE=1 bash benchmarks/clean_exit.sh 25   # with tracing on
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
for _ in $(seq 1 "$runs"); do
    port=$((30000 + RANDOM % 20000))
    for rank in 0 1; do
        COLLECTIVE_OPS_TRACE_DIR="$trace_dir" RANK=$rank WORLD_SIZE=2 DEVICE_ID=$rank MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port PYTHONPATH="$PWD" "$python" -c "$script" > /dev/null 2>&1 &
    done
    for _ in 1 2; do
        wait -n || failed=$((failed + 1))
    done
done
rm -rf "$trace_dir"
echo "$kind: $failed of $((2 * runs)) runs did not exit 0"
