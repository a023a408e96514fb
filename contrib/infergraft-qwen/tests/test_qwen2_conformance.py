"""The Qwen2 plugin's suite: the infergraft policy conformance kit with its fixtures."""
import pytest

from infergraft import core
from infergraft.core.testing.models import random_model, tiny_qwen2_config
from infergraft.core.testing.policy_kit import PolicyTests

CONFIGS = {
    "gqa": {},
    "mqa-tied": dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=48,
                     tie_word_embeddings=True),
    "sliding-window-declared-off": dict(sliding_window=16, max_window_layers=1),
    # every layer slides: prompts (45) and generations (32) run far past the window
    "sliding-window-every-layer": dict(use_sliding_window=True, sliding_window=8,
                                       max_window_layers=0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def qwen2_model(request):
    return random_model(tiny_qwen2_config(**CONFIGS[request.param]), seed=11, scale=5.0)


class TestQwen2Policy(PolicyTests):
    @pytest.fixture
    def policy(self):
        # the installed entry point, not an import of our own module: proves registration
        return core.get_plugin_manager().policies().get("qwen2")

    @pytest.fixture
    def hf_model(self, qwen2_model):
        return qwen2_model
