"""The fast paths of secure aggregation against independent oracles: chunked / fused PRG mask
addition vs one-shot keystreams, and the vectorised clip + stochastic-rounding encoder vs a
per-client float64 loop."""

import math
import os

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from memaudit.federated.secagg import prg
from memaudit.federated.secagg.aggregator import (
    ENCODE_CHUNK,
    decode,
    encode,
    quantisation_scale,
    row_norms,
)


def _keystream(seed: bytes, d: int) -> np.ndarray:
    """Oracle: AES-256-CTR of 4d zero bytes in one call, read as little-endian uint32."""
    enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(enc.update(bytes(4 * d)) + enc.finalize(), dtype="<u4")


def _toolchain() -> bool:
    """Whether this machine can build the C mask extension: a C compiler and OpenSSL headers."""
    import shutil
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    heads = ["/usr/include", "/usr/local/include", sysconfig.get_paths()["include"]]
    return shutil.which(cc) is not None and any(
        os.path.exists(os.path.join(h, "openssl", "evp.h")) for h in heads)


def test_the_c_mask_extension_is_built_where_the_toolchain_exists():
    """The install builds `_maskadd` wherever it can (setup.py marks it optional): a silent
    fallback to numpy on a machine with a compiler and OpenSSL headers is a build defect."""
    if not _toolchain():
        pytest.skip("no C compiler or OpenSSL headers here: memaudit masks with numpy")
    assert prg.NATIVE, "reinstall memaudit (pip install -e .) to build the C mask extension"


PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not prg.NATIVE, reason="C mask extension not built (no compiler or OpenSSL headers)"))]


@pytest.mark.parametrize("native", PATHS, ids=["numpy", "native"])
@pytest.mark.parametrize("d", [1, 7, 2047, 2049, prg.CHUNK_WORDS, 2 * prg.CHUNK_WORDS + 5])
def test_add_masks_equals_one_shot_keystreams(d, native):
    rng = np.random.default_rng(d)
    acc0 = rng.integers(0, 2**32, size=d, dtype=np.uint32)
    seeds = [(os.urandom(32), +1), (os.urandom(32), -1), (os.urandom(32), +1)]
    want = acc0.astype(np.int64)
    for seed, sign in seeds:
        want = want + sign * _keystream(seed, d).astype(np.int64)
    want = (want % 2**32).astype(np.uint32)
    fused = acc0.copy()
    prg.add_masks(fused, seeds, native=native)
    np.testing.assert_array_equal(fused, want)
    one_by_one = acc0.copy()
    for seed, sign in seeds:
        prg.add_mask(one_by_one, seed, sign, native=native)
    np.testing.assert_array_equal(one_by_one, want)
    np.testing.assert_array_equal(prg.expand(seeds[0][0], d), _keystream(seeds[0][0], d))


@pytest.mark.parametrize("native", PATHS, ids=["numpy", "native"])
def test_masks_cancel_and_bad_inputs_are_refused(native):
    x = np.arange(100_003, dtype=np.uint32)
    y = x.copy()
    s, t = os.urandom(32), os.urandom(32)
    prg.add_masks(y, [(s, +1), (t, +1)], native=native)
    assert not np.array_equal(x, y)
    prg.add_masks(y, [(s, -1)], native=not native if prg.NATIVE else False)  # paths mix freely
    prg.add_masks(y, [], native=native)  # no masks: unchanged
    prg.add_mask(y, t, -1, native=native)
    np.testing.assert_array_equal(x, y)  # every mask cancelled
    with pytest.raises(ValueError, match="32 bytes"):
        prg.add_masks(y, [(s, +1), (b"short", +1)], native=native)
    np.testing.assert_array_equal(x, y)  # a refused call changes nothing
    with pytest.raises(ValueError, match="uint32"):
        prg.add_masks(np.zeros(4, np.int64), [(s, +1)], native=native)
    with pytest.raises(ValueError, match="uint32"):
        prg.add_masks(np.zeros(8, np.uint32)[::2], [(s, +1)], native=native)


