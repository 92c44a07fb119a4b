"""Secure aggregation and distributed DP with the clients' side on the nodes (the Flower runtime).

Aggregator level (fast, no model): the cohort's deltas live on `NodeExecutor` s in this process
and the aggregators get a `ClientRows` handle; the update equals the in-JAX aggregator's on the
same arrays exactly, and the decoded sum equals the integer sum of the survivors' quantised
rows computed here (the oracle: `quantise.encode` row by row with each slot's generator). What
the server receives holds no quantised row. A node that dies before sending its masked input
drops its users from the sum; one that dies after it stays in the sum; below min_survivors the
round aborts. Trainer level: DP-FedAvg with adaptive clipping and distributed DP, both with
secure aggregation and FedAdam on the server, on `flower_trainer` with in-process nodes end with
the in-JAX run's weights. (Secure aggregation without DP is the same trainer path with the plain
mean inside: its sum over the nodes' rows equals the in-JAX one exactly in
`test_remote_secure_sum_equals_in_jax_and_the_integer_oracle`.)
"""

from __future__ import annotations

import numpy as np
import pytest

from memaudit.federated.secagg.messages import masked_bytes
from memaudit.run.driver import run_trainer
from tests.federated.toy_nodes import keep_rows

jax = pytest.importorskip("jax")
import jax.numpy as jnp

N, D1, D2 = 6, (3, 4), (5,)
HOSTS = {"a": [0, 1, 2], "b": [3, 4, 5]}


def _deltas(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(0, 0.3, (n, *D1)).astype(np.float32),
            "b": rng.normal(0, 0.3, (n, *D2)).astype(np.float32)}


class _Recording:
    """LocalNodes that records every reply the server gets, and can kill a node at a step
    (``when="before"``: it does not answer that step; ``"after"``: it answers, then dies)."""

    def __init__(self, local, kill=None):
        self.local, self.kill, self.replies = local, kill, []

    def run_secagg(self, payloads):
        step = next(iter(payloads.values()))["step"]
        if self.kill and self.kill[1] == step and self.kill[2] == "before":
            self.local.dead.add(self.kill[0])
        out = self.local.run_secagg(payloads)
        if self.kill and self.kill[1] == step and self.kill[2] == "after":
            self.local.dead.add(self.kill[0])
        self.replies.extend((step, r) for r in out.values())
        return out


def _remote(deltas, hosts=HOSTS, rnd=0, kill=None):
    from memaudit.federated.flower.execute import LocalNodes, NodeExecutor
    from memaudit.federated.secagg.remote import ClientRows, NodeChannel

    leaves, treedef = jax.tree.flatten(deltas)
    ex = {node: keep_rows(NodeExecutor([f"u{s}" for s in slots], {}), leaves, slots, rnd)
          for node, slots in hosts.items()}
    nodes = _Recording(LocalNodes(ex), kill)
    rows = ClientRows(NodeChannel(nodes, hosts, rnd), tuple(range(len(leaves))),
                      tuple((x.shape[1:], x.dtype.name) for x in leaves), treedef)
    return rows, nodes


def _secagg(**kw):
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.secagg.aggregator import secure_aggregation

    return secure_aggregation(mean_aggregator(), **{"clip": 1.0, "bits": 16, "seed": 3, **kw})


def _flat(tree):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(tree)])


def _oracle(deltas, present, survivors, key, *, clip=1.0, bits=16, seed=3, rnd=0):
    """The survivors' mean from the integer sum of their quantised rows (numpy, row by row)."""
    from memaudit.federated.secagg.aggregator import flatten_clients
    from memaudit.federated.secagg.quantise import check_bits, decode, encode, quantisation_scale
    from memaudit.federated.secagg.remote import slot_rng, slot_seed

    rows, _ = flatten_clients(deltas)
    scale, b = quantisation_scale(clip, bits, len(present))
    inner = check_bits(clip, b, rows.shape[1], cohort=len(present))
    q = [encode(rows[s][None], clip, scale, slot_rng(slot_seed(key, seed, rnd, s)), inner=inner)[0]
         for s in present]
    total = np.zeros(rows.shape[1], np.uint32)
    for cid in survivors:
        total += q[cid]
    return decode(total, scale) / len(survivors), q


