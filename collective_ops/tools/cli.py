"""The ``collective-ops`` command line: ``info`` (and the tools that build on it)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from ..launch import backend_problem, detect_launch_env, probe_hardware, select_backend


def _topology() -> str:
    """The device topology as the platform's own tool prints it."""
    for tool, args in (("npu-smi", ["info", "-t", "topo"]), ("nvidia-smi", ["topo", "-m"])):
        if shutil.which(tool):
            try:
                result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=20)
                if result.returncode == 0 and result.stdout.strip():
                    return f"{tool} {' '.join(args)}:\n{result.stdout.rstrip()}"
            except (OSError, subprocess.TimeoutExpired):
                pass
    return f"no accelerator topology tool found; {os.cpu_count()} CPU core(s)"


def cmd_info(args: argparse.Namespace) -> int:
    """What init() would choose here; exit 1 when an asked-for --backend is unavailable."""
    env = detect_launch_env()
    probe = probe_hardware()
    mindspore = env.launcher == "msrun" and importlib.util.find_spec("mindspore") is not None and args.backend is None
    available = True
    if mindspore:  # init() joins MindSpore communication under msrun
        choice = "MindSpore communication (HCCL on Ascend, NCCL on GPU, MCCL on CPU: MindSpore's device target)"
    else:
        try:
            choice = select_backend(args.backend, probe)
        except (RuntimeError, ValueError) as exc:
            choice, available = f"unavailable: {exc}", False
    print(f"collective-ops {_version()}  (python {sys.version.split()[0]})")
    print(f"launcher      : {env.launcher}")
    print(f"framework     : {'mindspore' if mindspore else 'torch'}")
    print(f"rank/world    : {env.rank}/{env.world_size}  local_rank={env.local_rank}  DEVICE_ID={env.device_id}")
    if mindspore:
        print(
            f"rendezvous    : msrun scheduler at {env.master_addr or '127.0.0.1'}:{os.environ.get('MS_SCHED_PORT', '?')}"
        )
    else:
        print(f"rendezvous    : {env.master_addr or '127.0.0.1 (default, loopback)'}:{env.master_port or 29500}")
    print(
        f"torch_npu     : {'installed' if probe.torch_npu_installed else 'not installed'}; NPU visible: {probe.npu_available}"
    )
    print(f"CUDA visible  : {probe.cuda_available}")
    print(
        f"backend       : {choice}" + ("  (COLLECTIVE_OPS_BACKEND)" if os.environ.get("COLLECTIVE_OPS_BACKEND") else "")
    )
    for name in ("hccl", "nccl"):
        problem = backend_problem(name, probe)
        print(f"  {name:<5}: {'ready' if problem is None else problem}")
    print(_topology())
    return 0 if available else 1


def _version() -> str:
    from .. import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="collective-ops", description="Data-parallel gradient communication tools.")
    parser.add_argument("--version", action="version", version=f"collective-ops {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="what init() would choose here, and the device topology")
    info.add_argument("--backend", default=None, help="ask about a specific backend (hccl, nccl, gloo)")
    info.set_defaults(func=cmd_info)

    from . import bench

    bench_parser = sub.add_parser(
        "bench", help="collective benchmark (nccl-tests style), raw framework call beside collective_ops"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.run)

    from . import heatmap

    heatmap_parser = sub.add_parser("heatmap", help="summarize a communication trace and draw ranks x buckets heatmaps")
    heatmap.add_arguments(heatmap_parser)
    heatmap_parser.set_defaults(func=heatmap.run)

    from . import tune

    tune_parser = sub.add_parser(
        "tune", help="project a saved step profile to other world sizes and links (simulation) and pick bucket_size_mb"
    )
    tune.add_arguments(tune_parser)
    tune_parser.set_defaults(func=tune.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a relaunch (bench --link) repeats
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
