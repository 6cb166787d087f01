"""msrun worker: runs several worker scripts, in order, in one MindSpore process group.

``suite.py MODE PART [PART ...]``, each PART a script of this folder with its own arguments after
colons (``adapter:1e-06``); each script gets ``MODE`` as its first argument. Starting msrun costs
~15-20 s on a 2-core machine (its scheduler and every worker import MindSpore and rendezvous), more
than most checks take: one start per (mode, world size) keeps the suite short. Each part writes its
result under its own name (``write_result``); a part that raises writes its traceback instead, and the later parts
still run (a rank that dies, or a part that hangs until msrun's timeout, ends the start). The part
``after_shutdown`` runs after ``co.shutdown()``: which MindSpore class attributes differ from before the first
part (none should: the wrappers' replacements are removed at shutdown).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import collective_ops as co
from tests.msrun_harness import PART_ENV, PART_ERROR, write_result

HERE = Path(__file__).resolve().parent


def _mindspore_attributes() -> dict[str, dict]:
    from mindspore import nn
    from mindspore.train import amp

    owners = {"Cell": nn.Cell, "TrainOneStepCell": nn.TrainOneStepCell, "amp": amp}
    owners["TrainOneStepWithLossScaleCell"] = nn.TrainOneStepWithLossScaleCell
    return {name: dict(vars(owner)) for name, owner in owners.items()}


def _changed_since(before: dict[str, dict]) -> list[str]:
    now = _mindspore_attributes()
    return sorted(
        f"{owner}.{key}"
        for owner in before
        for key in set(before[owner]) | set(now[owner])
        if before[owner].get(key) is not now[owner].get(key)
        and (callable(before[owner].get(key)) or callable(now[owner].get(key)))  # (not counters such as instances')
    )


def main() -> None:
    mode, *parts = sys.argv[1:]
    before = _mindspore_attributes()
    after_shutdown = "after_shutdown" in parts
    parts = [part for part in parts if part != "after_shutdown"]
    for part in parts:
        script, *args = part.split(":")
        os.environ[PART_ENV] = part
        sys.argv = [str(HERE / f"{script}.py"), mode, *args]
        start = time.perf_counter()
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except Exception:  # this part's test fails with the traceback; the later parts still run
            write_result(co.get_rank(), {PART_ERROR: traceback.format_exc()})
        co.barrier()  # no part starts while a peer still finishes the last one
        print(f"suite.py: part {part} took {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    rank = co.get_rank()
    co.shutdown()  # ends with a barrier: no rank leaves while a peer still sends
    if after_shutdown:
        os.environ[PART_ENV] = "after_shutdown"
        write_result(rank, {"changed": _changed_since(before)})


main()
