"""The page with a keyboard and a screen reader, from an accessibility pass: the arrows step heads
only on the heatmap and the grid (elsewhere they scroll), Shift+arrows read cells into a live
region and a run started from the Run button leaves focus on the heatmap and says it is done
(Generate and Stop handing focus to each other is in test_experiments_ui)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.browser.test_experiments_ui import weight_text
from tests.browser.test_page import SENTENCE, api_attention, hover_cell, open_page, run, wait_focus, wait_grid, wait_saved

pytestmark = pytest.mark.browser


def active_id(page) -> str:
    return page.evaluate("() => document.activeElement.id || document.activeElement.tagName")


def test_arrows_step_heads_on_the_heatmap_and_scroll_elsewhere(server, page):
    page.set_viewport_size({"width": 1280, "height": 600})
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    assert active_id(page) == "focus-plot"
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)
    # Said, as well as shown: the heatmap's new name is not re-read by screen readers.
    assert page.locator("#cell-reading").text_content() == "Layer 0, head 1"
    # Off the heatmap and the grid, the arrows are the page's: they scroll and leave the head alone.
    page.evaluate("() => { document.activeElement.blur(); window.scrollTo(0, 0); }")
    assert active_id(page) == "BODY"
    for _ in range(3):
        page.keyboard.press("ArrowDown")
    page.wait_for_function("() => window.scrollY > 0")
    page.wait_for_timeout(300)  # a step, had there been one, starts at once
    plot = page.locator("#focus-plot")
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-head")) == ("0", "1")
    # In a text box they move the caret, not the head.
    page.focus("#text")
    page.keyboard.press("ArrowLeft")
    page.wait_for_timeout(200)
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-head")) == ("0", "1")
    # On a modebar button inside the heatmap they are the button's: no head step, no cell cursor.
    for key in ("ArrowRight", "ArrowDown"):
        for shift in (False, True):
            page.evaluate("""([key, shift]) => document.querySelector('#focus-plot .modebar-btn').dispatchEvent(
                new KeyboardEvent('keydown', {key, shiftKey: shift, bubbles: true}))""", [key, shift])
    page.wait_for_timeout(200)
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-head")) == ("0", "1")
    assert not page.locator("#focus-plot .cell-cursor").is_visible()
    # The made-up example is gone, and the plot says so (the theme switch reads it).
    assert plot.get_attribute("data-example") == "false"


def reading(page, query: int, key: int) -> float:
    page.wait_for_selector(f"#tooltip[data-query='{query}'][data-key='{key}']", state="visible")
    spoken = page.locator("#cell-reading").text_content()
    # After a step to another head, the reading says whose it is first ("Layer 0, head 1: ...").
    assert spoken.endswith(page.locator("#tooltip").text_content().split("\n")[0])
    return float(spoken.rsplit(": ", 1)[1])


def test_shift_arrows_read_the_weights_cell_by_cell(server, api, page):
    open_page(page, server)
    run(page, SENTENCE)
    tokens, weights = api_attention(api, SENTENCE, layers=[0], heads=[0, 1])
    T = len(tokens)
    head = weights.reshape(2, T, T)
    assert page.locator("#cell-reading").get_attribute("aria-live") == "polite"
    # The heatmap's name, rewritten for each head, still tells a screen reader how to read cells.
    assert "Shift+arrow keys read the weights" in page.locator("#focus-plot").get_attribute("aria-label")
    # The first press lands on the top-left cell in view, the next ones walk from it.
    page.keyboard.press("Shift+ArrowRight")
    assert abs(reading(page, 0, 0) - head[0, 0, 0]) <= 1.1e-3
    for key in ("Shift+ArrowRight", "Shift+ArrowRight", "Shift+ArrowDown", "Shift+ArrowDown"):
        page.keyboard.press(key)
    assert abs(reading(page, 2, 2) - head[0, 2, 2]) <= 1.1e-3
    assert page.locator("#cell-reading").text_content().startswith(f"{tokens[2]['piece']} → {tokens[2]['piece']}: ")
    # The cell is outlined on screen too, centred on it.
    centre, cell = page.evaluate("""() => {
        const gd = document.getElementById('focus-plot');
        const b = gd.querySelector('.cell-cursor').getBoundingClientRect(), p = gd.getBoundingClientRect();
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        return [[b.left + b.width / 2 - p.left, b.top + b.height / 2 - p.top], [xa._offset + xa.l2p(2), ya._offset + ya.l2p(2)]];
    }""")
    assert page.locator("#focus-plot .cell-cursor").is_visible()
    assert abs(centre[0] - cell[0]) < 1.5 and abs(centre[1] - cell[1]) < 1.5, (centre, cell)
    # A step to the next head reads the same cell of it (one whose weight differs between the heads).
    assert abs(head[0, 2, 2] - head[1, 2, 2]) > 0.005
    spoken = page.locator("#cell-reading").text_content()
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)
    page.wait_for_function("(before) => document.getElementById('cell-reading').textContent.includes(': ')"
                           " && document.getElementById('cell-reading').textContent !== before", arg=spoken)
    assert abs(reading(page, 2, 2) - head[1, 2, 2]) <= 1.1e-3
    assert page.locator("#cell-reading").text_content().startswith("Layer 0, head 1: ")
    # The cursor stays inside the matrix.
    for _ in range(T + 2):
        page.keyboard.press("Shift+ArrowLeft")
    assert abs(reading(page, 2, 0) - head[1, 2, 0]) <= 1.1e-3
    assert not page.locator("#cell-reading").text_content().startswith("Layer"), "the head is said once"
    # Escape puts the reading away (it covered the cells around it until focus left).
    page.keyboard.press("Escape")
    page.locator("#tooltip").wait_for(state="hidden")
    assert page.locator("#focus-plot .cell-cursor").is_hidden() and page.locator("#cell-reading").text_content() == ""
    page.keyboard.press("Shift+ArrowDown")
    assert abs(reading(page, 0, 0) - head[1, 0, 0]) <= 1.1e-3  # and the next Shift+arrow starts again
    # A mouse takes over the tooltip without the live region speaking for it.
    spoken = page.locator("#cell-reading").text_content()
    page.mouse.move(5, 5)
    page.locator("#focus-plot").hover()
    page.wait_for_function("() => !document.getElementById('tooltip').textContent.startsWith('[CLS] → [CLS]')")
    page.locator("#tooltip").wait_for(state="visible")
    assert page.locator("#cell-reading").text_content() == spoken
    assert page.locator("#focus-plot .cell-cursor").is_hidden()
    # A zoom that leaves the cursor's cell out of view brings the cursor into it, and reads there.
    page.focus("#focus-plot")
    page.keyboard.press("Shift+ArrowUp")  # the mouse took over: the cursor starts again at the top-left
    assert abs(reading(page, 0, 0) - head[1, 0, 0]) <= 1.1e-3
    page.evaluate("() => Plotly.relayout('focus-plot', {'xaxis.range': [3.5, 8.5], 'yaxis.range': [8.5, 3.5]})")
    assert abs(reading(page, 4, 4) - head[1, 4, 4]) <= 1.1e-3
    assert page.locator("#focus-plot .cell-cursor").is_visible()
    # A new text: the old text's reading is gone from the screen and from the live region.
    done = page.locator("#run-status").text_content()
    page.fill("#text", "A different sentence entirely.")
    page.focus("#run")
    page.keyboard.press("Enter")
    page.wait_for_function("(before) => { const s = document.getElementById('run-status').textContent;"
                           " return s.startsWith('Done') && s !== before; }", arg=done)
    assert page.locator("#tooltip").is_hidden() and page.locator("#cell-reading").text_content() == ""


def test_a_reading_of_a_word_the_text_holds_twice_says_which(server, page):
    """SENTENCE holds "the" twice: "the → the: 0.008" was any of four cells."""
    open_page(page, server)
    run(page, SENTENCE)
    for key in ["Shift+ArrowRight"] + ["Shift+ArrowRight", "Shift+ArrowDown"] * 4:  # to (4, 4): the second "the"
        page.keyboard.press(key)
    page.wait_for_selector("#tooltip[data-query='4'][data-key='4']", state="visible")
    assert re.match(r"#4 the → #4 the: \d", page.locator("#cell-reading").text_content())
    page.keyboard.press("Shift+ArrowLeft")
    page.wait_for_selector("#tooltip[data-key='3']", state="visible")
    assert re.match(r"#4 the → of: \d", page.locator("#cell-reading").text_content()), "a word once is named alone"


def luminance(rgb) -> float:
    """WCAG 2's relative luminance of an sRGB colour (0-255 channels)."""
    linear = [c / 255 / 12.92 if c / 255 <= 0.04045 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a, b) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def rgb(css: str, under: tuple[int, int, int] = (255, 255, 255)) -> tuple[float, float, float]:
    """A CSS rgb()/rgba() colour as drawn over `under` (Plotly's icons are 30% alpha by default)."""
    if css.startswith("#"):
        css = "rgb({}, {}, {})".format(*(int(css[i:i + 2], 16) for i in (1, 3, 5)))
    values = [float(v) for v in re.findall(r"[\d.]+", css)]
    alpha = values[3] if len(values) > 3 else 1.0
    return tuple(alpha * c + (1 - alpha) * u for c, u in zip(values[:3], under))