@pytest.mark.skipif(not prg.NATIVE, reason="C mask extension not built")
@pytest.mark.parametrize("threads", [2, 3, 7, 300])
def test_native_masking_split_over_threads_equals_the_oracle(monkeypatch, threads):
    """A sum split into slices, each masked from its own CTR block, equals the one-shot
    keystreams: ragged sizes, more threads than 16-byte blocks, first_block offsets."""
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 8)
    monkeypatch.setattr(prg, "MIN_SLICE_WORDS", 1)
    for d in (9, 1001, 4 * 257 + 3):
        acc0 = np.random.default_rng(d).integers(0, 2**32, size=d, dtype=np.uint32)
        seeds = [(os.urandom(32), +1), (os.urandom(32), -1)]
        want = acc0.astype(np.int64)
        for seed, sign in seeds:
            want += sign * _keystream(seed, d).astype(np.int64)
        got = acc0.copy()
        prg.add_masks(got, seeds, threads=threads)
        np.testing.assert_array_equal(got, (want % 2**32).astype(np.uint32))
    # the raw entry point: a slice from block 5 on is the keystream's words 20.. onwards
    seed = os.urandom(32)
    part = np.zeros(11, np.uint32)
    prg._native.add_masks(part, seed, b"\x01", 5)
    np.testing.assert_array_equal(part, _keystream(seed, 31)[20:])


@pytest.mark.skipif(not prg.NATIVE, reason="C mask extension not built")
def test_native_masking_runs_in_threads_at_once():
    """The C path releases the GIL: threads mask their own sums concurrently, each exact."""
    from concurrent.futures import ThreadPoolExecutor

    d = 3 * prg.CHUNK_WORDS + 11
    jobs = [(np.full(d, i, np.uint32), [(os.urandom(32), 1 - 2 * (j % 2)) for j in range(3)])
            for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda job: prg.add_masks(job[0], job[1], native=True), jobs))
    for i, (acc, seeds) in enumerate(jobs):
        want = np.full(d, i, np.int64)
        for seed, sign in seeds:
            want += sign * _keystream(seed, d).astype(np.int64)
        np.testing.assert_array_equal(acc, (want % 2**32).astype(np.uint32))


