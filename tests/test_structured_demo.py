"""Structured output on the real demo model (SmolLM2-135M-Instruct): a pydantic City
schema answered with JSON that parses into it, other schemas, a regex and a choice, all
obeyed, and an unconstrained request in the same batch unchanged."""
import json
import re

import jsonschema
import pydantic
import pytest

from infergraft import core

pytestmark = pytest.mark.slow


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


def chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def engine():
    return core.build("smollm2-135m", plugins=["paged"], max_batch_size=4, max_seq_len=512,
                      dtype="float32", device="cpu")


def test_the_demo_model_answers_a_city_in_the_schema(engine):
    # (asked for unbounded integers, a model this small may count digits until max tokens:
    # these two prompts it answers; the schema is obeyed either way)
    asked = {"Paris": "Tell me about Paris: name, country, population.",
             "Tokyo": "Describe the city of Tokyo as JSON with its name, country and population."}
    free = chat(engine, "What is the capital of France?")
    alone = engine.generate(free, max_new_tokens=24)[0].token_ids
    cities = [engine.add_request(chat(engine, q), core.SamplingParams(
        max_new_tokens=48, json_schema=City)) for q in asked.values()]
    beside = engine.add_request(free, core.SamplingParams(max_new_tokens=24))
    while engine.has_unfinished():
        engine.step()
    for name, city in zip(asked, cities):
        assert city.finish_reason == "stop", city.text
        parsed = City.model_validate_json(city.text)
        assert parsed.name == name and parsed.population > 0, parsed
    assert beside.output_ids == alone  # constrained rows in its batch change nothing of it


def test_the_demo_model_obeys_schemas_regexes_and_choices(engine):
    schema = {"type": "object", "properties": {
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12},
                      "minItems": 1, "maxItems": 3},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "kind": {"enum": ["compiled", "interpreted"]}},
        "required": ["languages", "year", "kind"]}
    asked = chat(engine, "Describe the Python programming language as JSON.")
    done = engine.generate([asked, asked], max_new_tokens=80, json_schema=schema,
                           temperature=0.8, seed=4)
    for d in done:
        assert d.finish_reason == "stop", d.text
        jsonschema.validate(json.loads(d.text), schema)
    date = engine.generate(chat(engine, "When did the Berlin wall fall? Answer with a date."),
                           max_new_tokens=20, regex=r"\d{4}-\d{2}-\d{2}")[0]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text) and date.finish_reason == "stop"
    answer = engine.generate(chat(engine, "Is Paris in France? Answer yes or no."),
                             max_new_tokens=8, choice=["yes", "no"])[0]
    assert answer.text == "yes" and answer.finish_reason == "stop"