def test_the_heatmaps_toolbar_icons_stand_out_in_both_themes(server, page):
    """Plotly's own icon colour, 30% grey, stood at 1.7:1 on the light paper and 2.6:1 on the dark:
    a control needs 3:1 (WCAG 1.4.11)."""
    open_page(page, server)
    run(page, SENTENCE)
    for theme in ("light", "dark"):
        icon, hovered, paper = page.evaluate("""async (name) => {
            (await import('/static/js/theme.js')).setTheme(name);
            const icons = document.querySelectorAll('#focus-plot .modebar-btn path');
            const css = (node) => getComputedStyle(node).fill;
            const button = icons[0].closest('.modebar-btn');
            button.classList.add('active');  // as a pressed button is drawn
            const pressed = css(icons[0]);
            button.classList.remove('active');
            // the heatmap's paper, which the toolbar sits on, once the theme has repainted it
            await new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));
            return [css(icons[1]), pressed, document.getElementById('focus-plot')._fullLayout.paper_bgcolor];
        }""", theme)
        assert (sum(rgb(paper)) < 300) == (theme == "dark"), (theme, paper)  # the theme's own paper
        for colour in (icon, hovered):
            assert contrast(rgb(colour, rgb(paper)), rgb(paper)) >= 3, (theme, colour, paper)