def _encode_oracle(rows, clip, scale):
    """Per-client float64 clip and scale (the values stochastic rounding brackets)."""
    out = []
    for row in np.asarray(rows, dtype=np.float64):
        norm = math.sqrt(sum(float(v) * float(v) for v in row))
        out.append(row * min(1.0, clip / max(norm, 1e-300)) * scale)
    return np.array(out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encode_rounds_to_a_neighbour_of_the_clipped_value(dtype):
    rng = np.random.default_rng(0)
    d = ENCODE_CHUNK + 17  # more than one chunk, and a ragged tail
    rows = (rng.normal(size=(5, d)) * np.array([[0.001], [0.01], [0.5], [3.0], [0.0]])).astype(dtype)
    clip = 1.0
    scale, _ = quantisation_scale(clip, 24, 5)
    np.testing.assert_allclose(row_norms(rows), np.linalg.norm(rows.astype(np.float64), axis=1),
                               rtol=1e-12)
    want = _encode_oracle(rows, clip, scale)
    q = encode(rows, clip, scale, np.random.default_rng(1)).view(np.int32).astype(np.float64)
    assert np.all((q == np.floor(want)) | (q == np.floor(want) + 1))
    assert np.all(q[4] == 0)
    assert np.all(np.abs(q) <= 2**23 - 1)  # clipped rows stay within the integer range
    # the two integer neighbours are taken with the right probabilities: unbiased on average
    np.testing.assert_allclose(q.mean(axis=1), want.mean(axis=1), atol=4 / math.sqrt(d))


def test_stochastic_rounding_is_unbiased_per_coordinate():
    x = np.full((1, 4), [0.25, 0.5, 0.9, -0.3])
    scale = 1.0
    qs = np.stack([encode(x, 10.0, scale, np.random.default_rng(s)).view(np.int32)[0]
                   for s in range(4000)])
    np.testing.assert_allclose(qs.mean(0), x[0], atol=0.03)
    assert set(np.unique(qs[:, 3]).tolist()) == {-1, 0}


def test_sum_of_encodings_decodes_to_the_clipped_sum():
    rng = np.random.default_rng(5)
    n, d, clip = 8, 1000, 2.0
    rows = rng.normal(size=(n, d)).astype(np.float32)
    scale, _ = quantisation_scale(clip, 20, n)
    q = encode(rows, clip, scale, rng)
    total = q.sum(0, dtype=np.uint32)  # mod 2^32, as the protocol sums
    want = _encode_oracle(rows, clip, 1.0).sum(0)
    np.testing.assert_allclose(decode(total, scale), want, atol=n / scale)


@pytest.mark.parametrize("n,kind,degree,drop", [
    (10, "full", None, {"before_shares": {9}, "before_masked": {1, 4}, "before_unmask": {3}}),
    (12, "sparse", 4, {"before_masked": {1, 4}}),  # holds for every graph seed at threshold 0.6
])
def test_server_unmasks_in_one_batched_pass_with_dropouts(monkeypatch, n, kind, degree, drop):
    """The server removes every mask with one `add_masks` call over a sum longer than a chunk,
    and the result equals the survivors' plain sum mod 2^32 computed in int64."""
    from memaudit.federated.secagg import Dropouts, run_round
    from memaudit.federated.secagg.graph import neighbours

    d = prg.CHUNK_WORDS + 3  # a full chunk and a ragged tail
    drop = Dropouts(**drop)
    x = np.random.default_rng(n).integers(0, 2**32, size=(n, d), dtype=np.uint32)
    calls = []
    batched = prg.add_masks

    def spy(acc, seeds_signs, **kw):
        seeds_signs = list(seeds_signs)
        calls.append(len(seeds_signs))
        batched(acc, seeds_signs, **kw)

    def one_by_one(*_):
        raise AssertionError("masks must be removed in one batched pass")

    monkeypatch.setattr(prg, "add_masks", spy)
    monkeypatch.setattr(prg, "add_mask", one_by_one)
    r = run_round(x, neighbours=kind, degree=degree, graph_seed=3, threshold=0.6, dropouts=drop)

    u3 = set(range(n)) - drop.before_shares - drop.before_masked
    assert r.survivors == frozenset(u3)
    want = (x[sorted(u3)].astype(np.int64).sum(axis=0) % 2**32).astype(np.uint32)
    np.testing.assert_array_equal(r.total, want)
    # one call per masking client (self mask + pairwise masks), then one for the server:
    # every survivor's self mask and the pairwise masks of the clients that dropped
    neigh = neighbours(n, kind, seed=3, degree=degree)
    server_masks = len(u3) + sum(len(neigh[i] & u3) for i in drop.before_masked)
    assert calls == [1 + len(neigh[i] - drop.before_shares) for i in sorted(u3)] + [server_masks]


def test_without_the_extension_masking_falls_back_to_numpy(monkeypatch):
    """An install without a C toolchain masks on the numpy path by default, with the same sums;
    asking for the C path there is a clear error, not a silent fallback."""
    d = 2 * prg.CHUNK_WORDS + 3
    seeds = [(os.urandom(32), +1), (os.urandom(32), -1)]
    want = np.zeros(d, np.int64)
    for seed, sign in seeds:
        want += sign * _keystream(seed, d).astype(np.int64)
    monkeypatch.setattr(prg, "_native", None)
    monkeypatch.setattr(prg, "NATIVE", False)
    got = np.zeros(d, np.uint32)
    prg.add_masks(got, seeds)
    np.testing.assert_array_equal(got, (want % 2**32).astype(np.uint32))
    with pytest.raises(RuntimeError, match="not built"):
        prg.add_masks(got, seeds, native=True)


def test_a_whole_round_is_the_same_on_either_masking_path(monkeypatch):
    """The protocol end to end, with dropouts at every stage, gives the survivors' exact sum
    whether masks go through the C path (split over threads) or the numpy fallback."""
    from memaudit.federated.secagg import Dropouts, run_round

    n, d = 9, prg.CHUNK_WORDS + 5
    x = np.random.default_rng(7).integers(0, 2**32, size=(n, d), dtype=np.uint32)
    drop = {"before_shares": {8}, "before_masked": {2}, "before_unmask": {5}}
    survivors = sorted(set(range(n)) - {8, 2})
    want = (x[survivors].astype(np.int64).sum(axis=0) % 2**32).astype(np.uint32)
    paths = [False] + ([True] if prg.NATIVE else [])
    monkeypatch.setattr(prg, "PARALLEL_MIN_WORDS", 1)  # every native call split over threads:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # two of them (the test workers set 1)
    for native in paths:
        monkeypatch.setattr(prg, "NATIVE", native)
        r = run_round(x, neighbours="full", threshold=0.5,
                      dropouts=Dropouts(**{k: set(v) for k, v in drop.items()}))
        assert r.survivors == frozenset(survivors)
        np.testing.assert_array_equal(r.total, want)


def test_encode_calls_no_blas(monkeypatch):
    """The encoder's norm check adds its squares in numpy's own loop, never through BLAS: a
    node encodes while its other processes hold the cores, and OpenBLAS's threads then wait for
    a time slice at every call. Measured on 2 cores with two busy processes beside it, 4 rows of
    1.8M: 0.9-2.4 s for the first encode and 0.14-0.29 s after with ``np.dot`` (one call every
    `ENCODE_CHUNK` values), 0.04-0.09 s without. Failed before the fix (``np.dot``)."""
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(3, 2 * ENCODE_CHUNK + 5)).astype(np.float32)
    scale, _ = quantisation_scale(1.0, 24, 3)
    want = encode(rows, 1.0, scale, np.random.default_rng(4), inner=0.99)

    def blas(*a, **k):
        raise AssertionError("encode called BLAS")

    for name in ("dot", "vdot", "inner", "matmul", "tensordot"):
        monkeypatch.setattr(np, name, blas)
    got = encode(rows, 1.0, scale, np.random.default_rng(4), inner=0.99)
    np.testing.assert_array_equal(got, want)


