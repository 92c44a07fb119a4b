"""Submitting a run to a Flower federation, and a federation on one machine for tests.

`submit` writes a minimal Flower App (a ``pyproject.toml`` whose components are memaudit's
``ServerApp`` and ``ClientApp``) and a Flower config naming the SuperLink, then runs
``flwr run APP memaudit --run-config launch-dir=... --stream`` and waits for it to end.
`superlink_args` and `supernode_args` are the deployment's commands' arguments (TLS, SuperNode
authentication, the host the SuperLink binds, each node's partition and stage manifest; plain
HTTP only on localhost). `LocalFederation` starts memaudit's SuperLink and SuperNodes (or
Flower's own) as separate processes on 127.0.0.1 with free ports (plain HTTP: localhost only),
and tears them down; the tests and ``benchmarks/federated_round.py`` use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

from memaudit.errors import ConfigError, MemauditError
from memaudit.federated.flower.messages import SERVER_KEY
from memaudit.io import atomic_write_json

APP_MODULE = "memaudit_flower_app"
CONNECTION = "memaudit"
RUN_ID = "flower-run.json"  # in a launch folder: the id of the Flower run it was submitted as


def require_flwr() -> None:
    """One-line error naming the extra when flwr is not installed."""
    try:
        import flwr  # noqa: F401  (optional dependency: flwr, the flower extra)
    except ImportError:
        raise ConfigError("federated.runtime=flower needs Flower; install the extra: "
                          "pip install 'memaudit[flower]'") from None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """One-line error when nothing listens at the SuperLink's address."""
    host, port = _split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise MemauditError(f"the SuperLink at {address} cannot be reached ({e.strerror or e}); "
                            "start flower-superlink there or fix federated.flower.superlink") from None


def _tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def write_app(d: Path) -> Path:
    """The Flower App memaudit submits: its components are memaudit's apps."""
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{APP_MODULE}.py").write_text(
        '"""memaudit on Flower: its ServerApp and ClientApp (memaudit.federated.flower.node)."""\n'
        "from memaudit.federated.flower.node import client_app, server_app\n\n"
        '__all__ = ["client_app", "server_app"]\n')
    (d / "pyproject.toml").write_text(f'''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "memaudit-flower-app"
version = "1.0.0"
description = "memaudit's federated program on Flower"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "memaudit"

[tool.flwr.app.components]
serverapp = "{APP_MODULE}:server_app"
clientapp = "{APP_MODULE}:client_app"

[tool.flwr.app.config]
launch-dir = ""
''')
    return d


def write_flower_home(d: Path, fcfg: Any) -> Path:
    """A Flower config (``$FLWR_HOME/config.toml``) with one connection to the SuperLink."""
    d.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
             f'address = "{fcfg.superlink}"']
    if fcfg.insecure:
        lines.append("insecure = true")
    if fcfg.root_certificates:
        lines.append(f'root-certificates = "{Path(fcfg.root_certificates).expanduser().resolve()}"')
    (d / "config.toml").write_text("\n".join(lines) + "\n")
    return d


