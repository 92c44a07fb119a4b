"""memaudit's DP-SGD against Opacus 1.6 (dev extra, fp32): ε of Poisson DP-SGD and the clipped
per-example gradients of a tiny Llama under eager and sdpa attention."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

opacus = pytest.importorskip("opacus", reason="Opacus is in the dev extra: pip install -e .[dev]")

from memaudit.privacy.accounting import rdp_curve
from memaudit.privacy.ledger import PrivacyLedger
from memaudit.train.dpsgd import DPSGD
from memaudit.train.ghost import GhostClipper, vmap_clipped_sum
from memaudit.train.losses import causal_lm_loss_per_example
from tests.train.test_dpsgd import _batch, _model


def test_opacus_version_pinned():
    assert opacus.__version__ == "1.6.0"


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.1, 1000), (0.05, 0.8, 300), (0.2, 2.0, 50)])
def test_poisson_dpsgd_epsilon_matches_opacus(q, sigma, steps):
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    n = 1000
    dp = DPSGD(torch.nn.Linear(2, 1), clip=1.0, noise_multiplier=sigma, expected_batch_size=q * n,
               population=n, mode="vmap")
    led = PrivacyLedger(unit="example", delta=1e-5)
    led.record_mechanism(dp.mechanism, steps=steps)
    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    # the same RDP curve at Opacus' integer orders (the two bound fractional orders differently);
    # ε agrees to 1 % (Opacus' exact fractional orders can land slightly lower)
    alphas = [float(a) for a in acc.DEFAULT_ALPHAS if float(a).is_integer()]
    ours = rdp_curve(led.events[0], tuple(alphas))
    np.testing.assert_allclose(ours, compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=alphas),
                               rtol=1e-6)
    eps_opacus = acc.get_epsilon(1e-5)
    assert led.epsilon("rdp") == pytest.approx(eps_opacus, rel=0.01)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_clipped_per_example_gradients_match_opacus(attn_impl):
    from opacus import GradSampleModule

    model = _model()
    model.config._attn_implementation = attn_impl
    ids, attn, lmask = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModule(model, loss_reduction="sum")
        logits = gsm(input_ids=ids, attention_mask=attn, use_cache=False).logits
        causal_lm_loss_per_example(logits, ids, lmask).sum().backward()
    per = {n: p.grad_sample.detach().double() for n, p in model.named_parameters()}
    gsm._close()
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad_sample = None
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))  # (B,)
    clip = float(norms.median())  # some examples clipped, some not
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    want = {n: torch.einsum("b,b...->...", factor, g) for n, g in per.items()}
    assert (norms > clip).any() and (norms < clip * 0.999).any()
    for name, res in (("ghost", GhostClipper(model).clipped_sum(ids, attn, lmask, clip)),
                      ("vmap", vmap_clipped_sum(model, ids, attn, lmask, clip))):
        torch.testing.assert_close(res.norms.double(), norms, rtol=1e-5, atol=1e-8, msg=f"{name} norms")
        for n, g in want.items():
            torch.testing.assert_close(res.grads[n].double(), g, rtol=1e-4, atol=1e-6,
                                       msg=f"{name} {attn_impl}: {n}")
    assert not math.isnan(float(norms.sum()))