def test_secure_rounds_allocate_in_ordinary_pages(monkeypatch):
    """Secure aggregation and distributed DP encode, mask and decode arrays of the model's size
    afresh every round, in ordinary pages (`memaudit.federated.secagg.pages`): in-process, and
    on a Flower node (`node_step`). numpy's huge pages stalled the encoder in the kernel in about
    half the rounds on a 2-core VM (0.6-0.9 s against 0.08 s). Failed before: huge pages."""
    import jax
    import jax.numpy as jnp
    import numpy._core.multiarray as m

    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.client_ops import DDGEncoding
    from memaudit.federated.ddp import distributed_dp
    from memaudit.federated.secagg import remote
    from memaudit.federated.secagg.aggregator import secure_aggregation
    from memaudit.federated.secagg.quantise import SecAggEncoding

    seen: list[tuple[str, bool]] = []

    def spy(cls, name):
        orig = getattr(cls, name)

        def wrapped(self, *a, **k):
            seen.append((cls.__name__, bool(m._get_madvise_hugepage())))
            return orig(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)

    spy(SecAggEncoding, "encode")
    spy(DDGEncoding, "encode")
    spy(remote.Client, "advertise")
    before = m._set_madvise_hugepage(True)
    try:
        d = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(4, 8)) * 0.1, jnp.float32)}
        for agg in (secure_aggregation(mean_aggregator(), clip=1.0, bits=24, seed=0),
                    distributed_dp(clip=1.0, noise_multiplier=0.5, expected_cohort=4)):
            agg.aggregate(d, jnp.ones(4), agg.init(None), jax.random.key(0))
        payload = {"step": "advertise", "round": 0, "policy": [0.6, 0, 2, "honest_but_curious"],
                   "clients": [[0, 0], [1, 1]], "round_id": 1}
        remote.node_step(payload, kept=lambda r, v: None, load=lambda r: {}, save=lambda r, s: None)
        assert m._get_madvise_hugepage()  # the setting before comes back
    finally:
        m._set_madvise_hugepage(before)
    assert {name for name, _ in seen} == {"SecAggEncoding", "DDGEncoding", "Client"}
    assert not any(huge for _, huge in seen), seen


