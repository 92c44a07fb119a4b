"""SLURM rendezvous of a multi-task point (memaudit.sweep.slurm_env), against submitit's own
node-list parser and hand-computed torchrun variables."""

from __future__ import annotations

import pytest

from memaudit.sweep import slurm_env

NODELISTS = ["gpu17", "nid[0012-0015,0020]", "a[1-3],b[07-08]", "rack[1-2]-node[01-04]",
             "c001,c002", "x[9-11]y", "node[000-127]"]


@pytest.mark.parametrize("nodelist", NODELISTS)
def test_first_host_is_submitits_first_host(nodelist):
    from submitit.slurm.slurm import _parse_node_list

    assert slurm_env.first_host(nodelist) == _parse_node_list(nodelist)[0]


def _env(**kw):
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242"}
    return {**base, **{k: str(v) for k, v in kw.items()}}


def test_every_task_of_a_two_node_job_agrees_on_the_rendezvous():
    seen = []
    for rank in range(8):
        node, local = divmod(rank, 4)
        r = slurm_env.rendezvous(_env(SLURM_PROCID=rank, SLURM_LOCALID=local, SLURM_NODEID=node))
        seen.append(r)
        assert (r.rank, r.local_rank, r.world_size, r.local_world_size) == (rank, local, 8, 4)
    assert {(r.master_addr, r.master_port) for r in seen} == {("gpu03", 15000 + 4242)}
    env: dict[str, str] = {}
    slurm_env.export(seen[5], env)
    assert env == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "gpu03", "MASTER_PORT": str(15000 + 4242)}


def test_uneven_tasks_per_node_and_array_job_ids():
    r = slurm_env.rendezvous(_env(SLURM_TASKS_PER_NODE="3,2(x2)", SLURM_NODEID=2, SLURM_NTASKS=7,
                                  SLURM_PROCID=6, SLURM_LOCALID=1, SLURM_JOB_ID="77_3"))
    assert r.local_world_size == 2 and r.master_port == 15000 + 773 % 10000
    assert slurm_env.port_for("123456789") == 15000 + 6789


def test_submitit_local_emulation_maps_onto_slurm_names():
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1",
           "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "31337",
           "SLURM_PROCID": "9", "SLURM_NTASKS": "16"}  # a local job inside an allocation
    r = slurm_env.rendezvous(slurm_env.slurm_view(env))
    assert (r.rank, r.world_size, r.local_rank, r.master_addr, r.job_id) == (1, 2, 1, "127.0.0.1", "31337")
    assert slurm_env.slurm_view({"PATH": "/bin"}) is None


@pytest.mark.parametrize(("env", "match"), [
    ({"SLURM_PROCID": "8"}, "do not fit"),
    ({"SLURM_NTASKS": "x"}, "not an integer"),
    ({"SLURM_JOB_NODELIST": ""}, "names no host"),
    ({"SLURM_JOB_ID": "abc"}, "no digits"),
    ({"SLURM_TASKS_PER_NODE": "4(y2)"}, "N\\(xM\\)"),
])
def test_bad_environment_is_one_line(env, match):
    with pytest.raises(ValueError, match=match) as e:
        slurm_env.rendezvous(_env(**env))
    assert "\n" not in str(e.value)