def test_the_cell_cursor_stands_out_on_every_colour_of_both_scales(server, page):
    """WCAG 1.4.11: the cursor's outline must reach 3:1 against the cell it sits on, whatever the
    cell's colour. It is two rings, each at least 2 px; each colour of either theme's scale, and
    the masked colour, must contrast 3:1 with at least one of them."""
    open_page(page, server)
    run(page, SENTENCE)
    page.keyboard.press("Shift+ArrowRight")
    assert page.locator("#focus-plot .cell-cursor").is_visible()
    for theme in ("light", "dark"):
        border, border_width, shadow, table = page.evaluate("""async (name) => {
            // A second instance of the page's theme module: its setTheme sets <html data-theme>,
            // which the CSS follows, and its colour table is then that theme's.
            const theme = await import('/static/js/theme.js');
            theme.setTheme(name);
            const style = getComputedStyle(document.querySelector('#focus-plot .cell-cursor'));
            return [style.borderTopColor, style.borderTopWidth, style.boxShadow,
                    Array.from(theme.colorTable(), (c) => [c & 255, (c >> 8) & 255, (c >> 16) & 255])];
        }""", theme)
        assert len({tuple(c) for c in table}) > 100, theme  # the scale itself, not one colour
        shadow_rgb, shadow_px = re.fullmatch(r"(rgb\([^)]*\)) (.*)", shadow).groups()
        assert float(border_width.removesuffix("px")) >= 2 and float(shadow_px.split()[-1].removesuffix("px")) >= 2
        rings = [[int(v) for v in re.findall(r"\d+", colour)[:3]] for colour in (border, shadow_rgb)]
        worst = min(max(contrast(cell, ring) for ring in rings) for cell in table)
        assert worst >= 3, (theme, rings, worst)


def test_the_run_button_leaves_focus_on_the_heatmap_and_says_done(server, page):
    open_page(page, server)
    page.fill("#text", SENTENCE)
    page.focus("#run")
    page.keyboard.press("Space")
    wait_focus(page)
    page.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done')")
    assert re.fullmatch(r"Done: \d+ tokens, 6 layers × 12 heads\.", page.locator("#run-status").text_content())
    # The Run button was disabled while it worked, which drops focus to the page: it is back on the heatmap.
    assert active_id(page) == "focus-plot"
    page.keyboard.press("ArrowDown")
    wait_focus(page, layer=1, head=0)



