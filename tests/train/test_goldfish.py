"""Goldfish mask: deterministic per passage, drop rate about 1/k, bad k rejected."""

import pytest
import torch

from memaudit.train.goldfish import goldfish_mask


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_same_passage_same_mask_at_any_offset():
    g = torch.Generator().manual_seed(0)
    passage = torch.randint(0, 5000, (200,), generator=g)
    k, h = 4, 13
    a = goldfish_mask(passage[None], k=k, h=h)[0]
    assert torch.equal(a, goldfish_mask(passage[None].clone(), k=k, h=h)[0])  # repeatable
    for offset in (1, 7, 50):
        prefix = torch.randint(0, 5000, (offset,), generator=g)
        seq = torch.cat([prefix, passage])[None]
        b = goldfish_mask(seq, k=k, h=h)[0, offset:]
        # once the passage's own h tokens precede a position, its mask is the passage's mask
        assert torch.equal(b[h:], a[h:])
    assert a[:h].all()  # fewer than h preceding tokens: kept
    # the same passage twice in one batch row and in another row
    two = torch.stack([torch.cat([passage, passage]), torch.cat([passage[:50], passage, passage[:150]])])
    m = goldfish_mask(two, k=k, h=h)
    assert torch.equal(m[0, 200 + h:], a[h:]) and torch.equal(m[1, 50 + h:250], a[h:])


def test_mask_matches_python_oracle():
    """Dropped exactly where the hash of the h preceding ids is 0 mod k."""
    from memaudit.train import goldfish as gf

    ids = torch.randint(0, 1000, (2, 60))
    k, h = 3, 5
    m = goldfish_mask(ids, k=k, h=h)

    def py_hash(window):
        acc = 0
        for x in window:
            acc = (acc * gf._BASE + x) % gf._PRIME
        x = (acc * gf._MIX) % 2**32
        x ^= x >> 16
        x = (x * 0x45D9F3B) % 2**32
        return x ^ (x >> 16)

    for b in range(2):
        for t in range(60):
            want = t < h or py_hash(ids[b, t - h:t].tolist()) % k != 0
            assert bool(m[b, t]) == want


@pytest.mark.parametrize("k", [2, 4, 7])
def test_drop_rate_about_one_in_k(k):
    ids = torch.randint(0, 32000, (2, 40_000), generator=torch.Generator().manual_seed(k))
    m = goldfish_mask(ids, k=k, h=13)
    rate = 1 - m[:, 13:].float().mean().item()
    # binomial sd sqrt(p(1-p)/n) < 0.0036 for n = 80k; allow 5 sd
    assert rate == pytest.approx(1 / k, abs=0.018)


def test_bad_arguments():
    ids = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="k=4"):
        goldfish_mask(ids, k=1, h=13)
    with pytest.raises(ValueError, match="h"):
        goldfish_mask(ids, k=4, h=0)
    assert goldfish_mask(torch.zeros(2, 5, dtype=torch.long), k=4, h=13).all()  # shorter than h
