"""Multi-valued fields' pooled gather and its backward (hvctr.optim.pooling): the C kernels and
the torch reference against a float64 reference written from the definition, against each
other, and against the one-valued path where every bag holds one value."""

import numpy as np
import pytest
import torch

from hvctr.data.bags import Bags, field_pooling_mask
from hvctr.formats import RowLayout
from hvctr.kernels import native
from hvctr.optim import batch_unique, gather_embeddings, sum_embedding_grads
from hvctr.optim.pooling import embed_batch, gather_pooled, sum_pooled_grads

D, F = 8, 5
needs_native = pytest.mark.skipif(native.lib() is None, reason="C kernels not built")


def _bags(rng, rows: int, max_len: int, table: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, max_len + 1, size=(rows, F))
    lengths[0, :] = 0  # a row of empty bags
    pos = rng.integers(0, table, size=int(lengths.sum()))
    off = np.zeros(rows * F + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1), out=off[1:])
    return pos, off


def _reference(rows: np.ndarray, pos, off, mean, g_emb, g_w1):
    """float64, one bag and one value at a time, from the definition."""
    nb = off.size - 1
    g_emb, g_w1 = g_emb.reshape(nb, D), g_w1.reshape(nb)
    emb, w1 = np.zeros((nb, D)), np.zeros(nb)
    grad = np.zeros((rows.shape[0], D + 1))
    for b in range(nb):
        vals = pos[off[b]:off[b + 1]]
        n = len(vals)
        div = n if (mean[b % F] and n) else 1
        for p in vals:
            emb[b] += rows[p, :D]
            w1[b] += rows[p, D]
            grad[p, :D] += g_emb[b] / div
            grad[p, D] += g_w1[b] / div
        emb[b] /= div
        w1[b] /= div
    return emb.reshape(-1, F, D), w1.reshape(-1, F), grad


def _run(rows, pos, off, mean, g_emb, g_w1):
    t = torch.from_numpy(rows)
    p, o = torch.from_numpy(pos), torch.from_numpy(off)
    emb, w1 = gather_pooled(t, p, o, mean, F, D)
    uniq, summed = sum_pooled_grads(p, o, mean, torch.from_numpy(g_emb), torch.from_numpy(g_w1), batch_unique(p))
    return emb.detach().numpy(), w1.detach().numpy(), uniq.numpy(), summed.numpy()


@pytest.mark.parametrize("mean_fields", [(), (1, 3), tuple(range(F))])
@pytest.mark.parametrize("native_on", [True, False])
def test_pooled_gather_and_backward_match_the_definition(mean_fields, native_on):
    if native_on and native.lib() is None:
        pytest.skip("C kernels not built")
    rng = np.random.default_rng(3)
    width = RowLayout(D).width
    rows = rng.standard_normal((50, width)).astype(np.float32)
    pos, off = _bags(rng, 12, 4, 50)
    mean = np.array([f in mean_fields for f in range(F)], dtype=np.uint8)
    g_emb = rng.standard_normal((12, F, D)).astype(np.float32)
    g_w1 = rng.standard_normal((12, F)).astype(np.float32)
    ctx = native.disabled() if not native_on else _nothing()
    with ctx:
        emb, w1, uniq, summed = _run(rows, pos, off, mean, g_emb, g_w1)
    r_emb, r_w1, r_grad = _reference(rows.astype(np.float64), pos, off, mean, g_emb.astype(np.float64),
                                     g_w1.astype(np.float64))
    np.testing.assert_allclose(emb, r_emb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w1, r_w1, rtol=1e-5, atol=1e-5)
    assert np.array_equal(uniq, np.unique(pos))
    np.testing.assert_allclose(summed, r_grad[uniq], rtol=1e-5, atol=1e-5)
    assert not emb[0].any() and not w1[0].any()  # row 0's bags are empty: 0, sum or mean


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_native
def test_c_kernels_equal_the_torch_reference_bit_for_bit():
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((200, RowLayout(D).width)).astype(np.float32)
    pos, off = _bags(rng, 64, 6, 200)
    mean = np.array([0, 1, 0, 1, 1], dtype=np.uint8)
    g_emb = rng.standard_normal((64, F, D)).astype(np.float32)
    g_w1 = rng.standard_normal((64, F)).astype(np.float32)
    c = _run(rows, pos, off, mean, g_emb, g_w1)
    with native.disabled():
        t = _run(rows, pos, off, mean, g_emb, g_w1)
    for a, b in zip(c, t):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_bags_of_one_value_are_the_one_valued_path_bit_for_bit(pooling):
    rng = np.random.default_rng(5)
    rows = torch.from_numpy(rng.standard_normal((300, RowLayout(D).width)).astype(np.float32))
    pos = torch.from_numpy(rng.integers(0, 300, size=(32, F)))
    mean = field_pooling_mask([pooling], F)
    off = torch.arange(32 * F + 1)
    emb1, w11 = gather_embeddings(rows, pos, D)
    embp, w1p = gather_pooled(rows, pos.reshape(-1), off, mean, F, D)
    assert torch.equal(emb1, embp) and torch.equal(w11, w1p)
    g_emb = torch.randn(32, F, D, generator=torch.Generator().manual_seed(0))
    g_w1 = torch.randn(32, F, generator=torch.Generator().manual_seed(1))
    u1, s1 = sum_embedding_grads(pos, g_emb, g_w1, batch_unique(pos))
    up, sp = sum_pooled_grads(pos.reshape(-1), off, mean, g_emb, g_w1, batch_unique(pos.reshape(-1)))
    assert torch.equal(u1, up) and torch.equal(s1, sp)


