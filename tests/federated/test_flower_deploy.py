"""The Flower runtime in deployment form on one machine: one SuperLink and two SuperNodes as
separate processes on 127.0.0.1 (free ports, started once for the module and torn down), each
SuperNode holding only its partition of the prepared corpus. For the same cohorts, keys and data
(privacy.reproducible_randomness), the weights of `federated.runtime=flower` equal the in-JAX
program's within ATOL, without DP (through `memaudit train`) and with DP-FedAvg over secure
aggregation (the protocol's clients on the SuperNodes); a SuperNode killed mid-run drops its
users from the rounds after (absent slots, as in JAX).

What this module adds is the process boundary: every case costs a minute of SuperNode start-up
and XLA compilation on 2 cores. The algorithms' equations across the partition (FedAvg, FedAdam,
DP-FedAvg with adaptive clipping, FedSGD as jax.grad of a federated loss) are checked in-process
by test_flower_partition.py and secure aggregation's rounds by test_flower_secagg.py, on the same
partition/execute code the SuperNodes run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import flwr  # noqa: F401 - installed by the set-up (.[flower]); missing it is a failure, not a skip
import numpy as np
import pytest

from memaudit.federated.flower import deploy
from memaudit.federated.flower.transport import bundle
from memaudit.run.driver import run_trainer
from tests.conftest import XLA_ONE_THREAD

pytestmark = pytest.mark.slow

# FedAvg's fused map-and-sum adds the nodes' partial sums in another order than one loop over the
# cohort: float32 reassociation (1.2e-7 measured with nodes in-process); the rest is bit for bit.
ATOL = 1e-5
CACHE_DIR = os.environ["MEMAUDIT_TEST_JAX_CACHE"]  # the run's compilation cache (tests/conftest.py)

OVERRIDES = [
    "backend=federated", "data.synth.users=12", "data.synth.docs_per_user=3", "data.seq_len=32",
    "data.canaries.repetitions=[1]", "federated.rounds=2", "federated.cohort=4",
    "federated.sampling=fixed", "federated.local_steps=2", "federated.local_batch_size=2",
    "federated.server_optimizer=fedavg", "federated.client_lr=0.2", "federated.eval_every=10",
    "federated.checkpoint_every=1", "federated.mesh_clients=1", "train.batch_size=8",
    "train.eval_batches=1", "federated.flower.insecure=true", "federated.flower.stage_timeout=90",
]
BASE = "configs/federated-tiny.yaml"
DP = ["privacy.noise_multiplier=0.8", "privacy.clip=0.5", "privacy.reproducible_randomness=true"]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """(LocalFederation, overrides with its address and the partitions' tokenizer)."""
    from memaudit.config import load_config
    from memaudit.federated.flower.deploy import LocalFederation
    from memaudit.federated.flower.nodes import write_partitions

    root = tmp_path_factory.mktemp("flower")
    # the SuperNodes' manifest allows both cases' stages (the same data)
    variant = load_config(BASE, [*OVERRIDES, *DP, "privacy.secure_aggregation.enabled=true"])
    info = write_partitions(load_config(BASE, OVERRIDES), root / "parts", nodes=2, variants=[variant])
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {XLA_ONE_THREAD}"}
    fed = LocalFederation(root / "federation", info["partitions"], env=env)
    fed.start()
    try:
        yield fed, [*OVERRIDES, f"data.tokenizer={info['tokenizer']}",
                    f"federated.flower.superlink={fed.address}"], root
    finally:
        fed.stop()
    assert all(p.poll() is not None for p in [fed.superlink, *fed.nodes])  # torn down


def _train(overrides, out: Path, trainer_cls=None, cli=False):
    from memaudit.config import load_config
    from memaudit.run.dispatch import dispatch
    from memaudit.rundir import RunDir

    if cli:  # through `memaudit train`, in this process
        from memaudit.cli import main

        args = ["train", BASE, "--out", str(out)]
        for o in overrides:
            args += ["--set", o]
        assert main(args) == 0
        return json.loads((out / "run.json").read_text())["result"]
    cfg = load_config(BASE, overrides)
    if trainer_cls is not None:
        return run_trainer(trainer_cls(cfg, RunDir(out)))
    return dispatch(cfg, RunDir(out), resume=False)


def _weights(run: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    return max(float(np.max(np.abs(wa[k] - wb[k]))) for k in wa)


def _metrics(run: Path) -> list[dict]:
    from tests.test_lifecycle import merged_metrics

    return merged_metrics(run)


def _check_flower_run(fed, flower_run: Path, result: dict, rounds: int) -> None:
    """What every run on the federation shows: complete, one metrics line a round, the first
    round's stage modules new to the nodes, every node's messages bundled."""
    manifest = json.loads((flower_run / "run.json").read_text())
    assert manifest["status"] == "complete" and manifest["backend"] == "federated"
    assert manifest["config"]["federated"]["runtime"] == "flower"
    assert [m["round"] for m in _metrics(flower_run)] == list(range(1, rounds + 1))
    # each case's first round runs stage modules new to the nodes: a node says so (nodes_compiling)
    assert _metrics(flower_run)[0]["nodes_compiling"] >= 1
    assert result["rounds"] == rounds
    # every node pulled and pushed its messages bundled (memaudit.federated.flower.transport.bundle)
    for i in range(len(fed.partitions)):
        assert bundle.BUNDLED in (fed.workdir / f"supernode-{i}.log").read_text(errors="replace")


def test_flower_weights_equal_in_jax(federation):
    """DP-FedAvg over secure aggregation. (FedAvg without DP, through `memaudit train`:
    test_killed_supernode_drops_its_users, whose first round has every node.)"""
    fed, overrides, root = federation
    case = "dp-fedavg-secagg"
    rounds = 1  # multi-round Flower state: test_flower_trainer (resume) and test_killed_supernode_drops_its_users
    extra = [*DP, "privacy.secure_aggregation.enabled=true", f"federated.rounds={rounds}"]
    jax_run, flower_run = root / f"{case}-jax", root / f"{case}-flower"
    _train([*overrides, *extra], jax_run)
    result = _train([*overrides, *extra, "federated.runtime=flower"], flower_run)
    assert _max_diff(jax_run, flower_run) <= ATOL
    _check_flower_run(fed, flower_run, result, rounds)
    assert all(m["dropped_users"] == 0 for m in _metrics(flower_run))
    # the protocol ran: every sampled user survived it
    sens = [json.loads(x) for x in (flower_run / "sensitive_metrics.jsonl").read_text().splitlines()]
    assert [(m["survivors"], m["secagg_aborted"]) for m in sens] == [(4, 0)] * rounds
    # the same ledger: same events, same epsilon
    a = json.loads((jax_run / "privacy.json").read_text())
    b = json.loads((flower_run / "privacy.json").read_text())
    assert a["epsilon"] == b["epsilon"] and a["events"] == b["events"] and a["steps"] == rounds


FOREIGN_APP = '''"""An app that is not memaudit's: its ClientApp reads the node's partition."""
import json
import time
from pathlib import Path

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

server_app = ServerApp()
client_app = ClientApp()


@client_app.query()
def read_partition(msg, context):
    data = Path(str(context.node_config["partition"])).read_bytes()
    Path(str(context.run_config["marker"])).write_bytes(data[:64])
    return Message(RecordDict({"c": ConfigRecord({"read": len(data)})}), reply_to=msg)


@server_app.main()
def main(grid, context):
    deadline, nodes = time.time() + 60, []
    while len(nodes) < 2 and time.time() < deadline:
        nodes = sorted(grid.get_node_ids())
        time.sleep(0.2)
    msgs = [Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query")
            for n in nodes]
    replies = list(grid.send_and_receive(msgs, timeout=120))
    Path(str(context.run_config["out"])).write_text(json.dumps(
        [{"error": r.has_error(), "reason": r.error.reason if r.has_error() else ""} for r in replies]))
'''


def _submit_foreign_app(root: Path, address: str, env: dict, name: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """`flwr run` FOREIGN_APP against the SuperLink at `address`, as whoever reaches it can; the
    file its ClientApp would copy the partition to, and the file its ServerApp writes the replies to."""
    from types import SimpleNamespace

    from memaudit.federated.flower.deploy import write_flower_home

    app = root / f"{name}-app"
    app.mkdir()
    (app / "foreign_app.py").write_text(FOREIGN_APP)
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "foreign"\nversion = "1.0.0"\ndependencies = []\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n[tool.flwr.app]\npublisher = "someone"\n\n'
        '[tool.flwr.app.components]\nserverapp = "foreign_app:server_app"\nclientapp = "foreign_app:client_app"\n\n'
        '[tool.flwr.app.config]\nmarker = ""\nout = ""\n')
    marker, out = root / f"{name}-read-the-partition", root / f"{name}-replies.json"
    home = write_flower_home(root / f"{name}-home", SimpleNamespace(superlink=address, insecure=True,
                                                                  root_certificates=None))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flwr"), "run", str(app), "memaudit", "--run-config",
         f"marker='{marker}' out='{out}'", "--stream"],
        env={**env, "FLWR_HOME": str(home)}, capture_output=True, text=True, timeout=300, check=False)
    return proc, marker, out


