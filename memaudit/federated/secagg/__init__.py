"""Secure aggregation (Bonawitz et al. 2017) and SecAgg+ (Bell et al. 2020)."""

from memaudit.federated.secagg.messages import (
    AuthenticationError,
    MessageError,
    ReplayError,
    SecAggAbort,
    SecAggError,
)
from memaudit.federated.secagg.protocol import Dropouts, RoundResult, run_round

__all__ = ["AuthenticationError", "Dropouts", "MessageError", "ReplayError", "RoundResult",
           "SecAggAbort", "SecAggError", "run_round"]
