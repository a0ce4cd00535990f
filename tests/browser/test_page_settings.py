"""The page under its reader's own settings (review h50d: forced colours, a larger default font,
reduced motion, a phone's width; h50c: a repeated text's neuron view) and a generation whose
connection drops. Each test fails on the page as it was before its fix. Screenshots go to
test-artifacts/ to be looked at."""

from __future__ import annotations

import pytest

from tests.browser.test_page import SENTENCE, open_page, run, wait_grid

pytestmark = pytest.mark.browser

# Repeated, as an induction test's R+R is: its keys repeat their tokens.
REPEATED = "red green blue red green blue"

# What each element whose colour is its data draws with: the colour bar's gradient, a head's
# swatch, the attribution and head finder cells' fills, and the ink and paper under those cells.
DRAWN_COLOURS = """() => {
    const look = (selector) => [...document.querySelectorAll(selector)].map((node) => {
        const style = getComputedStyle(node);
        return [style.backgroundImage, style.backgroundColor, style.color];
    });
    return {
        bar: look('#focus-plot .colorbar .cb-bar'),
        swatches: look('#headview-heads .swatch'),
        attribution: look('#attribution .attribution-cell, #attribution .attribution-mlp'),
        finder: look('#finder .finder-cell'),
        grids: look('.attribution-grid, .finder-grid'),
    };
}"""


def measures_drawn(page) -> None:
    page.wait_for_selector("#finder .finder-cell", timeout=60_000)
    page.locator("#measures").scroll_into_view_if_needed()  # the panel draws its views once seen
    page.wait_for_selector("#attribution .attribution-cell", timeout=30_000)
    page.wait_for_selector("#neuron-table tbody tr[data-key]", timeout=30_000)


def test_forced_colours_keep_the_colours_that_are_the_data(server, page, artifacts):
    """Windows High Contrast (forced colours) dropped the focused heatmap's colour bar, turned the
    head view's swatches black and took the attribution and head finder cells' fills."""
    open_page(page, server)
    run(page, REPEATED, model="tiny-causal")
    wait_grid(page)
    measures_drawn(page)
    page.emulate_media(forced_colors="none")
    own = page.evaluate(DRAWN_COLOURS)
    assert own["bar"][0][0].startswith("linear-gradient") and own["swatches"] and own["attribution"] and own["finder"]
    page.emulate_media(forced_colors="active")
    forced = page.evaluate(DRAWN_COLOURS)
    assert page.evaluate("() => matchMedia('(forced-colors: active)').matches")
    for part in ("bar", "swatches", "attribution", "finder"):
        assert forced[part] == own[part], part
    # Under the cells, the theme's own paper and ink (which their text was chosen to read on), not
    # the system's: the cells' translucent fills over a high-contrast black hid their dark text.
    theme = page.evaluate("""() => ['--panel', '--text'].map((name) =>
        getComputedStyle(document.documentElement).getPropertyValue(name).trim())""")
    paper, ink = ("rgb({}, {}, {})".format(*(int(colour[i:i + 2], 16) for i in (1, 3, 5))) for colour in theme)
    assert [grid[1:] for grid in forced["grids"]] == [[paper, ink]] * 2, forced["grids"]
    page.locator("#views").screenshot(path=str(artifacts / "settings-forced-views.png"))
    page.locator(".measures-grid").screenshot(path=str(artifacts / "settings-forced-measures.png"))


def test_the_page_follows_the_readers_default_font_size(server, page, artifacts):
    """A fixed 15 px root left a reader whose browser default is 24 px at 15 px: every rem with it."""
    cdp = page.context.new_cdp_session(page)
    sizes = {}
    for default in (16, 24):
        cdp.send("Page.setFontSizes", {"fontSizes": {"standard": default, "fixed": 13}})
        open_page(page, server)
        sizes[default] = page.evaluate("""() => [document.documentElement, document.querySelector('.caption')]
            .map((node) => parseFloat(getComputedStyle(node).fontSize))""")
    cdp.detach()
    assert sizes[16] == [15, 12]  # the page's own look at the usual default, as before
    assert sizes[24] == [22.5, 18]
    # The skip link, taller in the larger font, is still wholly above the page until Tab reaches it.
    assert page.evaluate("() => document.querySelector('.skip-link').getBoundingClientRect().bottom") <= 0
    run(page, SENTENCE)
    wait_grid(page)
    # Larger text, and still one page wide.
    assert page.evaluate("() => document.documentElement.scrollWidth <= innerWidth")
    page.screenshot(path=str(artifacts / "settings-font-24.png"))