def test_a_foreign_app_is_refused_by_the_superlink(federation):
    """Whoever reaches the SuperLink can `flwr run` an app (Flower 1.42's open-source SuperLink
    authenticates no account), and Flower's SuperExec starts its ServerApp on the SuperLink's host,
    which holds the run directories. memaudit's SuperLink fails the run before anything of the
    app is installed: its ServerApp never runs, so no node is asked anything."""
    from memaudit.federated.flower.superexec import REFUSED_SERVER

    fed, _, root = federation
    proc, marker, out = _submit_foreign_app(root, fed.address, fed.env, "foreign-link")
    assert not out.exists() and not marker.exists()
    logs = proc.stdout + proc.stderr
    assert REFUSED_SERVER in logs, logs[-2000:]  # the run's log, as `flwr run --stream` shows it


def test_memaudits_own_app_from_a_stranger_is_refused_by_the_serverapp(federation, tmp_path):
    """A stranger who reaches the SuperLink submits memaudit's own app (which the SuperLink
    runs) naming a launch folder the real run's ServerApp has not taken yet. The folder records
    the Flower run id memaudit train was given; the stranger's run has another, so its ServerApp
    refuses before it reads the launch file or claims the folder: nothing there changes, and
    the real run can still be served."""
    from memaudit.federated.flower.deploy import CONNECTION, write_app, write_flower_home

    fed = federation[0]
    launch = tmp_path / "launch"
    launch.mkdir(mode=0o700)
    (launch / "launch.json").write_text(json.dumps({"run_dir": str(tmp_path / "victim")}))
    (launch / "flower-run.json").write_text(json.dumps({"run_id": 1}))  # the real run's id
    os.chmod(launch / "flower-run.json", 0o600)
    before = {p.name: p.read_bytes() for p in launch.iterdir()}
    home = write_flower_home(tmp_path / "home", SimpleNamespace(superlink=fed.address, insecure=True,
                                                               root_certificates=None))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flwr"), "run", str(write_app(tmp_path / "app")), CONNECTION,
         "--run-config", f"launch-dir='{launch}'", "--stream"],
        env={**fed.env, "FLWR_HOME": str(home)}, capture_output=True, text=True, timeout=300, check=False)
    logs = proc.stdout + proc.stderr
    assert "was submitted as another Flower run than" in logs, logs[-2000:]
    assert {p.name: p.read_bytes() for p in launch.iterdir()} == before
    assert not (tmp_path / "victim").exists()


