"""The cache conformance state machine on every built-in backend (>= 200 examples each)."""
import pytest

from infergraft.core.cache import CacheFullError
from infergraft.core.testing.cache_machine import cache_factory, make_cache_test, tiny_cache_spec

TestContiguous = make_cache_test(cache_factory("contiguous", max_batch_size=3))
TestContiguousInt8 = make_cache_test(cache_factory("contiguous", max_batch_size=3,
                                                   kv_quantizer="kv-int8"))
# rolling buffer: int8 through the prefill path that attends before it writes
TestContiguousWindowInt8 = make_cache_test(
    cache_factory("contiguous", tiny_cache_spec(num_heads=6, num_kv_heads=2, sliding_window=5),
                  max_batch_size=3, kv_quantizer="kv-int8"))
# small pools, so that running out of blocks (and of fast slots) happens often
TestPaged = make_cache_test(cache_factory("paged", block_size=4, num_blocks=12))
TestPagedWindowOddBlocks = make_cache_test(
    cache_factory("paged", tiny_cache_spec(num_heads=6, num_kv_heads=2, sliding_window=5),
                  block_size=3, num_blocks=14))
TestPagedInt8 = make_cache_test(cache_factory("paged", block_size=4, num_blocks=12,
                                              kv_quantizer="kv-int8"))
TestPagedFp8 = make_cache_test(cache_factory("paged", block_size=4, num_blocks=12,
                                             kv_quantizer="kv-fp8"))
TestContiguousWindowFp8 = make_cache_test(
    cache_factory("contiguous", tiny_cache_spec(num_heads=6, num_kv_heads=2, sliding_window=5),
                  max_batch_size=3, kv_quantizer="kv-fp8"))
TestOffload = make_cache_test(cache_factory("offload", block_size=4, num_blocks=16,
                                            fast_blocks=7))
TestOffloadInt8 = make_cache_test(cache_factory("offload", block_size=4, num_blocks=16,
                                                fast_blocks=6, kv_quantizer="kv-int8"))


@pytest.mark.parametrize("kv_quantizer", [None, "kv-int8", "kv-fp8"])
def test_contiguous_refused_step_is_atomic(kv_quantizer):
    cache = cache_factory("contiguous", max_batch_size=2, kv_quantizer=kv_quantizer)()
    for s in (0, 1):
        cache.allocate(s, 1)
    before = cache.stats()
    with pytest.raises(CacheFullError, match="sequence 1 would hold 25 tokens"):
        cache.prepare([0, 1], [1, 25])  # sequence 0 fits, sequence 1 does not
    assert (cache.length(0), cache.length(1)) == (0, 0) and cache.stats() == before
    cache.device_decode = True  # the CUDA-graph path refuses atomically too
    cache.prepare([0, 1], [1, 24])  # sequence 1 is full (max_seq_len=24)
    with pytest.raises(CacheFullError, match="sequence 1 would hold 25 tokens"):
        cache.prepare([0, 1], [1, 1])
    assert (cache.length(0), cache.length(1)) == (1, 24)


@pytest.mark.parametrize("ids,counts,error,match", [
    ([0, 0], [1, 1], ValueError, "duplicate sequences"),
    ([0], [1, 2], ValueError, "one count per sequence"),
    ([], [], ValueError, "at least one sequence"),
    ([0], [0], ValueError, "integer >= 1 tokens"),
    ([7], [1], KeyError, "sequence 7 is not allocated"),
])
def test_contiguous_bad_step_is_refused_clearly(ids, counts, error, match):
    cache = cache_factory("contiguous", max_batch_size=2)()
    cache.allocate(0, 1)
    with pytest.raises(error, match=match):
        cache.prepare(ids, counts)
    assert cache.length(0) == 0