def test_remote_secure_sum_equals_in_jax_and_the_integer_oracle():
    deltas, key = _deltas(), jax.random.key(11)
    weights = jnp.ones(N)
    agg = _secagg()
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), weights, agg.init(None), key)
    rows, nodes = _remote(deltas)
    remote = agg.aggregate(rows, weights, agg.init(None), key)
    assert np.array_equal(_flat(local.update), _flat(remote.update))  # exact
    expect, _q = _oracle(deltas, range(N), range(N), key)
    np.testing.assert_allclose(_flat(remote.update), expect, rtol=0, atol=1e-6)  # float32 cast
    assert float(remote.metrics["survivors"]) == N and remote.metrics["secagg_aborted"] == 0
    words = _flat(local.update).size  # no clip indicator in this aggregator: the update's words
    assert remote.metrics["secagg_words"] == local.metrics["secagg_words"] == words
    # a node sends its clients' masked inputs added up: one vector a node, not one a client
    assert local.metrics["secagg_bytes_masked"] == N * masked_bytes(words)
    assert remote.metrics["secagg_bytes_masked"] == len(HOSTS) * masked_bytes(words)
    assert (local.metrics["secagg_bytes_up"] - remote.metrics["secagg_bytes_up"]
            == (N - len(HOSTS)) * masked_bytes(words))  # every other message as in JAX
    assert sorted(step for step, _ in nodes.replies) == sorted(
        ["advertise", "shares", "masked", "check", "unmask"] * len(HOSTS))  # default mode: signed
    sums = [r for step, r in nodes.replies if step == "masked"]
    assert sorted(r["cids"] for r in sums) == [HOSTS["a"], HOSTS["b"]]
    assert all(set(r) == {"cids", "sum"} and r["sum"].shape == (words,) for r in sums)


def test_no_unmasked_row_reaches_the_server():
    """Every byte the nodes send the server: no user's quantised row, no delta row, and no
    node's sum of its users' rows (a node's masked sum is that sum plus the self masks of its
    users and their pairwise masks with the other node's users)."""
    deltas, key = _deltas(1), jax.random.key(5)
    rows, nodes = _remote(deltas)
    agg = _secagg()
    agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    _, q = _oracle(deltas, range(N), range(N), key)
    blobs = [bytes(m) for _, r in nodes.replies for m in r.get("msgs", {}).values()]
    blobs += [r["sum"].tobytes() for step, r in nodes.replies if step == "masked"]
    assert len(blobs) > 2 * len(HOSTS)
    node_sums = [np.sum([q[c] for c in cids], axis=0, dtype=np.uint32) for cids in HOSTS.values()]
    for row in [*q, *node_sums]:
        assert not any(row.tobytes() in b for b in blobs)
        assert not any(row[:4].tobytes() in b for b in blobs)  # not even a prefix
    for x in jax.tree.leaves(deltas):
        for k in range(N):
            assert not any(x[k].tobytes() in b for b in blobs)


@pytest.mark.parametrize("when", ["before", "after"])
def test_node_killed_before_or_after_its_masked_input(when):
    """Node b dies at the masked-input step: before sending it its users are not in the sum;
    after sending it they are (the others unmask them). Both exact against the oracle."""
    deltas, key = _deltas(2), jax.random.key(7)
    hosts = {"a": [0, 1, 2, 3], "b": [4, 5]}  # t = 4 of 6 holders: node a alone can unmask
    rows, _ = _remote(deltas, hosts, kill=("b", "masked", when))
    agg = _secagg()
    res = agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    survivors = range(N) if when == "after" else hosts["a"]
    expect, _ = _oracle(deltas, range(N), survivors, key)
    assert res.metrics["secagg_aborted"] == 0
    assert float(res.metrics["survivors"]) == len(survivors)
    np.testing.assert_allclose(_flat(res.update), expect, rtol=0, atol=1e-6)


def test_killed_node_below_min_survivors_aborts():
    """Node b dies before its masked input: 3 survivors, below the threshold t = 4 of 6
    holders: zero update, ``secagg_aborted``, the round counter unchanged (as in-JAX)."""
    deltas, key = _deltas(3), jax.random.key(8)
    rows, _ = _remote(deltas, kill=("b", "masked", "before"))
    agg = _secagg()
    state = agg.init(None)
    res = agg.aggregate(rows, jnp.ones(N), state, key)
    assert res.metrics["secagg_aborted"] == 1 and int(res.state.round) == int(state.round)
    assert not np.any(_flat(res.update))


