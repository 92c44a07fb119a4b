"""Run a partitioned round: the server's stages here, the client stages on the nodes.

`run_plan(plan, args, nodes, cohort)` walks the plan's stages in order. A server stage runs
its jitted function on the server's values. A client stage is handed to ``nodes`` (anything
with `Nodes.run_stage`: the nodes of a Flower federation, `memaudit.federated.flower.server`,
or `LocalNodes` in this process for tests) with the server values it reads; each node runs the
stage's exported module for the cohort slots it hosts (shaped for its own slots and lowered for
its platform: ``node_stages``, ``platforms``), keeps the clients-placed values later
client stages read, and returns the rows (and partial sums) the server reads. Rows of a slot no
node returned (an absent slot, or the users of a node that died) are zeros: the absent-client
convention of every memaudit federated program (weight 0, no contribution).

A node (`NodeExecutor`) holds its users' data only: its partition of the prepared corpus, as
arrays named ``input_ids``, ``attention_mask``, ``example_mask`` with one row per user. A node
on a SuperNode trusts nothing the server chooses (`NodeTrust`, from the stage manifest its
operator gave it at start): it runs a client stage only when the stage's signature (the module's
bytes and how its inputs and outputs are wired: `stage_signature`) is one of memaudit's for the
operator's config, and refuses any other call with `StageRefused` (one line, never data). The
server reads a node's reply only after `valid_reply` checked it against the plan (outputs,
dtypes, shapes, finite values): a node whose reply fails is dropped for the round like one that
did not answer (``rejected_nodes``).

References:
    Rush et al. 2024, "FAX: Scalable and Differentiable Federated Primitives in JAX".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from jax import export

from memaudit.federated.flower import wire
from memaudit.federated.flower.identity import authenticated_keys, sign_keys
from memaudit.federated.flower.partition import (
    CLIENT,
    STAGE_PLATFORMS,
    Lit,
    NodeStages,
    Plan,
    PlanError,
    Stage,
    modules_for,
)
from memaudit.federated.flower.trust import NodeTrust, StageRefused, stage_signature
from memaudit.federated.secagg.remote import STEPS, node_step

KEEP, ROWS, SUM = "keep", "rows", "sum"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A node's reply that it refused a call (`StageRefused`): one line, no data."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Resident:
    """A round output that stayed on the nodes (``plan.resident_out``): each node keeps its
    rows under ``var`` for the round; ``aval`` is the whole (clients, ...) array's."""

    var: int
    aval: Any


@dataclasses.dataclass(frozen=True)
class StageCall:
    """What one node needs to run one client stage (all plain data: it travels in a message).

    ``inputs``: per stage input, ``("server", value)``, ``("data", array name)`` or
    ``("store", var id)``; ``outputs``: per stage output, KEEP / ROWS / SUM; ``slots``: the
    cohort slot of each user the node serves this round, ``users`` those users' names, ``rows``
    the row of the module's clients dim each user takes: its slot in a module shaped for the
    cohort, 0, 1, ... in one shaped for the node (`memaudit.federated.flower.partition.NodeStages`).
    ``advertise``: on the round's last client stage under secure aggregation, the node's
    advertise payload (`memaudit.federated.secagg.remote.advertisement`): the node makes its
    clients' keys for the round once the stage ran and answers them with the outputs, under
    `ADVERTISED`.
    """

    module: bytes
    module_key: str
    round: int
    stage: int
    inputs: list[tuple[str, Any]]
    outputs: list[str]
    output_ids: list[int]
    slots: list[int]
    users: list[str]
    rows: list[int]
    advertise: dict[str, Any] | None = None


ROW_MAP = -1
"""The var id under which a node keeps the round's (slots, rows): secure aggregation names a
client by its cohort slot, and the node finds its kept rows by it."""
ADVERTISED = "advertise"
"""The key of a stage reply that holds the node's advertise reply (`StageCall.advertise`)."""


class Nodes(Protocol):
    def run_stage(self, calls: dict[Any, StageCall]) -> dict[Any, dict[int, Any]]:
        """Run ``calls`` (node -> call); returns node -> {output index: value} for the nodes
        that answered (a node that did not is absent from the result)."""

    def run_secagg(self, payloads: dict[Any, dict]) -> dict[Any, dict]:
        """One exchange of a remote secure-aggregation round (node -> payload); the replies of
        the nodes that answered (`memaudit.federated.secagg.remote.node_step`)."""


