"""Secure aggregation (Bonawitz et al. 2017) and SecAgg+ (Bell et al. 2020).

Threat model (policy.py, docs/secure-aggregation.md): by default a malicious server colluding
with at most n_C clients (``mode="malicious"``: Ed25519 signatures with keys from outside the
server, the view check and the consistency-check round with a quorum of the cohort); the
``honest_but_curious`` mode drops them and holds only against a server that follows the
protocol. Every client's threshold exceeds (holders + n_C)/2, and a round with fewer than
``min_survivors`` survivors aborts.
"""

from memaudit.federated.secagg.messages import (
    AuthenticationError,
    InconsistencyDetected,
    MessageError,
    ReplayError,
    SecAggAbort,
    SecAggError,
)
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import Policy, ThresholdError, min_threshold
from memaudit.federated.secagg.protocol import Dropouts, RoundResult, run_round

__all__ = ["AuthenticationError", "Dropouts", "InconsistencyDetected", "KeyRing", "MessageError",
           "Policy", "ReplayError", "RoundResult", "SecAggAbort", "SecAggError", "ThresholdError",
           "min_threshold", "run_round"]
