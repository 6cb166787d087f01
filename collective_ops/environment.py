"""The environment variables collective_ops reads, each checked once at ``init``.

A bad value fails there, with a ``ValueError`` naming the variable, its value and what it takes,
rather than later and elsewhere (a stall timeout of ``nan`` used to surface as a comm hook error at
the first backward, a ``MASTER_PORT`` of 99999 as a rendezvous timeout).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .launch import TORCH_BACKENDS


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _seconds_at_least_zero(text: str) -> bool:
    value = _number(text)
    return value is not None and value >= 0


def _seconds_above_zero(text: str) -> bool:
    value = _number(text)
    return value is not None and value > 0


def _integer_in(low: int, high: float) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        value = _integer(text)
        return value is not None and low <= value <= high

    return check


def _one_of(*choices: str) -> Callable[[str], bool]:
    return lambda text: text.lower() in choices


@dataclass(frozen=True)
class Variable:
    name: str
    takes: str  # completes "<name>=<value> is not ..."
    accepts: Callable[[str], bool]


SWITCH = ("1", "true", "yes", "on", "0", "false", "no", "off")
VARIABLES: tuple[Variable, ...] = (
    Variable(
        "COLLECTIVE_OPS_STALL_TIMEOUT",
        "a number of seconds >= 0 (0 waits forever; default 300)",
        _seconds_at_least_zero,
    ),
    Variable("COLLECTIVE_OPS_RENDEZVOUS_TIMEOUT", "a number of seconds > 0 (default 120)", _seconds_above_zero),
    Variable("COLLECTIVE_OPS_TRACE", f"a switch: one of {', '.join(SWITCH)}", _one_of(*SWITCH)),
    Variable(
        "COLLECTIVE_OPS_TRACE_MAX_EVENTS", "a whole number of events >= 1 (default 200000)", _integer_in(1, math.inf)
    ),
    Variable("COLLECTIVE_OPS_CHECK_SHAPES", "0 or 1", _one_of("0", "1")),
    Variable(
        "COLLECTIVE_OPS_BACKEND",
        f"a backend: one of {', '.join(TORCH_BACKENDS)}, mccl",
        _one_of(*TORCH_BACKENDS, "mccl"),
    ),
    Variable("MASTER_PORT", "a TCP port: a whole number in 1..65535", _integer_in(1, 65535)),
    Variable("RANK", "a whole number >= 0", _integer_in(0, math.inf)),
    Variable("WORLD_SIZE", "a whole number >= 1", _integer_in(1, math.inf)),
    Variable("LOCAL_RANK", "a whole number >= 0", _integer_in(0, math.inf)),
    Variable("DEVICE_ID", "a whole number >= 0", _integer_in(0, math.inf)),
)
# Read as given, any value taken: COLLECTIVE_OPS_TRACE_FILE, COLLECTIVE_OPS_TRACE_DIR (paths), COLLECTIVE_OPS_LOG_PLAN
# (any non-empty value), MASTER_ADDR (a host name or address; a wrong one fails the rendezvous, naming it).


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``ValueError`` for the first variable of :data:`VARIABLES` that is set (non-empty) to a value it
    does not take."""
    environ = os.environ if environ is None else environ
    for variable in VARIABLES:
        value = environ.get(variable.name, "").strip()
        if value and not variable.accepts(value):
            raise ValueError(
                f"environment variable {variable.name}={environ[variable.name]!r} is not {variable.takes}; "
                "set it to such a value, or unset it"
            )