def _resident(plan: Plan) -> set[int]:
    """Var ids that live on the nodes: the cohort data and clients-placed client-stage outputs."""
    out = set(plan.data_leaves)
    for st in plan.client_stages:
        out |= set(st.outputs) - set(st.sums)
    return out


def run_plan(plan: Plan, args: Sequence[Any], nodes: Nodes, assignment: dict[Any, list[tuple[int, str]]],
              *, round: int, node_stages: Callable[[Any, int], NodeStages | None] | None = None,
              platforms: Mapping[Any, str] | None = None,
              advertise: Mapping[Any, dict] | None = None) -> tuple[Any, dict[str, Any]]:
    """Run one round of ``plan``.

    Args:
        plan: from `memaudit.federated.flower.partition.compile_plan`.
        args: the round's arguments; the clients-placed leaves are ignored (the server has
            no client data: pass ``jax.ShapeDtypeStruct`` s).
        nodes: runs the client stages.
        assignment: node -> [(cohort slot, user name)] of the sampled users it hosts.
        round: the round number (nodes key their stored values by it).
        node_stages: ``node_stages(node, hosted)``: the client stages for ``node`` when it
            hosts ``hosted`` of the cohort's slots (`memaudit.federated.flower.partition.node_stages`),
            or None for the cohort's; by default every node runs the cohort's.
        platforms: node -> its JAX platform ("cpu", "cuda"): the stages it gets are lowered for
            that platform alone (`memaudit.federated.flower.partition.modules_for`); default CPU.
        advertise: node -> its advertise payload, sent with the last client stage
            (`StageCall.advertise`).

    Returns:
        (outputs, info): the round's outputs (the program's output pytree; a `Resident` for
        each output that stays on the nodes) and {"dropped_nodes": [...], "dropped_slots":
        [...], "alive_nodes": [...], "rejected_nodes": [...], "advertised": {node: reply}}:
        nodes that did not answer a stage or whose reply failed `valid_reply` (those also in
        "rejected_nodes"), those left, and the advertise replies of those left.

    Raises:
        PlanError: every node refused a stage (`Refusal`: the nodes' manifests are not this
            program's), with the first refusal's line.
    """
    flat = jax.tree.leaves(tuple(args))
    env: dict[int, Any] = dict(plan.consts)
    for i, x in zip(plan.invars, flat, strict=True):
        if i not in plan.data_leaves:
            env[i] = x
    resident = _resident(plan)
    alive = {node for node, users in assignment.items() if users}
    dropped: list[Any] = []
    rejected: list[Any] = []
    advertised: dict[Any, Any] = {}
    last = max((st.index for st in plan.stages if st.kind == CLIENT), default=None)
    for st in plan.stages:
        if st.kind != CLIENT:
            outs = plan.server_fns[st.index](*[env[i] for i in st.inputs])
            env.update(zip(st.outputs, outs, strict=True))
            continue
        wired = _wiring(plan, st, resident)
        served = {ref: np.asarray(env[ref]) for kind, ref in wired[0] if kind == "server"}  # once, not per node
        calls = {node: _call(plan, st, wired, served, assignment[node], round,
                             node_stages(node, len(assignment[node])) if node_stages else None,
                             (platforms or {}).get(node, STAGE_PLATFORMS[0]))
                 for node in alive}
        if advertise and st.index == last:
            calls = {n: dataclasses.replace(c, advertise=advertise.get(n)) for n, c in calls.items()}
        replies = {n: r for n, r in dict(nodes.run_stage(calls)).items() if n in calls}  # asked nodes only
        for n, r in replies.items():
            if isinstance(r, dict) and ADVERTISED in r:
                advertised[n] = r.pop(ADVERTISED)
        refusals = [replies[n].reason for n in sorted(replies, key=str) if isinstance(replies[n], Refusal)]
        bad = sorted((n for n in replies if valid_reply(plan, st, replies[n], len(assignment[n]))
                      is not None), key=str)
        rejected.extend(bad)
        replies = {n: r for n, r in replies.items() if n not in bad}
        if refusals and not replies:
            raise PlanError(f"every SuperNode refused the round's client stage: {refusals[0]}")
        dropped.extend(sorted(alive - set(replies), key=str))
        alive &= set(replies)
        env.update(_assemble(plan, st, {n: replies[n] for n in alive}, {n: assignment[n] for n in alive}))
    outs = [o.value if isinstance(o, Lit) else Resident(o, plan.avals[o]) if k in plan.resident_out
            else env[o] for k, o in enumerate(plan.outvars)]
    slots = sorted(s for n in dropped for s, _ in assignment[n])
    return jax.tree.unflatten(plan.out_tree, outs), {"dropped_nodes": dropped, "dropped_slots": slots,
                                                     "alive_nodes": sorted(alive, key=str),
                                                     "rejected_nodes": rejected,
                                                     "advertised": {n: advertised[n] for n in alive
                                                                    if n in advertised}}