def submit(launch: Path, fcfg: Any, *, progress: Callable[[], None] | None = None) -> int:
    """``flwr run`` the app for ``launch`` (a folder with launch.json); returns its exit code.
    Its output goes to ``launch/flwr-run.log``; the run id it prints is recorded in
    ``launch/RUN_ID`` as soon as it does (the ServerApp serves the folder only as that run:
    `memaudit.run.flower.bind_launch`)."""
    app = write_app(launch / "app")
    home = write_flower_home(launch / "flwr-home", fcfg)
    env = {**os.environ, "FLWR_HOME": str(home), "PYTHONUNBUFFERED": "1"}  # the run id, as printed
    cmd = [_tool("flwr"), "run", str(app), CONNECTION, "--run-config",
           f"launch-dir='{launch.resolve()}'", "--stream"]
    with open(launch / "flwr-run.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            bound = False
            while proc.poll() is None:
                if not bound:
                    bound = record_run_id(launch)
                if progress is not None:
                    progress()
                time.sleep(1.0 if bound else 0.05)
        except BaseException:  # interrupted: stop the Flower run too, not only flwr run
            proc.terminate()
            _stop_run(launch, env)
            raise
    if progress is not None:
        progress()
    return proc.returncode


def started_run(launch: Path) -> int | None:
    """The id of the run ``flwr run`` started for ``launch``, from its log; None before it says.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "flwr-run.log").write_text("Successfully started run 1234567\\n")
    >>> started_run(d)
    1234567
    """
    try:
        text = (launch / "flwr-run.log").read_text(errors="replace")
    except OSError:
        return None
    return started_run_id(text)


def started_run_id(text: str) -> int | None:
    """The run id in ``flwr run``'s output; None where it names none.

    >>> started_run_id("Successfully started run 42\\n"), started_run_id("")
    (42, None)
    """
    found = re.search(r"started run (\d+)", text)
    return None if found is None else int(found.group(1))


def record_run_id(launch: Path) -> bool:
    """Write the started run's id to ``launch/RUN_ID`` (0600, atomic); False until it is known."""
    run_id = started_run(launch)
    if run_id is None:
        return False
    atomic_write_json(launch / RUN_ID, {"run_id": run_id})  # 0600, as every memaudit write
    return True


def _stop_run(launch: Path, env: dict[str, str]) -> None:
    """``flwr stop`` the run ``flwr run`` started (its id is in the log), best effort."""
    run_id = started_run(launch)
    if run_id is None:
        return
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([_tool("flwr"), "stop", str(run_id), CONNECTION], env=env, timeout=60,
                       stdin=subprocess.DEVNULL, capture_output=True, check=False)


# ------------------------------------------------------------------ the processes' commands
def superlink_args(host: str, port: int, *, tls: tuple[str, str, str] | None = None,
                   supernode_auth: bool = True, server_key: str | Path | None = None) -> list[str]:
    """The arguments of memaudit's SuperLink (`memaudit.federated.flower.superlink`; Flower's
    ``flower-superlink`` takes the same but ``--server-key``): bound to ``host`` (the interface
    the SuperNodes and the operator reach; flwr serves its Fleet, Control and Runtime APIs on
    this one address), TLS from ``tls`` = (CA certificate, certificate, key), only registered
    SuperNodes (``--enable-supernode-auth``), no dependency installation, and the key its
    ServerApp signs its messages with (``server_key``, the ``serverapp.key`` written with the
    partitions). Without ``tls`` only on localhost (the tests' federation).

    >>> superlink_args("127.0.0.1", 9091, supernode_auth=False)[:3]
    ['--insecure', '--host', '127.0.0.1']
    """
    if tls is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"a SuperLink on {host} without TLS would take runs and nodes in plain text; "
                          "give its CA certificate, certificate and key, or bind it to 127.0.0.1")
    out = ["--insecure"] if tls is None else ["--ssl-ca-certfile", tls[0], "--ssl-certfile", tls[1],
                                              "--ssl-keyfile", tls[2]]
    out += ["--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    out += ["--server-key", str(server_key)] if server_key is not None else []
    return out + (["--enable-supernode-auth"] if supernode_auth else [])


def supernode_args(superlink: str, partition: str | Path, manifest: str | Path, *,
                   root_certificates: str | None = None, auth_key: str | None = None,
                   cache_dir: str | Path | None = None, resident: bool = True) -> list[str]:
    """The arguments of memaudit's SuperNode (`memaudit.federated.flower.supernode`; Flower's
    ``flower-supernode`` takes the same): the SuperLink verified with ``root_certificates`` (TLS;
    plain HTTP only to a SuperLink on localhost), the node's private key (SuperNode
    authentication) and the node config memaudit's ClientApp reads: its partition and its
    stage manifest (`memaudit.federated.flower.trust`); ``resident=False`` runs every message in
    its own ``flwr-clientapp`` process rather than the node's resident one (`memaudit.federated.flower.node`)."""
    host, _ = _split(superlink)
    if root_certificates is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise ConfigError(f"a SuperNode talking to {superlink} without TLS sends its replies in plain "
                          "text; give the SuperLink's CA certificate (root_certificates)")
    out = ["--insecure"] if root_certificates is None else ["--root-certificates", root_certificates]
    out += ["--superlink", superlink]
    if auth_key is not None:
        out += ["--auth-supernode-private-key", auth_key]
    config = f"partition='{partition}' manifest='{manifest}'"
    if cache_dir is not None:
        config += f" cache-dir='{cache_dir}'"
    if not resident:
        config += " resident='false'"
    return [*out, "--node-config", config]


# ------------------------------------------------------------------ one machine
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MemauditError(f"flower-superlink exited ({proc.returncode}); see {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.3)
    raise MemauditError(f"flower-superlink did not listen on port {port} within {timeout:g} s")


class LocalFederation:
    """One SuperLink and one SuperNode per partition, as processes on 127.0.0.1.

    Args:
        workdir: logs, the Flower home and the nodes' caches go here.
        partitions: one partition file per SuperNode (`memaudit.federated.flower.nodes`).
        env: environment of the processes (default: this one's).
        manifest: the SuperNodes' stage manifest (default: ``manifest.json`` beside the first
            partition, where `memaudit.federated.flower.nodes` writes it).
        resident: each SuperNode answers through its resident process (`memaudit.federated.flower.node`);
            False: the process that runs the ClientApp does the work.
        flower_supernode: run Flower's own ``flower-supernode`` (a ``flwr-clientapp`` process per
            message, a 3 s poll, any app) rather than memaudit's SuperNode
            (`memaudit.federated.flower.supernode`): the comparison of the benchmark.
        flower_superlink: run Flower's own ``flower-superlink`` (any app's ServerApp) rather than
            memaudit's (`memaudit.federated.flower.superlink`): what a SuperNode's own refusal is
            tested against.
        bundled: memaudit's SuperNodes pull a message and push a reply in one request each
            (`memaudit.federated.flower.transport.bundle`); False: Flower's requests (``--fleet flower``).
        tls: (CA certificate, certificate, key) of the SuperLink: it serves TLS on 127.0.0.1
            (the certificate must name that address) and the SuperNodes verify it with the CA, as
            in the multi-host deployment (docs/flower.md); None: plain HTTP.
        node_keys: one private key file per SuperNode (its public half beside it, ``.pub``,
            OpenSSH format): the SuperLink admits only these nodes (``--enable-supernode-auth``,
            which needs ``tls``), each registered with ``flwr supernode register`` before it starts.
        superlink_extra: more arguments of the SuperLink. memaudit's SuperLink is given the
            ``serverapp.key`` beside the manifest, where there is one (``--server-key``).
        transport_off: layers of memaudit's Flower transport its SuperLink and SuperNodes leave
            out (``--transport-off``; `memaudit.federated.flower.transport.OPTIONAL`): the
            benchmark's comparison (``benchmarks/flower_transport.py``).
    """

    def __init__(self, workdir: Path, partitions: Sequence[str | Path],
                 env: dict[str, str] | None = None, manifest: str | Path | None = None,
                 resident: bool = True, flower_supernode: bool = False, flower_superlink: bool = False,
                 bundled: bool = True, tls: tuple[str, str, str] | None = None,
                 node_keys: Sequence[str | Path] | None = None, superlink_extra: Sequence[str] = (),
                 transport_off: Sequence[str] = ()) -> None:
        self.resident, self.flower_supernode, self.flower_superlink = resident, flower_supernode, flower_superlink
        self.bundled, self.tls, self.superlink_extra = bundled, tls, list(superlink_extra)
        self.transport_off = [a for layer in transport_off for a in ("--transport-off", layer)]
        self.node_keys = None if node_keys is None else [str(k) for k in node_keys]
        if self.node_keys is not None and (tls is None or len(self.node_keys) != len(partitions)):
            raise ValueError("node_keys needs tls and one key per partition")
        self.workdir, self.partitions = Path(workdir), [str(p) for p in partitions]
        self.manifest = str(manifest or Path(self.partitions[0]).parent / "manifest.json")
        self.env = dict(os.environ if env is None else env)
        self.env["FLWR_HOME"] = str(self.workdir / "flwr-home")
        # Flower's SuperExec looks for a message to start a ClientApp for once a second by default
        self.env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.05")
        # the SuperLink and SuperNodes start flower-superexec, flwr-serverapp, flwr-clientapp
        bindir = str(Path(sys.executable).parent)
        self.env["PATH"] = os.pathsep.join([bindir, self.env.get("PATH", "")])
        self.port = 0
        self.superlink: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.runtime_ports: list[int] = []  # each SuperNode's runtime API port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - kept open by the process
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        link = ([_tool("flower-superlink")] if self.flower_superlink
                else [sys.executable, "-m", "memaudit.federated.flower.superlink"])
        key = Path(self.manifest).with_name(SERVER_KEY)  # written with the manifest
        key = key if key.is_file() and not self.flower_superlink else None
        self.superlink = self._start("superlink", [  # state in memory (no --database)
            *link, *([] if self.flower_superlink else self.transport_off),
            *superlink_args("127.0.0.1", self.port, tls=self.tls, supernode_auth=self.node_keys is not None,
                            server_key=key), *self.superlink_extra])
        _wait_port(self.port, self.superlink, timeout, self.workdir / "superlink.log")
        for key in self.node_keys or ():
            self.register(f"{key}.pub")
        for i, part in enumerate(self.partitions):
            self.nodes.append(self.start_node(i, part))

    def flower_home(self, d: Path) -> Path:
        """A Flower config in ``d`` whose one connection is this federation's SuperLink."""
        return write_flower_home(d, SimpleNamespace(superlink=self.address, insecure=self.tls is None,
                                                    root_certificates=None if self.tls is None else self.tls[0]))

    def register(self, public_key: str | Path) -> None:
        """``flwr supernode register``: the SuperLink admits the node of this public key."""
        home = self.flower_home(self.workdir / "flwr-home")
        proc = subprocess.run([_tool("flwr"), "supernode", "register", str(public_key), CONNECTION],
                              env={**self.env, "FLWR_HOME": str(home)}, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise MemauditError(f"flwr supernode register {public_key} failed: "
                                f"{(proc.stdout + proc.stderr).strip()[-300:]}")

    def start_node(self, i: int, partition: str) -> subprocess.Popen:
        cache = self.workdir / f"node-{i}-cache"
        node = ([_tool("flower-supernode")] if self.flower_supernode
                else [sys.executable, "-m", "memaudit.federated.flower.supernode",
                      *([] if self.bundled else ["--fleet", "flower"]), *self.transport_off])
        port = free_port()
        self.runtime_ports[i:i + 1] = [port]  # the node's runtime API (127.0.0.1, plain HTTP)
        return self._start(f"supernode-{i}", [
            *node, "--host", "127.0.0.1", "--port", str(port),
            *supernode_args(self.address, partition, self.manifest, cache_dir=cache, resident=self.resident,
                            root_certificates=None if self.tls is None else self.tls[0],
                            auth_key=None if self.node_keys is None else self.node_keys[i])])

    def kill_node(self, i: int) -> None:
        """SIGKILL SuperNode ``i`` and the processes it started (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.nodes[i].pid, signal.SIGKILL)
        self.nodes[i].wait(timeout=30)

    def stop(self) -> None:
        for p in [*self.nodes, self.superlink]:
            if p is None or p.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in [*self.nodes, self.superlink]:
            if p is None:
                continue
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=15)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
