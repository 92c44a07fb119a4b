"""What a SuperNode trusts: only what its operator gave it at start, never what the server sends.

Adversary: the server (the SuperLink's ServerApp, or anyone who can submit a Flower run that
uses memaudit's ClientApp) deviating from memaudit's program to learn one user's data. A node
started with a stage manifest (`memaudit.federated.flower.manifest`, written by the operator
from the run's config with ``python -m memaudit.federated.flower.nodes``) holds a `NodeTrust`:

- ``stages``: the signatures of memaudit's client stages for that config (`stage_signature`:
  sha256 over the exported module's bytes and how the call wires its inputs and outputs). A call
  with any other module, or an allowed module wired otherwise (a data array into another input,
  a kept output marked as rows the server reads), is refused with `StageRefused`: one line,
  never data;
- ``resident``: the var ids of the deltas a secure-aggregation round may encode (the host split's
  resident outputs); any other kept value is refused;
- ``policy``: the secure-aggregation policy (threshold, colluding clients, minimum survivors,
  mode) the node's protocol clients enforce, whatever the server's message says; no policy: the
  node takes part in no secure-aggregation round;
- ``nodes``: every node's long-term Ed25519 public key, the PKI of the malicious-server mode
  (`memaudit.federated.flower.identity`): a client's round key counts only when a listed node
  signed it;
- ``server``: the server's Ed25519 public key: the node answers only messages it signed for
  their run and this node (`memaudit.federated.flower.messages.server_refusal`), so whoever else holds a
  run's ServerApp task gets no answer;
- ``dp``: the DP parameters the node enforces on the round's public encoding: the clip bound of a
  quantised contribution (unless adaptive clipping moves it), and under distributed DP each
  client's noise share, at least ``noise_multiplier * clip / sqrt(expected_cohort)``.

References:
    Bonawitz et al., CCS 2017 (the server as adversary); Kairouz, Liu, Steinke, ICML 2021
    (each client's share of the distributed discrete Gaussian).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from jax import export

from memaudit.errors import DataError, MemauditError

SCHEMA = 1


class StageRefused(MemauditError):
    """A node refused a call the server sent (one line naming why; no data in it)."""


def module_digest(module: bytes) -> str:
    """sha256 of what an exported module computes: its StableHLO without source locations
    (they name the frames it was traced from, not what it does; their count varies with those
    frames) and its calling convention
    (argument and result shapes, trees, kept arguments, platforms, effects, shardings).

    Deserialising and printing the module takes tens of milliseconds and a node checks the same
    module every round: the digest is kept for the module's bytes (the last 64 modules)."""
    return _digest(bytes(module))


@functools.lru_cache(maxsize=64)
def _digest(module: bytes) -> str:
    exp = export.deserialize(bytearray(module))
    text = re.sub(r"^#loc[\w.]*\s*=.*$", "", exp.mlir_module(), flags=re.MULTILINE)
    text = re.sub(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)", "", text)
    # the number of location aliases depends on the frames traced through: drop the blank lines
    text = "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
    conv = [repr(getattr(exp, k, None)) for k in (
        "in_avals", "out_avals", "in_tree", "out_tree", "module_kept_var_idx", "platforms",
        "nr_devices", "ordered_effects", "unordered_effects", "in_shardings_hlo", "out_shardings_hlo",
        "calling_convention_version", "uses_global_constants", "disabled_safety_checks")]
    return hashlib.sha256("\n".join([text, *conv]).encode()).hexdigest()


def stage_signature(call: Any) -> str:
    """sha256 of what a client-stage call makes the node do, independent of the round's values:
    the module (`module_digest`), each input's source (``data`` array name, ``store`` var id, or
    a server value), each output's mode and var id.

    The node computes it from the bytes it runs; the manifest from the server's program.
    """
    inputs = [[str(kind), None if kind == "server" else ref] for kind, ref in call.inputs]
    body = {"module": module_digest(bytes(call.module)), "inputs": inputs,
            "outputs": [str(o) for o in call.outputs], "output_ids": [int(i) for i in call.output_ids]}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class DPBound:
    """The DP parameters a node enforces (from its operator's config)."""

    mechanism: str  # "central" | "distributed"
    clip: float | None  # bound on the encoding's clip; None: adaptive clipping moves it
    noise_multiplier: float | None = None  # distributed DP: z of the noise shares
    expected_cohort: float | None = None