def valid_reply(plan: Plan, st: Stage, reply: Any, hosted: int) -> str | None:
    """None when ``reply`` is what client stage ``st`` returns for a node hosting ``hosted``
    cohort slots: exactly the stage's row and sum outputs, each a numpy array of the plan's
    dtype and shape (rows: ``(hosted, ...)``), floating values finite. Otherwise why not (the
    server drops that node for the round: a truncated, reshaped, oversized or non-finite update
    never reaches the aggregate)."""
    if isinstance(reply, Refusal):
        return "refused"
    want = {k for k, i in enumerate(st.outputs) if i in st.sums or i in st.rows}
    if not isinstance(reply, dict) or set(reply) != want:
        return "not the stage's outputs"
    for k in sorted(want):
        aval, x = plan.avals[st.outputs[k]], reply[k]
        shape = tuple(aval.shape) if st.outputs[k] in st.sums else (hosted, *aval.shape[1:])
        if not isinstance(x, np.ndarray) or x.dtype != np.dtype(aval.dtype) or x.shape != shape:
            return f"output {k} is not a {np.dtype(aval.dtype).name} array of shape {shape}"
        if np.issubdtype(x.dtype, np.inexact) and not np.all(np.isfinite(x)):
            return f"output {k} is not finite"
    return None


def _wiring(plan: Plan, st: Stage, resident: set[int]) -> tuple[list[tuple[str, Any]], list[str]]:
    """A client stage's inputs (``("data", name)``, ``("store", var)``, ``("server", var)``) and
    output modes, as every call of it wires them."""
    inputs: list[tuple[str, Any]] = []
    for i in st.inputs:
        if i in plan.data_leaves:
            inputs.append(("data", plan.data_leaves[i]))
        elif i in resident:
            inputs.append(("store", i))
        else:
            inputs.append(("server", i))
    outputs = [SUM if i in st.sums else (ROWS if i in st.rows else KEEP) for i in st.outputs]
    # an output both kept and read by the server is sent by rows and kept
    outputs = [ROWS + "+" + KEEP if (o == ROWS and i in st.keep) else o
               for o, i in zip(outputs, st.outputs, strict=True)]
    return inputs, outputs


def _call(plan: Plan, st: Stage, wiring: tuple[list, list[str]], served: dict[int, np.ndarray],
          hosted: list[tuple[int, str]], round: int, shaped: NodeStages | None = None,
          platform: str = STAGE_PLATFORMS[0]) -> StageCall:
    """Client stage ``st`` (its `_wiring`, the server values it reads ``served``) for a node
    hosting ``hosted`` (slot, user) on ``platform``: the cohort's module, or the node-shaped one
    of ``shaped`` with the per-client server inputs cut to the node's rows."""
    wired, outputs = wiring
    slots = [s for s, _ in hosted]
    module, rows = modules_for(plan, platform)[st.index], slots
    if shaped is not None:
        module, rows = modules_for(shaped, platform)[st.index], list(range(len(hosted)))
    inputs = []
    for kind, ref in wired:
        if kind != "server":
            inputs.append((kind, ref))
        elif shaped is not None and ref in shaped.rows_in:
            full = served[ref]
            mine = np.zeros((shaped.capacity, *full.shape[1:]), full.dtype)
            mine[rows] = full[slots]
            inputs.append((kind, mine))
        else:
            inputs.append((kind, served[ref]))
    return StageCall(module, hashlib.sha256(module).hexdigest()[:24], round, st.index, inputs,
                     outputs, list(st.outputs), slots, [u for _, u in hosted], rows)


