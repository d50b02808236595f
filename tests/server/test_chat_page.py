"""The chat page at GET / in a real browser: Debian's chromium, headless, driven by
Playwright. A typed question gets, streamed, the answer /v1/chat/completions gives; Stop
aborts a long answer on the server and the page takes the next question; with --api-key
the page asks for the key, then chats. Skipped where no chromium is installed
(`make test` installs Debian's: the Makefile's `browser` target)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import httpx
import pytest
from server_launcher import ServerHandle


def _chromium() -> str | None:
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else shutil.which("chromium")


CHROMIUM = _chromium()
if CHROMIUM is None:
    pytest.skip(
        "no chromium browser installed (Debian: apt-get install chromium, or `make browser`)", allow_module_level=True
    )
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements.txt)")
expect = sync_api.expect

API_KEY = "page-secret"
# Each forward of the slow server sleeps this long (test hook), so that an answer streams
# in many chunks and a long one runs for minutes unless aborted.
FORWARD_SLEEP_S = 0.03
TIMEOUT_MS = 20_000
# expect()'s own default is 5 s, not the context's: under `make test`'s load (two test processes
# on two cores) the key form took longer than that to hide once the right key was given.
expect.set_options(timeout=TIMEOUT_MS)
STATUS = re.compile(r"^\d+ running · \d+ queued · \d+\.\d tok/s$")
ANSWER_DONE = re.compile(r"^\d+ tokens · .* · (stop|length)$")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:  # stops the driver even on failure
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def _page(browser, api_key: str | None = None):
    """A page in a fresh context (empty localStorage), with `api_key` already stored as a
    returning user's page would have it."""
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    if api_key is not None:
        context.add_init_script(f"localStorage.setItem('tandem.apiKey', {json.dumps(api_key)})")
    return context, context.new_page()


@pytest.fixture
def page(browser):
    context, page = _page(browser)
    yield page
    context.close()


@pytest.fixture(scope="module")
def slow_keyed_server(tiny_llama_dir):
    with ServerHandle(
        tiny_llama_dir,
        extra_args=["--api-key", API_KEY, "--skip-server-warmup"],
        env={"TANDEM_TEST_FORWARD_SLEEP_S": str(FORWARD_SLEEP_S)},
    ) as handle:
        yield handle


def _settings(page, **values: str) -> None:
    if not page.locator("#settings").evaluate("d => d.open"):
        page.click("#settings summary")
    for field, value in values.items():
        page.fill(f"#{field}", value)


def _ask(page, text: str) -> None:
    """Type `text` (Shift+Enter for its line breaks) and send it with Enter."""
    page.click("#prompt")
    for i, line in enumerate(text.split("\n")):
        if i:
            page.keyboard.press("Shift+Enter")
        page.keyboard.type(line)
    assert page.input_value("#prompt") == text  # Shift+Enter sent nothing
    page.keyboard.press("Enter")


