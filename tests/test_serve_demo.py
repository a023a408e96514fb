"""The real demo model (SmolLM2-135M-Instruct) through ``infergraft serve``: "What is the
capital of France?" answered with Paris through chat completions, streamed and not, and
on the chat page (a screenshot of the answered question)."""
import pytest
from serve_support import chromium_page, require_chromium, screenshot, serving

from infergraft.core.loading.demo import ensure_demo_model

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    ensure_demo_model("smollm2-135m")  # fetched and converted once, outside the server
    with serving("smollm2-135m", "--max-seq-len", "512") as s:
        yield s


def test_the_demo_model_answers_paris(server):
    client = server.client()
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=32,
                                       temperature=0)
    answer = r.choices[0].message.content
    assert "Paris" in answer and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                            max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer


def test_the_chat_page_answers_paris(server, tmp_path):
    require_chromium()
    with chromium_page() as page:
        page.goto(server.url)
        page.fill("#input", QUESTION)
        page.click("#send")
        page.wait_for_selector('.assistant[data-done="true"]')
        assert "Paris" in page.text_content(".assistant")
        screenshot(page, tmp_path, "chat-page-demo.png")
