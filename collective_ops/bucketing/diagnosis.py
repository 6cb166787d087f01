"""Why a bucket's collective did not complete: the errors a bucket manager raises, naming the ranks not taking
part (from each peer's progress, exchanged on the engine's side channel where it has one)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .interfaces import env_seconds

DEFAULT_STALL_TIMEOUT_S = 300.0


class StallError(RuntimeError):
    """A bucket's collective did not complete in time: some rank is not taking part."""


class CommunicationError(RuntimeError):
    """A bucket's collective failed (a peer exited, the network broke)."""


class CommHookError(RuntimeError):
    """Finishing a bucket failed outside the transport: a comm hook or its completion callback raised."""


def stall_timeout_from_env() -> float | None:
    """COLLECTIVE_OPS_STALL_TIMEOUT seconds (0 waits forever), default 300."""
    return env_seconds("COLLECTIVE_OPS_STALL_TIMEOUT", DEFAULT_STALL_TIMEOUT_S)


def is_transport_error(engine: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the transport (a peer gone, the network), as the engine tells it."""
    is_transport = getattr(engine, "is_transport_error", None)
    return is_transport is not None and is_transport(exc)


_BACKWARD_ADVICE = (
    "Every rank must run the same number of backward passes, and with data-dependent branches pass "
    "find_unused_parameters=True."
)
_BETWEEN_STEPS_ADVICE = (
    "A rank that stopped or crashed, or one busy between steps for longer (an evaluation, a checkpoint, a slow data "
    "loader on that rank alone), looks the same: give every rank's pauses alike, or a longer limit."
)


def diagnose(
    engine: Any,
    where: str,
    exc: BaseException,
    progress: dict,
    stall_timeout_s: float | None,
    advice: str = _BACKWARD_ADVICE,
) -> RuntimeError:
    """A clear error for a bucket that did not complete (``where``: which rank waited for what), naming the ranks
    not taking part. ``progress``: this rank's, as its peers' reports are compared with it; ``advice``: what to do
    about a stall."""
    if not isinstance(exc, TimeoutError):
        # an engine that cannot tell blames the transport
        if hasattr(engine, "is_transport_error") and not is_transport_error(engine, exc):
            return CommHookError(
                f"{where}: finishing it raised {type(exc).__name__}: {exc}. This is not a communication "
                "failure: the bucket's comm hook or its completion callback failed (see the chained error)."
            )
        peers, store_note = peer_view(engine, progress, stall_timeout_s)
        missing = [p for p, info in peers.items() if info is None]
        named = f" (ranks gone or not answering: {missing})" if missing else ""
        return CommunicationError(
            f"{where}, and its collective failed{named}. A peer rank probably exited or crashed "
            f"(its own log says why), or the network between ranks failed. The transport said: {exc}{store_note}"
        )
    mark_stalled = getattr(engine, "mark_stalled", None)
    if mark_stalled is not None:  # its groups cannot be destroyed now: the process must still exit
        mark_stalled()
    peers, store_note = peer_view(engine, progress, stall_timeout_s)
    lines = [_peer_line(peer, info, progress["step"]) for peer, info in sorted(peers.items())]
    missing = [p for p, info in peers.items() if info is None]
    return StallError(
        f"stall: {where} for {stall_timeout_s:g} s. "
        + (f"Ranks not taking part: {missing}. " if missing else "")
        + f"{advice} Set COLLECTIVE_OPS_STALL_TIMEOUT (seconds) to wait longer."
        + ("\n" + "\n".join(lines) if lines else "")
        + store_note
    )


@contextlib.contextmanager
def agreeing(manager: Any, what: str) -> Iterator[None]:
    """Around the collectives every rank issues between steps to agree on ``what`` (the first-step rebuild, a bucket
    size, a launch order): each blocking one inside is bounded by ``manager``'s stall timeout (where its engine can:
    ``engine.bounded``), and a stall or a failed peer there raises as a bucket's does, saying what this rank waited
    in and naming the ranks not taking part."""
    engine, timeout = manager.engine, manager.stall_timeout_s
    step = manager.steps_synced + (1 if getattr(manager, "deferred_pending", False) else 0)  # (owed ones count)
    with engine.bounded(timeout) if hasattr(engine, "bounded") else contextlib.nullcontext():
        try:
            yield
        except (StallError, CommunicationError):
            raise  # explained already
        except Exception as exc:
            if isinstance(exc, TimeoutError) or is_transport_error(engine, exc):
                where = f"rank {engine.rank} waited in {what}, after step {step}"
                progress = {"step": step, "agreeing": what}
                raise diagnose(engine, where, exc, progress, timeout, _BETWEEN_STEPS_ADVICE) from exc
            raise


def _peer_line(peer: int, info: dict | None, mine: int) -> str:
    if info is None:
        return (
            f"  rank {peer}: did not report: it is not waiting in a gradient reduction "
            "(it stopped, crashed, skipped a backward, or is blocked in another collective)"
        )
    differs = " <- a different step: a rank skipped or added a backward" if info["step"] != mine else ""
    if "agreeing" in info:  # between steps, in a collective every rank issues there
        return f"  rank {peer}: after step {info['step']}, in {info['agreeing']}{differs}"
    return (
        f"  rank {peer}: step {info['step']}, waiting for bucket {info['waiting_for_bucket']} of "
        f"{info['buckets']}, {info['gradients_ready']}/{info['gradients']} gradients ready{differs}"
    )


def peer_view(engine: Any, progress: dict, stall_timeout_s: float | None) -> tuple[dict[int, dict | None], str]:
    """Every peer's progress as it reported it on the side channel (None: no report), and a note where the
    side channel's host did not answer (then it is the rank named as not taking part)."""
    exchange = getattr(engine, "exchange_progress", None)
    if exchange is None:
        return {}, ""
    # peers stalled on the same bucket time out within moments of each other; a short timeout asks for a
    # prompt answer, so the wait for their reports is a quarter of it, at most 2 s
    grace_s = min(2.0, stall_timeout_s / 4) if stall_timeout_s else 2.0
    try:
        return exchange(progress, grace_s), ""
    except (TimeoutError, ConnectionError) as exc:  # the store's host is stopped or gone
        store_rank = getattr(engine, "store_rank", None)
        if store_rank is None or store_rank == engine.rank:
            return {}, f"\n  {exc}"
        return {store_rank: None}, f"\n  {exc}"