def _record_answer_lengths(page) -> None:
    """From now on, window.answerLengths gets the last answer's length at each change."""
    page.evaluate("""() => {
        window.answerLengths = [];
        new MutationObserver(() => {
            const texts = document.querySelectorAll('.msg.assistant .text');
            const n = texts.length ? texts[texts.length - 1].textContent.length : 0;
            if (n !== window.answerLengths.at(-1)) window.answerLengths.push(n);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")


def _loads(server, headers=None) -> dict:
    r = httpx.get(server.base_url + "/v1/loads", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()["loads"][0]


def test_a_typed_question_gets_the_streamed_answer(server, page):
    """On the shared server (no key): the page names the model, and at temperature 0 the
    streamed answer is the text /v1/chat/completions answers the same conversation."""
    question = "Tell me about the sea.\nIn two lines."
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    page.goto(server.base_url + "/")
    expect(page.locator("#model")).to_have_text(model)
    expect(page.locator("#status")).to_have_text(STATUS)
    _settings(page, temperature="0", **{"max-tokens": "24"})
    _ask(page, question)

    expect(page.locator(".msg.user .text")).to_have_text(question)
    meta = page.locator(".msg.assistant .meta")
    expect(meta).to_have_text(ANSWER_DONE)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#prompt")).to_have_value("")
    shown = page.locator(".msg.assistant .text").text_content()

    reference = httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": 24,
        },
    ).json()
    (choice,) = reference["choices"]
    assert shown and shown == choice["message"]["content"]
    assert meta.text_content().startswith(f"{reference['usage']['completion_tokens']} tokens")
    assert meta.text_content().endswith(choice["finish_reason"])


def test_stop_aborts_a_long_answer_on_the_server(slow_keyed_server, browser):
    """A 2000-token answer (a minute of forwards) streams chunk by chunk, the status line
    counts it running; Stop aborts it on the server, and the page answers the next one."""
    server = slow_keyed_server
    key = {"Authorization": f"Bearer {API_KEY}"}
    context, page = _page(browser, api_key=API_KEY)
    try:
        page.goto(server.base_url + "/")
        expect(page.locator("#key-form")).to_be_hidden()
        _settings(page, temperature="0", **{"max-tokens": "2000"})
        _record_answer_lengths(page)
        _ask(page, "Tell me a very long story.")

        expect(page.locator("#stop")).to_be_visible()  # in place of Send
        expect(page.locator("#send")).to_be_hidden()
        expect(page.locator("#status")).to_have_text(re.compile(r"^1 running · 0 queued · [1-9][\d.]* tok/s$"))
        page.wait_for_function("() => window.answerLengths.length >= 5")  # it grows chunk by chunk
        lengths = page.evaluate("window.answerLengths")
        assert lengths == sorted(lengths) and lengths[-1] > 0
        assert _loads(server, key)["num_running_reqs"] == 1

        page.click("#stop")
        expect(page.locator(".msg.assistant .meta")).to_have_text(re.compile(r"^\d+ tokens · .* · stopped$"))
        stopped = page.locator(".msg.assistant .text").text_content()
        assert stopped
        deadline = time.monotonic() + 10  # unaborted, it would run for a minute more
        while (running := _loads(server, key)["num_running_reqs"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running == 0, "the stopped request still runs on the server"
        expect(page.locator("#status")).to_have_text(re.compile(r"^0 running · 0 queued"))

        # Ready for the next question; the stopped answer stays in the conversation.
        expect(page.locator("#stop")).to_be_hidden()
        expect(page.locator("#send")).to_be_visible()
        _settings(page, **{"max-tokens": "4"})
        _ask(page, "Thanks.")
        expect(page.locator(".msg.assistant .meta").nth(1)).to_have_text(ANSWER_DONE)
        assert page.locator(".msg.assistant .text").nth(0).text_content() == stopped
        assert page.locator(".msg.assistant .text").nth(1).text_content()
        assert page.locator(".msg .error").count() == 0
    finally:
        context.close()


def test_with_an_api_key_the_page_asks_for_it(slow_keyed_server, page):
    """The page is served without the key; its API calls get 401 until the key is given
    (a wrong one is refused and asked for again), then the chat works."""
    server = slow_keyed_server
    assert httpx.get(server.base_url + "/v1/models").status_code == 401
    page.goto(server.base_url + "/")
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#status")).to_have_text("API key needed")

    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-message")).to_contain_text("The API key was refused.")
    expect(page.locator("#key-form")).to_be_visible()

    page.fill("#api-key", API_KEY)
    page.click("#key-form button")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model")).to_have_text(
        httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0][
            "id"
        ]
    )
    expect(page.locator("#status")).to_have_text(STATUS)
    _settings(page, **{"max-tokens": "6"})
    _ask(page, "Hello!")
    expect(page.locator(".msg.assistant .meta")).to_have_text(ANSWER_DONE)
    assert page.locator(".msg.assistant .text").text_content()
    assert page.evaluate("localStorage.getItem('tandem.apiKey')") == API_KEY


def test_a_server_error_is_shown_and_the_question_kept(server, page):
    """A 400 from the server (max tokens beyond the context) shows its message; the
    question goes back into the input box. "New chat" clears the conversation."""
    page.goto(server.base_url + "/")
    _settings(page, **{"max-tokens": "100000"})
    _ask(page, "Hi")
    error = page.locator(".msg.assistant .error")
    expect(error).to_contain_text("max_completion_tokens is too large")
    expect(page.locator("#prompt")).to_have_value("Hi")
    expect(page.locator("#send")).to_be_visible()
    page.click("#new-chat")
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator("#hint")).to_be_visible()
