"""Who secure aggregation protects against, and the bounds that follow.

Threat model (docs/secure-aggregation.md):

- ``honest_but_curious`` (default): the server follows the protocol but tries to learn
  individual inputs, and colludes with at most ``colluding`` (n_C) clients.
- ``malicious``: the server may deviate arbitrarily (drop, reorder, forge and send different
  messages to different clients), again with at most n_C colluding clients. Clients sign their
  keys and the survivor list (Ed25519) with keys distributed outside the server, and run
  Bonawitz et al.'s consistency-check round before they reveal any share.

memaudit runs SecAgg+ (Bell et al. 2020): client i's Shamir shares go to its h_i holders
(its neighbours and itself), and the threshold is a fraction of h_i. A server that shows
different survivor lists to different holders gets shares of the self-mask seed b_i from one
group and of the mask key s_sk_i from the other; with both it unmasks x_i alone. The groups
are disjoint among honest holders and the n_C colluders give both, so the attack needs
2t <= h_i + n_C. Every client's threshold must therefore exceed (h_i + n_C)/2, in both modes.
The malicious mode adds Bonawitz et al. 2017's condition t > 2h/3 with n_C < h/3 (their
Theorem A.2 pairs them), under which the signed survivor lists cannot be forked.

A round also needs ``min_survivors`` survivors (at least n_C + 2, so a released sum always
mixes two honest inputs): a cohort of one, or dropouts down to one survivor, would otherwise
reveal that client's update.

References:
    Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
    CCS 2017 (Sections 4 and 6, Appendix A). Bell et al., "Secure Single-Server Aggregation
    with (Poly)Logarithmic Overhead", CCS 2020.

>>> Policy(threshold=0.6).holder_threshold(5)
3
>>> min_threshold(5, colluding=1)
4
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from memaudit.federated.secagg.messages import SecAggAbort

Mode = Literal["honest_but_curious", "malicious"]
MODES = ("honest_but_curious", "malicious")


class ThresholdError(SecAggAbort, ValueError):
    """The Shamir threshold is below what the threat model needs for these holders."""


def min_threshold(holders: int, *, colluding: int = 0, mode: str = "honest_but_curious") -> int:
    """The smallest safe Shamir threshold for a client with ``holders`` holders.

    t > (h + n_C)/2 in both modes (no two survivor lists both reach t); in malicious mode
    also t > 2h/3 (Bonawitz et al. 2017). The result may exceed ``holders``: no threshold works.
    """
    t = (holders + colluding) // 2 + 1
    if mode == "malicious":
        t = max(t, (2 * holders) // 3 + 1)
    return t


def _fraction_needed(t: int, holders: int) -> float:
    """The smallest two-decimal threshold fraction f with ceil(f h) >= t (f h > t - 1)."""
    return round(math.floor(100 * (t - 1) / holders + 1e-9) / 100 + 0.01, 2)


@dataclass(frozen=True)
class Policy:
    """The public parameters every client and the server agree on before a round.

    Args:
        threshold: Shamir threshold as a fraction of each client's holders, in (0, 1].
        colluding: n_C, how many clients may collude with the server.
        min_survivors: a round aborts with fewer survivors (>= n_C + 2 and >= 2).
        mode: ``"honest_but_curious"`` or ``"malicious"``.
    """

    threshold: float = 0.6
    colluding: int = 0
    min_survivors: int = 3
    mode: str = "honest_but_curious"

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold fraction must be in (0, 1], got {self.threshold}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'honest_but_curious' or 'malicious', got {self.mode!r}")
        if self.colluding < 0:
            raise ValueError(f"colluding clients must be >= 0, got {self.colluding}")
        if self.min_survivors < max(2, self.colluding + 2):
            raise ValueError(f"min_survivors={self.min_survivors} lets a sum reveal one honest client "
                             f"to {self.colluding} colluding clients; set min_survivors >= "
                             f"{max(2, self.colluding + 2)}")

    @property
    def malicious(self) -> bool:
        return self.mode == "malicious"

    def holder_threshold(self, holders: int) -> int:
        """t = ceil(threshold * holders), checked against the bound for ``holders``.

        Raises:
            ThresholdError: t is below :func:`min_threshold`, or n_C >= h/3 in malicious mode.
        """
        t = max(1, math.ceil(self.threshold * holders - 1e-9))
        self.check_threshold(t, holders)
        return t

    def check_threshold(self, t: int, holders: int) -> None:
        """Refuse a threshold t for ``holders`` holders that the threat model does not allow."""
        n_c = self.colluding
        if self.malicious and 3 * n_c >= holders:
            raise ThresholdError(f"{n_c} colluding clients among {holders} holders: the malicious-server "
                                 f"mode needs n_C < n/3 (Bonawitz et al. 2017); lower colluding_clients "
                                 f"or use a larger cohort")
        need = min_threshold(holders, colluding=n_c, mode=self.mode)
        if need > holders:
            raise ThresholdError(f"no threshold is safe for {holders} holders with {n_c} colluding "
                                 f"clients (t must exceed (holders + colluding)/2); use a larger cohort "
                                 f"or fewer colluding_clients")
        if t < need:
            why = ("exceed 2/3 of the holders (malicious server, Bonawitz et al. 2017)"
                   if self.malicious and need == (2 * holders) // 3 + 1 and need > (holders + n_c) // 2 + 1
                   else f"exceed (holders + colluding)/2 = ({holders} + {n_c})/2, or a server that shows "
                        f"different survivor lists unmasks one client")
            raise ThresholdError(f"threshold t={t} of {holders} holders with {n_c} colluding clients is "
                                 f"too low: t must {why}; raise the threshold fraction to >= "
                                 f"{_fraction_needed(need, holders)}")

    def check_survivors(self, count: int, what: str) -> None:
        """Abort when fewer than ``min_survivors`` clients are left (``what``: where)."""
        if count < self.min_survivors:
            raise SecAggAbort(f"secure aggregation aborted at {what}: {count} survivors, fewer than "
                              f"min_survivors={self.min_survivors}; a smaller sum could reveal one client")


__all__ = ["MODES", "Mode", "Policy", "ThresholdError", "min_threshold"]
