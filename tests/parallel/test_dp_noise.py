"""DP-SGD noise of both layouts: the configured std, drawn in fixed tiles keyed by the run's secret
at (step, parameter, tile) (`memaudit.train.noise`), the same bits in one process and on any grid,
where each rank draws only the tiles of its own elements."""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
import torch

from memaudit.models.presets import build_model
from memaudit.parallel.dims import ParallelDims
from memaudit.parallel.dp import add_noise_
from memaudit.parallel.layers import RankOnGrid, ShardSpec
from memaudit.parallel.parallelize import parallelize_llama
from memaudit.privacy.randomness import DPRandomness
from memaudit.train import noise
from tests.parallel._draws import counting_normals

RAND = DPRandomness.from_seed(7)


def _zero_grad_model():
    pm = parallelize_llama(build_model("tiny", seed=0), dims=ParallelDims())
    for p in pm.parameters():
        p.grad = torch.zeros_like(p)
    return pm


def _tiles_oracle(step: int, i: int, shape: tuple[int, ...], tile: tuple[int, int], std: float) -> torch.Tensor:
    """The definition written out: the matrix view cut into `tile`-shaped tiles, tile (a, b) the
    randn of a generator seeded with BLAKE2b(a, b) keyed by HKDF(secret, purpose/step/i)."""
    key = RAND.key("dpsgd-noise-tile", step, i, 32)
    rows, cols = shape[0], math.prod(shape[1:])
    bands = []
    for a in range(math.ceil(rows / tile[0])):
        band = []
        for b in range(math.ceil(cols / tile[1])):
            h = hashlib.blake2b(a.to_bytes(8, "little") + b.to_bytes(8, "little"), key=key, digest_size=8)
            gen = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") >> 1)
            size = (min(tile[0], rows - a * tile[0]), min(tile[1], cols - b * tile[1]))
            band.append(torch.randn(size, generator=gen))
        bands.append(torch.cat(band, 1))
    return (torch.cat(bands, 0) * std).view(shape)


def test_tiles_are_set_by_the_logical_shape() -> None:
    assert noise.tile_shape(8192, 384) == (256, 256)
    assert noise.tile_shape(4096, 128) == (512, 128)  # narrow matrices: taller tiles of 65,536
    assert noise.tile_shape(8, 4096) == (8, 4096)  # a LoRA A of rank 8: one tile of 32k
    assert noise.tile_shape(4096, 8) == (4096, 8)
    assert noise.tile_shape(100_000, 1) == (65_536, 1)  # a vector: runs of 65,536
    assert noise.matrix_shape((384,)) == (384, 1) and noise.matrix_shape((4, 5, 6)) == (4, 30)


def test_noise_has_the_configured_std_and_is_its_tiles_draw() -> None:
    pm = _zero_grad_model()
    add_noise_(pm, std=0.5, randomness=RAND, step=3)
    params = list(pm.hf.named_parameters())
    emb_i = next(i for i, (n, _) in enumerate(params) if n == "model.embed_tokens.weight")
    g = params[emb_i][1].grad.view(4096, 128)  # one rank holds the whole weight, flattened
    assert abs(float(g.std()) - 0.5) < 0.005  # 524k samples: the estimate's sd is ~0.0005
    assert abs(float(g.mean())) < 0.005
    torch.testing.assert_close(g, _tiles_oracle(3, emb_i, (4096, 128), (512, 128), 0.5), rtol=0, atol=0)
    norm_i, norm = next((i, p) for i, (_, p) in enumerate(params) if len(p.shard_spec.full_shape) == 1)
    want = _tiles_oracle(3, norm_i, tuple(norm.shape), (norm.numel(), 1), 0.5)  # a vector: one column
    torch.testing.assert_close(norm.grad, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside"):
        noise.noise_block(b"k" * 32, (4, 4), (0, 5), (0, 4), 1.0)


def test_noise_differs_across_steps_parameters_and_tiles() -> None:
    a, b = _zero_grad_model(), _zero_grad_model()
    add_noise_(a, std=1.0, randomness=RAND, step=0)
    add_noise_(b, std=1.0, randomness=RAND, step=1)
    ga = [p.grad for p in a.parameters()]
    gb = [p.grad for p in b.parameters()]
    assert all(not torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    # two parameters of one step are not copies of each other
    assert not torch.equal(ga[1].reshape(-1)[:100], ga[2].reshape(-1)[:100])
    assert len({noise.parameter_key(RAND, s, i) for s in range(50) for i in range(40)}) == 50 * 40
    # nor two tiles of one parameter
    emb = ga[0].view(4096, 128)
    assert not torch.equal(emb[:512], emb[512:1024])


def _specs() -> list[ShardSpec]:
    """Every kind of shard the grid makes: tiny's weights, embedding and norms, LoRA's A and B."""
    from memaudit.config import LoraConfig
    from memaudit.models.lora import apply_lora

    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "down_proj"))
    pm = parallelize_llama(apply_lora(build_model("tiny", seed=0), lora, seed=0), dims=ParallelDims())
    return sorted({p.shard_spec for p in pm.hf.parameters()},
                  key=lambda s: (s.full_shape, str(s.row), str(s.col), s.z_flat))


