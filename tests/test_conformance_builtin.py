"""Built-in plugins run the same conformance kit as third-party ones."""
import pytest

from infergraft import core
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.testing.cache_kit import CacheBackendTests
from infergraft.core.testing.logits_kit import LogitsProcessorTests
from infergraft.core.testing.planner_kit import PlannerTests
from infergraft.core.testing.policy_kit import PolicyTests
from infergraft.core.testing.proposer_kit import ProposerTests


LLAMA_CONFIGS = {"gqa-untied": {}, "mqa-tied": dict(tie_word_embeddings=True, num_key_value_heads=1)}


@pytest.fixture(scope="module", params=sorted(LLAMA_CONFIGS))
def llama_model(request):
    return random_model(tiny_llama_config(**LLAMA_CONFIGS[request.param]), seed=7, scale=5.0)


class TestLlamaPolicy(PolicyTests):
    @pytest.fixture
    def policy(self):
        return core.get_plugin_manager().policies().get("llama")

    @pytest.fixture
    def hf_model(self, llama_model):
        return llama_model


class TestSinglePlanner(PlannerTests):
    world_sizes = (1,)
    bad_world_sizes = (2, 3)

    @pytest.fixture
    def planner(self):
        return core.get_plugin_manager().planners().get("single")


class TestTensorParallelPlanner(PlannerTests):
    world_sizes = (1, 2, 4, 8)  # 8: each of the 4 kv heads copied to two ranks
    bad_world_sizes = (3, 16)  # neither divides 8 heads

    @pytest.fixture
    def planner(self):
        return core.get_plugin_manager().planners().get("tp")


class TestPipelineParallelPlanner(PlannerTests):
    world_sizes = (1, 2, 3, 4)  # 4 layers: 3 stages take 2 + 1 + 1
    bad_world_sizes = (5, 0)

    @pytest.fixture
    def planner(self):
        return core.get_plugin_manager().planners().get("pp")


class TestPipelineTensorPlanner(TestPipelineParallelPlanner):
    plan_options = {"tensor_parallel": 2}
    world_sizes = (2, 4, 8)  # 1, 2 and 4 stages of 2 ranks over 4 layers
    bad_world_sizes = (3, 10)  # not a multiple of 2; 5 stages for 4 layers


# tests/test_cache_machine.py runs the state machine >= 200 examples per built-in backend;
# here the kit's copy of it runs a few, to prove the kit wires it up
class TestContiguousBackend(CacheBackendTests):
    machine_examples = 10

    @pytest.fixture
    def backend(self):
        return core.get_plugin_manager().cache_backends().get("contiguous")


@pytest.mark.parametrize("name", ["paged", "offload"])
class TestBlockBackends(CacheBackendTests):
    machine_examples = 10

    @pytest.fixture
    def backend(self, name):
        return core.get_plugin_manager().cache_backends().get(name)

    @pytest.fixture
    def cache_options(self, name):
        return dict(block_size=4, num_blocks=16)


class TestGrammarProcessor(LogitsProcessorTests):
    """The built-in structured-output processor on a JSON schema, a regex and a choice."""

    @pytest.fixture
    def processor(self):
        return core.get_plugin_manager().logits_processors().get("grammar")

    @pytest.fixture(params=[dict(json_schema={"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}),
        dict(regex=r"[a-c]{1,3}-\d"), dict(choice=["left", "right"])],
        ids=["json_schema", "regex", "choice"])
    def processor_arg(self, request):
        return core.SamplingParams(**request.param).constraint

    @pytest.fixture
    def bad_arg(self):
        return {"type": "object"}  # a schema, not the Constraint SamplingParams makes of it


class TestNgramProposer(ProposerTests):
    @pytest.fixture
    def proposer(self):
        return core.get_plugin_manager().proposers().get("ngram")

    @pytest.fixture
    def proposer_options(self):
        return {"min_n": 1, "max_n": 3}

    @pytest.fixture
    def bad_options(self):
        return {"min_n": 0}


class TestDraftProposer(ProposerTests):
    @pytest.fixture
    def proposer(self):
        return core.get_plugin_manager().proposers().get("draft")

    @pytest.fixture
    def proposer_options(self):
        return {"model": random_model(tiny_llama_config(num_hidden_layers=1), seed=3, scale=5.0)}

    @pytest.fixture
    def bad_options(self):
        return {"model": None}
