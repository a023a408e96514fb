"""The chat page at ``GET /`` in headless Chromium (Debian's ``chromium``, driven by the
``playwright`` package): a question typed and sent, the answer streamed in pieces and equal
to the API's, a screenshot saved (to $INFERGRAFT_SCREENSHOT_DIR when set). Skipped where
Chromium or playwright is missing, except under CI (CI=true), where that is a failure."""
import pytest
from serve_support import chromium_page, require_chromium, screenshot, serving, tiny_model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_chromium()
    with serving(tiny_model(tmp_path_factory), "--max-seq-len", "256") as s:
        yield s


@pytest.fixture(scope="module")
def page(server):
    with chromium_page() as page:
        yield page


def test_the_page_streams_an_answer_equal_to_the_apis(server, page, tmp_path):
    page.goto(server.url)
    page.wait_for_function(f"document.getElementById('model').textContent === {server.model!r}")
    page.fill("#max-tokens", "24")
    # count the answer's updates: streamed, it grows in several pieces, not at once
    page.evaluate("""() => {
        window.pieces = 0;
        new MutationObserver((ms) => { for (const m of ms)
            if (m.target.classList && m.target.classList.contains('assistant')) window.pieces++;
        }).observe(document.getElementById('messages'), {childList: true, subtree: true});
    }""")
    page.fill("#input", QUESTION)
    page.click("#send")
    page.wait_for_selector('.assistant[data-done="true"]')
    answer = page.text_content(".assistant")
    want = server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0).choices[0].message.content
    assert answer == want and answer
    assert page.evaluate("window.pieces") > 3
    assert page.text_content(".user") == QUESTION
    assert "24 tokens" in page.text_content(".stats")
    assert page.query_selector(".error") is None
    screenshot(page, tmp_path, "chat-page.png")


def test_the_page_shows_a_refusal(server, page):
    page.goto(server.url)
    page.fill("#max-tokens", "100000")  # beyond the context: the server says so
    page.fill("#input", "Hello")
    page.click("#send")
    error = page.wait_for_selector(".error")
    assert "max_tokens" in error.text_content() and "max_seq_len=256" in error.text_content()
    page.wait_for_selector("#send:not([disabled])")
