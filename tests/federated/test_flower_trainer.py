"""flower_trainer (the ServerApp's trainer) against nodes in this process: the run directory of
an in-JAX run (weights, metrics, checkpoints), and a run interrupted after round 2 and resumed
ends with the uninterrupted in-JAX run's weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memaudit.run.driver import run_trainer

jax = pytest.importorskip("jax")

OVERRIDES = [
    "backend=federated", "data.synth.users=12", "data.synth.docs_per_user=3", "data.seq_len=32",
    "data.canaries.repetitions=[1]", "federated.rounds=3", "federated.cohort=4",
    "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
    "federated.server_optimizer=fedadam", "federated.client_lr=0.2", "federated.eval_every=10",
    "federated.checkpoint_every=1", "federated.mesh_clients=1", "train.batch_size=8",
    "train.eval_batches=1", "federated.runtime=flower",
]
NODES = 6
ATOL = 1e-5  # FedAvg's fused mean adds the nodes' partial sums: float32 reassociation


class _Nodes:
    """LocalNodes with the hello of FlowerNodes: users from the partitions, digests checked."""

    def __init__(self, partitions):
        from memaudit.federated.flower.execute import LocalNodes, NodeExecutor
        from memaudit.federated.flower.nodes import load_partition

        ex = {}
        for i, p in enumerate(partitions):
            users, arrays = load_partition(p)
            ex[i] = NodeExecutor(users, arrays)
        self.local = LocalNodes(ex)
        self.calls = []

    def connect(self, digests):
        from memaudit.federated.flower.nodes import user_digest

        host = {}
        for node, ex in self.local.executors.items():
            for k, u in enumerate(ex.users):
                assert digests[u] == user_digest(ex.arrays["input_ids"][k], ex.arrays["example_mask"][k])
                host[u] = node
        assert set(host) == set(digests)
        return host

    def run_stage(self, calls):
        self.calls += list(calls.values())
        return self.local.run_stage(calls)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from memaudit.config import load_config
    from memaudit.federated.flower.nodes import write_partitions

    root = tmp_path_factory.mktemp("flower-trainer")
    # 6 nodes of 2 users: a node hosts at most 2 of a round's 4, so its modules are 2 wide
    info = write_partitions(load_config(None, OVERRIDES), root / "parts", nodes=NODES,
                            manifest=False)  # in-process nodes check nothing
    return [*OVERRIDES, f"data.tokenizer={info['tokenizer']}"], info["partitions"], root


def _weights(run):
    from safetensors.numpy import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def test_interrupted_and_resumed_flower_run_equals_in_jax(setup):
    from memaudit.config import load_config
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.rundir import RunDir

    overrides, partitions, root = setup
    jax_run = root / "jax"
    run_trainer(FederatedTrainer(load_config(None, [*overrides, "federated.runtime=jax"]), RunDir(jax_run)))

    cfg = load_config(None, overrides)
    run = root / "flower"

    def stop_after_two(done, total, info):
        if done == 2 and "round" in info:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_trainer(flower_trainer(cfg, RunDir(run), _Nodes(partitions), progress=stop_after_two))
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    nodes = _Nodes(partitions)
    result = run_trainer(flower_trainer(cfg, RunDir(run), nodes), resume=True)
    # every node ran modules of one width, its steady capacity (2: it hosts 2 of the 12 users),
    # not the cohort's 4, nor a width for each count the draw gave it (1 or 2: a new compile
    # whenever a count first came); its slots fill rows 0, 1, ...
    from jax import export

    assert nodes.calls and any(len(c.slots) < 2 for c in nodes.calls)
    for c in nodes.calls:
        exp = export.deserialize(bytearray(c.module))
        dims = {a.shape[0] for (kind, _), a in zip(c.inputs, exp.in_avals, strict=True) if kind == "data"}
        assert c.rows == list(range(len(c.slots))) and dims == {2}
    assert result["resumed_from_round"] == 2
    a, b = _weights(jax_run), _weights(run)
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= ATOL
    rounds = [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]  # one line per round across the resume
    manifest = json.loads((run / "run.json").read_text())
    assert manifest["status"] == "complete" and manifest["config"]["federated"]["runtime"] == "flower"


LORA = "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}"


def test_lora_with_dropout_on_flower_equals_in_jax_uploads_only_the_adapters_and_the_base_is_the_operators(setup):
    """Federated LoRA with adapter dropout on Flower, nodes that trust only their operator's
    manifest: the merged model and the adapter folder equal the in-JAX LoRA run's; a client's
    upload is the adapters (rank 4 on q, v: 7,168 floats), not the model (1.8M). Each client's
    dropout keys are derived inside its stage from the per-client key the stage already receives,
    so the adapters equal the in-JAX run's, and differ from the in-JAX run without dropout (the
    nodes applied it). The frozen base travels inside the stage module the manifest pins, so a
    server that trains on another base (here: model.init_seed changed, as a server would to make
    the adapters' gradients say more about the data) is refused by every node before any of its
    data is touched. (LoRA without dropout on Flower: the FedSGD case below.)"""
    import dataclasses

    from safetensors.numpy import load_file

    from memaudit.config import load_config
    from memaudit.federated.flower.nodes import write_partitions
    from memaudit.federated.flower.partition import PlanError
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.federated.flower.trust import NodeTrust
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.rundir import RunDir

    _overrides, _partitions, root = setup
    lora = [*OVERRIDES, LORA, "model.lora.dropout=0.1"]
    info = write_partitions(load_config(None, lora), root / "parts-lora", nodes=2)  # with its manifest
    lora.append(f"data.tokenizer={info['tokenizer']}")
    trust = dataclasses.replace(NodeTrust.load(info["manifest"]), nodes=())  # in-process: no PKI

    def trusting_nodes():
        nodes = _Nodes(info["partitions"])
        for ex in nodes.local.executors.values():
            ex.trust = trust
        return nodes

    runs = {name: root / f"lora-{name}" for name in ("jax", "flower", "none")}
    run_trainer(FederatedTrainer(load_config(None, [*lora, "federated.runtime=jax"]), RunDir(runs["jax"])))
    run_trainer(FederatedTrainer(load_config(None, [*lora, "federated.runtime=jax", "model.lora.dropout=0"]),
                                 RunDir(runs["none"])))
    result = run_trainer(flower_trainer(load_config(None, lora), RunDir(runs["flower"]), trusting_nodes()))
    a, b = _weights(runs["jax"]), _weights(runs["flower"])
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= ATOL
    ad_a, ad_b, ad_c = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in runs.values())
    assert set(ad_a) == set(ad_b) == set(ad_c)
    assert max(float(np.max(np.abs(ad_a[k] - ad_b[k]))) for k in ad_a) <= ATOL
    assert max(float(np.max(np.abs(ad_a[k] - ad_c[k]))) for k in ad_a) > 100 * ATOL  # dropout applied
    adapter_floats = sum(v.size for v in ad_b.values())
    assert adapter_floats == 4 * 4 * ((128 + 128) + (128 + 64))  # tiny: 4 layers, rank 4, q 128->128, v 128->64
    assert result["upload_bytes_per_client_per_round"] == 4 * adapter_floats

    with pytest.raises(PlanError, match="every SuperNode refused"):
        run_trainer(flower_trainer(load_config(None, [*lora, "model.init_seed=7"]), RunDir(root / "other-base"),
                       trusting_nodes()))


def test_lora_fedsgd_on_flower_equals_in_jax_when_the_rank_equals_the_cohort(setup):
    """FedSGD's gradient of LoRA adapters of rank 4 in a cohort of 4: the partitioner told the
    clients dim from the shapes alone, so the sum over the clients of lora_B's gradient, of
    shape (rank, d), read as per-client rows, and the Flower run's adapters moved 0.0031 away
    from the in-JAX run's (0.0 with rank 8). It now follows the clients dim through the round's
    dataflow (memaudit.federated.closure): an aggregate is server-placed whatever its shape."""
    from memaudit.config import load_config
    from memaudit.federated.flower.trainer import flower_trainer
    from memaudit.federated.trainer import FederatedTrainer
    from memaudit.rundir import RunDir

    overrides, partitions, root = setup
    fedsgd = [*overrides, LORA, "federated.algorithm=fedsgd", "federated.server_optimizer=sgd",
              "federated.server_lr=0.5", "federated.rounds=1"]
    assert load_config(None, fedsgd).model.lora.rank == load_config(None, fedsgd).federated.cohort
    runs = {name: root / f"fedsgd-{name}" for name in ("jax", "flower")}
    run_trainer(FederatedTrainer(load_config(None, [*fedsgd, "federated.runtime=jax"]), RunDir(runs["jax"])))
    run_trainer(flower_trainer(load_config(None, fedsgd), RunDir(runs["flower"]), _Nodes(partitions)))
    a, b = (_weights(r) for r in runs.values())
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= ATOL


def test_a_nodes_steady_capacity_holds_its_users_in_all_but_the_tail_of_rounds():
    """`steady_node_capacity` against the exact law of the draw, counted with binomial
    coefficients: the capacity is the smallest power of two that a node's share of a fixed
    cohort (hypergeometric) or of a Poisson one (binomial) exceeds in at most 1e-3 of rounds."""
    from math import comb

    from memaudit.federated.flower.manifest import NODE_TAIL, steady_node_capacity

    def over_fixed(k, population, m, cohort):  # P(hosted > k), cohort drawn without replacement
        return sum(comb(m, h) * comb(population - m, cohort - h)
                   for h in range(k + 1, min(m, cohort) + 1)) / comb(population, cohort)

    def over_poisson(k, m, q):  # P(hosted > k), each of the node's m users joins with q
        return sum(comb(m, h) * q**h * (1 - q) ** (m - h) for h in range(k + 1, m + 1))

    cases = [(16, 4, 8), (16, 8, 8), (12, 2, 4), (1000, 50, 64), (5000, 400, 256), (100, 100, 10)]
    for population, m, cohort in cases:
        for mode, over in (("fixed", lambda k, p=population, m=m, c=cohort: over_fixed(k, p, m, c)),
                           ("poisson", lambda k, p=population, m=m, c=cohort: over_poisson(k, m, c / p))):
            k = steady_node_capacity(m, population, cohort, mode)
            assert k & (k - 1) == 0, (mode, population, m, cohort, k)  # a power of two
            assert over(k) <= NODE_TAIL, (mode, population, m, cohort, k)
            assert k == 1 or over(k // 2) > NODE_TAIL, (mode, population, m, cohort, k)
    with pytest.raises(ValueError, match="sampling mode"):
        steady_node_capacity(2, 12, 4, "uniform")