def test_simulated_dropout_and_absent_slots_as_in_jax():
    """privacy.secure_aggregation.dropout and absent cohort slots (weight 0): same survivors
    and the same update as the in-JAX aggregator."""
    deltas, key = _deltas(4, n=8), jax.random.key(9)
    hosts = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    weights = jnp.asarray([1, 1, 0, 1, 1, 1, 1, 0], jnp.float32)
    agg = _secagg(dropout_rate=0.2, threshold=0.5)
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), weights, agg.init(None), key)
    rows, _ = _remote(deltas, hosts)
    remote = agg.aggregate(rows, weights, agg.init(None), key)
    assert float(local.metrics["survivors"]) < 6  # the simulation dropped someone
    assert float(remote.metrics["survivors"]) == float(local.metrics["survivors"])
    assert np.array_equal(_flat(local.update), _flat(remote.update))


def test_dp_fedavg_adaptive_over_remote_rows_equals_in_jax():
    """DP-FedAvg (adaptive clipping) around secure aggregation: each node clips its users'
    rows and appends their indicators 1[norm <= C] to the masked rows; update, next clip and
    metrics equal in-JAX, and the count is the survivors' (an independent numpy count)."""
    from memaudit.config import AdaptiveClipConfig
    from memaudit.federated.dp import dp_fedavg

    deltas, key = _deltas(5), jax.random.key(10)
    adaptive = AdaptiveClipConfig(enabled=True, initial_clip=1.25)
    agg = dp_fedavg(_secagg(), clip=1.0, noise_multiplier=0.5, expected_cohort=N, adaptive=adaptive)
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), jnp.ones(N), agg.init(None), key)
    rows, nodes = _remote(deltas)
    remote = agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    assert 0 < float(local.metrics["clip_fraction"]) < 1  # some clipped, some not
    assert np.array_equal(_flat(local.update), _flat(remote.update))
    for k in ("clip_fraction", "next_clip", "survivors"):
        assert float(local.metrics[k]) == float(remote.metrics[k])
    norms = np.sqrt(sum((x.reshape(N, -1).astype(np.float64) ** 2).sum(1) for x in deltas.values()))
    assert float(remote.metrics["clip_fraction"]) == pytest.approx(np.mean(norms > 1.25), rel=1e-6)
    assert {s for s, _ in nodes.replies} == {"advertise", "shares", "masked", "check", "unmask"}  # no count


def test_adaptive_count_is_over_the_survivors_and_never_sent_alone():
    """The defect: the count adaptive clipping needs was each node's count in the clear (one
    user's bit for a node hosting one). Now it rides in the secure sum: the nodes send no
    count, and a node that dies before its masked input takes its users' bits with it."""
    from memaudit.config import AdaptiveClipConfig
    from memaudit.federated.dp import dp_fedavg

    deltas, key = _deltas(5), jax.random.key(10)
    hosts = {"a": [0, 1, 2, 3], "b": [4, 5]}
    adaptive = AdaptiveClipConfig(enabled=True, initial_clip=1.25)
    agg = dp_fedavg(_secagg(), clip=1.0, noise_multiplier=0.5, expected_cohort=N, adaptive=adaptive)
    rows, nodes = _remote(deltas, hosts, kill=("b", "masked", "before"))
    res = agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    norms = np.sqrt(sum((x.reshape(N, -1).astype(np.float64) ** 2).sum(1) for x in deltas.values()))
    assert float(res.metrics["survivors"]) == 4
    assert float(res.metrics["clip_fraction"]) == pytest.approx(np.mean(norms[:4] > 1.25), rel=1e-6)
    assert not any("count" in r for _, r in nodes.replies)


def test_distributed_dp_over_remote_rows_equals_in_jax(monkeypatch):
    """Distributed DP: each node rotates, rounds and adds its users' discrete-Gaussian noise
    shares (from each client's own secret; keyed by slot here so both paths draw the same); the
    decoded estimate equals the in-JAX aggregator's."""
    from memaudit.federated.ddp import distributed_dp
    from tests.federated.test_ddp import noise_by_slot

    deltas, key = _deltas(6), jax.random.key(12)
    agg = distributed_dp(clip=1.0, noise_multiplier=0.8, expected_cohort=N, bits=20, seed=3)
    noise_by_slot(monkeypatch)
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), jnp.ones(N), agg.init(None), key)
    rows, _ = _remote(deltas)
    remote = agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    assert np.array_equal(_flat(local.update), _flat(remote.update))
    assert float(remote.metrics["survivors"]) == N


