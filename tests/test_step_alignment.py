"""A rank that skips a backward must not have its next gradients averaged with its peers' current ones.

Real 2-rank Gloo runs, many loops in one spawn: with a plain optimizer, a DistributedOptimizer and a sharded
one, every rank raises ``StepMisalignedError`` at the same reduced step with nothing of it applied, and training
goes on aligned afterwards; loops whose ranks legitimately differ in forwards (accumulating more micro-batches,
eval or no-grad forwards on one rank) train on; ``check_step_alignment=False`` trains on silently, as DDP does.
"""

from __future__ import annotations

from tests.harness import run_ranks

SKIPPING_RANK, SKIPPED_ITERATION, ITERATIONS = 1, 2, 5


def _loop(rank: int, optimizer_kind: str, check: bool = True) -> dict:
    """Rank 1 runs iteration 2's forward and skips its backward and step (its loss judged non-finite, say), then
    one iteration more than rank 0, so that both run as many backwards."""
    import torch

    import collective_ops as co
    from collective_ops.bucketing import StepMisalignedError
    from tests.models import MLP, rank_batch

    torch.manual_seed(0)
    model = co.wrap(MLP(), bucket_size_mb=0.001, check_step_alignment=check)
    if optimizer_kind == "plain":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        shard = optimizer_kind == "sharded"
        optimizer = co.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, shard=shard)
    errors, before_error, after_error = [], None, None
    for iteration in range(ITERATIONS + (rank == SKIPPING_RANK)):
        x, y = rank_batch(MLP, iteration, rank)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if rank == SKIPPING_RANK and iteration == SKIPPED_ITERATION:
            continue
        snapshot = [p.detach().clone() for p in model.parameters()]
        try:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if optimizer_kind != "plain":
                optimizer.synchronize()  # an error owed to the next forward surfaces in this iteration
        except StepMisalignedError as exc:
            errors.append((iteration, str(exc)))
            before_error = snapshot
            after_error = [p.detach().clone() for p in model.parameters()]
    if optimizer_kind != "plain":
        optimizer.synchronize()
    unchanged = before_error is not None and all(torch.equal(a, b) for a, b in zip(before_error, after_error))
    return {
        "errors": errors,
        "unchanged_by_the_refused_step": unchanged,
        "weights": [p.detach().tolist() for p in model.parameters()],
    }


def _legitimate_differences(rank: int) -> dict:
    """Ranks differ in forwards that are not a skipped backward: none of these may raise."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    torch.manual_seed(0)
    model = co.wrap(MLP(), bucket_size_mb=0.001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(iteration: int):
        x, y = rank_batch(MLP, iteration, rank)
        return torch.nn.functional.cross_entropy(model(x), y)

    # rank 1 accumulates one more micro-batch than rank 0 (each of its forwards has its backward)
    with model.no_sync():
        for micro in range(1 + rank):
            loss_of(micro).backward()
    loss_of(10).backward()
    optimizer.step()
    optimizer.zero_grad()
    # rank 0 alone runs a forward in eval mode, and one under no_grad, before the step's forward
    if rank == 0:
        model.eval()
        loss_of(11)
        model.train()
        with torch.no_grad():
            loss_of(12)
    loss_of(13).backward()
    optimizer.step()
    optimizer.zero_grad()
    # every rank runs two forwards for one backward
    (loss_of(14) + loss_of(15)).backward()
    optimizer.step()
    return {"weights": [p.detach().tolist() for p in model.parameters()]}


def _join_with_varying_forwards(rank: int) -> dict:
    """Inside join(), a rank out of data shadows the others' steps without a count of its own: iteration i runs
    i % 2 + 1 forwards on every rank, so the count of a joined rank's last step (2) is not the current one (1)."""
    import torch

    import collective_ops as co
    from tests.models import MLP, rank_batch

    torch.manual_seed(0)
    model = co.wrap(MLP(), bucket_size_mb=0.001)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for iteration in range(2 + rank):
            optimizer.zero_grad()
            losses = []
            for forward in range(iteration % 2 + 1):
                x, y = rank_batch(MLP, 10 * iteration + forward, rank)
                losses.append(torch.nn.functional.cross_entropy(model(x), y))
            sum(losses).backward()
            optimizer.step()
    return {"weights": [p.detach().tolist() for p in model.parameters()]}


def _host_group_beside_a_device_backend(rank: int) -> dict:
    """An engine on an accelerator (here its device type only: no accelerator on this machine) sends the tables
    on a Gloo group of its own, on host tensors, so that reading them never waits for the device's queue."""
    import copy

    import torch

    from collective_ops.bucketing import StepAlignment
    from collective_ops.runtime import get_engine

    gloo_engine = get_engine("torch")
    device_engine = copy.copy(gloo_engine)
    device_engine.device = torch.device("cuda")
    group, device = device_engine.host_group()
    alignment = StepAlignment(group, device)
    for _ in range(1 + rank):  # rank 1 ran one forward more behind its backward
        alignment.count_forward()
    alignment.backward_started()
    alignment.launch(device_engine, step=7, taking_part=True)
    error = alignment.settle(device_engine, timeout_s=30)
    return {
        "gloo": gloo_engine.host_group(),
        "device": device,
        "backend": None if group is None else torch.distributed.get_backend(group),
        "error": str(error),
    }


def alignment_checks(rank: int, world: int) -> dict:
    return {
        "plain": _loop(rank, "plain"),
        "deferred": _loop(rank, "deferred"),
        "sharded": _loop(rank, "sharded"),
        "unchecked": _loop(rank, "plain", check=False),
        "legitimate": _legitimate_differences(rank),
        "joined": _join_with_varying_forwards(rank),
        "host_group": _host_group_beside_a_device_backend(rank),
    }


def test_a_skipped_backward_is_refused_on_every_rank_and_training_goes_on() -> None:
    results = run_ranks(2, alignment_checks)
    for kind in ("plain", "deferred", "sharded"):
        outs = [results[rank][kind] for rank in range(2)]
        # rank 0's iteration 2 met rank 1's iteration 3: the only reduced step that mixed iterations
        assert [e[0] for e in outs[0]["errors"]] == [SKIPPED_ITERATION], (kind, outs[0]["errors"])
        assert [e[0] for e in outs[1]["errors"]] == [SKIPPED_ITERATION + 1], (kind, outs[1]["errors"])
        for out in outs:
            message = out["errors"][0][1]
            assert "reduced step 2" in message and "rank 0: 1, rank 1: 2" in message, message
            assert "torch.no_grad()" in message and "check_step_alignment=False" in message
            assert out["unchanged_by_the_refused_step"], f"{kind}: the refused step changed the weights"
        # aligned again afterwards: the replicas trained on together
        for a, b in zip(outs[0]["weights"], outs[1]["weights"]):
            assert a == b, kind
    unchecked = [results[rank]["unchecked"] for rank in range(2)]
    assert unchecked[0]["errors"] == unchecked[1]["errors"] == [], "without the check it trains on, as DDP"
    for kind in ("legitimate", "joined"):
        assert results[0][kind]["weights"] == results[1][kind]["weights"], kind
    for rank in range(2):
        host = results[rank]["host_group"]
        assert host["gloo"] == (None, "cpu"), "on Gloo the default group serves"
        assert (host["device"], host["backend"]) == ("cpu", "gloo"), host
        assert "reduced step 7" in host["error"] and "rank 0: 1, rank 1: 2" in host["error"], host
