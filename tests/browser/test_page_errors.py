"""What the page says when requests fail, and that it stops saying it once they succeed."""

from __future__ import annotations

import json
import re

import pytest

from tests.browser.conftest import serving
from tests.browser.test_page import SENTENCE, open_page, run, submit, wait_focus, wait_grid

pytestmark = pytest.mark.browser


def refuse(route, status: int, code: str, message: str, retry_after: str | None = None) -> None:
    headers = {"Retry-After": retry_after} if retry_after else {}
    route.fulfill(status=status, content_type="application/json", headers=headers,
                  body=json.dumps({"error": {"code": code, "message": message}}))


def test_a_busy_banner_from_a_view_goes_when_a_later_view_loads(server, page, watched):
    """A 429 on one slice put "The server is busy" up, and it stayed over every view that loaded
    after it, until the next text was run."""
    refused = []

    def busy_once(route):
        if refused:
            route.continue_()
            return
        refused.append(route.request.url)
        refuse(route, 429, "busy", "the server is busy", retry_after="1")

    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    # Only the slice the arrow asks for, once the page's own loads are done: under a loaded CI
    # machine the head view's slice of layer 0 came after the route, took the refusal, and the
    # next view to load had taken its banner down before the test looked.
    watched.settle(page)
    page.route(re.compile(r".*/api/v1/runs/.*format=f16&layers=1(&|$).*"), busy_once)
    # Every banner the page puts up, as it puts it up: the retry 1 s later takes it down, and on a
    # loaded machine a look after "visible" had found it empty again (the README suite, once).
    page.evaluate("""() => { window.banners = [];
        new MutationObserver(() => { const box = document.getElementById('error');
            if (!box.hidden) window.banners.push(box.textContent); })
            .observe(document.getElementById('error'), { childList: true, characterData: true, subtree: true, attributes: true }); }""")
    page.click("#focus-plot")
    page.keyboard.press("ArrowDown")  # the next layer: its exact values are a slice of the run
    error = page.locator("#error")
    page.wait_for_function("() => window.banners.length > 0")
    assert page.evaluate("() => window.banners") == ["The server is busy. Try again in 1 s."]
    page.keyboard.press("ArrowDown")
    wait_focus(page, layer=2)
    error.wait_for(state="hidden")
    assert len(refused) == 1


def test_a_refused_run_says_the_results_on_screen_are_the_last_runs(server, page):
    """The last text's heatmaps stayed under the new text, unmarked, as if they were its own."""
    open_page(page, server)
    run(page, SENTENCE)
    advice = "no input of this model fits it: the server's MANYEYES_CACHE_BYTES must be raised"
    page.route("**/api/v1/attention", lambda route: refuse(route, 413, "run_too_large", f"this input's run would hold more; {advice}"))
    submit(page, "A new text that the server refuses.")
    error = page.locator("#error")
    error.wait_for(state="visible")
    # The server's advice, once: not "Try a shorter text", which no length would satisfy here.
    assert error.text_content() == (f"Too large: this input's run would hold more; {advice}. "
                                    "The results below are still those of the last run.")
    assert page.evaluate("() => document.body.hasAttribute('data-stale')")
    assert page.evaluate("() => getComputedStyle(document.querySelector('main')).opacity") == "0.55"
    page.unroute("**/api/v1/attention")
    page.press("#text", "Enter")
    page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done:')")
    assert error.is_hidden()
    assert not page.evaluate("() => document.body.hasAttribute('data-stale')")
    assert page.evaluate("() => getComputedStyle(document.querySelector('main')).opacity") == "1"


def test_a_first_run_refused_has_no_last_run_to_speak_of(server, page):
    open_page(page, server)
    page.route("**/api/v1/attention", lambda route: refuse(route, 429, "busy", "the server is busy", retry_after="2"))
    submit(page, SENTENCE)
    error = page.locator("#error")
    error.wait_for(state="visible")
    assert error.text_content() == "The server is busy. Try again in 2 s."
    assert not page.evaluate("() => document.body.hasAttribute('data-stale')")


def test_copy_link_copies_where_the_page_has_no_clipboard_api(server, make_page):
    """Over plain http to a network address (a classroom's laptop) the page is no secure context
    and has no navigator.clipboard: every Copy link said to copy it from the address bar."""
    page = make_page()
    page.add_init_script("""Object.defineProperty(navigator, 'clipboard', { value: undefined });
        window.copiedText = null;
        document.addEventListener('copy', () => { window.copiedText = String(document.getSelection()); });""")
    open_page(page, server)
    run(page, SENTENCE)
    page.click("#copy-link")
    page.wait_for_function("() => document.getElementById('link-status').textContent.length > 0")
    assert page.text_content("#link-status") == "Link copied."
    assert page.evaluate("() => window.copiedText") == page.url and "view=" in page.url
    assert page.evaluate("() => document.activeElement.id") == "copy-link"  # focus stays where it was


