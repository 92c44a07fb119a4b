"""DP-SGD noise of the parallel backend: once per logical parameter, the configured std, and
independent of the grid (a full-size draw from a generator keyed by the run's secret at
(step, parameter))."""

from __future__ import annotations

import torch

from memaudit.models.presets import build_model
from memaudit.parallel.dims import ParallelDims
from memaudit.parallel.dp import add_noise_
from memaudit.parallel.parallelize import parallelize_llama
from memaudit.privacy.randomness import DPRandomness

RAND = DPRandomness.from_seed(7)


def _zero_grad_model():
    pm = parallelize_llama(build_model("tiny", seed=0), dims=ParallelDims())
    for p in pm.parameters():
        p.grad = torch.zeros_like(p)
    return pm


def test_noise_has_the_configured_std_and_is_a_full_size_draw() -> None:
    pm = _zero_grad_model()
    add_noise_(pm, std=0.5, randomness=RAND, step=3)
    params = list(pm.hf.named_parameters())
    emb_i = next(i for i, (n, _) in enumerate(params) if n == "model.embed_tokens.weight")
    g = params[emb_i][1].grad
    assert abs(float(g.std()) - 0.5) < 0.005  # 524k samples: the estimate's sd is ~0.0005
    assert abs(float(g.mean())) < 0.005
    expect = torch.randn(g.shape, generator=RAND.torch_generator("dpsgd-noise", 3, emb_i)) * 0.5
    torch.testing.assert_close(g, expect, rtol=0, atol=0)


def test_noise_differs_across_steps_and_parameters() -> None:
    a, b = _zero_grad_model(), _zero_grad_model()
    add_noise_(a, std=1.0, randomness=RAND, step=0)
    add_noise_(b, std=1.0, randomness=RAND, step=1)
    ga = [p.grad for p in a.parameters()]
    gb = [p.grad for p in b.parameters()]
    assert all(not torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    # two parameters of one step are not copies of each other
    assert not torch.equal(ga[1].reshape(-1)[:100], ga[2].reshape(-1)[:100])
    assert len({RAND.seed64("dpsgd-noise", s, i) for s in range(50) for i in range(40)}) == 50 * 40


def _replica_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        own = DPRandomness.fresh()  # each process draws its own secret first
        before = torch.tensor(list(own.key("dpsgd-noise", 3)), dtype=torch.int64)
        shared = own.broadcast()
        noise = torch.randn(1000, generator=shared.torch_generator("dpsgd-noise", 3, 0))
        befores = [torch.zeros_like(before) for _ in range(world)]
        noises = [torch.zeros_like(noise) for _ in range(world)]
        dist.all_gather(befores, before)
        dist.all_gather(noises, noise)
        if rank == 0:
            torch.save({"before": befores, "noise": noises}, out)
    finally:
        dist.destroy_process_group()


def test_every_replica_adds_identical_noise(tmp_path) -> None:
    """On a grid the secret is drawn once (rank 0) and broadcast: every replica's noise is the same."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "noise.pt"
    mp.spawn(_replica_worker, args=(2, port, str(out)), nprocs=2, join=True)
    res = torch.load(out, weights_only=True)
    assert not torch.equal(res["before"][0], res["before"][1])  # independent secrets before the broadcast
    assert torch.equal(res["noise"][0], res["noise"][1])


def test_each_parameters_noise_is_its_generators_draw_on_torchs_threads(monkeypatch) -> None:
    """Both layouts draw the parameters' noise on torch's threads at once (`for_each_draw`):
    torch's CPU normal draws one tensor on one thread, so the noise of `small` took 70-75 ms a
    step one draw after the other and 48 ms on two threads. Failed before: every draw ran on the
    calling thread. Oracle: each parameter's own generator drawn alone, bit for bit."""
    import threading

    from memaudit.train.dpsgd import SerialClipping

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    real = DPRandomness.torch_generator
    drawn_on: set[int] = set()

    def generator(self, *args, **kwargs):
        drawn_on.add(threading.get_ident())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DPRandomness, "torch_generator", generator)
    try:
        pm = _zero_grad_model()
        add_noise_(pm, std=0.5, randomness=RAND, step=4)
        serial = SerialClipping(build_model("tiny", seed=0), "ghost")
        for _, p in serial.params:
            p.grad = torch.zeros_like(p)
        serial.add_noise_(0.5, RAND, 4)
    finally:
        torch.set_num_threads(torch_threads)
    assert drawn_on and threading.get_ident() not in drawn_on
    trained = [p for p in pm.hf.parameters() if p.requires_grad]
    assert len(trained) == len(serial.params) > 2
    for i, (p, (_, q)) in enumerate(zip(trained, serial.params, strict=True)):
        expect = torch.randn(p.shard_spec.full_shape, generator=real(RAND, "dpsgd-noise", 4, i)) * 0.5
        assert torch.equal(p.grad, p.shard_spec.local(expect, pm.comm)), i  # one rank: the whole tensor
        alone = torch.normal(0.0, 0.5, size=q.shape, generator=real(RAND, "dpsgd-noise", 4, i))
        assert torch.equal(q.grad, alone), i


def _draw_in_child(out) -> None:
    from memaudit.train.dpsgd import for_each_draw

    got: list[int] = []
    for_each_draw(got.append, [torch.zeros(1)] * 8)
    out.put(sorted(got))


def test_a_forked_process_draws_its_noise_on_threads_of_its_own() -> None:
    """A process forked after DP-SGD drew noise (Python's default start method on Linux) gets
    new draw threads: the parent's do not exist in it. Failed before: the child's draws went to
    the parent's pool, which no thread served there, and the child hung."""
    import multiprocessing

    from memaudit.train.dpsgd import for_each_draw

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        drawn: list[int] = []
        for_each_draw(drawn.append, [torch.zeros(1)] * 8)  # the parent's threads
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_draw_in_child, args=(out,))
        child.start()
        child.join(20)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        torch.set_num_threads(torch_threads)
    assert sorted(drawn) == list(range(8))
    assert not hung and child.exitcode == 0, "the forked child's draws never ran"
    assert out.get(timeout=5) == list(range(8))