def test_a_foreign_app_is_refused_by_the_supernode(federation, tmp_path):
    """Behind a SuperLink that does run a foreign ServerApp (Flower's own, or a server that
    deviates), the foreign ClientApp would run on the nodes: under Flower's own SuperNode it read
    the partition file. memaudit's SuperNode answers with an error naming the refusal, and the
    foreign ClientApp never runs: no byte of the partition leaves the node."""
    from memaudit.federated.flower.deploy import LocalFederation
    from memaudit.federated.flower.superexec import REFUSED

    fed, _, root = federation
    with LocalFederation(tmp_path / "federation", fed.partitions, env=fed.env, manifest=fed.manifest,
                         flower_superlink=True) as other:
        proc, marker, out = _submit_foreign_app(root, other.address, other.env, "foreign-node")
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    replies = json.loads(out.read_text())
    assert len(replies) == 2 and all(r["error"] and r["reason"] == REFUSED for r in replies)
    # Flower's SuperLink has no bundled Fleet requests: the nodes used Flower's own
    logs = [(other.workdir / f"supernode-{i}.log").read_text(errors="replace") for i in range(2)]
    assert all(bundle.FLOWERS in t and bundle.BUNDLED not in t for t in logs)
    assert not marker.exists()


def _certificates(d: Path) -> tuple[str, str, str]:
    """A CA and a certificate it signs for 127.0.0.1 (the multi-host recipe's step 1, for this
    host): (ca.crt, server.pem, server.key)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def cert(subject, issuer, key, signer, *, ca):
        now = datetime.datetime.now(datetime.UTC)
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
             .not_valid_after(now + datetime.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return b.sign(signer, hashes.SHA256())

    pem = serialization.Encoding.PEM
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "memaudit-test-ca")])
    ca = cert(ca_name, ca_name, ca_key, ca_key, ca=True)
    server = cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name, key, ca_key, ca=False)
    d.mkdir(parents=True, exist_ok=True)
    (d / "ca.crt").write_bytes(ca.public_bytes(pem))
    (d / "server.pem").write_bytes(server.public_bytes(pem))
    (d / "server.key").write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return str(d / "ca.crt"), str(d / "server.pem"), str(d / "server.key")


def _node_keys(d: Path, n: int) -> list[str]:
    """One SuperNode key pair each (``ssh-keygen -t ecdsa -b 384`` of the recipe): node-<i>, node-<i>.pub."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        path = d / f"node-{i}"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        path.with_name(f"node-{i}.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
        out.append(str(path))
    return out