def test_the_head_view_isolates_a_token_from_the_keyboard(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    page.wait_for_function("() => document.querySelectorAll('.hv-left li').length > 0")
    assert page.locator(".hv-left li[tabindex='0']").count() == 1 == page.locator(".hv-right li[tabindex='0']").count()
    page.focus(".hv-left li[tabindex='0']")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    focused = page.evaluate("() => document.activeElement.dataset.index")
    assert focused == "2" and page.locator(".hv-left li.active").get_attribute("data-index") == "2"
    assert page.locator(".hv-left li[tabindex='0']").get_attribute("data-index") == "2"  # Tab comes back here
    plot = page.locator("#focus-plot")
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-head")) == ("0", "0")
    # Leaving the list lets every token's lines back.
    page.focus("#text")
    page.wait_for_function("() => document.querySelectorAll('.hv-tokens li.active').length === 0")


def test_alt_enter_on_a_thumbnail_ablates_it_as_alt_click_does(server, page):
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    page.focus("#grid .thumb[tabindex='0']")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("Alt+Enter")
    page.wait_for_selector("#ablate-plot[data-depth='1'][data-state='ablated']", timeout=30_000)
    assert page.inner_text("#ablate-list") == "L0 H1 · zero"
    # A ranked head's button shows it in the ablation heatmap, and keeps keyboard focus on it.
    button = page.locator("#ablate-ranking tbody tr:nth-child(2) button")
    layer, head = (button.locator("xpath=ancestor::tr").get_attribute(f"data-{a}") for a in ("layer", "head"))
    assert button.get_attribute("aria-label") == f"Show layer {layer} head {head} in the ablation heatmap"
    button.focus()
    page.keyboard.press("Enter")
    page.wait_for_selector(f"#ablate-plot[data-layer='{layer}'][data-head='{head}']")
    assert page.evaluate("() => { const tr = document.activeElement.closest('tr'); return [tr.dataset.layer, tr.dataset.head]; }") == [layer, head]


def test_a_restored_link_leaves_keyboard_focus_where_it_was(server, make_page):
    first = make_page()
    open_page(first, server)
    run(first, SENTENCE)
    wait_saved(first)
    other = make_page()
    other.goto(first.url)
    wait_focus(other)
    other.wait_for_function("() => document.getElementById('run-status').textContent.startsWith('Done')")
    # Not on the heatmap: the first Tab still reaches the skip link, not Plotly's modebar.
    assert active_id(other) == "BODY"
    other.keyboard.press("Tab")
    assert other.evaluate("() => document.activeElement.className") == "skip-link"


def test_the_head_view_keeps_keyboard_focus_while_it_scrolls(server, page):
    open_page(page, server)
    run(page, " ".join([SENTENCE] * 12))
    page.wait_for_function("() => document.querySelectorAll('.hv-left li').length > 0")
    page.focus(".hv-left li[tabindex='0']")
    for _ in range(45):  # past the first rebuild of the token window (30 rows of margin)
        page.keyboard.press("ArrowDown")
    assert page.evaluate("() => document.activeElement.dataset.index") == "45"
    assert page.locator(".hv-left li.active").get_attribute("data-index") == "45"


def test_small_weights_read_with_an_exponent_not_a_row_of_zeros(server, page):
    """toPrecision(2) wrote weights from 1e-6 to 1e-4 with their zeros (0.0000048, a review by use)
    and smaller ones with an exponent (4.8e-7): one form now from 1e-4 down."""
    open_page(page, server)
    values = [0, 0.25, 0.0004812, 9.96e-5, 4.8e-5, 4.8e-6, 4.8e-7, 3e-12]
    shown = page.evaluate("""async (values) => {
        const { weightText } = await import('/static/js/focus.js');
        return values.map((v) => weightText(v));
    }""", values)
    assert shown == ["0.000", "0.250", "0.00048", "1.0e-4", "4.8e-5", "4.8e-6", "4.8e-7", "3.0e-12"]
    assert shown == [weight_text(v, digits=3) for v in values]
    bounds = page.evaluate("""async (values) => {
        const { boundText } = await import('/static/js/long_focus.js');
        return values.map((v) => boundText(v));
    }""", [4.47e-5, 0, 0.25])
    assert bounds == ["≤ 4.5e-5", "≤ 3.0e-8", "≤ 0.250"]  # a pooled bin's bound: it read "≤ 0.000" for 4.5e-5


def test_readings_are_the_float32_weights_not_the_float16_cells_drawn(server, api, page):
    """Cells are drawn from float16, and readings said so: 1.2e-7 for a weight of 9.2e-8 (float16
    holds no two digits there) and 0.150 for 0.1495, in 3-5% of a run's cells (a review by use)."""
    open_page(page, server)
    run(page, SENTENCE)
    tokens, weights = api_attention(api, SENTENCE, layers=[0], heads=[2])
    T = len(tokens)
    head = weights.reshape(T, T)
    assert head.min() < 6e-5  # float16 subnormals: where its digits were made up
    for _ in range(2):
        page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=2)
    page.keyboard.press("Shift+ArrowRight")
    reading(page, 0, 0)
    # The float32 head, asked for by the first reading, is read once it is here (networkidle, reached
    # once already, did not wait for it: CI's reading of (0, 1) was still float16's).
    page.wait_for_selector("#tooltip[data-query='0'][data-key='0'][data-reads='float32']", state="visible")
    readings = []
    for row in range(T):  # every cell, walked as a snake: right along even rows, left along odd ones
        for step in range(T):
            if step:
                page.keyboard.press("Shift+ArrowRight" if row % 2 == 0 else "Shift+ArrowLeft")
            elif row:
                page.keyboard.press("Shift+ArrowDown")
            col = step if row % 2 == 0 else T - 1 - step
            page.wait_for_selector(f"#tooltip[data-query='{row}'][data-key='{col}']", state="visible")
            readings.append((row, col, page.locator("#cell-reading").text_content().rsplit(": ", 1)[1]))
    wrong = [(r, c, got, weight_text(float(head[r, c]), digits=3)) for r, c, got in readings
             if float(got) != float(weight_text(float(head[r, c]), digits=3))]
    assert len(readings) == T * T and wrong == []
    # Under a threshold a cut weight reads as its cell is drawn, not as its float32 value.
    page.locator("#threshold").fill("0.2")
    page.wait_for_function("() => document.getElementById('threshold-value').textContent === '0.20'")
    page.wait_for_timeout(300)
    row = T - 1
    cut, kept = int(np.argmin(head[row])), int(np.argmax(head[row]))
    assert head[row, cut] < 0.2 <= head[row, kept]
    assert hover_cell(page, row, cut).endswith(": < 0.20")
    assert hover_cell(page, row, kept).endswith(f": {weight_text(float(head[row, kept]), digits=3)}")