def _advertised(rows, hosts, policy, round_id=991, rnd=0):
    """The nodes' answers to the advertisement their last client stage carried (what
    `NodeExecutor.run` does with ``StageCall.advertise``), for ``rows.channel``."""
    from memaudit.federated.secagg.remote import Advertised, advertisement

    ads = advertisement(hosts, round_id, policy)
    executors = rows.channel.nodes.local.executors
    replies = {n: executors[n].secagg({**p, "step": "advertise", "round": rnd}) for n, p in ads.items()}
    return Advertised(round_id, tuple(policy), tuple(sorted(s for v in hosts.values() for s in v)), replies, ads)


SIGNED = (0.6, 0, 3, "malicious")  # secure_aggregation's default policy


def test_keys_advertised_with_the_stage_save_the_advertise_exchange():
    """The nodes advertise their clients' keys with the round's last client stage: the round
    runs four exchanges (shares, masked, check, unmask), not five, under the stage's round id,
    and the update equals the in-JAX aggregator's exactly. Failed before: every remote round
    sent its own advertise exchange."""
    deltas, key = _deltas(7), jax.random.key(13)
    agg = _secagg()
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), jnp.ones(N), agg.init(None), key)
    rows, nodes = _remote(deltas)
    rows.channel.early = _advertised(rows, HOSTS, SIGNED)
    remote = agg.aggregate(rows, jnp.ones(N), agg.init(None), key)
    assert np.array_equal(_flat(local.update), _flat(remote.update))
    assert sorted(step for step, _ in nodes.replies) == sorted(["shares", "masked", "check", "unmask"] * len(HOSTS))
    assert rows.channel.early is None  # used once


@pytest.mark.parametrize("why", ["absent slot", "other policy"])
def test_advertisements_for_another_cohort_or_policy_are_not_used(why):
    """An absent slot after the stage (weight 0) renumbers the clients, and another policy is
    another round: the round then runs its own advertise exchange, with the in-JAX update."""
    deltas, key = _deltas(8), jax.random.key(14)
    weights = jnp.asarray([1, 1, 0, 1, 1, 1] if why == "absent slot" else [1] * N, jnp.float32)
    agg = _secagg()
    local = agg.aggregate(jax.tree.map(jnp.asarray, deltas), weights, agg.init(None), key)
    rows, nodes = _remote(deltas)
    rows.channel.early = _advertised(rows, HOSTS, SIGNED if why == "absent slot" else (0.7, 0, 3, "malicious"))
    remote = agg.aggregate(rows, weights, agg.init(None), key)
    assert np.array_equal(_flat(local.update), _flat(remote.update))
    assert [step for step, _ in nodes.replies].count("advertise") == len(HOSTS)


def test_a_node_whose_stage_advertisement_is_invalid_is_out_of_the_round():
    """Node b answers the stage's advertisement with its second client's keys under its
    first client's id: the guard rejects b's advertisement, b's clients are out of the round
    as if b had not answered, and node a's four clients are summed (the integer oracle)."""
    from memaudit.federated.flower.guard import SecAggGuard

    deltas, key = _deltas(9), jax.random.key(15)
    hosts = {"a": [0, 1, 2, 3], "b": [4, 5]}  # t = 4 of 6 holders: node a alone can unmask
    rows, nodes = _remote(deltas, hosts)
    early = _advertised(rows, hosts, SIGNED)
    early.replies["b"]["msgs"][4] = early.replies["b"]["msgs"][5]
    guard = SecAggGuard(nodes, sum(int(np.prod(x.shape[1:])) for x in deltas.values()))
    rows.channel.nodes, rows.channel.early = guard, early
    res = _secagg().aggregate(rows, jnp.ones(N), _secagg().init(None), key)
    expect, _ = _oracle(deltas, range(N), hosts["a"], key)
    assert res.metrics["secagg_aborted"] == 0 and float(res.metrics["survivors"]) == 4
    np.testing.assert_allclose(_flat(res.update), expect, rtol=0, atol=1e-6)
    assert guard.rejected == ["b"] and rows.channel.dropped == ["b"]
    assert "advertise" not in {step for step, _ in nodes.replies}


def test_slot_seed_is_one_way_and_per_slot():
    from memaudit.federated.secagg.remote import slot_seed

    k = jax.random.key(1)
    seeds = {slot_seed(k, 3, 0, s) for s in range(4)} | {slot_seed(k, 3, 1, 0), slot_seed(k, 4, 0, 0)}
    assert len(seeds) == 6  # distinct per slot, round and seed
    data = np.asarray(jax.random.key_data(k)).tobytes().hex()
    assert all(data not in s for s in seeds)