def _unauthenticated(e: Exception) -> bool:
    """Whether a runtime API call was refused as unauthenticated (HTTP 401)."""
    return getattr(getattr(e, "response", None), "status_code", None) == 401


def _run_status(home: Path) -> dict[int, tuple[str, str]]:
    """What `flwr ls memaudit --format json` lists (run id: status, status details), asked with the
    same Flower CLI code in this process rather than a new interpreter for every poll."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.cli.ls import _list_runs
    from flwr.cli.utils import init_http_client_from_connection

    from memaudit.federated.flower.deploy import CONNECTION

    before = os.environ.get("FLWR_HOME")
    os.environ["FLWR_HOME"] = str(home)  # where the CLI reads its connections
    try:
        client = init_http_client_from_connection(read_superlink_connection(CONNECTION))
        try:
            return {int(r.run_id): (r.status_text, r.details) for r in _list_runs(client)}
        finally:
            client.close()
    finally:
        if before is None:
            del os.environ["FLWR_HOME"]
        else:
            os.environ["FLWR_HOME"] = before


def _take_the_server_seat(fed, tmp_path: Path, runs: int = 3) -> dict:
    """A stranger who reaches the SuperLink's address (no credential; the CA certificate only,
    which every SuperNode holds) asks its Runtime API for ServerApp tasks, with Flower's own
    client, while ``runs`` runs of memaudit's app are submitted. With a task it reads the run's
    config, asks for the node ids and sends every node memaudit's hello. What it got: tasks
    acquired, asks refused as unauthenticated, bytes of run config, bytes of node replies."""
    from flwr.app import Message
    from flwr.common.constant import SubStatus
    from flwr.common.serde import run_from_proto
    from flwr.proto.runtime_pb2 import (
        AcquireTaskRequest,
        PullTaskInputRequest,
        PushTaskOutputRequest,
    )
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.grid import HttpGrid

    from memaudit.federated.flower import wire
    from memaudit.federated.flower.deploy import CONNECTION, write_app
    from memaudit.federated.flower.messages import payload_of

    ca = None if fed.tls is None else Path(fed.tls[0]).read_bytes()
    tls = {"insecure": ca is None, "root_certificates": ca}

    def client(*interceptors):
        return RuntimeHttpClient.from_server_address(
            server_address=fed.address, **tls,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-serverapp"), *interceptors])

    got = {"tasks": 0, "refused": 0, "other_errors": 0, "run_config_bytes": 0, "node_ids": 0,
           "node_bytes": 0, "users": 0}
    done = threading.Event()

    def seize(token: str) -> None:
        task = client(RuntimeTokenHttpInterceptor(token=token))
        res = task.PullTaskInput(PullTaskInputRequest())
        got["run_config_bytes"] += res.run.ByteSize()
        TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
        TaskIdentity.node_id = res.context.node_id
        grid = HttpGrid(fed.address, token=token, **tls)
        grid.set_run(run_from_proto(res.run))
        nodes, patience = sorted(grid.get_node_ids()), time.monotonic() + 90
        while len(nodes) < len(fed.partitions) and time.monotonic() < patience:
            time.sleep(0.5)  # a patient stranger: the SuperNodes may still be connecting under load
            nodes = sorted(grid.get_node_ids())
        got["node_ids"] += len(nodes)
        hello = [Message(wire.content({}), dst_node_id=n, message_type=f"query.{wire.HELLO}") for n in nodes]
        for reply in grid.send_and_receive(hello, timeout=60):
            if not reply.has_error():
                got["node_bytes"] += len(payload_of(reply))
                got["users"] += len(wire.read(reply).get("users", ()))
        task.PushTaskOutput(PushTaskOutputRequest(context=res.context, sub_status=SubStatus.COMPLETED))

    def stranger() -> None:
        ask = client()
        request = AcquireTaskRequest(supported_task_types=[TaskType.SERVER_APP.value])
        while not done.is_set():
            try:
                res = ask.AcquireTask(request)
            except Exception as e:  # noqa: BLE001 - the stranger notes what it was told
                got["refused" if _unauthenticated(e) else "other_errors"] += 1
                time.sleep(0.01)
                continue
            if res.HasField("task") and res.token:
                got["tasks"] += 1
                try:
                    seize(res.token)
                except Exception as e:  # noqa: BLE001 - noted; the stranger goes on asking
                    got.setdefault("seize_errors", []).append(repr(e)[:300])

    t = threading.Thread(target=stranger, daemon=True)
    t.start()
    app, home = write_app(tmp_path / "app"), fed.flower_home(tmp_path / "home")
    flwr_cli = [str(Path(sys.executable).parent / "flwr")]
    env = {**fed.env, "FLWR_HOME": str(home)}
    ids = []
    try:
        for i in range(runs):  # memaudit's app, as memaudit train submits it (the folder: none)
            out = subprocess.run([*flwr_cli, "run", str(app), CONNECTION, "--run-config",
                                  f"launch-dir='{tmp_path / f'launch-{i}'}'"],
                                 env=env, capture_output=True, text=True, timeout=300, check=True)
            ids.append(deploy.started_run_id(out.stdout + out.stderr))
        # every run's ServerApp task taken, by whichever asked first, and the run over
        deadline, status = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            status = {i: s for i, s in _run_status(home).items() if i in ids}
            if len(status) == runs and all(s.startswith("finished") for s, _ in status.values()):
                break
            time.sleep(1.0)
    finally:
        done.set()
        t.join(timeout=120)
    got["runs"] = [status.get(i) for i in ids]
    # each SuperNode's runtime API (on 127.0.0.1: a stranger on the node's host) asked for a task too
    got["node_runtime_refused"] = 0
    for port in fed.runtime_ports:
        node = RuntimeHttpClient.from_server_address(
            server_address=f"127.0.0.1:{port}", insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")])
        try:
            res = node.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value]))
            got["tasks"] += int(res.HasField("task"))
        except Exception as e:  # noqa: BLE001 - refused, or another failure (which fails the test)
            got["node_runtime_refused"] += _unauthenticated(e)
    return got


@pytest.mark.parametrize("transport", ["http", "tls"])
def test_nobody_takes_the_server_seat(federation, tmp_path, transport):
    """A stranger who reaches the SuperLink's address asks its Runtime API (served on the same
    address as the Fleet API) for ServerApp tasks. Without a check on that ask it acquired them,
    read the run's config, got the node ids and sent the nodes memaudit's hello, which both
    answered with their users and data digests. memaudit's SuperLink serves that ask only to
    its own SuperExec: the stranger's asks are refused, 0 tasks, 0 bytes of node data. Loopback
    plain HTTP (the tests' federation) and the multi-host recipe (TLS, SuperNode
    authentication: nodes registered by their keys) alike; the recipe's real run is served
    (`test_flower_weights_equal_in_jax` on the first federation, a hello exchange here)."""
    from memaudit.federated.flower.deploy import LocalFederation

    fed = federation[0]
    if transport == "http":
        got = _take_the_server_seat(fed, tmp_path)
    else:
        tls, keys = _certificates(tmp_path / "tls"), _node_keys(tmp_path, len(fed.partitions))
        with LocalFederation(tmp_path / "federation", fed.partitions, env=fed.env, manifest=fed.manifest,
                             tls=tls, node_keys=keys) as recipe:
            got = _take_the_server_seat(recipe, tmp_path)
            ls = subprocess.run([str(Path(sys.executable).parent / "flwr"), "supernode", "ls", "memaudit",
                                 "--format", "json"], env={**recipe.env, "FLWR_HOME": str(tmp_path / "home")},
                                capture_output=True, text=True, timeout=300, check=True)
        # the registered SuperNodes came online over TLS: the federation the stranger faced works
        assert [n["status"] for n in json.loads(ls.stdout)["nodes"]] == ["online"] * len(fed.partitions), ls.stdout
    print(f"stranger over {transport}: {got}")  # the before/after figures
    assert got["refused"] > 0, got  # it asked, and the SuperLink said no
    assert got["node_runtime_refused"] == len(fed.partitions), got  # so did each SuperNode
    assert (got["tasks"], got["run_config_bytes"], got["node_ids"], got["node_bytes"]) == (0, 0, 0, 0), got
    # memaudit's own SuperExec took every run's task: its ServerApp ran and refused the run,
    # whose launch folder does not exist (the run binding, run.flower.bind_launch)
    assert all(r is not None and r[0] == "finished:failed" and "memaudit's ServerApp raised" in r[1]
               for r in got["runs"]), got["runs"]


def test_a_node_answers_only_its_runs_server(federation, tmp_path):
    """Whoever holds a run's ServerApp task speaks for the run: behind a SuperLink that hands the
    task out (here Flower's own, its ServerApps left to a SuperExec elsewhere, so the stranger
    takes every one) the stranger sends memaudit's hello. A node answers only messages the
    server key of its manifest signed for the run and the node (memaudit's ServerApp signs once
    bound to its run): the stranger gets errors, 0 bytes of node data. Their own run's ServerApp
    on memaudit's SuperLink is answered (`test_flower_weights_equal_in_jax`, same manifest)."""
    from memaudit.federated.flower.deploy import LocalFederation

    fed = federation[0]
    assert json.loads(Path(fed.manifest).read_text())["server"]  # the nodes' manifest names the key
    with LocalFederation(tmp_path / "federation", fed.partitions, env=fed.env, manifest=fed.manifest,
                         flower_superlink=True, superlink_extra=["--isolation", "process"]) as other:
        got = _take_the_server_seat(other, tmp_path, runs=1)
        logs = [(other.workdir / f"supernode-{i}.log").read_text(errors="replace") for i in range(2)]
    print(f"stranger in the server seat: {got}")  # the before/after figures
    assert got["tasks"] == 1 and got["node_ids"] >= len(fed.partitions), got  # it held the seat, saw the nodes
    assert (got["node_bytes"], got["users"]) == (0, 0), got
    assert all("not signed by this node's server" in t for t in logs)