def test_a_click_on_the_heatmap_gives_it_the_arrows(server, page):
    """Plotly's drag layer cancels a press's default, so a clicked heatmap stayed unfocused and
    its arrows did nothing: a page opened from a link had no way in but Tab (a review by use)."""
    open_page(page, server)
    run(page, SENTENCE)
    wait_focus(page, layer=0, head=0)
    page.evaluate("() => document.activeElement.blur()")
    box = page.locator("#focus-plot").bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    assert active_id(page) == "focus-plot"
    page.keyboard.press("ArrowRight")
    wait_focus(page, layer=0, head=1)


def test_each_modebar_is_one_tab_stop_and_the_arrows_move_along_it(server, page):
    """Plotly put all seven buttons of each plot's modebar in the Tab order: 35 of 109 stops."""
    open_page(page, server)
    run(page, SENTENCE)
    wait_grid(page)
    page.wait_for_selector("#measure-plot .modebar-btn", state="attached", timeout=30_000)
    stops = page.evaluate("""() => [...document.querySelectorAll('.modebar')].map((bar) =>
        [...bar.querySelectorAll('.modebar-btn')].map((b) => b.tabIndex))""")
    assert len(stops) >= 2 and all(tabs.count(0) == 1 and len(tabs) > 2 for tabs in stops), stops
    # Tab from the heatmap lands on its modebar's one stop; → walks it, End and Home jump; the next
    # Tab leaves the modebar.
    page.focus("#focus-plot")
    page.keyboard.press("Tab")
    titles = page.evaluate("() => [...document.querySelectorAll('#focus-plot .modebar-btn')].map((b) => b.dataset.title)")
    title = lambda: page.evaluate("() => document.activeElement.dataset.title")  # noqa: E731
    assert title() == titles[0]
    page.keyboard.press("ArrowRight")
    assert title() == titles[1]
    page.keyboard.press("End")
    assert title() == titles[-1]
    page.keyboard.press("ArrowRight")
    assert title() == titles[0]
    page.keyboard.press("ArrowLeft")
    assert title() == titles[-1]  # and it is the modebar's stop now
    page.keyboard.press("Tab")
    assert not page.evaluate("() => document.activeElement.closest('#focus-plot .modebar') !== null")
    page.keyboard.press("Shift+Tab")
    assert title() == titles[-1]