# ------------------------------------------------------------------ the trainer, nodes in-process
OVERRIDES = [
    "backend=federated", "data.synth.users=12", "data.synth.docs_per_user=3", "data.seq_len=32",
    "data.canaries.repetitions=[1]", "federated.rounds=2", "federated.cohort=4",
    "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
    "federated.client_lr=0.2", "federated.eval_every=10", "federated.checkpoint_every=5",
    "federated.mesh_clients=1", "train.batch_size=8", "train.eval_batches=1",
    "privacy.secure_aggregation.enabled=true", "privacy.clip=0.5",
]
DP = ["privacy.noise_multiplier=0.8", "privacy.reproducible_randomness=true"]
CASES = {  # federated.server_optimizer: fedadam, the default
    "dp-adaptive": [*DP, "privacy.adaptive_clipping.enabled=true",
                    "privacy.adaptive_clipping.initial_clip=0.3", "privacy.adaptive_clipping.count_noise=1.0"],
    "distributed": [*DP, "privacy.mechanism=distributed"],
}


class _TrainerNodes:
    """In-process nodes from the partitions, with FlowerNodes' connect (users by digest)."""

    def __init__(self, partitions):
        from memaudit.federated.flower.execute import LocalNodes, NodeExecutor
        from memaudit.federated.flower.nodes import load_partition

        self.local = LocalNodes({i: NodeExecutor(*load_partition(p)) for i, p in enumerate(partitions)})
        self.secagg_steps: list[str] = []

    def connect(self, digests):
        return {u: node for node, ex in self.local.executors.items() for u in ex.users}

    def run_stage(self, calls):
        return self.local.run_stage(calls)

    def run_secagg(self, payloads):
        self.secagg_steps.append(next(iter(payloads.values()))["step"])
        return self.local.run_secagg(payloads)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from memaudit.config import load_config
    from memaudit.federated.flower.nodes import write_partitions

    root = tmp_path_factory.mktemp("flower-secagg")
    info = write_partitions(load_config(None, OVERRIDES), root / "parts", nodes=2,
                            manifest=False)  # in-process nodes check nothing
    return [*OVERRIDES, f"data.tokenizer={info['tokenizer']}"], info["partitions"], root


@pytest.mark.parametrize("case", list(CASES))
def test_flower_trainer_with_secure_aggregation_equals_in_jax(case, parts, monkeypatch):
    import json

    from safetensors.numpy import load_file

    from memaudit.config import load_config
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.rundir import RunDir
    from tests.test_lifecycle import merged_metrics

    overrides, partitions, root = parts
    over = [*overrides, *CASES[case]]
    if case == "distributed":  # the clients' own noise, keyed alike on both runtimes to compare
        from tests.federated.test_ddp import noise_by_slot

        noise_by_slot(monkeypatch)
    run_trainer(FederatedTrainer(load_config(None, over), RunDir(root / f"{case}-jax")))
    nodes = _TrainerNodes(partitions)
    run_trainer(flower_trainer(load_config(None, [*over, "federated.runtime=flower"]), RunDir(root / f"{case}-flower"),
                  nodes))
    a = load_file(str(root / f"{case}-jax" / "model" / "model.safetensors"))
    b = load_file(str(root / f"{case}-flower" / "model" / "model.safetensors"))
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert diff <= ATOL_TRAINER, diff
    # four protocol exchanges a round on the nodes: the keys came with the client stage
    assert nodes.secagg_steps == ["shares", "masked", "check", "unmask"] * 2
    # under DP the cohort's statistics are in sensitive_metrics.jsonl: read both files
    ma, mb = merged_metrics(root / f"{case}-jax"), merged_metrics(root / f"{case}-flower")
    assert [m["round"] for m in mb] == [1, 2] and all(m["dropped_users"] == 0 for m in mb)
    assert [m["survivors"] for m in ma] == [m["survivors"] for m in mb] == [4, 4]
    for key in ("clip_fraction", "next_clip", "secagg_aborted"):
        if key in ma[0]:
            assert [m[key] for m in ma] == [m[key] for m in mb], key
    # the same ledger: accounting by the same survivors
    pa = json.loads((root / f"{case}-jax" / "privacy.json").read_text())
    pb = json.loads((root / f"{case}-flower" / "privacy.json").read_text())
    assert pa["epsilon"] == pb["epsilon"] and pa["events"] == pb["events"]
    from tests.test_lifecycle import scan_public_files

    for side in ("jax", "flower"):  # nothing of the realized cohort in the public files
        scan_public_files(root / f"{case}-{side}")


ATOL_TRAINER = 0.0  # exact: the same deltas, the same quantised rows, integer sums
