"""Contract suite of `memaudit.federated.updates.ClientUpdates`: the in-process arrays
(`LocalUpdates`) and the rows kept on the nodes (`ClientRows`, nodes in this process) answer every
operation the aggregation wrappers use with the same values, and the per-client step parameters
cross the wire and come back equal."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp

from memaudit.federated.client_ops import ClientStep, DDGEncoding, slot_seed
from memaudit.federated.secagg.protocol import Dropouts
from memaudit.federated.secagg.quantise import SecAggEncoding, check_bits, quantisation_scale
from memaudit.federated.secagg.remote import encoding_from_wire
from memaudit.federated.updates import ClientUpdates, LocalUpdates, client_updates
from tests.federated.test_flower_secagg import N, _deltas, _flat, _remote

PROTOCOL = {"round_id": 7, "neighbours": "full", "threshold": 0.6, "graph_seed": 1,
            "dropouts": Dropouts()}


def _kinds(deltas):
    return {"local": client_updates(jax.tree.map(jnp.asarray, deltas)), "remote": _remote(deltas)[0]}


def test_both_kinds_implement_the_interface():
    for u in _kinds(_deltas()).values():
        assert isinstance(u, ClientUpdates)
    local = LocalUpdates(jnp.ones((2, 3)))
    assert client_updates(local) is local


def test_dim_zeros_unflatten_agree():
    kinds = _kinds(_deltas())
    dims = {k: u.dim for k, u in kinds.items()}
    assert dims == {"local": 17, "remote": 17}
    for u in kinds.values():
        z = u.zeros()
        assert jax.tree.map(jnp.shape, z) == {"w": (3, 4), "b": (5,)}
        assert float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(z))) == 0.0
    v = np.arange(17.0)
    a, b = (kinds[k].unflatten(v) for k in ("local", "remote"))
    assert np.array_equal(_flat(a), _flat(b))


@pytest.mark.parametrize("count", [False, True])
def test_clipped_secure_sum_is_the_same_integer_sum(count):
    deltas, key = _deltas(1), jax.random.key(3)
    present = np.arange(N)
    seeds = [slot_seed(key, 0, 0, int(s)) for s in present]
    scale, b = quantisation_scale(0.5, 16, N)
    enc = SecAggEncoding(0.5, scale, check_bits(0.5, b, 17, cohort=N))
    totals = {k: u.clipped(0.5, count=count).secure_sum(enc, present, seeds, **PROTOCOL).total
              for k, u in _kinds(deltas).items()}
    assert totals["local"].shape == (17 + count,)
    assert np.array_equal(totals["local"], totals["remote"])
    if count:  # the indicators of 1[‖Δ‖ <= 0.5], summed under the masks
        norms = np.sqrt(sum(np.sum(x.reshape(N, -1) ** 2, axis=1) for x in deltas.values()))
        assert int(totals["local"][-1]) == int(np.sum(norms <= 0.5))


def test_only_in_process_deltas_are_read_in_the_clear():
    kinds = _kinds(_deltas())
    local = kinds["local"].clipped(0.5)
    assert float(local.within_count(jnp.ones(N))) >= 0
    with pytest.raises(ValueError, match="secure aggregation"):
        kinds["remote"].clipped(0.5).within_count(jnp.ones(N))
    with pytest.raises(ValueError, match="secure aggregation"):
        kinds["remote"].tree()


def test_step_parameters_round_trip_the_wire():
    step = ClientStep().then_clip(1.5).then_clip(0.5, count=True)
    assert step == ClientStep((1.5, 0.5), 0.5)
    assert ClientStep.from_wire(step.to_wire()) == step
    for enc in (SecAggEncoding(1.0, 2.0, 0.9), DDGEncoding(1.0, 0.1, 5, 3.0, 2.0, 20)):
        assert encoding_from_wire(enc.to_wire()) == enc
    with pytest.raises(ValueError, match="unknown secure-sum encoding"):
        encoding_from_wire({"kind": "nope"})
    with pytest.raises(ValueError, match="unknown per-client transform"):
        ClientStep.from_wire({"pre": [["scale", 2.0]], "count": None})
