"""AllReduce (and allgather, broadcast, reduce_scatter) latency and bandwidth, nccl-tests style.

    torchrun --nproc-per-node 8 benchmarks/allreduce_benchmark.py -b 8 -e 256M -f 2
    python benchmarks/allreduce_benchmark.py --spawn 2 -b 8 -e 64M -f 4 --plot busbw.png

The same as `collective-ops bench`; see collective_ops/bench.py for the definitions.
"""

import sys

from collective_ops.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