def test_a_model_that_reads_no_w1_sums_zeros_there():
    rng = np.random.default_rng(6)
    rows = torch.from_numpy(rng.standard_normal((40, RowLayout(D).width)).astype(np.float32))
    pos, off = (torch.from_numpy(a) for a in _bags(rng, 8, 3, 40))
    mean = np.zeros(F, np.uint8)
    _, summed = sum_pooled_grads(pos, off, mean, torch.ones(8, F, D), None)
    assert not summed[:, D].any() and summed[:, :D].any()


def test_embed_batch_pools_bags_and_gathers_plain_positions():
    rng = np.random.default_rng(7)
    rows = torch.from_numpy(rng.standard_normal((30, RowLayout(D).width)).astype(np.float32))
    lengths = rng.integers(0, 4, size=(6, F)).astype(np.uint16)
    bags = Bags(rng.integers(0, 30, size=int(lengths.sum())), lengths)
    mean = np.ones(F, np.uint8)
    emb, w1 = embed_batch(rows, bags, mean, D)
    want, want_w1 = gather_pooled(rows, torch.from_numpy(bags.values), torch.from_numpy(bags.bag_offsets()), mean,
                                  F, D)
    assert torch.equal(emb, want) and torch.equal(w1, want_w1) and not emb.requires_grad
    plain = rng.integers(0, 30, size=(6, F))
    emb, _ = embed_batch(rows, plain, mean, D)
    assert torch.equal(emb, rows[torch.from_numpy(plain)][..., :D])


def test_bad_offsets_and_pooling_are_refused_by_name():
    rows = torch.zeros(10, RowLayout(D).width)
    pos = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="do not cover"):
        gather_pooled(rows, pos, torch.tensor([0, 1, 2, 2, 2, 2]), np.zeros(F, np.uint8), F, D)
    with pytest.raises(IndexError, match="gather_pooled"):
        gather_pooled(rows, torch.tensor([1, 2, 30]), torch.tensor([0, 1, 2, 3, 3, 3]), np.zeros(F, np.uint8), F, D)
    with pytest.raises(ValueError, match="model.pooling"):
        field_pooling_mask(["sum", "mean"], F)
    with pytest.raises(ValueError, match="model.pooling"):
        field_pooling_mask(["max"], F)


def test_bags_offsets_slices_and_checks():
    b = Bags(np.array([7, 8, 9, 4]), np.array([[2, 0], [1, 1]], dtype=np.uint16))
    assert b.bag_offsets().tolist() == [0, 2, 2, 3, 4]
    assert b.row_offsets().tolist() == [0, 2, 4]
    s = b.rows_slice(1, 2)
    assert s.values.tolist() == [9, 4] and s.lengths.tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="lengths sum to 4 values, 3 held"):
        Bags(np.array([1, 2, 3]), np.array([[2, 0], [1, 1]])).bag_offsets()
