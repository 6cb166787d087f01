"""python tools/comm_heatmap.py --trace comm_trace.json --output heatmap.png  (= collective-ops heatmap)"""

import sys

from collective_ops.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["heatmap", *sys.argv[1:]]))
