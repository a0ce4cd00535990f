"""The one-file HTML export, opened from file:// in headless chromium with every network request refused."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from manyeyes.app.cli import main as cli

pytestmark = pytest.mark.browser
TEXT = "In the beginning was the Word, and the Word was with God."
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def open_offline(browser, path: Path, precision: str = "f16", downloads: bool = False):
    """The file in a fresh context that refuses any request that is not the file itself."""
    context = browser.new_context(accept_downloads=downloads)
    seen, refused, problems = [], [], []
    context.route(lambda url: urlsplit(url).scheme not in ("file", "data"), lambda route: (refused.append(route.request.url), route.abort()))
    page = context.new_page()
    page.on("request", lambda r: seen.append(r.url))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: m.type == "error" and problems.append(m.text))
    page.on("dialog", lambda d: (problems.append(f"dialog {d.message}"), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector("#grid canvas", timeout=20_000)
    page.wait_for_function("(p) => document.querySelector('#focus-plot').dataset.precision === p", arg=precision,
                           timeout=20_000)
    page.wait_for_selector("#headview canvas", timeout=20_000)
    return context, page, seen, refused, problems


def focus_z(page) -> np.ndarray:
    # The page paints the cells itself; plotted() gives them as Plotly's z did (README, Browser).
    z = page.evaluate("document.getElementById('focus-plot').plotted().z")
    return np.array([[np.nan if v is None else v for v in row] for row in z], dtype=np.float64)


def check_view(page, tiny_gpt, text: str, layer: int, head: int) -> None:
    plot = page.locator("#focus-plot")
    assert (plot.get_attribute("data-layer"), plot.get_attribute("data-head")) == (str(layer), str(head))
    expected = tiny_gpt.attend(text).attention[layer, head].numpy()
    shown = focus_z(page)
    assert shown.shape == expected.shape
    known = ~np.isnan(shown)  # the causal upper triangle is drawn masked (null), not as zeros
    assert known.sum() >= expected.shape[0] * (expected.shape[0] + 1) // 2
    np.testing.assert_allclose(shown[known], expected[known], atol=1e-3)


def test_cli_export_opens_from_disk_with_grid_focus_and_head_view(browser, tiny_gpt, tmp_path, capsys):
    out = tmp_path / "view.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--layer", "1", "--head", "0", "--device", "cpu"]) == 0
    size = out.stat().st_size
    print(f"export size: {size:,} bytes")  # README records it
    assert "MiB" in capsys.readouterr().err and size < 8 * 2**20
    context, page, seen, refused, problems = open_offline(browser, out)
    try:
        assert not refused and all(urlsplit(u).scheme in ("file", "data") for u in seen), seen
        assert page.locator("#grid canvas").count() == 2 * 8
        check_view(page, tiny_gpt, TEXT, 1, 0)
        page.locator("#grid canvas").nth(3).click()  # layer 0, head 3: the previous-token head
        page.wait_for_function("() => document.querySelector('#focus-plot').dataset.head === '3'")
        page.wait_for_function("() => document.querySelector('#focus-plot').dataset.precision === 'f16'")
        check_view(page, tiny_gpt, TEXT, 0, 3)
        page.locator("#focus-plot").focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('#focus-plot').dataset.head === '4'")
        # A reading is the file's float16 value: a live page asks its server for float32, which
        # the file does not hold (that had put "not in this file" up at the first reading).
        page.keyboard.press("Shift+ArrowDown")
        page.wait_for_selector("#tooltip[data-query='0'][data-key='0']", state="visible")
        page.wait_for_timeout(300)
        assert page.locator("#error").is_hidden()
        assert page.locator("#headview .hv-left li").count() == len(tiny_gpt.attend(TEXT).tokens)
        assert page.locator("#export-page").is_hidden() and page.locator("#copy-link").is_hidden()
        assert page.locator("#docs-link").is_hidden()
        # The mean of all heads comes from the server's /mean on a live page: here from the file.
        page.select_option("#aggregate", "all")
        page.wait_for_selector("#focus-plot[data-aggregate=all]", timeout=10_000)
        page.wait_for_function("() => document.querySelector('#focus-plot').dataset.precision === 'f16'")
        expected = tiny_gpt.attend(TEXT).attention.mean(dim=(0, 1)).numpy()
        shown = focus_z(page)
        known = ~np.isnan(shown)
        np.testing.assert_allclose(shown[known], expected[known], atol=1e-3)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "export-offline.png"), full_page=True)
        assert not problems, problems
    finally:
        context.close()


def test_export_html_refuses_a_layer_or_head_the_model_lacks(tiny_gpt):
    # The CLI checked them; the Python function wrote a file that opened on some other head.
    from manyeyes.export import export_html

    for layer, head in ((2, 0), (0, 8), (-1, 0)):
        with pytest.raises(ValueError, match=r"model tiny-gpt has layers 0\.\.1 and heads 0\.\.7"):
            export_html(tiny_gpt, "The bank.", layer=layer, head=head)
    assert "<html" in export_html(tiny_gpt, "The bank.", layer=1, head=7).lower()


def test_the_runs_json_goes_into_the_file_as_one_piece_made_once():
    """The server's /export sends build_pieces' pieces: the run's JSON (tens of MB of weights) made
    once, not spliced and substituted through the whole file's text (256 MB above rest for a 30 MB
    file at T=512). Its `<` are escaped there, as in the rest of the file."""
    import orjson

    from manyeyes.export import build_pieces, render_page

    embedded = {"text": "a </script><b>", "run": {"attention": {"data": "QUJD" * 1000}}}
    before, run, after = build_pieces(render_page(), embedded)
    assert run == orjson.dumps(embedded).replace(b"<", b"\\u003c") and b"<" not in run
    assert before.endswith(b'<script type="application/json" id="manyeyes-export">') and after.startswith(b"</script>")
    assert orjson.loads(run) == embedded  # the escapes read back as the text they stand for


def test_hostile_text_stays_text_in_the_file(browser, tiny_gpt, tmp_path):
    text = "</script><script>alert(1)</script><!-- <img src=x onerror=alert(2)>"
    out = tmp_path / "hostile.html"
    assert cli(["export", text, "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 0
    context, page, seen, refused, problems = open_offline(browser, out)
    try:
        assert page.locator("#text").input_value() == text
        check_view(page, tiny_gpt, text, 0, 0)
        assert not problems and not refused, (problems, refused)
        # New text needs a server, and the page says which, in words (it showed `manyeyes serve`
        # with its Markdown backticks).
        page.fill("#text", "And God said")
        page.press("#text", "Enter")
        page.wait_for_selector("#error:visible", timeout=10_000)
        assert "“manyeyes serve” analyses new text" in page.text_content("#error")
        assert "`" not in page.text_content("#error")
    finally:
        context.close()


def test_a_script_that_got_into_the_file_anyway_does_not_run(browser, tiny_gpt, tmp_path):
    """Opened from disk, a file has no server to send it a CSP: the escaping alone kept a text from
    running (review h51k). Its own policy lets only its own scripts run, so markup that got past the
    escaping (simulated here) stays inert, and the viewer still works."""
    from manyeyes.export import export_html

    html = export_html(tiny_gpt, TEXT)
    injected = '<script>window.__pwned = 1</script><img src="x" onerror="window.__pwned = 2">'
    out = tmp_path / "injected.html"
    out.write_text(html.replace("<body", injected + "<body", 1) if "<body" in html else injected + html, encoding="utf-8")
    context, page, seen, refused, problems = open_offline(browser, out)
    try:
        check_view(page, tiny_gpt, TEXT, 0, 0)
        assert page.evaluate("window.__pwned") is None, "the injected script ran"
        assert problems and all("Content Security Policy" in p for p in problems), problems
    finally:
        context.close()


def test_export_button_downloads_the_same_viewer(browser, server, tiny_gpt, tmp_path):
    context = browser.new_context(accept_downloads=True)
    try:
        page = context.new_page()
        page.goto(f"{server}/?text=And+God+said&model=tiny-gpt&layer=1&head=2")
        page.wait_for_selector("#grid canvas", timeout=20_000)
        page.wait_for_function("() => document.body.dataset.view && !document.body.dataset.viewPending")
        # Options the file must keep (it kept only the focus), and a new focus exported at once:
        # the address bar is saved a quarter second after a change, and the file once got the old one.
        page.select_option("#scale", "fixed")
        page.select_option("#head", "5")
        with page.expect_download() as download:
            page.locator("#export-page").click()
        path = tmp_path / download.value.suggested_filename
        download.value.save_as(path)
        assert path.name == "manyeyes-tiny-gpt.html"
    finally:
        context.close()
    context, page, seen, refused, problems = open_offline(browser, path)
    try:
        check_view(page, tiny_gpt, "And God said", 1, 5)
        assert page.locator("#scale").input_value() == "fixed"
        # The panels that need a model give way to one note, not a row of "no server" errors.
        assert page.locator("#export-note").is_visible()
        assert page.locator("#measures").is_hidden() and page.locator("#experiments").is_hidden()
        assert not refused and not problems, (refused, problems)
    finally:
        context.close()


def test_export_route_errors_are_json(server):
    r = httpx.get(f"{server}/export", params={"text": "hi", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model"
    # Each names the query field and says what is wrong (the message was pydantic's URL line).
    for params, field in (({"text": "   "}, "query.text"), ({"text": "hi", "pair": " "}, "query.pair")):
        r = httpx.get(f"{server}/export", params=params)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field}: ") and "whitespace" in message and "pydantic.dev" not in message, message
    # A view names its whole run: a text or head beside it was dropped without a word, and the
    # file held the view's run, not the one asked for.
    r = httpx.get(f"{server}/export", params={"view": "0" * 18, "text": "another text", "head": 3})
    assert r.status_code == 422 and "leave out text, head" in r.json()["error"]["message"], r.text
    # The API's name for the second text, or a parameter of no route, was dropped without a word:
    # the file held the text alone (review h55d). A field given twice, the last one only.
    for params in ({"text": "Where is it", "text_pair": "On the bank"}, {"text": "hi", "layers": "1"}, {"text": "hi", "foo": "1"}):
        r = httpx.get(f"{server}/export", params=params)
        message = r.json()["error"]["message"]
        assert r.status_code == 422 and "unknown query parameter" in message and "it takes: head, layer, model, pair, text" in message, r.text
    r = httpx.get(f"{server}/export?text=hi&layer=0&layer=1")
    assert r.status_code == 422 and "'layer' given more than once" in r.json()["error"]["message"], r.text


def test_cli_export_refuses_a_text_over_the_dense_bound_as_the_server_does(tiny_gpt, tmp_path, capsys, monkeypatch):
    # The file holds every weight (L x H x T x T) and the offline page has no long-run mode: a 6 x 12
    # llama at 2,000 tokens wrote 371 MiB whose tab crashed. /export answers 413 needs_tiles there.
    monkeypatch.setenv("MANYEYES_DENSE_MAX_TOKENS", "40")
    out = tmp_path / "view.html"
    long = "In the beginning God created the heaven and the earth."  # 54 tokens: tiny-gpt reads bytes
    assert cli(["export", long, "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: this text is 54 tokens") and err.count("\n") == 1, err
    for says in ("up to 40 tokens", "MANYEYES_DENSE_MAX_TOKENS", "manyeyes serve", "MiB"):
        assert says in err, err
    assert cli(["export", long[:39], "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 0 and out.exists()


def test_u8_export_shows_the_file_weights(browser, tiny_gpt, tmp_path):
    # A u8 file is answered from its bytes as stored (no float32 copy of every head): the focus,
    # the next head and the mean of all heads still read the run's weights, within u8's 1/510.
    out = tmp_path / "u8.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--format", "u8", "--layer", "1", "--head", "6",
                "--device", "cpu"]) == 0
    context, page, seen, refused, problems = open_offline(browser, out, "u8")
    try:
        attention = tiny_gpt.attend(TEXT).attention.numpy()
        for expected, step in ((attention[1, 6], None), (attention[1, 7], "ArrowRight"), (attention.mean(axis=(0, 1)), "all")):
            if step == "ArrowRight":
                page.locator("#focus-plot").focus()
                page.keyboard.press(step)
                page.wait_for_function("() => document.querySelector('#focus-plot').dataset.head === '7'")
            elif step == "all":
                page.select_option("#aggregate", "all")
                page.wait_for_selector("#focus-plot[data-aggregate=all]", timeout=10_000)
            # 8-bit, as the file holds them: "f16" had been claimed for the bytes widened to floats.
            page.wait_for_function("() => document.querySelector('#focus-plot').dataset.precision === 'u8'")
            shown = focus_z(page)
            known = ~np.isnan(shown)
            np.testing.assert_allclose(shown[known], expected[known], atol=1 / 510 + 1e-3)
        assert not refused and not problems, (refused, problems)
    finally:
        context.close()


def test_hiding_tokens_in_an_export_renormalises_the_file_weights_and_a_click_gives_the_arrows(browser, tiny_gpt, tmp_path):
    """Hidden tokens renormalise rows from float32 on a live page, which the file does not hold:
    ticking "Hide first token" put an error up, faded the heatmap and silenced the downloads. And
    a click on the heatmap did not focus it, so its arrows did nothing (reviews by use)."""
    out = tmp_path / "hide.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--layer", "1", "--head", "2", "--device", "cpu"]) == 0
    context, page, seen, refused, problems = open_offline(browser, out)
    try:
        page.check("#hide-first")
        page.wait_for_selector("#focus-plot[data-precision=f16]:not([data-stale])", timeout=10_000)
        page.wait_for_timeout(300)
        assert page.locator("#error").is_hidden()
        head = tiny_gpt.attend(TEXT).attention[1, 2].numpy()[1:, 1:]
        expected = head / head.sum(-1, keepdims=True)
        shown = focus_z(page)
        assert shown.shape == expected.shape
        known = ~np.isnan(shown)
        np.testing.assert_allclose(shown[known], expected[known], atol=2e-3)
        page.evaluate("() => document.activeElement.blur()")
        box = page.locator("#focus-plot").bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        assert page.evaluate("() => document.activeElement.id") == "focus-plot"
        page.keyboard.press("ArrowRight")
        page.wait_for_function("() => document.querySelector('#focus-plot').dataset.head === '3'")
        assert not refused and not problems, (refused, problems)
    finally:
        context.close()


def test_export_html_takes_its_bound_as_an_argument_and_never_reads_the_environment(tiny_gpt, monkeypatch):
    """export_html read the bound through Settings(), which parses every MANYEYES_* variable: an
    unrelated malformed one (MANYEYES_MAX_QUEUE=lots) failed a notebook's export with pydantic's
    ValidationError, and MANYEYES_DENSE_MAX_TOKENS changed a library call behind its back."""
    from manyeyes.export import DENSE_MAX_TOKENS, TooLongToExport, export_html

    from manyeyes.app.config import Settings

    assert DENSE_MAX_TOKENS == Settings.model_fields["dense_max_tokens"].default == 1024
    monkeypatch.setenv("MANYEYES_MAX_QUEUE", "lots")
    monkeypatch.setenv("MANYEYES_DENSE_MAX_TOKENS", "3")
    text = "In the beginning"  # 16 tokens: tiny-gpt reads bytes
    html = export_html(tiny_gpt, text)  # the default bound, 1024, whatever the environment says
    embedded = json.loads(re.search(r'<script type="application/json" id="manyeyes-export">(.*?)</script>', html, re.S)[1])
    assert "".join(t["text"] for t in embedded["run"]["tokens"]) == text and len(embedded["run"]["tokens"]) == 16
    with pytest.raises(TooLongToExport, match=r"this text is 16 tokens.*up to 15 tokens \(dense_max_tokens"):
        export_html(tiny_gpt, text, dense_max_tokens=15)
    assert "<html" in export_html(tiny_gpt, text, dense_max_tokens=16).lower()
    # A numpy integer is a count too (README), as layer and head are; it was refused as no whole number.
    assert "<html" in export_html(tiny_gpt, text, dense_max_tokens=np.int64(16)).lower()
    with pytest.raises(TooLongToExport, match=r"up to 15 tokens \(dense_max_tokens"):
        export_html(tiny_gpt, text, dense_max_tokens=np.int32(15))
    for bad in (0, -1, 2.5, True, np.int64(0), np.float64(16.0)):
        says = f"dense_max_tokens must be a whole number of tokens, at least 1; got {bad!r}"
        with pytest.raises(ValueError, match=re.escape(says)):
            export_html(tiny_gpt, text, dense_max_tokens=bad)
    for bad in ("bogus", "json", "F16"):  # "bogus" was a bare KeyError: 'bogus'
        with pytest.raises(ValueError, match=f"format must be 'f16', 'u8' or None .*got {bad!r}"):
            export_html(tiny_gpt, text, format=bad)
    assert '"format":"u8"' in export_html(tiny_gpt, text, format="u8").replace(" ", "")


def test_cli_export_says_in_one_line_which_setting_is_malformed(tmp_path, capsys, monkeypatch):
    """With the bound read inside the library, a malformed MANYEYES_* variable ended `manyeyes
    export` (and `manyeyes serve`) in pydantic's multi-line ValidationError traceback."""
    monkeypatch.setenv("MANYEYES_MAX_QUEUE", "lots")
    out = tmp_path / "view.html"
    assert cli(["export", "In the beginning", "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: a MANYEYES_* setting in the environment is malformed: MANYEYES_MAX_QUEUE='lots': "
                   "Input should be a valid integer, unable to parse string as an integer\n"), err
    assert not out.exists()
    assert cli(["serve", "--port", "1"]) == 2  # before it binds or loads anything
    assert capsys.readouterr().err.startswith("error: a MANYEYES_* setting in the environment is malformed: MANYEYES_MAX_QUEUE=")


def test_a_text_with_crlf_or_a_lone_cr_opens_on_its_run(browser, server, tiny_gpt, tmp_path):
    """The page's text box gives "\\r\\n" and "\\r" back as "\\n", so the file's own text was refused
    as another: it opened on "Only the exported text can be shown" with no heatmap, whether
    written by `manyeyes export` or by the server's /export."""
    crlf, cr = "first line\r\nsecond line", "first line\rsecond line"
    out = tmp_path / "crlf.html"
    assert cli(["export", crlf, "--model", "tiny-gpt", "-o", str(out), "--layer", "1", "--head", "2", "--device", "cpu"]) == 0
    served = tmp_path / "cr.html"
    answer = httpx.get(f"{server}/export", params={"text": cr, "model": "tiny-gpt", "layer": 0, "head": 3}, timeout=60)
    assert answer.status_code == 200, answer.text
    served.write_bytes(answer.content)
    for path, text, (layer, head) in ((out, crlf, (1, 2)), (served, cr, (0, 3))):
        context, page, seen, refused, problems = open_offline(browser, path)
        try:
            assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
            check_view(page, tiny_gpt, text, layer, head)  # the run of the text as written, "\r" and all
            assert page.locator("#grid canvas").count() == 2 * 8
            assert page.locator("#headview .hv-left li").count() == len(tiny_gpt.attend(text).tokens)
            assert not refused and not problems, (refused, problems)
        finally:
            context.close()


def downloaded_json(page) -> dict:
    with page.expect_download() as download:
        page.click("#download-json")
    return json.loads(Path(download.value.path()).read_text(encoding="utf-8"))


@pytest.mark.parametrize("fmt, marked, precision", [("f16", "f16", "float16"), ("u8", "u8", "uint8")])
def test_a_download_from_an_export_states_the_precision_the_file_holds(browser, tiny_gpt, tmp_path, fmt, marked, precision):
    """The JSON download said "precision": "float32" of the file's float16 or 8-bit weights, and a
    u8 file's heatmap was marked data-precision="f16"."""
    out = tmp_path / f"{fmt}.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--format", fmt, "--layer", "1", "--head", "6",
                "--device", "cpu"]) == 0
    context, page, seen, refused, problems = open_offline(browser, out, marked, downloads=True)
    try:
        body = downloaded_json(page)
        assert (body["precision"], body["layer"], body["head"]) == (precision, 1, 6)
        expected = tiny_gpt.attend(TEXT).attention[1, 6].numpy()
        shown = np.array([[np.nan if v is None else v for v in row] for row in body["attention"]])
        known = ~np.isnan(shown)
        np.testing.assert_allclose(shown[known], expected[known], atol=1 / 510 if fmt == "u8" else 1e-3)
        # A mean, too, is of the file's weights and says so.
        page.select_option("#aggregate", "layer")
        page.wait_for_selector(f"#focus-plot[data-aggregate=layer][data-precision={marked}]:not([data-stale])", timeout=10_000)
        body = downloaded_json(page)
        assert (body["precision"], body["aggregate"]) == (precision, "layer")
        # Renormalised, it is the file's weights again (a live page's are float32).
        page.check("#hide-first")
        n = len(expected) - 1
        page.wait_for_function("(n) => document.getElementById('focus-plot').plotted().z.length === n", arg=n, timeout=10_000)
        page.wait_for_selector(f"#focus-plot[data-precision={marked}]:not([data-stale])", timeout=10_000)
        body = downloaded_json(page)
        assert (body["precision"], body["hide_first"], len(body["queries"])) == (precision, True, n)
        assert not refused and not problems, (refused, problems)
    finally:
        context.close()


