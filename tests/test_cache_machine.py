"""The cache conformance state machine on every built-in backend (>= 200 examples each)."""
import pytest

from infergraft.core.cache import CacheFullError
from infergraft.core.testing.cache_machine import cache_factory, make_cache_test, tiny_cache_spec

# contiguous.prepare bumps the lengths of the sequences before the one that overflows
# max_seq_len and then raises, so a refused multi-sequence step is not atomic there (see
# test_contiguous_refused_step_is_atomic); the engine never asks for such a step.
TestContiguous = make_cache_test(cache_factory("contiguous", max_batch_size=3),
                                 probe_refused_steps=False)
# small pools, so that running out of blocks (and of fast slots) happens often
TestPaged = make_cache_test(cache_factory("paged", block_size=4, num_blocks=12))
TestPagedWindowOddBlocks = make_cache_test(
    cache_factory("paged", tiny_cache_spec(num_heads=6, num_kv_heads=2, sliding_window=5),
                  block_size=3, num_blocks=14))
TestPagedInt8 = make_cache_test(cache_factory("paged", block_size=4, num_blocks=12,
                                              kv_quantizer="kv-int8"))
TestOffload = make_cache_test(cache_factory("offload", block_size=4, num_blocks=16,
                                            fast_blocks=7))
TestOffloadInt8 = make_cache_test(cache_factory("offload", block_size=4, num_blocks=16,
                                                fast_blocks=6, kv_quantizer="kv-int8"))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="contiguous.prepare is not atomic on refusal (owner: contiguous.py)")
def test_contiguous_refused_step_is_atomic():
    cache = cache_factory("contiguous", max_batch_size=2)()
    for s in (0, 1):
        cache.allocate(s, 1)
    with pytest.raises(CacheFullError):
        cache.prepare([0, 1], [1, 25])
    assert (cache.length(0), cache.length(1)) == (0, 0)
