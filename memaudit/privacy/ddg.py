"""RDP of the distributed discrete Gaussian: the sum of m discrete Gaussians (KLS 2021).

The maths behind distributed DP's ledger events, beside the rest of the accounting (it used
to live in `memaudit.federated.ddp`, which `privacy/` had to import from). Pure numpy: no JAX.

Per round, the sum of m independent N_Z(0, σ²) on a query with L2 / L1 sensitivities Δ₂ / Δ₁
in dimension D is ε(α)-RDP with (Kairouz, Liu, Steinke 2021, Prop. 14)

    ε(α) = min{ α/2 Δ₂²/(mσ²) + τD,  α/2 (Δ₂²/(mσ²) + 2Δ₁τ/(√m σ) + τ²D),  α/2 (Δ₂/(√m σ) + τ√D)² }

with τ = 10 Σ_{k=1}^{m-1} exp(-2π²σ² k/(k+1)).

Adjacency: *zero-out*. The neighbouring input replaces one surviving client's quantised
update by zero while that client still adds its noise share, so the m counted shares include
the target's own. Under add/remove the target's share would be missing from one side;
memaudit states zero-out in the ledger instead of silently assuming it.

References:
    Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
    Learning with Secure Aggregation", ICML 2021.

>>> round(float(ddg_rdp([2.0], l2=4.0, l1=10.0, local_std=5.0, n=4, dim=16)[0]), 4)
0.16
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def ddg_tau(local_std: float, n: int) -> float:
    """τ = 10 Σ_{k=1}^{n-1} exp(-2π²σ² k/(k+1)) (KLS 2021, Thm. 1)."""
    return 10.0 * sum(math.exp(-2 * math.pi ** 2 * local_std ** 2 * k / (k + 1)) for k in range(1, n))


def ddg_rdp(orders: Sequence[float], *, l2: float, l1: float, local_std: float, n: int, dim: int) -> np.ndarray:
    """Per-round RDP of the sum of n discrete Gaussians N_Z(0, σ²) on a query with L2/L1
    sensitivities l2/l1 in dimension dim (KLS 2021, Prop. 14). n = 0 or σ = 0: infinite."""
    a = np.asarray(orders, dtype=np.float64)
    if n < 1 or local_std == 0:
        return np.full(a.shape, np.inf)
    if local_std < 0.5:
        raise ValueError(f"discrete Gaussian local std {local_std:.3g} < 0.5 is outside the bound's range; "
                         "raise the noise multiplier or the bits")
    tau = ddg_tau(local_std, n)
    s2 = l2 / (math.sqrt(n) * local_std)
    s1 = l1 / (math.sqrt(n) * local_std)
    t1 = a / 2 * s2 ** 2 + tau * dim
    t2 = a / 2 * (s2 ** 2 + 2 * s1 * tau + tau ** 2 * dim)
    t3 = a / 2 * (s2 + math.sqrt(dim) * tau) ** 2
    return np.minimum(np.minimum(t1, t2), t3)


__all__ = ["ddg_rdp", "ddg_tau"]