def plan_signatures(plan: Plan, shaped: NodeStages | None = None, platform: str = STAGE_PLATFORMS[0]) -> set[str]:
    """`memaudit.federated.flower.trust.stage_signature` of every client stage of ``plan`` (or
    of its node-shaped stages ``shaped``) lowered for ``platform``: what a node's stage manifest
    allows."""
    resident = _resident(plan)
    modules = modules_for(plan if shaped is None else shaped, platform)
    out = set()
    for st in plan.client_stages:
        inputs, outputs = _wiring(plan, st, resident)
        module = modules[st.index]
        out.add(stage_signature(StageCall(module, "", 0, st.index, inputs, outputs,
                                          list(st.outputs), [], [], [])))
    return out


def resident_vars(plan: Plan) -> set[int]:
    """Var ids of the round's outputs that stay on the nodes (the deltas a host aggregator
    encodes there)."""
    return {plan.outvars[k] for k in plan.resident_out}


def _assemble(plan: Plan, st: Stage, replies: dict, hosted: dict) -> dict[int, Any]:
    """The server's view of a client stage's outputs: rows placed at their slots (zeros
    elsewhere), partial sums added in node order."""
    out: dict[int, Any] = {}
    for k, i in enumerate(st.outputs):
        aval = plan.avals[i]
        if i in st.sums:
            total = np.zeros(aval.shape, aval.dtype)
            for node in sorted(replies, key=str):
                total = (total + np.asarray(replies[node][k])).astype(aval.dtype)
            out[i] = total
        elif i in st.rows:
            full = np.zeros(aval.shape, aval.dtype)
            for node in sorted(replies, key=str):
                slots = [s for s, _ in hosted[node]]
                full[slots] = np.asarray(replies[node][k])
            out[i] = full
    return out