def test_killed_supernode_drops_its_users(federation):
    """FedAvg through `memaudit train`; SuperNode 1 is killed once round 1 is logged: from the
    round it missed on, its users are dropped (absent slots); the weights equal the in-JAX
    program's with those slots empty. Round 1 has every node (no user dropped), so the run is
    also FedAvg on Flower equal to in-JAX without a drop."""
    from memaudit.federated.trainer import FederatedTrainer

    fed, overrides, root = federation
    run = root / "kill-flower"
    ov = [*overrides, "federated.rounds=3", "federated.runtime=flower"]
    part = np.load(fed.partitions[1])
    dead_users = {str(u) for u in part["users"]}

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            p = run / "metrics.jsonl"
            if p.is_file() and p.read_text().strip():
                fed.kill_node(1)
                return
            time.sleep(0.2)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    result = _train(ov, run, cli=True)
    t.join(timeout=5)
    _check_flower_run(fed, run, result, 3)
    metrics = _metrics(run)
    first = next(m["round"] for m in metrics if m["dropped_users"] > 0)
    assert first >= 2 and all(m["dropped_nodes"] == 1 for m in metrics if m["round"] >= first)
    assert all(m["dropped_users"] == 0 for m in metrics if m["round"] < first)

    class Dropped(FederatedTrainer):  # in-JAX: the dead node's users absent from round `first` on
        def round_data(self, cohort):
            data = super().round_data(cohort)
            r = int(self._round) + 1
            if r < first:
                return data
            keep = np.asarray([self.clients.users[int(k)] not in dead_users for k in cohort], np.float32)
            mask = np.asarray(data.mask).copy()
            mask[: len(cohort)] *= keep[:, None]
            ex = {k: np.asarray(v).copy() for k, v in data.examples.items()}
            for v in ex.values():
                v[: len(cohort)] *= keep.astype(v.dtype)[:, None, None]
            return type(data)(ex, mask)

        def algorithm_round(self, state, cohort, r, key):
            self._round = r
            return super().algorithm_round(state, cohort, r, key)

    jax_run = root / "kill-jax"
    _train([*overrides, "federated.rounds=3"], jax_run, trainer_cls=Dropped)
    assert _max_diff(jax_run, run) <= ATOL
    # the survivors the aggregate counts are the same in both runs, and fewer once the node died
    survivors = [m["aggregated_clients"] for m in metrics]
    assert survivors == [m["aggregated_clients"] for m in _metrics(jax_run)]
    assert all(s < 4 for s, m in zip(survivors, metrics, strict=True) if m["round"] >= first)