def test_export_html_refuses_blank_text_and_layers_that_are_no_whole_number(tiny_gpt):
    """"" was a TypeError from deep inside (a causal model runs no token), "   " a file that opened
    on "Type a sentence first."; np.int64(0) (np.argmax's) failed in orjson, and layer=0.5,
    head=2.7 wrote a file that never drew."""
    from manyeyes.export import export_html

    for text, pair, name in (("", None, "text"), ("   ", None, "text"), ("\r\n", None, "text"), ("a", " ", "text_pair"),
                             (None, None, "text")):
        with pytest.raises(ValueError, match=f"^{name} must contain something other than whitespace; got "):
            export_html(tiny_gpt, text, pair)
    for layer, head, says in ((0.5, 2, "layer must be a whole number (an int), got 0.5"),
                              (0, 2.7, "head must be a whole number (an int), got 2.7"),
                              ("1", 0, "layer must be a whole number (an int), got '1'"),
                              (np.float64(1.0), 0, "layer must be a whole number (an int), got")):
        with pytest.raises(ValueError, match=re.escape(says)):
            export_html(tiny_gpt, "The bank.", layer=layer, head=head)
    html = export_html(tiny_gpt, "The bank.", layer=np.int64(1), head=np.intp(7))
    embedded = json.loads(re.search(r'<script type="application/json" id="manyeyes-export">(.*?)</script>', html, re.S)[1])
    assert (embedded["view"]["layer"], embedded["view"]["head"]) == (1, 7)