# ------------------------------------------------------------------ the node side
class NodeExecutor:
    """A node's side of the client stages: its users' data, exported modules by key, and the
    values kept between the stages of a round.

    Args:
        users: the names of the users this node hosts (its partition), in row order.
        arrays: ``input_ids`` (users, seqs, L), ``attention_mask`` (users, seqs, L),
            ``example_mask`` (users, seqs): only these users' data.
        store_dir: where values kept between a round's client stages go (a Flower ClientApp
            runs each message in a new process); None keeps them in memory.
        trust: the node's stage manifest (`NodeTrust`): only its stages run, its policy and DP
            parameters hold in secure aggregation. A SuperNode always has one
            (`memaudit.federated.flower.apps`); None (nodes in the server's own process: tests,
            the benchmark's baseline) checks nothing.
    """

    def __init__(self, users: Sequence[str], arrays: dict[str, np.ndarray],
                 store_dir: Any = None, *, trust: NodeTrust | None = None,
                 identity: tuple[int, Any] | None = None) -> None:
        self.users = list(users)
        self.row = {u: k for k, u in enumerate(self.users)}
        self.arrays = arrays
        self.modules: dict[str, Any] = {}
        self.store: dict[tuple[int, int], Any] = {}
        self.store_dir = store_dir
        self.trust = trust
        self.identity = identity
        if trust is not None and trust.nodes and identity is None:
            raise ValueError("a manifest that lists node keys needs this node's identity")
        self.protocol: dict[int, dict] = {}  # secure-aggregation state by round (store_dir None)
        self.platform = node_platform()
        self.new_module = False  # whether the last `run` was this executor's first of its module

    def _keep(self, round: int, var: int, value: Any) -> None:
        if self.store_dir is None:
            self.store[(round, var)] = value
            return

        d = Path(self.store_dir)
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("r*-v*.npy"):
            if not old.name.startswith(f"r{round}-"):
                old.unlink(missing_ok=True)
        np.save(d / f"r{round}-v{var}.npy", np.asarray(value))

    def _kept(self, round: int, var: int) -> Any:
        if self.store_dir is None:
            return self.store[(round, var)]

        return np.load(Path(self.store_dir) / f"r{round}-v{var}.npy")

    def _load_protocol(self, round: int) -> dict:
        if self.store_dir is None:
            return self.protocol[round]

        return wire.unpack((Path(self.store_dir) / f"secagg-r{round}.bin").read_bytes())

    def _save_protocol(self, round: int, state: dict | None) -> None:
        """This node's protocol clients of a round (their secret keys, the shares they hold):
        in memory, or a file only this user can read under ``store_dir``; None deletes it."""
        if self.store_dir is None:
            self.protocol = {} if state is None else {round: state}
            return


        d = Path(self.store_dir)
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("secagg-r*.bin"):
            old.unlink(missing_ok=True)
        if state is None:
            return
        path, tmp = d / f"secagg-r{round}.bin", d / f".secagg-r{round}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(wire.pack(state))
        os.replace(tmp, path)

    def secagg(self, payload: dict) -> dict:
        """This node's side of one secure-aggregation exchange (its clients, its rows): under a
        `NodeTrust`, with the node's own policy and DP bound (a refusal is an abort reply), and
        at the masked-input step only with finite rows (`StageRefused` otherwise: the node drops
        out of the round). The round's protocol state is read once per exchange: the signatures
        are checked, the rows tested and the step run against the same state."""
        step = payload.get("step")
        state = self._load_protocol(int(payload["round"])) if step in STEPS and step != "advertise" else None
        try:
            if self.trust is not None and step == "advertise":
                payload = self.trust.secagg_payload(payload)
            if self.trust is not None and step == "shares":
                self.trust.secagg_encoding(payload)
                if self.trust.nodes:
                    payload = {**payload, "verify": authenticated_keys(payload.get("signed"), self.trust.nodes,
                                                                       state["round_id"])}
        except StageRefused as e:
            if state is not None:  # the round aborts: its secret keys and shares go
                self._save_protocol(int(payload["round"]), None)
            return {"abort": str(e)}
        if step == "advertise":
            try:
                payload = {**payload, "clients": self._rows_of(payload)}
            except StageRefused as e:
                return {"abort": str(e)}
        if step == "masked":
            self._check_finite(int(payload["round"]), state)
        reply = node_step(payload, kept=self._kept, load=lambda _round: state, save=self._save_protocol)
        if step == "advertise" and self.identity is not None and "verify" in reply:
            reply["keys_sig"] = sign_keys(self.identity, int(payload["round_id"]), reply["verify"])
        return reply

    def _rows_of(self, payload: dict) -> list:
        """The advertise payload's clients [cid, slot] with each slot replaced by the row the
        node keeps that slot's values in (the round's stage calls placed them)."""
        try:
            slots, rows = np.asarray(self._kept(int(payload["round"]), ROW_MAP)).tolist()
        except (KeyError, OSError, ValueError):
            raise StageRefused("no client stage of this round ran on this node") from None
        row = dict(zip(slots, rows, strict=True))
        out = []
        for c, s in payload.get("clients") or ():
            if int(s) not in row:
                raise StageRefused(f"the server named cohort slot {int(s)}, which this node did not serve")
            out.append([c, row[int(s)]])
        return out

    def _check_finite(self, round: int, st: dict) -> None:
        if not st.get("leaves"):
            self._save_protocol(round, None)
            raise StageRefused("the round's encoding did not come before its masked input; the node leaves the round")
        slots = [int(s) for s, _ in st["slots"].values()]
        for v in st["leaves"]:
            if not np.all(np.isfinite(np.asarray(self._kept(round, int(v)))[slots])):
                self._save_protocol(round, None)
                raise StageRefused("a user's update on this node is not finite; the node leaves the round")

    def _module(self, call: StageCall) -> Any:
        """The call's exported module, cached by the sha256 of its bytes (never by a name the
        server gives)."""
        key = hashlib.sha256(bytes(call.module)).hexdigest()
        self.new_module = key not in self.modules
        if self.new_module:
            exp = export.deserialize(bytearray(call.module))
            # one jitted callable per module: a node that runs many rounds (a resident process)
            # traces and compiles each stage once
            self.modules[key] = (exp, jax.jit(exp.call))
        return self.modules[key]

    def _check(self, call: StageCall) -> None:
        if self.trust is not None:
            self.trust.check_call(call)
        unknown = [u for u in call.users if u not in self.row]
        if unknown:
            raise StageRefused(f"this node does not host user {unknown[0]!r}; the server's "
                               "assignment does not match the node's partition")
        if len(set(call.users)) != len(call.users) or len(set(call.slots)) != len(call.slots):
            raise StageRefused("the server assigned a user or a cohort slot twice")
        if len(call.rows) != len(call.slots) or len(set(call.rows)) != len(call.rows):
            raise StageRefused("the server gave the node's users no distinct rows")

    def _data(self, name: str, aval: Any, call: StageCall) -> np.ndarray:
        full = np.zeros(aval.shape, aval.dtype)
        src = self.arrays[name]
        for r, user in zip(call.rows, call.users, strict=True):
            row = np.asarray(src[self.row[user]])
            full[(r, *[slice(0, d) for d in row.shape])] = row.astype(aval.dtype)
        return full

    def run(self, call: StageCall) -> dict[int, Any]:
        """Run one client stage for the slots this node serves; returns {output index: value},
        and with ``call.advertise`` the node's advertise reply under `ADVERTISED`.

        Raises:
            StageRefused: a stage not in the node's manifest, or users it does not host.
        """
        self._check(call)
        exp, fn = self._module(call)
        if self.platform not in exp.platforms:
            raise StageRefused(f"the stage is lowered for {', '.join(exp.platforms)}; this node runs "
                               f"{self.platform} (the server exports each node's stages for its platform)")
        self.store = {k: v for k, v in self.store.items() if k[0] == call.round}
        # the module's clients dim: its data inputs' and per-client outputs' leading dim
        width = min([a.shape[0] for (kind, _), a in zip(call.inputs, exp.in_avals, strict=True) if kind == "data"]
                    + [a.shape[0] for mode, a in zip(call.outputs, exp.out_avals, strict=True) if mode != SUM],
                    default=None)
        if width is not None and any(not 0 <= r < width for r in call.rows):
            raise StageRefused(f"the server gave rows outside the module's {width} clients")
        self._keep(call.round, ROW_MAP, np.asarray([call.slots, call.rows], np.int64))
        args = []
        for (kind, ref), aval in zip(call.inputs, exp.in_avals, strict=True):
            if kind == "data":
                args.append(self._data(ref, aval, call))
            elif kind == "store":
                args.append(self._kept(call.round, ref))
            else:
                args.append(ref)
        outs = fn(*args)
        reply: dict[int, Any] = {}
        for k, (mode, out) in enumerate(zip(call.outputs, outs, strict=True)):
            if KEEP in mode:
                self._keep(call.round, call.output_ids[k], out)
            if ROWS in mode:
                reply[k] = np.asarray(out)[call.rows]
            elif mode == SUM:
                reply[k] = np.asarray(out)
        if call.advertise is not None:  # the round's keys, made once its last stage ran here
            reply[ADVERTISED] = self.secagg({**call.advertise, "step": "advertise", "round": call.round})
        return reply


