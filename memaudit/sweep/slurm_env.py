"""Rendezvous of a multi-task scheduler job, read from SLURM's environment (as torchrun does).

A parallel sweep point runs as ONE job with one task per rank. Each task reads its place from
SLURM (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the tasks per node), takes the first
host of `SLURM_JOB_NODELIST` as `MASTER_ADDR` and a port derived from `SLURM_JOB_ID` (every
task computes the same one, and two jobs on one node rarely collide), and exports the
`RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`LOCAL_WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` variables that
`memaudit.run.launch` reads; the existing per-rank entry point (`launch_training` under a
launcher) then runs unchanged. submitit's LocalExecutor sets `SUBMITIT_LOCAL_*` variables
instead; `slurm_view` maps them onto the SLURM names, so the local test exercises this module.

References:
  SLURM srun(1) "OUTPUT ENVIRONMENT VARIABLES"; PyTorch torchrun environment variables.

>>> first_host("nid[0012-0015,0020],gpu7")
'nid0012'
>>> tasks_on_node("4(x2),3", node=2)
3
>>> r = rendezvous({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
...                 "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[3-4]",
...                 "SLURM_JOB_ID": "123456", "SLURM_NODEID": "1"})
>>> (r.rank, r.world_size, r.local_rank, r.local_world_size, r.master_addr, r.master_port)
(5, 8, 1, 4, 'gpu3', 18456)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

PORT_BASE, PORT_SPAN = 15000, 10000  # below Linux's ephemeral range (32768+)


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job_id: str

    def torchrun_env(self) -> dict[str, str]:
        """The variables torchrun would set for this task."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def _split_top(spec: str) -> list[str]:
    """Split a SLURM host list on the commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in spec:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur] if cur else out


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list (`a[01-04,09]b`, `x1,y2`), zero padding kept."""
    items = [s for s in _split_top(nodelist.strip()) if s]
    if not items:
        raise ValueError(f"SLURM_JOB_NODELIST='{nodelist}' names no host; run inside a SLURM job")
    # each bracket group contributes its first entry (`rack[1-2]-n[07-08]` -> rack1-n07)
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], items[0])


def tasks_on_node(tasks_per_node: str, *, node: int) -> int:
    """Tasks on node `node` from SLURM_TASKS_PER_NODE's compressed form (`4(x2),3`)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE='{tasks_per_node}' is not SLURM's 'N(xM),...' form")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node < len(counts):
        raise ValueError(f"node {node} is not among the {len(counts)} nodes of "
                         f"SLURM_TASKS_PER_NODE='{tasks_per_node}'")
    return counts[node]


def port_for(job_id: str) -> int:
    """One port per job, the same on every task: from the numeric part of the job id."""
    digits = re.sub(r"\D", "", str(job_id))
    if not digits:
        raise ValueError(f"SLURM_JOB_ID='{job_id}' has no digits; cannot derive MASTER_PORT")
    return PORT_BASE + int(digits) % PORT_SPAN


def slurm_view(environ: Mapping[str, str]) -> dict[str, str] | None:
    """SLURM's task variables of this process (submitit's local emulation mapped onto them),
    or None outside a scheduler task."""
    if environ.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in environ:
        n = environ["SUBMITIT_LOCAL_NTASKS"]
        return {"SLURM_PROCID": environ["SUBMITIT_LOCAL_GLOBALID"], "SLURM_NTASKS": n,
                "SLURM_LOCALID": environ["SUBMITIT_LOCAL_LOCALID"], "SLURM_NTASKS_PER_NODE": n,
                "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NODEID": "0",
                "SLURM_JOB_ID": environ["SUBMITIT_LOCAL_JOB_ID"]}
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return dict(environ)
    return None


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except KeyError:
        raise ValueError(f"{key} is not set; a multi-task point must run as a SLURM job step") from None
    except ValueError:
        raise ValueError(f"{key}='{env[key]}' is not an integer") from None


def rendezvous(env: Mapping[str, str]) -> Rendezvous:
    """This task's place in the job, from SLURM's variables (see `slurm_view`)."""
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    if "SLURM_NTASKS_PER_NODE" in env and env["SLURM_NTASKS_PER_NODE"].isdigit():
        local_world = int(env["SLURM_NTASKS_PER_NODE"])
    elif "SLURM_TASKS_PER_NODE" in env:
        local_world = tasks_on_node(env["SLURM_TASKS_PER_NODE"], node=_int(env, "SLURM_NODEID"))
    else:
        local_world = world // max(1, int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1"))))
    if not (0 <= rank < world and 0 <= local < max(local_world, 1)):
        raise ValueError(f"SLURM_PROCID={rank} / SLURM_LOCALID={local} do not fit SLURM_NTASKS={world} "
                         f"with {local_world} tasks per node")
    nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
    job_id = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
    return Rendezvous(rank, world, local, local_world, first_host(nodelist), port_for(job_id), job_id)


def export(rdv: Rendezvous, environ: MutableMapping[str, str] | None = None) -> None:
    """Set torchrun's variables for this task (os.environ by default)."""
    (os.environ if environ is None else environ).update(rdv.torchrun_env())
