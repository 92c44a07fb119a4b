"""The privacy events a mechanism declares and the ledger records: dp_accounting's `DpEvent`s,
and memaudit's own `RdpCurveEvent` for mechanisms dp_accounting has none for (distributed DP
with discrete noise); their JSON form, and how repetitions of one step's event compose.

A bottom module: the mechanisms (`memaudit.privacy.mechanisms`) build these events and the
ledger (`memaudit.privacy.ledger`) records them; neither imports the other for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import attr
import numpy as np
from dp_accounting import dp_event

_RDP_TYPE = "memaudit.RdpCurveEvent"


@dataclass(frozen=True, kw_only=True)
class RdpCurveEvent:
    """`count` repetitions of a mechanism given by its RDP curve ε(α) for one repetition.

    For mechanisms outside dp_accounting (e.g. distributed DP with discrete noise). ε(α) at
    an order not on the curve is bounded by the value at the next larger order (RDP is
    non-decreasing in α).
    """

    orders: tuple[float, ...]
    rdp: tuple[float, ...]
    count: int = 1
    label: str = ""

    def __post_init__(self) -> None:
        if len(self.orders) != len(self.rdp) or not self.orders:
            raise ValueError("RdpCurveEvent needs as many rdp values as orders (at least one)")
        if any(a <= 1 for a in self.orders):
            raise ValueError(f"RDP orders must be > 1, got {min(self.orders)}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")

    def at(self, orders: np.ndarray) -> np.ndarray:
        """Total RDP (times count) at `orders`, upper-bounded from the curve."""
        o = np.asarray(self.orders, dtype=np.float64)
        r = np.asarray(self.rdp, dtype=np.float64)
        idx = np.argsort(o)
        o, r = o[idx], np.maximum.accumulate(r[idx])
        pos = np.searchsorted(o, orders, side="left")
        out = np.full(len(orders), np.inf)
        ok = pos < len(o)
        out[ok] = r[pos[ok]] * self.count
        return out


Event = dp_event.DpEvent | RdpCurveEvent


# ----------------------------------------------------------------------------- serialisation
def event_to_dict(event: Event) -> dict[str, Any]:
    """A JSON-ready dict that `event_from_dict` turns back into an equal event."""
    if isinstance(event, RdpCurveEvent):
        return {"type": _RDP_TYPE, "orders": list(event.orders), "rdp": list(event.rdp),
                "count": event.count, "label": event.label}
    if not isinstance(event, dp_event.DpEvent):
        raise TypeError(f"not a DpEvent: {type(event).__name__}")
    out: dict[str, Any] = {"type": type(event).__name__}
    for key, value in attr.asdict(event, recurse=False).items():
        if isinstance(value, dp_event.DpEvent):
            value = event_to_dict(value)
        elif isinstance(value, list | tuple):
            value = [event_to_dict(v) if isinstance(v, dp_event.DpEvent) else v for v in value]
        out[key] = value
    return out


def event_from_dict(obj: dict[str, Any]) -> Event:
    kind = obj.get("type")
    if kind == _RDP_TYPE:
        # strict JSON writes an infinite RDP value as null
        rdp = tuple(math.inf if v is None else float(v) for v in obj["rdp"])
        return RdpCurveEvent(orders=tuple(obj["orders"]), rdp=rdp,
                             count=int(obj.get("count", 1)), label=obj.get("label", ""))
    cls = getattr(dp_event, str(kind), None)
    if not (isinstance(cls, type) and issubclass(cls, dp_event.DpEvent)):
        raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument type
            f"unknown privacy event type '{kind}' in the ledger; is the file corrupt?")
    kwargs = {}
    for key, value in obj.items():
        if key == "type":
            continue
        if isinstance(value, dict) and "type" in value:
            value = event_from_dict(value)
        elif isinstance(value, list):
            value = [event_from_dict(v) if isinstance(v, dict) and "type" in v else v for v in value]
        kwargs[key] = value
    return cls(**kwargs)


def steps_of(event: Event) -> int:
    if isinstance(event, RdpCurveEvent):
        return event.count
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count * steps_of(event.event)
    return 1


def with_count(event: Event, count: int) -> Event:
    if isinstance(event, RdpCurveEvent):
        return RdpCurveEvent(orders=event.orders, rdp=event.rdp, count=count, label=event.label)
    return dp_event.SelfComposedDpEvent(event.event, count)


def coalescable(event: Event) -> bool:
    return isinstance(event, RdpCurveEvent) or (
        isinstance(event, dp_event.SelfComposedDpEvent) and steps_of(event.event) == 1
    )


def repeated(event: Any, count: int) -> Any:
    """``count`` repetitions of one step's event, as the ledger would coalesce them."""
    if isinstance(event, RdpCurveEvent):
        return replace(event, count=event.count * int(count))
    return dp_event.SelfComposedDpEvent(event, int(count))