def test_copy_link_says_when_the_link_could_not_be_saved(server, page):
    """With the server gone, Copy link said "The address bar holds this view": it held an older
    one, or none."""
    open_page(page, server)
    run(page, SENTENCE)
    page.route("**/api/v1/views", lambda route: route.abort("connectionrefused"))
    page.click("#copy-link")
    status = page.locator("#link-status")
    page.wait_for_function("() => document.getElementById('link-status').textContent.length > 0")
    assert status.text_content() == (
        "The link could not be saved: The server could not be reached. Is `manyeyes serve` still running?")
    # The server back, the next view saved: the failure no longer holds, and is not left on show.
    page.unroute("**/api/v1/views")
    page.select_option("#head", "3")
    page.wait_for_function("() => document.getElementById('link-status').textContent === ''")


def test_the_model_list_is_asked_for_once_per_page(server, page, watched):
    """The form, Generate and the predictions strip each asked the server for it."""
    open_page(page, server)
    run(page, SENTENCE)
    watched.settle(page)  # the predictions strip and Generate have asked by now
    assert len([u for u in watched.requests if u.endswith("/api/v1/models")]) == 1


def test_a_page_opened_while_the_models_load_says_so_and_goes_on_when_they_are_in(server, page):
    """It said "Cannot list the models: The server failed (503): models are still loading" and
    stayed so, with an empty model menu, when the server was ready seconds later."""
    loading = {"n": 3}

    def models(route):
        if loading["n"] > 0:
            return refuse(route, 503, "not_ready", "models are still loading; retry shortly")
        route.continue_()

    def readyz(route):
        loading["n"] -= 1
        if loading["n"] >= 0:
            route.fulfill(status=503, content_type="application/json", body=json.dumps({
                "error": {"code": "not_ready", "message": "loading smol"}, "status": "loading",
                "models": {"minilm": {"state": "ready"}, "smol": {"state": "downloading", "bytes_done": 30, "bytes_total": 120}}}))
        else:
            route.continue_()

    page.route("**/api/v1/models", models)
    page.route("**/readyz", readyz)
    page.goto(f"{server}/")
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('The server is still loading')")
    assert page.text_content("#error") == (
        "The server is still loading its models (minilm ready, smol downloading 25%). The page goes on when they are ready.")
    assert page.locator("#model option").count() == 0
    assert page.get_attribute("#error", "data-source") == "loading"  # drawn as news, not in the failure's red
    assert page.get_attribute("#error", "role") == "status"  # and said as news: an alert each second interrupted
    assert page.evaluate("() => getComputedStyle(document.getElementById('error')).backgroundColor") != page.evaluate(
        "() => { const e = document.getElementById('error'); e.dataset.source = 'models'; const c = getComputedStyle(e).backgroundColor; e.dataset.source = 'loading'; return c; }")
    assert page.get_attribute("#focus-plot", "data-example") == "true"  # no "the run above failed"
    page.wait_for_selector("body[data-ready=true]", timeout=15_000)
    assert page.is_hidden("#error") and page.locator("#model option").count() >= 1
    run(page, SENTENCE)


def test_a_page_opened_on_a_server_whose_models_failed_says_why(server, page):
    page.route("**/api/v1/models", lambda route: refuse(route, 503, "not_ready", "models are still loading; retry shortly"))
    page.route("**/readyz", lambda route: route.fulfill(status=503, content_type="application/json", body=json.dumps({
        "error": {"code": "not_ready", "message": "model 'smol' failed to load: no such model file or folder: /x"},
        "status": "failed", "models": {"smol": {"state": "failed"}}})))
    page.goto(f"{server}/")
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('Cannot list')")
    assert page.text_content("#error") == (
        "Cannot list the models: The server failed (503): model 'smol' failed to load: no such model file or folder: /x.")
    assert page.get_attribute("#error", "role") == "alert"


def test_a_view_whose_values_cannot_load_fades_the_last_one_and_says_so(server, page):
    """With the server gone, "Mean of all heads" kept the single head's heatmap (title, readings)
    under the new heading, and "Loading exact values…" for good."""
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    page.route(re.compile(r".*/api/v1/runs/.*"), lambda route: route.abort("connectionrefused"))
    page.select_option("#aggregate", "all")
    page.locator("#error").wait_for(state="visible")
    plot = page.locator("#focus-plot")
    assert plot.get_attribute("data-stale") is not None and plot.get_attribute("data-aggregate") == "head"
    assert float(plot.evaluate("p => getComputedStyle(p).opacity")) < 0.5
    page.wait_for_function("() => document.getElementById('focus-caption').textContent.startsWith("
                           "\"This view's values could not be loaded\")")
    page.unroute(re.compile(r".*/api/v1/runs/.*"))
    page.select_option("#aggregate", "head")
    page.wait_for_selector("#focus-plot[data-aggregate=head]:not([data-stale])")
    assert re.match(r"\d+ tokens · model minilm", page.locator("#focus-caption").text_content())


