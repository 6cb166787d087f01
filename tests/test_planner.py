"""Property tests of the framework-free planner (no framework imported)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collective_ops.bucketing import MIB, ParamSpec, plan_buckets

DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

param_lists = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=3 * MIB),
        st.sampled_from(sorted(DTYPES)),
        st.sampled_from(["cpu", "cuda:0", "cuda:1"]),
    ),
    min_size=1,
    max_size=40,
).map(lambda rows: [ParamSpec(f"p{i}", n, d, dev, DTYPES[d]) for i, (n, d, dev) in enumerate(rows)])
caps = st.sampled_from([0.25, 0.5, 1.0, 2.0, 5.0, 25.0])


def check_invariants(plan, params, bucket_mb, first_mb) -> None:
    seen = [i for b in plan.buckets for i in b.param_indices]
    assert sorted(seen) == list(range(len(params))), "every parameter exactly once"
    first_seen: set = set()
    for bucket in plan.buckets:
        members = [params[i] for i in bucket.param_indices]
        assert {(p.dtype, p.device) for p in members} == {(bucket.dtype, bucket.device)}, "no mixing"
        assert bucket.nbytes == sum(p.nbytes for p in members)
        assert list(bucket.offsets) == [sum(p.numel for p in members[:k]) for k in range(len(members))]
        key = (bucket.dtype, bucket.device)
        cap = int((first_mb if key not in first_seen else bucket_mb) * MIB)
        cap = min(cap, int(bucket_mb * MIB))
        first_seen.add(key)
        assert bucket.nbytes <= cap or len(members) == 1, "cap respected"
        for slot, index in enumerate(bucket.param_indices):
            assert plan.location[index] == (bucket.index, slot)


@settings(max_examples=200, deadline=None)
@given(params=param_lists, bucket_mb=caps, first_mb=caps)
def test_plan_invariants(params, bucket_mb, first_mb) -> None:
    plan = plan_buckets(params, bucket_mb, first_mb)
    check_invariants(plan, params, bucket_mb, first_mb)
    again = plan_buckets(params, bucket_mb, first_mb)
    assert again == plan and again.fingerprint() == plan.fingerprint(), "deterministic"


@settings(max_examples=200, deadline=None)
@given(params=param_lists, bucket_mb=caps, data=st.data())
def test_rebuild_keeps_invariants(params, bucket_mb, data) -> None:
    plan = plan_buckets(params, bucket_mb, 1.0)
    observed = data.draw(
        st.permutations(range(len(params))).flatmap(lambda p: st.just(p[: data.draw(st.integers(0, len(p)))]))
    )
    rebuilt = plan.rebuild(observed)
    check_invariants(rebuilt, params, bucket_mb, 1.0)
    # launch order follows the observed order: a bucket's first member never comes after a later bucket's
    position = {index: pos for pos, index in enumerate(rebuilt.order)}
    firsts = [position[b.param_indices[0]] for b in rebuilt.buckets]
    assert firsts == sorted(firsts)


def test_reverse_registration_order_and_first_bucket() -> None:
    params = [ParamSpec(f"layer{i}", MIB // 4, "float32", "cpu", 4) for i in range(10)]  # 1 MiB each
    plan = plan_buckets(params, bucket_size_mb=3, first_bucket_mb=1)
    groups = [[params[i].name for i in b.param_indices] for b in plan.buckets]
    assert groups == [
        ["layer9"],
        ["layer8", "layer7", "layer6"],
        ["layer5", "layer4", "layer3"],
        ["layer2", "layer1", "layer0"],
    ]
    assert "bucket 0" in plan.describe() and "layer9" in plan.describe()


def test_oversized_parameter_gets_its_own_bucket() -> None:
    params = [
        ParamSpec("small_a", 10, "float32", "cpu", 4),
        ParamSpec("huge", 10 * MIB, "float32", "cpu", 4),
        ParamSpec("small_b", 10, "float32", "cpu", 4),
    ]
    plan = plan_buckets(params, bucket_size_mb=1, first_bucket_mb=1)
    assert [list(b.param_indices) for b in plan.buckets] == [[2], [1], [0]]


def test_fused_count_matches_expectation() -> None:
    # 200 tensors totalling 60 MiB at 25 MiB -> 3 buckets per dtype
    params = [ParamSpec(f"w{i}", 60 * MIB // 4 // 200, "float32", "cpu", 4) for i in range(200)]
    params += [ParamSpec(f"h{i}", 60 * MIB // 2 // 200, "float16", "cpu", 2) for i in range(200)]
    plan = plan_buckets(params, bucket_size_mb=25, first_bucket_mb=25)
    assert sum(b.dtype == "float32" for b in plan.buckets) == 3
    assert sum(b.dtype == "float16" for b in plan.buckets) == 3


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, 1e12, "25", None, True])
def test_bad_bucket_sizes_are_refused(bad) -> None:
    params = [ParamSpec("w", 10, "float32", "cpu", 4)]
    with pytest.raises((ValueError, TypeError), match="bucket_size_mb"):
        plan_buckets(params, bucket_size_mb=bad)


def test_bad_plan_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        plan_buckets([])
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([ParamSpec("w", 1, "float32", "cpu", 4)] * 2)
    plan = plan_buckets([ParamSpec("w", 1, "float32", "cpu", 4)])
    with pytest.raises(ValueError, match="not a parameter index"):
        plan.rebuild([5])


def test_fingerprint_differs_when_plans_differ() -> None:
    a = [ParamSpec("w", 10, "float32", "cpu", 4), ParamSpec("b", 10, "float32", "cpu", 4)]
    b = [ParamSpec("w", 11, "float32", "cpu", 4), ParamSpec("b", 10, "float32", "cpu", 4)]
    assert plan_buckets(a).fingerprint() != plan_buckets(b).fingerprint()
    assert (
        plan_buckets(a).fingerprint()
        != plan_buckets(a, order=[0, 1], bucket_size_mb=1e-6, first_bucket_mb=1e-6).fingerprint()
    )


def test_row_sparse_tables_get_buckets_of_their_own() -> None:
    dense = [ParamSpec(f"layer{i}", MIB // 4, "float32", "cpu", 4) for i in range(4)]  # 1 MiB each
    table = ParamSpec("embed", 1000 * 16, "float32", "cpu", 4, rows=1000)
    params = [dense[0], table, *dense[1:]]
    plan = plan_buckets(params, bucket_size_mb=2, first_bucket_mb=2)
    groups = [[params[i].name for i in b.param_indices] for b in plan.buckets]
    # the dense buckets close as they would without the table; the table is alone, in its ready position
    assert groups == [["layer3", "layer2"], ["layer1", "layer0"], ["embed"]]
    plain = plan_buckets([*params[:1], ParamSpec("embed", 1000 * 16, "float32", "cpu", 4), *params[2:]], 2, 2)
    assert plain.fingerprint() != plan.fingerprint(), "ranks that disagree on a table must not agree on the plan"
    with pytest.raises(ValueError, match="rows=3 does not divide"):
        plan_buckets([ParamSpec("bad", 10, "float32", "cpu", 4, rows=3)])


def test_row_sparse_reduction_gives_up_after_dense_unions_in_a_row() -> None:
    from collective_ops.bucketing import RowSparseReduction

    plan = plan_buckets(
        [ParamSpec("embed", 100 * 4, "float32", "cpu", 4, rows=100), ParamSpec("w", 8, "float32", "cpu", 4)]
    )
    reduction = RowSparseReduction(mask_group="group", max_density=0.5, give_up_after=2)
    bucket = next(b.index for b in plan.buckets if b.param_indices == (0,))
    table = reduction.for_bucket(plan, bucket)
    assert (table.rows, table.cols, table.max_rows, table.mask_group) == (100, 4, 50, "group")
    assert reduction.for_bucket(plan, 1 - bucket) is None, "a dense parameter's bucket is reduced densely"
    table.record(80)
    table.record(10)  # a sparse step resets the streak
    table.record(51)
    assert reduction.for_bucket(plan, bucket) is not None
    table.record(100)
    assert reduction.given_up("embed") and reduction.for_bucket(plan, bucket) is None
    assert reduction.last_density["embed"] == 1.0
    with pytest.raises(ValueError, match="max_density"):
        RowSparseReduction(mask_group=None, max_density=0)


def test_row_exchanges_start_for_the_tables_whose_lookups_are_trusted() -> None:
    from collective_ops.bucketing import RowSparseReduction

    class Engine:
        def rows_union(self, mask, group):
            return ("union of", mask, group)

    class LookedUp:
        def __init__(self, name):
            self.name, self.taken = name, 0

        def take(self):
            self.taken += 1
            return f"{self.name} mask {self.taken}"

    specs = [ParamSpec(n, 100 * 4, "float32", "cpu", 4, rows=100) for n in ("a", "b", "c")]
    plan = plan_buckets(specs, bucket_size_mb=0.001, first_bucket_mb=0.001)
    reduction = RowSparseReduction(mask_group="masks", give_up_after=1)
    reduction.lookups = {n: LookedUp(n) for n in ("a", "b", "c")}
    reduction.untrusted.add("b")
    reduction.record("c", 1.0, sparse=False)  # given up
    reduction.start_exchanges(Engine())
    assert sorted(reduction.exchanges) == ["a"]
    bucket = next(b.index for b in plan.buckets if b.param_indices == (0,))
    table = reduction.for_bucket(plan, bucket)
    assert table.exchange.union == ("union of", "a mask 1", "masks") and table.exchange.local == "a mask 1"
    assert reduction.exchanges == {}, "an exchange is handed to one reduction only"
    table.distrust_lookups()
    reduction.start_exchanges(Engine())
    assert reduction.exchanges == {} and reduction.untrusted == {"a", "b"}


def test_core_imports_no_framework() -> None:
    code = (
        "import sys, collective_ops, collective_ops.bucketing; "
        "bad = [m for m in ('torch', 'mindspore') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engines_never_reach_back_into_the_runtime() -> None:
    """The runtime builds the engines; an engine importing the runtime would make a cycle."""
    import ast
    from pathlib import Path

    comm = Path(__file__).resolve().parents[1] / "collective_ops" / "comm"
    offenders = []
    for source in sorted(comm.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name == "runtime" or name.endswith(".runtime") for name in names):
                offenders.append(source.name)
    assert not offenders, f"engines importing collective_ops.runtime: {offenders}"