def test_a_nodes_dp_masked_input_norms_each_row_once(monkeypatch):
    """DP-FedAvg with secure aggregation on nodes: each node clips its users' rows to DP's C and
    appends the bit 1[‖Δ‖ <= C] of the delta before the clip, which the secure sum counts. The
    bit needs the norms the clip took. Failed before: the node normed its rows again for the bit
    (`within`): 4 norm passes on two nodes, not 2.
    Oracle: the same round with every client in this process (the dense deltas), bit for bit,
    and the count of rows whose float64 norm is within C."""
    import jax
    import jax.numpy as jnp

    from memaudit.federated import client_ops
    from memaudit.federated.aggregators import mean_aggregator
    from memaudit.federated.dp import dp_fedavg
    from memaudit.federated.flower.execute import LocalNodes, NodeExecutor
    from memaudit.federated.secagg.aggregator import secure_aggregation
    from memaudit.federated.secagg.remote import ClientRows, NodeChannel
    from tests.federated.toy_nodes import keep_rows

    n, hosts, clip = 6, {"a": [0, 1, 2, 3], "b": [4, 5]}, 0.5
    rng = np.random.default_rng(3)
    deltas = {"w": rng.normal(0, 0.05, (n, 3, 4)).astype(np.float32),
              "b": rng.normal(0, 0.05, (n, 5)).astype(np.float32)}
    deltas["w"][[1, 4]] *= 10  # two users above C
    leaves, treedef = jax.tree.flatten(deltas)
    agg = dp_fedavg(secure_aggregation(mean_aggregator(), clip=1.0, bits=16, seed=3), clip=clip,
                    noise_multiplier=0.0, expected_cohort=float(n))

    def aggregate(updates):
        return agg.aggregate(updates, jnp.ones(n), agg.init(None), jax.random.key(7))

    want = aggregate(deltas)
    passes: list[int] = []
    norms = client_ops.row_norms
    monkeypatch.setattr(client_ops, "row_norms", lambda rows: passes.append(len(rows[0])) or norms(rows))
    ex = {node: keep_rows(NodeExecutor([f"u{s}" for s in slots], {}), leaves, slots) for node, slots in hosts.items()}
    rows = ClientRows(NodeChannel(LocalNodes(ex), hosts, 0), tuple(range(len(leaves))),
                      tuple((x.shape[1:], x.dtype.name) for x in leaves), treedef)
    got = aggregate(rows)
    assert sorted(passes) == [2, 4], passes  # each node: its rows, once
    for a, b in zip(jax.tree.leaves(want.update), jax.tree.leaves(got.update), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    oracle = [math.sqrt(sum(float(np.sum(x[i].astype(np.float64) ** 2)) for x in leaves)) for i in range(n)]
    assert sum(v <= clip for v in oracle) == n - 2
    for key in [k for k in want.metrics if not k.startswith("secagg_bytes")]:  # one sum a node, not a row
        assert np.array_equal(np.asarray(want.metrics[key]), np.asarray(got.metrics[key])), key
    assert float(got.metrics["clip_fraction"]) == np.float32(2 / n)
