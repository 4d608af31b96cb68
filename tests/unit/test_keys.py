import numpy as np

from hvctr.formats import EMPTY_KEY, NUM_BUCKETS, bucket, default_bucket_owner, mix64, owner_of, remap_empty


def test_mix64_known_values_and_bijection():
    # splitmix64 finaliser reference values (computed with Python ints, mod 2^64).
    def ref(z):
        m = (1 << 64) - 1
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    xs = np.array([0, 1, 2, 12345, 2**63, 2**64 - 1], dtype=np.uint64)
    assert mix64(xs).tolist() == [ref(int(x)) for x in xs]
    many = np.arange(100_000, dtype=np.uint64)
    assert np.unique(mix64(many)).size == many.size


def test_buckets_are_balanced_and_owners_round_robin():
    keys = mix64(np.arange(1 << 18, dtype=np.uint64))
    b = bucket(keys)
    assert b.min() >= 0 and b.max() < NUM_BUCKETS
    counts = np.bincount(b, minlength=NUM_BUCKETS)
    assert counts.min() > 0.6 * counts.mean()
    for w in (1, 2, 3):
        owners = owner_of(keys, default_bucket_owner(w))
        share = np.bincount(owners, minlength=w) / keys.size
        assert np.all(np.abs(share - 1 / w) < 0.02)


def test_remap_empty():
    k = np.array([1, EMPTY_KEY, 3], dtype=np.uint64)
    assert EMPTY_KEY not in remap_empty(k)
