"""Survivor-list forking (issue 29, Found-1): a server that deviates from the protocol tries to
unmask one client's input, on the complete graph and on a SecAgg+ graph.

The server shows the target a shrunken survivor list at share forwarding (U2 = the target and
a set A of t - 1 of its holders: the target masks with its self-mask b_0 and the pairwise masks
of A only) and shows every other holder k its own unmasking list U3_k: the target and k in it,
as many members of A left out as k's checks allow. Holders reveal a share of b_0 (the target
"survived") and shares of the mask keys s_sk_a of the members of A they were told "dropped".
With t shares of b_0 and t key shares of every member of A, the server removes every mask from
the target's masked input. Every client check of the honest-but-curious protocol passes.

``test_forking_unmasks_the_target_in_the_honest_but_curious_mode`` shows the attack works (the
oracle: the recovered row equals the target's input bit for bit); the default mode (signed
consistency round over the client's view) defeats it: that test failed before the fix, when the
default mode was honest_but_curious (the target's input was recovered for every case below).
"""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from memaudit.federated.secagg import SecAggAbort, SecAggError, prg, shamir
from memaudit.federated.secagg.client import KIND_KEY, KIND_SEED, Client, mask_seed
from memaudit.federated.secagg.graph import neighbours
from memaudit.federated.secagg.messages import SERVER, Header, MsgType, Writer, parse
from memaudit.federated.secagg.pki import KeyRing
from memaudit.federated.secagg.policy import Policy
from memaudit.federated.secagg.server import Server, policy_thresholds

D = 6
RID = 7
# (n, graph kind, degree): the complete graph at n = 5, 8, 10 and a SecAgg+ graph at n = 16
CASES = [(5, "full", None), (8, "full", None), (10, "full", None), (16, "sparse", 8)]


def _plan(n, neigh, t, target, a_set):
    """Each holder's unmasking list U3_k: everyone, minus as many members of A (that it holds
    shares of, not itself) as its checks allow, those still short of key shares first."""
    need = {a: t[a] for a in a_set}  # key shares still missing per member of A
    plan = {}
    for k in sorted(range(n), key=lambda k: (k != target, -len(neigh[k] & a_set))):
        holders = neigh[k] | {k}
        if k == target:
            plan[k] = frozenset({target} | a_set)  # its own U2: it reveals its b_0 share
            continue
        room = len(holders) - t[k]
        cands = sorted((a for a in (holders & a_set) - {k} if need[a] > 0), key=lambda a: -need[a])
        out = set(cands[:room])
        for a in out:
            need[a] -= 1
        plan[k] = frozenset(set(range(n)) - out)
    return plan


def _fork(n, kind, degree, *, mode=None, target=0, single=False, refused=None):
    """Run the forking server against clients of ``mode`` (None: the default mode). ``single``:
    show every holder but the target one list, everyone but A (it can gather the signatures).
    ``refused``: a list that collects the holders that refused to reveal.

    Returns (recovered row or None, the target's real input)."""
    policy = Policy() if mode is None else Policy(mode=mode)
    x = np.random.default_rng(n).integers(0, 2**32, size=(n, D), dtype=np.uint32)
    neigh = neighbours(n, kind, seed=3, degree=degree)
    t = policy_thresholds(neigh, policy)
    signed = policy.malicious
    ring = KeyRing.generate(range(n)) if signed else None
    server = Server(round_id=RID, neighbours=neigh, threshold=t, dim=D, min_survivors=3, signed=signed,
                    graph=(kind, 3, degree))
    clients = [Client(i, round_id=RID, policy=policy, keys=ring) for i in range(n)]
    for c in clients:
        server.receive_advertise(c.advertise())
    for c in clients:
        server.receive_shares(c.share_keys(server.keys_for(c.cid)))
    a_set = frozenset(sorted(neigh[target])[: t[target] - 1])  # the target masks with these only
    u2 = {i: (frozenset({target} | a_set) if i == target else frozenset(range(n))) for i in range(n)}
    masked = None
    for c in clients:
        inbox = [(i, s[c.cid]) for i, s in sorted(server._shares.items()) if c.cid in s]
        w = Writer().ids(u2[c.cid]).u32(len(inbox))
        for i, ct in inbox:
            w.u32(i).blob(ct)
        msg = c.masked_input(w.finish(Header(MsgType.FORWARD, RID, SERVER, c.cid)), x[c.cid])
        if c.cid == target:
            masked = np.array(parse(msg, expect=MsgType.MASKED, round_id=RID)[1].array(D))
    plan = _plan(n, neigh, t, target, a_set)
    if single:
        plan = {k: (v if k == target else frozenset(range(n)) - a_set) for k, v in plan.items()}
    sigs = {}
    if signed:  # the consistency round: each client signs the list it is shown
        for c in clients:
            req = Writer().ids(plan[c.cid]).finish(Header(MsgType.CHECK_REQUEST, RID, SERVER, c.cid))
            try:
                sigs[c.cid] = parse(c.check(req), expect=MsgType.CHECK, round_id=RID)[1].blob()
            except SecAggError:  # a list without this client: it does not sign
                continue
    shares = {KIND_SEED: {}, KIND_KEY: {}}
    for c in clients:
        w = Writer().ids(plan[c.cid])
        if signed:  # every signature the server holds on the list this client was shown
            same = [j for j in sorted(sigs) if plan[j] == plan[c.cid]]
            w.u32(len(same))
            for j in same:
                w.u32(j).blob(sigs[j])
        if signed and c.cid not in sigs:
            continue
        try:
            reply = c.unmask(w.finish(Header(MsgType.UNMASK_REQUEST, RID, SERVER, c.cid)))
        except SecAggAbort:
            if refused is not None:
                refused.append(c.cid)
            continue  # this holder refused: it reveals nothing
        _, r = parse(reply, expect=MsgType.UNMASK, round_id=RID)
        for _ in range(r.u32()):
            owner, kind_, xs, y = r.u32(), r.u32(), r.u32(), r.blob()
            shares[kind_].setdefault(owner, []).append((xs, int.from_bytes(y, "big")))
    got_b = shares[KIND_SEED].get(target, [])
    if len(got_b) < t[target] or any(len(shares[KIND_KEY].get(a, [])) < t[a] for a in a_set):
        return None, x[target]
    masks = [(shamir.reconstruct_bytes(got_b[: t[target]], prg.SEED_BYTES), -1)]
    for a in sorted(a_set):
        s_sk = X25519PrivateKey.from_private_bytes(shamir.reconstruct_bytes(shares[KIND_KEY][a][: t[a]], 32))
        masks.append((mask_seed(s_sk, server._keys[target][1], RID), -1 if a > target else +1))
    prg.add_masks(masked, masks)
    return masked, x[target]