def test_a_layer_whose_exact_values_cannot_load_says_it_shows_8_bit_values(server, page, watched):
    """With the server gone, the next layer's heatmap stayed on its 8-bit values, and only the
    banner at the top said anything (a review by use): the caption says which values these are."""
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    watched.settle(page)
    exact = re.compile(r".*/api/v1/runs/.*format=f16&layers=1(&|$).*")
    page.route(exact, lambda route: route.abort("connectionrefused"))
    page.click("#focus-plot")
    page.keyboard.press("ArrowDown")
    page.locator("#error").wait_for(state="visible")
    page.wait_for_function("() => document.getElementById('focus-caption').textContent.includes('the exact ones could not')")
    plot = page.locator("#focus-plot")
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-precision")) == ("1", "u8")
    assert plot.get_attribute("data-stale") is None
    caption = page.locator("#focus-caption").text_content()
    assert caption.count("8-bit values") == 1 and caption.startswith(f"{caption.split(' · ')[0]} · model minilm")
    # Back on a layer whose values came, the caption has nothing to say of them.
    page.keyboard.press("ArrowUp")
    wait_focus(page, layer=0)
    assert "8-bit" not in page.locator("#focus-caption").text_content()
    # And once they can come, they come, and the note goes.
    page.unroute(exact)
    page.keyboard.press("ArrowDown")
    page.wait_for_selector("#focus-plot[data-layer='1'][data-precision='f16']")
    page.wait_for_function("() => !document.getElementById('focus-caption').textContent.includes('8-bit')")


def test_an_empty_text_is_a_mistake_in_the_form_not_a_failed_run(server, page):
    """It said "The example is hidden: the run above failed" where nothing had run."""
    open_page(page, server)
    page.fill("#text", "   ")
    page.press("#text", "Enter")
    page.locator("#error").wait_for(state="visible")
    assert page.locator("#error").text_content() == "Type a sentence first."
    assert "failed" not in page.locator("#focus-caption").text_content()
    assert page.locator("#focus-plot").get_attribute("data-example") == "true"
    # After a run, the results left on screen are said to be that run's (the model menu may
    # already name another model).
    run(page, "The cat sat.")
    page.fill("#text", "   ")
    page.press("#text", "Enter")
    page.wait_for_function("() => document.getElementById('error').textContent.startsWith('Type a sentence first.')")
    assert page.locator("#error").text_content() == "Type a sentence first. The results below are still those of the last run."
    # Over once there is a sentence: it stayed up beside the typed text until the next run.
    page.fill("#text", "  ")
    assert page.locator("#error").is_visible()
    page.fill("#text", "The cat sat.")
    page.locator("#error").wait_for(state="hidden")
    assert page.locator("#text").get_attribute("aria-invalid") is None


def test_hiding_special_tokens_of_a_run_that_has_none_says_so(page):
    """The caption said "special tokens hidden · rows renormalised" over tiny-gpt's unchanged weights."""
    with serving({"tiny-gpt": "tiny-gpt"}) as base:
        open_page(page, base)
        run(page, "The cat sat.", model="tiny-gpt")
        page.check("#hide-special")
        page.wait_for_function("() => document.getElementById('focus-caption').textContent.includes('no special tokens to hide')")
        caption = page.locator("#focus-caption").text_content()
    assert "renormalised" not in caption and "special tokens hidden" not in caption


def test_a_failed_float32_head_is_asked_for_once_per_view_not_at_every_reading(server, page):
    """Readings ask for the head's float32 values; when that failed, every cell the pointer crossed
    asked again (and put the error up again)."""
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    asked = []
    page.route(re.compile(r".*/api/v1/runs/.*format=json.*"),
               lambda route: (asked.append(route.request.url), refuse(route, 503, "busy", "the server is busy")))
    page.locator("#focus-plot").focus()
    for col in range(6):  # six readings, by the keyboard's cell cursor (the error banner moves the plot)
        page.keyboard.press("Shift+ArrowRight")
        page.wait_for_selector(f"#tooltip[data-query='0'][data-key='{col}']", state="visible")
        page.wait_for_timeout(100)
    assert len(asked) == 1, asked
    page.unroute(re.compile(r".*/api/v1/runs/.*format=json.*"))
    page.keyboard.press("ArrowRight")  # another view: its readings ask for its own values, once
    wait_focus(page, head=1)
    page.keyboard.press("Shift+ArrowDown")
    page.locator("#error").wait_for(state="hidden")