def node_platform() -> str:
    """This process's JAX platform as a stage is lowered for it ("cpu", "cuda", "rocm", ...)."""
    backend = jax.default_backend()
    return "cuda" if backend == "gpu" else backend


class LocalNodes:
    """Nodes in this process (tests and the benchmark's baseline): node name -> executor."""

    def __init__(self, executors: dict[Any, NodeExecutor], dead: Sequence[Any] = ()) -> None:
        self.executors, self.dead = executors, set(dead)

    def run_stage(self, calls: dict[Any, StageCall]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for node, call in calls.items():
            if node in self.dead:
                continue
            try:
                out[node] = self.executors[node].run(call)
            except StageRefused as e:
                out[node] = Refusal(str(e))
        return out

    def run_secagg(self, payloads: dict[Any, dict]) -> dict[Any, dict]:
        out: dict[Any, dict] = {}
        for node, p in payloads.items():
            if node in self.dead:
                continue
            with contextlib.suppress(StageRefused):  # a node that leaves the round does not answer
                out[node] = self.executors[node].secagg(p)
        return out


def call_to_wire(call: StageCall) -> dict[str, Any]:
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}


def call_from_wire(d: dict[str, Any]) -> StageCall:
    d = dict(d)
    d["inputs"] = [tuple(x) for x in d["inputs"]]
    return StageCall(**d)