@pytest.mark.parametrize(("n", "kind", "degree"), CASES)
def test_forking_unmasks_the_target_in_the_honest_but_curious_mode(n, kind, degree):
    """The attack of Found-1 is real: against clients that do not check a signed list it
    recovers the target's input exactly, with threshold 0.6 and every client check passing."""
    recovered, real = _fork(n, kind, degree, mode="honest_but_curious")
    assert recovered is not None and np.array_equal(recovered, real)


@pytest.mark.parametrize(("n", "kind", "degree"), CASES)
def test_forking_is_defeated_in_the_default_mode(n, kind, degree):
    """Failed before the fix (the default mode was honest_but_curious; the target's input was
    recovered exactly). Now every holder shown a list that fewer than its quorum signed refuses."""
    refused = []
    recovered, _ = _fork(n, kind, degree, refused=refused)
    assert recovered is None
    assert refused == list(range(n))  # no list reached the quorum of its view


@pytest.mark.parametrize(("n", "kind", "degree"), CASES)
def test_one_signed_list_without_the_targets_neighbours_reveals_too_few_seed_shares(n, kind, degree):
    """The server's best consistent move: one list (everyone but A) that the quorum signs. The
    holders act on it, but only h - t of the target's holders are left to reveal b_0 (< t)."""
    recovered, _ = _fork(n, kind, degree, single=True)
    assert recovered is None


def test_a_holder_shown_another_cohort_aborts_before_masking():
    """A server that shows one client a cohort without one member (to make it a world of its
    own) is caught when that client's shares meet the others' (their views differ)."""
    from memaudit.federated.secagg import InconsistencyDetected

    n, policy = 6, Policy()
    ring = KeyRing.generate(range(n))
    neigh = neighbours(n)
    server = Server(round_id=RID, neighbours=neigh, threshold=policy_thresholds(neigh, policy), dim=D,
                    min_survivors=3, signed=True)
    clients = [Client(i, round_id=RID, policy=policy, keys=ring) for i in range(n)]
    for c in clients:
        server.receive_advertise(c.advertise())
    kept = server._keys.pop(5)  # client 0 is told that client 5 never advertised
    keys0 = server.keys_for(0)
    server._keys[5] = kept
    server.receive_shares(clients[0].share_keys(keys0))
    for c in clients[1:]:
        server.receive_shares(c.share_keys(server.keys_for(c.cid)))
    with pytest.raises(InconsistencyDetected, match="inconsistent views"):
        clients[1].masked_input(server.forward_for(1), np.zeros(D, np.uint32))


def test_a_client_recomputes_its_own_neighbours_as_the_graph_draws_them():
    """The view check rests on `neighbours_of` (one client's set, computed alone) agreeing
    with the graph the server draws."""
    from memaudit.federated.secagg.graph import neighbours_of

    for n, kind, degree in [(16, "sparse", 8), (40, "sparse", None), (33, "sparse", 4), (6, "full", None)]:
        graph = neighbours(n, kind, seed=11, degree=degree)
        assert all(neighbours_of(i, n, kind, seed=11, degree=degree) == graph[i] for i in range(n))
