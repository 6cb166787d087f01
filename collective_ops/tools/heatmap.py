"""Read a communication trace; summarize it; render ranks × buckets heatmaps.

*Communication time*: a bucket's span from launch to completion, mean over steps.
*Wait skew*: for each step and bucket, how much later the last rank launched it than
this rank did (an allreduce cannot finish before its last rank joins), mean over steps.
A straggler has near-zero skew while every other rank waits on it. *Exposed*: the part of
a bucket's communication that finished after backward ended (not hidden by compute).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class TraceError(ValueError):
    """The trace file cannot be read as a collective-ops trace."""


def per_rank_files(path: str | Path) -> list[Path]:
    """The per-rank files a run leaves beside ``path`` when its ranks did not merge (no shutdown())."""
    path = Path(path)
    return sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix or '.json'}"), key=_rank_of)


def _rank_of(path: Path) -> int:
    digits = path.stem.rsplit(".rank", 1)[-1]
    return int(digits) if digits.isdigit() else 1 << 30


def resolve_trace_paths(paths: Sequence[str | Path]) -> list[Path]:
    """``paths``, where a merged file that does not exist stands for its run's per-rank files, if any."""
    resolved: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            resolved.append(path)
            continue
        ranks = per_rank_files(path)
        if not ranks:
            raise TraceError(
                f"{path}: no such file, and no per-rank files ({path.stem}.rank<N>{path.suffix or '.json'}) beside "
                "it. Tracing writes the merged file at collective_ops.shutdown() and each rank's own file at exit "
                "otherwise: was the run made with COLLECTIVE_OPS_TRACE=1, and did it write elsewhere "
                "(COLLECTIVE_OPS_TRACE_FILE / _DIR)?"
            )
        resolved.extend(ranks)
    return resolved


def load_events(paths: Sequence[str | Path]) -> list[dict]:
    """Events of one merged trace, or of several per-rank files (found by themselves for a missing merged one)."""
    if not paths:
        raise TraceError("no trace file given: pass --trace comm_trace.json")
    events: list[dict] = []
    for path in resolve_trace_paths(paths):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise TraceError(
                f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); the file may be truncated"
            ) from None
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not a text file; expected a JSON trace") from None
        items = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise TraceError(f"{path}: no 'traceEvents' list; is this a Chrome trace written by collective-ops?")
        for event in items:
            if not isinstance(event, dict) or "ph" not in event or "pid" not in event:
                raise TraceError(f"{path}: malformed event {str(event)[:120]!r} (needs at least 'ph' and 'pid')")
        events.extend(items)
    return events


@dataclass
class Analysis:
    ranks: list[int]
    buckets: list[int]
    steps: list[int]
    comm_ms: np.ndarray  # ranks × buckets
    wait_skew_ms: np.ndarray  # ranks × buckets
    exposed_ms: np.ndarray  # ranks × buckets
    bucket_bytes: dict[int, int] = field(default_factory=dict)
    primitive_calls: int = 0

    @property
    def slowest_rank(self) -> int:
        """The rank the others wait on: the smallest total wait skew."""
        return self.ranks[int(np.argmin(self.wait_skew_ms.sum(axis=1)))]

    @property
    def most_exposed_bucket(self) -> int:
        return self.buckets[int(np.argmax(self.exposed_ms.mean(axis=0)))]

    @property
    def hidden_share(self) -> float:
        total = float(self.comm_ms.sum())
        return 1.0 - float(self.exposed_ms.sum()) / total if total > 0 else float("nan")

    def summary(self) -> str:
        skew_per_rank = self.wait_skew_ms.mean(axis=1)
        others = [s for r, s in zip(self.ranks, skew_per_rank) if r != self.slowest_rank]
        lines = [
            f"trace: {len(self.ranks)} rank(s), {len(self.buckets)} bucket(s), {len(self.steps)} step(s), "
            f"{self.primitive_calls} primitive call(s)",
            f"slowest rank: {self.slowest_rank} (the others wait on it {np.mean(others) if others else 0.0:.2f} ms "
            "per bucket on average)",
            f"most exposed bucket: {self.most_exposed_bucket} "
            f"({self.exposed_ms.mean(axis=0).max():.2f} ms per step not hidden behind backward, "
            f"{self.bucket_bytes.get(self.most_exposed_bucket, 0) / 2**20:.2f} MiB)",
            f"communication hidden behind backward: {100 * self.hidden_share:.1f}%",
            "per rank: "
            + ", ".join(
                f"rank {r}: comm {c:.2f} ms, wait skew {s:.2f} ms"
                for r, c, s in zip(self.ranks, self.comm_ms.sum(axis=1), self.wait_skew_ms.sum(axis=1))
            ),
        ]
        return "\n".join(lines)