def test_reduced_motion_stills_the_spinner_and_the_thumbnails_pulse(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    animated = """() => {
        document.querySelector('.thumb').classList.add('loading');
        const names = ['.spinner', '.thumb.loading'].map((s) => getComputedStyle(document.querySelector(s)).animationName);
        document.querySelector('.thumb').classList.remove('loading');
        return names;
    }"""
    assert page.evaluate(animated) == ["spin", "pulse"]
    page.emulate_media(reduced_motion="reduce")
    assert page.evaluate(animated) == ["none", "none"]


def test_a_generation_whose_connection_drops_says_the_stream_was_cut_off(server, page):
    """A server that died mid-stream rejects the body's read with a TypeError "network error": the
    status line said "Something went wrong in the page", never the message written for a cut stream."""
    # The server's real answer, cut after its start line and two steps, then the connection lost.
    page.add_init_script("""(() => {
        const fetched = window.fetch;
        window.fetch = async (input, init) => {
            const response = await fetched(input, init);
            if (!String(input).endsWith('api/v1/generate') || !response.ok) return response;
            const lines = (await response.text()).split('\\n').filter(Boolean).slice(0, 3);
            const bytes = new TextEncoder().encode(lines.join('\\n') + '\\n');
            let sent = false;
            const body = new ReadableStream({ pull(controller) {
                if (sent) return controller.error(new TypeError('network error'));
                sent = true;
                controller.enqueue(bytes);
            } });
            return new Response(body, { status: response.status, headers: response.headers });
        };
    })()""")
    open_page(page, server)
    page.select_option("#model", "tiny-causal")
    page.fill("#gen-text", "The river bank")
    page.fill("#gen-n", "5")
    page.click("#gen-start")
    page.wait_for_selector("#generate-box[data-outcome='failed']", timeout=30_000)
    assert page.locator("#gen-status").text_content() == (
        "The stream was cut off after 2 tokens of 5, before the server's end line: generate again.")
    # The two steps that came are still there to step through.
    assert page.locator("#gen-position").text_content().startswith("Token 2 of 2")


def test_the_neuron_views_key_rows_say_their_positions(server, page):
    """In a repeated text two key rows read "red": which one a weight went to was not said."""
    open_page(page, server)
    run(page, REPEATED, model="tiny-causal")
    measures_drawn(page)
    keys = page.locator("#neuron-table tbody tr[data-key] th").all_text_contents()
    # Named as the query menu names the same tokens.
    assert keys == page.locator("#neuron-query option").all_text_contents()
    assert len(set(keys)) == len(keys)


def test_a_phones_wide_tables_show_that_they_scroll(server, make_page, artifacts):
    """At 375 px the head finder's and neuron view's tables were cut mid-word at the box's edge, and
    a phone draws no scroll bar until the box is touched."""
    page = make_page(viewport=(375, 740))
    open_page(page, server)
    run(page, REPEATED, model="tiny-causal")
    measures_drawn(page)
    boxes = page.evaluate("""() => [...document.querySelectorAll('.finder-scroll')].map((box) => {
        const style = getComputedStyle(box);
        return { wider: box.scrollWidth > box.clientWidth, images: style.backgroundImage.split('gradient(').length - 1,
                 attachment: style.backgroundAttachment };
    })""")
    assert len(boxes) == 2 and all(box["wider"] for box in boxes), boxes
    # A shadow fixed at each edge, under covers that travel with the table's ends.
    assert all(box["images"] == 4 and box["attachment"] == "local, local, scroll, scroll" for box in boxes), boxes
    page.locator("#neuron").scroll_into_view_if_needed()
    page.screenshot(path=str(artifacts / "settings-phone-neuron.png"))