def test_an_export_that_cannot_be_written_whole_leaves_the_file_that_was_there(tiny_gpt, tmp_path, capsys):
    """Written in place, `manyeyes export -o view.html` on a full disk (here `ulimit -f`) left 1 MiB
    of a 5 MiB page where the good view had been."""
    from tests.eco.test_figures import file_size_limit

    out = tmp_path / "view.html"
    assert cli(["export", TEXT, "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 0
    good = out.read_bytes()
    capsys.readouterr()
    with file_size_limit():
        assert cli(["export", "And God said", "--model", "tiny-gpt", "-o", str(out), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"error: cannot write {out}: File too large\n"
    assert out.read_bytes() == good and list(tmp_path.iterdir()) == [out]  # and no temporary file beside it


def test_cli_export_to_standard_output_and_over_a_file_keeps_its_mode(tiny_gpt, tmp_path, capsys, monkeypatch):
    """-o - wrote a file named "-", -o "" said "cannot write : Is a directory", and a file written
    over took the umask's mode: a 600 page of the user's text became world-readable (h56g)."""
    import os
    import stat

    monkeypatch.chdir(tmp_path)
    assert cli(["export", "The cat sat.", "--model", "tiny-gpt", "-o", "-", "--device", "cpu"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!doctype html>") and "The cat sat." in page and not (tmp_path / "-").exists()
    assert cli(["export", "The cat sat.", "--model", "tiny-gpt", "-o", "", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "error: -o names no file: give the file to write, or - for standard output\n"
    private = tmp_path / "private.html"
    private.write_text("old")
    private.chmod(0o600)
    assert cli(["export", "The cat sat.", "--model", "tiny-gpt", "-o", str(private), "--device", "cpu"]) == 0
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600 and private.read_text().startswith("<!doctype html>")
