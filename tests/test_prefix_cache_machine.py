"""The prefix cache in the cache kit's state machine (>= 200 examples each): the paged
cache with float32 and int8 K/V and a sliding window, and with a key function that
collides everywhere (the token comparison must refuse every false hit)."""
import pytest

from infergraft.core.testing.cache_machine import cache_factory, tiny_cache_spec
from infergraft.core.testing.prefix_machine import make_prefix_cache_test

CASES = {
    "float32": dict(),
    "int8": dict(kv_quantizer="kv-int8"),
    "window": dict(spec=tiny_cache_spec(sliding_window=6)),
    "collisions": dict(),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefix_cache_machine(case):
    factory = cache_factory("paged", block_size=4, num_blocks=14, **CASES[case])
    make_prefix_cache_test(factory, collide=case == "collisions")("runTest").runTest()