@dataclasses.dataclass(frozen=True)
class NodeTrust:
    """A node's manifest: what it runs and enforces (see the module docstring)."""

    stages: frozenset[str]
    resident: frozenset[int] = frozenset()
    policy: tuple | None = None  # (threshold, colluding, min_survivors, mode)
    dp: DPBound | None = None
    fingerprint: str = ""
    nodes: tuple[str, ...] = ()  # the nodes' Ed25519 public keys (hex), by node index
    server: str = ""  # the server's Ed25519 public key (hex): a node answers only what it signed

    # ------------------------------------------------------------------ stages
    def check_call(self, call: Any) -> None:
        sig = stage_signature(call)
        if sig not in self.stages:
            raise StageRefused(f"stage {sig[:12]} is not one of this node's {len(self.stages)} allowed "
                               "memaudit client stages; write the stage manifest from the run's config "
                               "(python -m memaudit.federated.flower.nodes) and restart the SuperNode")

    # ------------------------------------------------------------------ secure aggregation
    def _policy(self) -> tuple:
        if self.policy is None:
            raise StageRefused("this node's stage manifest has no secure-aggregation policy: it takes "
                               "part in no secure-aggregation round")
        return self.policy

    def secagg_payload(self, payload: dict[str, Any]) -> dict[str, Any]:
        """The advertise payload with this node's policy in place of the server's."""
        return {**payload, "policy": list(self._policy())}

    def secagg_encoding(self, payload: dict[str, Any]) -> None:
        """Check the round's encoding and per-client transforms (``payload["encoding"]`` of the
        shares step, before any share of a client's keys is sent) against the node's DP bound,
        and the kept values it encodes against ``resident``."""
        self._policy()
        payload = dict(payload.get("encoding") or {})
        leaves = [int(v) for v in payload.get("leaves") or ()]
        if not leaves or not set(leaves) <= self.resident:
            raise StageRefused("the server asked to encode values that are not the round's deltas")
        if self.dp is not None:
            self._check_dp(payload)

    def _check_dp(self, payload: dict[str, Any]) -> None:
        dp, spec = self.dp, dict(payload.get("spec") or {})
        want = "ddp" if dp.mechanism == "distributed" else "secagg"
        if spec.get("kind") != want:
            raise StageRefused(f"the round's encoding is {spec.get('kind')!r}, this node's config "
                               f"needs {want!r}")
        clip = float(spec["clip"])
        clips = [float(v) for _, v in payload.get("pre") or ()]
        if dp.clip is not None and (clip > dp.clip * (1 + 1e-9) or
                                    any(c > dp.clip * (1 + 1e-9) for c in clips)):
            raise StageRefused(f"the round's clip {clip:g} exceeds this node's privacy.clip {dp.clip:g}")
        if want == "ddp":
            share = float(spec["local_std"]) * float(spec["gamma"]) / clip  # in units of the clip
            need = float(dp.noise_multiplier) / math.sqrt(float(dp.expected_cohort))
            if not share >= need * (1 - 1e-9):
                raise StageRefused(f"the round's noise share {share:.4g} x clip is below this node's "
                                   f"{need:.4g} x clip (privacy.noise_multiplier)")

    def merge(self, other: NodeTrust) -> NodeTrust:
        """The manifest of two configs on the same data (a node serving both): their stages
        and deltas; their policies and DP bounds must agree where both set one."""
        for name in ("policy", "dp"):
            a, b = getattr(self, name), getattr(other, name)
            if a is not None and b is not None and a != b:
                raise DataError(f"the configs of one stage manifest set different secure-aggregation "
                                f"{'policies' if name == 'policy' else 'DP parameters'} ({a} and {b}); "
                                "give their SuperNodes separate manifests")
        if self.nodes and other.nodes and self.nodes != other.nodes:
            raise DataError("the configs of one stage manifest name different node keys; write their "
                            "partitions and manifest together")
        if self.server and other.server and self.server != other.server:
            raise DataError("the configs of one stage manifest name different server keys; write their "
                            "partitions and manifest together")
        if self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint:
            raise DataError("the configs of one stage manifest prepare different data; give each data "
                            "config its own partitions and manifest")
        return NodeTrust(self.stages | other.stages, self.resident | other.resident,
                         self.policy if self.policy is not None else other.policy,
                         self.dp if self.dp is not None else other.dp, self.fingerprint or other.fingerprint,
                         self.nodes or other.nodes, self.server or other.server)

    # ------------------------------------------------------------------ the file
    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "stages": sorted(self.stages), "resident": sorted(self.resident),
                "policy": None if self.policy is None else list(self.policy),
                "dp": None if self.dp is None else dataclasses.asdict(self.dp),
                "fingerprint": self.fingerprint, "nodes": list(self.nodes), "server": self.server}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeTrust:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"schema {d.get('schema')!r}")
        dp = d.get("dp")
        return cls(frozenset(str(s) for s in d["stages"]), frozenset(int(v) for v in d.get("resident") or ()),
                   None if d.get("policy") is None else tuple(d["policy"]),
                   None if dp is None else DPBound(**dp), str(d.get("fingerprint", "")),
                   tuple(str(k) for k in d.get("nodes") or ()), str(d.get("server") or ""))

    @classmethod
    def load(cls, path: str | Path) -> NodeTrust:
        """The manifest file; one-line `DataError` when it is missing or damaged."""
        p = Path(path).expanduser()
        try:
            return cls.from_json(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"the stage manifest '{p}' cannot be read ({type(e).__name__}); write it "
                            "with python -m memaudit.federated.flower.nodes") from None


__all__ = ["DPBound", "NodeTrust", "StageRefused", "stage_signature"]