GRIDS = [(x, y, z) for x, y, z in itertools.product((1, 2, 4), (1, 2), (1, 2, 3)) if x * y * z > 1]


def test_a_ranks_noise_is_its_share_of_the_one_process_noise_on_every_grid(monkeypatch) -> None:
    """For every kind of shard and every rank of 17 grids (x in 1, 2, 4; y in 1, 2; z in 1, 2, 3,
    the last padding the flattened blocks), `ShardSpec.local_of` over the tiles gives what
    `ShardSpec.local` cuts from the one-process noise, bit for bit. With 8 x 8 tiles a rank
    draws its own elements and the tiles its share cuts: on x=y=z=2, 1/8 of each weight and at
    most 4% more, where every rank drew all of it before."""
    monkeypatch.setattr(noise, "TILE_SIDE", 8)
    key = noise.parameter_key(RAND, 2, 0)
    specs = _specs()
    kinds = {(s.row is not None, s.col is not None, s.z_flat) for s in specs}
    assert kinds >= {(True, True, True), (True, False, False), (False, True, False)}, kinds
    shares = {}
    for spec in specs:
        full = noise.full_noise(key, spec.full_shape, 0.5)
        rows, cols = noise.matrix_shape(spec.full_shape)

        def block(r, c, s=spec):
            return noise.noise_block(key, s.full_shape, r, c, 0.5)

        for x, y, z in GRIDS:
            dims = ParallelDims(x=x, y=y, z=z)
            if (spec.row and rows % dims.size(spec.row)) or (spec.col and cols % dims.size(spec.col)):
                continue  # a split this grid cannot make
            for r in range(dims.tp_size):
                at = RankOnGrid(dims, r)
                with counting_normals() as drawn:
                    got = spec.local_of(block, at)
                assert torch.equal(got, spec.local(full, at)), (spec, (x, y, z), r)
                if (x, y, z) == (2, 2, 2):
                    shares[spec, r] = sum(drawn) / (rows * cols)
    weights = [s for s in specs if s.z_flat]
    assert len(weights) >= 3
    for s in weights:
        drawn_shares = [shares[s, r] for r in range(8)]
        assert 0.125 <= min(drawn_shares) and max(drawn_shares) <= 0.125 * 1.04, (s, drawn_shares)


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


def test_each_parameters_noise_is_its_tiles_drawn_on_torchs_threads(monkeypatch) -> None:
    """Both layouts draw the parameters' noise on torch's threads at once (`for_each_draw`):
    torch's CPU normal draws one tensor on one thread, so the noise of `small` took 70-75 ms a
    step one draw after the other and 48 ms on two threads. Oracle: each parameter's tiles,
    drawn alone, bit for bit, and one process's noise is the grid's."""
    import threading

    from memaudit.train.dpsgd import SerialClipping

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    real = DPRandomness.key
    drawn_on: set[int] = set()

    def key(self, *args, **kwargs):
        drawn_on.add(threading.get_ident())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DPRandomness, "key", key)
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
        tile = noise.tile_shape(*noise.matrix_shape(q.shape))
        expect = _tiles_oracle(4, i, tuple(q.shape), tile, 0.5)
        assert torch.equal(p.grad, p.shard_spec.local(expect, pm.comm)), i  # one rank: the whole tensor
        assert torch.equal(q.grad, expect), i


def _draw_in_child(out) -> None:
    from memaudit.train.noise import for_each_draw

    got: list[int] = []
    for_each_draw(got.append, [torch.zeros(1)] * 8)
    out.put(sorted(got))


def test_a_forked_process_draws_its_noise_on_threads_of_its_own() -> None:
    """A process forked after DP-SGD drew noise (Python's default start method on Linux) gets
    new draw threads: the parent's do not exist in it. Failed before: the child's draws went to
    the parent's pool, which no thread served there, and the child hung."""
    import multiprocessing

    from memaudit.train.noise import for_each_draw

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


def test_noise_for_a_gpu_is_drawn_on_torchs_threads_and_added_in_order_on_the_callers() -> None:
    """Gradients off the CPU (here on torch's meta device, as a GPU's would be): the draws still
    run on torch's threads, and the copy and add each returns run on the calling thread in the
    parameters' order, so CUDA work stays on one thread. Failed before: with any gradient off
    the CPU every draw ran on the calling thread, one after the other."""
    import threading

    from memaudit.train.noise import for_each_draw

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    main = threading.get_ident()
    drawn_on: set[int] = set()
    applied: list[tuple[int, int]] = []

    def draw(i: int):
        drawn_on.add(threading.get_ident())
        return lambda: applied.append((i, threading.get_ident()))

    try:
        for_each_draw(draw, [torch.zeros(3, device="meta")] * 9)
    finally:
        torch.set_num_threads(torch_threads)
    assert drawn_on and main not in drawn_on
    assert applied == [(i, main) for i in range(9)]
