"""Who secure aggregation protects against, and the bounds that follow.

Threat model (docs/secure-aggregation.md, where each bound is derived):

- ``malicious`` (default): the server may deviate arbitrarily (drop, reorder, forge and send
  different messages to different clients), and colludes with at most ``colluding`` (n_C)
  clients. Clients sign their keys, bind every Shamir share to the sender's view of the round
  (the cohort U1 and the graph), and sign the survivor list U3 together with that view
  (Ed25519, keys held outside the server); a client reveals shares only for a list that a
  quorum of its view signed.
- ``honest_but_curious``: the server follows the protocol but tries to learn individual
  inputs. No signatures: a server that shows different survivor lists to different clients
  unmasks one client (tests/federated/test_secagg_forking.py), so this mode is for
  comparison only.

memaudit runs SecAgg+ (Bell et al. 2020): client i's Shamir shares go to its h_i holders
(its neighbours and itself), and the threshold is a fraction of h_i. Two routes unmask x_i:
(1) shares of the self-mask seed b_i and of the mask key s_sk_i, from holders shown lists
with and without i; (2) b_i and the mask keys of the t_i - 1 neighbours the server left in
the shrunken U2 it showed i. Both need 2 t_i <= h_i + n_C once every honest holder that
reveals i's shares acts on one and the same list (the signed quorum below), so every client's
threshold must exceed (h_i + n_C)/2. A list is released only when more than (|U1| + n_C)/2
clients of the same view signed it: two different lists would need more honest signers than
the view has, so the list is unique per view.

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
>>> Policy().quorum(40)
21
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from memaudit.federated.secagg.messages import SecAggAbort

Mode = Literal["malicious", "honest_but_curious"]
MODES = ("malicious", "honest_but_curious")
DEFAULT_MODE = "malicious"


class ThresholdError(SecAggAbort, ValueError):
    """The Shamir threshold is below what the threat model needs for these holders."""


def min_threshold(holders: int, *, colluding: int = 0, mode: str = "honest_but_curious") -> int:
    """The smallest safe Shamir threshold for a client with ``holders`` holders.

    t > (h + n_C)/2 in both modes (docs/secure-aggregation.md derives it for both routes; the
    malicious-server mode makes it hold against a server that forks the lists, by the signed
    quorum). ``mode`` is accepted for symmetry: the bound is the same. The result may exceed
    ``holders``: no threshold works.
    """
    del mode
    return (holders + colluding) // 2 + 1


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
    mode: str = DEFAULT_MODE

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

    def quorum(self, cohort: int) -> int:
        """Signatures on one (view, U3) a client needs before it reveals: more than
        (|U1| + n_C)/2, so no two lists of one view both reach it (each honest client signs once)."""
        return (cohort + self.colluding) // 2 + 1

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
        need = min_threshold(holders, colluding=n_c, mode=self.mode)
        if need > holders:
            raise ThresholdError(f"no threshold is safe for {holders} holders with {n_c} colluding "
                                 f"clients (t must exceed (holders + colluding)/2); use a larger cohort "
                                 f"or fewer colluding_clients")
        if t < need:
            raise ThresholdError(f"threshold t={t} of {holders} holders with {n_c} colluding clients is "
                                 f"too low: t must exceed (holders + colluding)/2 = ({holders} + {n_c})/2, "
                                 f"or a server that shows different survivor lists unmasks one client; "
                                 f"raise the threshold fraction to >= {_fraction_needed(need, holders)}")

    def check_survivors(self, count: int, what: str) -> None:
        """Abort when fewer than ``min_survivors`` clients are left (``what``: where)."""
        if count < self.min_survivors:
            raise SecAggAbort(f"secure aggregation aborted at {what}: {count} survivors, fewer than "
                              f"min_survivors={self.min_survivors}; a smaller sum could reveal one client")


__all__ = ["DEFAULT_MODE", "MODES", "Mode", "Policy", "ThresholdError", "min_threshold"]