def analyze(events: Sequence[dict]) -> Analysis:
    bucket_events = [e for e in events if e.get("cat") == "bucket" and e.get("ph") == "X"]
    if not bucket_events:
        raise TraceError("the trace holds no bucket events: was a wrapped model trained with tracing on?")
    # Bucket numbers change meaning when the plan changes (the rebuild after step 1, a new size):
    # keep the plan of the latest step, the steady state.
    plans: dict[str, int] = {}
    for e in bucket_events:
        args = e.get("args")
        if isinstance(args, dict) and "plan" in args:
            plans[str(args["plan"])] = max(plans.get(str(args["plan"]), -1), int(args.get("step", -1)))
    if len(plans) > 1:
        latest = max(plans, key=plans.get)
        bucket_events = [e for e in bucket_events if str(e["args"].get("plan")) == latest]
    durations: dict[tuple[int, int], list[float]] = defaultdict(list)
    exposed: dict[tuple[int, int], list[float]] = defaultdict(list)
    launches: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)  # (step, bucket) -> rank -> ts
    sizes: dict[int, int] = {}
    for e in bucket_events:
        try:
            rank, args = int(e["pid"]), e["args"]
            bucket, step = int(args["bucket"]), int(args["step"])
            ts, dur = float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"malformed bucket event {str(e)[:160]!r}") from None
        durations[(rank, bucket)].append(dur / 1e3)
        exposed[(rank, bucket)].append(float(args.get("exposed_us") or 0.0) / 1e3)
        launches[(step, bucket)][rank] = ts
        sizes[bucket] = int(args.get("bytes", 0))
    ranks = sorted({r for r, _ in durations})
    buckets = sorted({b for _, b in durations})
    steps = sorted({s for s, _ in launches})
    shape = (len(ranks), len(buckets))
    comm, expo, skew = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    skew_samples: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (_step, bucket), by_rank in launches.items():
        last = max(by_rank.values())
        for rank, ts in by_rank.items():
            skew_samples[(rank, bucket)].append((last - ts) / 1e3)
    for i, r in enumerate(ranks):
        for j, b in enumerate(buckets):
            comm[i, j] = np.mean(durations.get((r, b), [0.0]))
            expo[i, j] = np.mean(exposed.get((r, b), [0.0]))
            skew[i, j] = np.mean(skew_samples.get((r, b), [0.0]))
    primitive_calls = sum(1 for e in events if e.get("cat") == "primitive")
    return Analysis(ranks, buckets, steps, comm, skew, expo, sizes, primitive_calls)


def render(analysis: Analysis, output: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 1.6 + 0.45 * len(analysis.ranks)
    width = min(4 + 0.5 * len(analysis.buckets), 20)
    fig, axes = plt.subplots(1, 2, figsize=(2 * width, height), squeeze=False)
    for ax, data, title, cmap in (
        (axes[0, 0], analysis.comm_ms, "communication time per bucket (ms, mean over steps)", "viridis"),
        (axes[0, 1], analysis.wait_skew_ms, "wait skew: time waited on the last rank (ms)", "magma"),
    ):
        image = ax.imshow(data, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("bucket (launch order)")
        ax.set_ylabel("rank")
        ax.set_yticks(range(len(analysis.ranks)), [str(r) for r in analysis.ranks])
        step = max(1, len(analysis.buckets) // 20)
        ax.set_xticks(range(0, len(analysis.buckets), step), [str(b) for b in analysis.buckets[::step]])
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        if data.size <= 200:
            bright = 0.6 * float(data.max()) if data.size else 0.0  # these colormaps are light at the top
            for (i, j), value in np.ndenumerate(data):
                color = "black" if value > bright else "white"
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7, color=color)
    fig.suptitle(
        f"slowest rank {analysis.slowest_rank}; most exposed bucket {analysis.most_exposed_bucket}; "
        f"{100 * analysis.hidden_share:.0f}% of communication hidden behind backward",
        fontsize=10,
    )
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def add_arguments(parser) -> None:
    parser.add_argument(
        "--trace",
        action="append",
        required=True,
        help="trace file (repeat for per-rank files); a merged file that does not exist is replaced by its run's "
        "per-rank files (NAME.rank<N>.json beside it) when there are any",
    )
    parser.add_argument(
        "--output", default="heatmap.png", help="PNG to write (its folder must exist; default: %(default)s)"
    )


def expected_world_size(paths: Sequence[str | Path]) -> int | None:
    """The world size the traces' writers recorded (the largest), or None."""
    sizes = []
    for path in resolve_trace_paths(paths):
        try:
            other = json.loads(path.read_text()).get("otherData", {})
        except (ValueError, AttributeError):
            continue
        if isinstance(other, dict) and isinstance(other.get("world_size"), int):
            sizes.append(other["world_size"])
    return max(sizes) if sizes else None


def run(args) -> int:
    import sys

    output = Path(args.output)
    if output.suffix.lower() != ".png":
        print(f"collective-ops heatmap: --output {output} must be a .png file", file=sys.stderr)
        return 2
    if not output.parent.is_dir():
        print(
            f"collective-ops heatmap: --output folder {output.parent} does not exist; create it first", file=sys.stderr
        )
        return 2
    try:
        analysis = analyze(load_events(args.trace))
        world = expected_world_size(args.trace)
    except TraceError as exc:
        print(f"collective-ops heatmap: {exc}", file=sys.stderr)
        return 2
    if world is not None and len(analysis.ranks) < world:
        missing = sorted(set(range(world)) - set(analysis.ranks))
        print(
            f"collective-ops heatmap: warning: the trace holds {len(analysis.ranks)} of {world} ranks "
            f"(missing: {missing}); pass every rank's file",
            file=sys.stderr,
        )
    print(analysis.summary())
    print(f"wrote {render(analysis, output)}")
    return 0
