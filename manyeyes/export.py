"""One self-contained HTML file: the page's viewer with one run's attention inside it.

The file opens from disk with no server and no network. It is assembled at export time from the
page as it is now (templates/index.html, static/css, static/js), so it follows the page's changes:

- the stylesheet and plotly.js (from the installed plotly package) are inlined;
- ES modules cannot load from file://, so each module's relative imports ("./grid.js") become
  bare specifiers ("manyeyes/grid.js") that an import map resolves to data: URLs;
- api.js is mapped to offline_api.js, which exports the same functions answered from the run
  embedded as JSON; the original api.js still loads behind it for everything it does not redefine;
- a small classic script puts `?view=<EXPORT_VIEW_ID>` in the address bar before the modules run,
  and offline_api.js answers that view (text, model, focus and every view option) from the file,
  so the page's own permalink code restores and draws the view as it was exported;
- the measures and experiments panels, which need a model, give way to a note.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from pathlib import Path

import orjson
import plotly

from manyeyes.app.routes.page import TEMPLATES_DIR
from manyeyes.app.services.payload import View, render_result
from manyeyes.indices import count_at_least, whole_number

PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = TEMPLATES_DIR.parent / "static"
PLOTLY_JS = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
OFFLINE_API = PACKAGE_DIR / "offline_api.js"
F16_BUDGET_BYTES = 16 * 2**20  # above this, u8: half the size, values within 1/510
EXPORT_VIEW_ID = "0" * 18  # the one saved view a file holds (the page's view ids are 18 hex digits)
SERVER_PANELS = re.compile(r"""<section id="measures"[^>]*>""")
OFFLINE_NOTE = (
    "<style>#measures, #experiments { display: none !important; }</style>\n"
    '<p class="hint export-note" id="export-note">This file holds one run. The measures and experiments '
    "need a model: open the text in <code>manyeyes serve</code> for them.</p>\n"
)
RELATIVE_IMPORT = re.compile(r"""(\bfrom\s*|\bimport\s*\(?\s*)(["'])\./([\w./-]+\.js)\2""")
STYLESHEET = re.compile(r"""<link\b[^>]*\brel="stylesheet"[^>]*\bhref="static/([^"?]+)"[^>]*>""")
PLOTLY_TAG = re.compile(r"""<script\b[^>]*\bsrc="vendor/plotly\.min\.js[^"]*"[^>]*>\s*</script>""")
MAIN_MODULE = re.compile(r"""<script\b[^>]*\btype="module"[^>]*\bsrc="static/js/([\w.-]+\.js)"[^>]*>\s*</script>""")


# The server's dense bound as shipped (app/config.py, MANYEYES_DENSE_MAX_TOKENS unset; a test keeps
# the two equal). The library never parses the environment, so an unrelated malformed MANYEYES_*
# variable cannot fail an export; `manyeyes export` passes the configured bound.
DENSE_MAX_TOKENS = 1024


class TooLongToExport(ValueError):
    """A text over the dense bound (export_html's dense_max_tokens; the CLI and the server's /export
    use MANYEYES_DENSE_MAX_TOKENS): the file would hold every weight of a run the live page reads
    in tiles, and the file has no server to ask for tiles."""


def pick_format(n_layers: int, n_heads: int, n_tokens: int) -> str:
    return "f16" if n_layers * n_heads * n_tokens * n_tokens * 2 <= F16_BUDGET_BYTES else "u8"


def inline_script(source: str) -> str:
    """Script text that cannot end its <script> element early (`<\\/` reads as `</` in JS)."""
    return source.replace("</", "<\\/").replace("<!--", "<\\!--")


def json_script(value) -> str:
    """JSON to place inside <script>: every `<` escaped, so no text in it can close the element."""
    return orjson.dumps(value).decode().replace("<", "\\u003c")


def json_script_bytes(value) -> bytes:
    """json_script's text as UTF-8, made without a str of it (bytes.replace copies only where a `<` is)."""
    return orjson.dumps(value).replace(b"<", b"\\u003c")


def data_url(source: str) -> str:
    return "data:text/javascript;base64," + base64.b64encode(source.encode("utf-8")).decode("ascii")


def bare(source: str) -> str:
    return RELATIVE_IMPORT.sub(lambda m: f"{m[1]}{m[2]}manyeyes/{m[3]}{m[2]}", source)


def module_graph(entry: str) -> dict[str, str]:
    """Every module reachable from static/js/<entry>, name -> source with bare specifiers."""
    modules: dict[str, str] = {}
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in modules:
            continue
        source = (STATIC_DIR / "js" / name).read_text(encoding="utf-8")
        modules[name] = bare(source)
        todo += [m[3] for m in RELATIVE_IMPORT.finditer(source)]
    return modules


def import_map(entry: str) -> dict[str, str]:
    modules = module_graph(entry)
    imports = {f"manyeyes/{name}": data_url(source) for name, source in modules.items()}
    if "api.js" in modules:
        imports["manyeyes/original-api.js"] = imports["manyeyes/api.js"]
        imports["manyeyes/api.js"] = data_url(OFFLINE_API.read_text(encoding="utf-8"))
        imports.setdefault("manyeyes/payload.js", data_url(bare((STATIC_DIR / "js" / "payload.js").read_text("utf-8"))))
    return imports


def build_html(page_html: str, embedded: dict) -> str:
    """The rendered index.html turned into the one-file export holding `embedded`."""
    return b"".join(build_pieces(page_html, embedded)).decode("utf-8")


def build_pieces(page_html: str, embedded: dict) -> list[bytes]:
    """build_html's file as UTF-8 pieces. The run's JSON, most of a file (25 MB of base64 weights
    at T=512 in MiniLM), is one piece made once: spliced into the page, substituted in and encoded
    whole, it went through about eight copies of itself, and a server's export at T=512 peaked
    256 MB above its rest for a 30 MB file."""
    html = STYLESHEET.sub(lambda m: "<style>\n" + inline_script((STATIC_DIR / m[1]).read_text(encoding="utf-8")) + "\n</style>", page_html)
    plotly_js = inline_script(PLOTLY_JS.read_text(encoding="utf-8"))
    html, n = PLOTLY_TAG.subn(lambda m: f"<script>{plotly_js}</script>", html)
    html, panels = SERVER_PANELS.subn(lambda m: OFFLINE_NOTE + m[0], html, count=1)
    main = MAIN_MODULE.search(html)
    if not n or not main:
        raise RuntimeError("templates/index.html no longer loads plotly.js and a main module the way the export expects")
    if not panels:
        raise RuntimeError("templates/index.html no longer has the measures panel the export hides")
    # Controls that need a server have nothing to do in a file: a copied link would name the
    # file's own view id, and the API docs are the server's.
    before, after = (re.sub(r'(<(?:button|a)\b[^>]*\bid="(?:export-page|copy-link|docs-link)")', r"\1 hidden", part)
                     for part in (html[: main.start()], html[main.end():]))
    # The page restores a view from the address bar: the file's own, which offline_api.js answers.
    restore = ("(() => { const id = " + json_script(EXPORT_VIEW_ID) + ";"
               " if (new URLSearchParams(location.search).get('view') !== id)"
               " history.replaceState(null, '', location.pathname + '?view=' + id); })();")
    imports = json_script({"imports": import_map(main[1])})
    start = f'import "manyeyes/{main[1]}";'
    boot_end = (f"</script>\n<script>{restore}</script>\n<script type=\"importmap\">{imports}</script>\n"
                f'<script type="module">{start}</script>')
    if "<head>" not in before:
        raise RuntimeError("templates/index.html no longer has the <head> the export puts its policy in")
    before = before.replace("<head>", "<head>\n  " + csp_meta([plotly_js, restore, imports, start]), 1)
    return [(before + '<script type="application/json" id="manyeyes-export">').encode("utf-8"), json_script_bytes(embedded),
            (boot_end + after).encode("utf-8")]


def csp_meta(scripts: list[str]) -> str:
    """The file's own Content-Security-Policy: opened from disk it has no server to send one. Of
    inline scripts only its own run (by their hashes), no event-handler attribute runs, and nothing
    is fetched from anywhere. The escaping keeps a text from closing its element; this stops most
    of what could get through anyway."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode('utf-8')).digest()).decode()}'" for s in scripts)
    # `data:` is listed for the modules: Chromium checks a module's static imports against the list
    # even under 'strict-dynamic' (the page did not start). So a planted `<script src="data:...">`
    # would still run (review h51g): against that, only the escaping stands.
    policy = (f"default-src 'none'; script-src {hashes} data:; style-src 'unsafe-inline'; img-src data: blob:; "
              "font-src data:; worker-src blob:; object-src 'none'; base-uri 'none'; form-action 'none'")
    return f'<meta http-equiv="Content-Security-Policy" content="{policy}">'


@functools.cache
def page_bytes() -> int:
    """An export's bytes beside its run, at most: plotly.js, the stylesheets and every module (the
    modules as base64 data URLs, 4/3), and the page itself."""
    static = sum(path.stat().st_size for path in STATIC_DIR.rglob("*") if path.is_file()) + OFFLINE_API.stat().st_size
    return PLOTLY_JS.stat().st_size + static * 4 // 3 + len(render_page().encode()) + 64 * 1024


def render_page() -> str:
    from manyeyes.app.routes.page import templates

    return templates.env.get_template("index.html").render(plotly_version=plotly.__version__, request=None)


def embed(body: dict, model: dict, text: str, text_pair: str | None, layer: int, head: int, truncate: bool = False,
          view: dict | None = None) -> dict:
    """The file's run and its one saved view: `view` is a saved view's state (POST /api/v1/views),
    whose options (aggregate, extra heads, segments, threshold, scale, labels...) the file keeps."""
    return {
        "text": text,
        "text_pair": text_pair,
        "model": model,
        # The most precise format the run's views can take is the file's own, f16 or u8 (a server's
        # body says what its cache keeps): the page labels its views and downloads by it.
        "run": {**body, "precision": body["attention"]["format"]},
        "view_id": EXPORT_VIEW_ID,
        "view": {**(view or {}), "text": text, "text_pair": text_pair, "model": model["id"], "truncate": truncate,
                 "layer": min(max(layer, 0), body["n_layers"] - 1), "head": min(max(head, 0), body["n_heads"] - 1)},
    }


def model_entry(info, default: bool = True) -> dict:
    """The model as GET /api/v1/models lists it."""
    fields = ("family", "causal", "n_layers", "n_heads", "d_model", "head_dim", "max_tokens", "device")
    return {"id": info.id, **{f: getattr(info, f) for f in fields}, "sliding_windows": list(info.sliding_windows),
            "default": default}


def export_html(
    model, text: str, text_pair: str | None = None, *, layer: int = 0, head: int = 0, truncate: bool = False,
    format: str | None = None, dense_max_tokens: int = DENSE_MAX_TOKENS,
) -> str:
    """One run of a loaded model (manyeyes.load) as a one-file HTML viewer, focused on `layer`
    and `head` when it opens. ValueError for a text or pair of only whitespace (as `manyeyes
    export` refuses them), a layer or head that is no whole number or one the model does not have,
    a format other than f16 or u8, or a dense_max_tokens under 1; TooLongToExport for a text over `dense_max_tokens` tokens (default
    1024, the server's default bound; the file holds every weight, L x H x T x T of them). The
    environment is not read: `manyeyes export` passes MANYEYES_DENSE_MAX_TOKENS here."""
    from manyeyes.app.services.cache import Run, run_id_for

    info = model.info
    layer, head = whole_number(layer, "layer"), whole_number(head, "head")
    if not (0 <= layer < info.n_layers and 0 <= head < info.n_heads):
        # The page would open on a head that is not there (it fell back to a clamped one unasked).
        raise ValueError(f"model {info.id} has layers 0..{info.n_layers - 1} and heads 0..{info.n_heads - 1}; "
                         f"got layer {layer}, head {head}")
    limit = count_at_least(dense_max_tokens, 1)  # numpy's integers too, as layer's and head's
    if limit is None:
        raise ValueError(f"dense_max_tokens must be a whole number of tokens, at least 1; got {dense_max_tokens!r}")
    if format not in (None, "f16", "u8"):  # "bogus" was a KeyError; "json" a file the viewer was never tested on
        raise ValueError(f"format must be 'f16', 'u8' or None (the smaller that keeps the picture); got {format!r}")
    for name, value in (("text", text), ("text_pair", text_pair)):
        # "" was a TypeError deep inside (a causal model's run of no token), "   " a file that opened
        # on "Type a sentence first."; the page leaves a blank pair out, so the file's never matched.
        if (name == "text" or value is not None) and not (isinstance(value, str) and value.strip()):
            raise ValueError(f"{name} must contain something other than whitespace; got {value!r}")
    encoded = model.encode(text, text_pair, truncate=truncate)
    if len(encoded) > limit:
        # Said before the forward pass; the size is what the file would have been (base64 weights).
        n = len(encoded)
        cell_bytes = {"f16": 2, "u8": 1}[format or pick_format(info.n_layers, info.n_heads, n)]
        size = info.n_layers * info.n_heads * n * n * cell_bytes * 4 / 3 / 2**20
        raise TooLongToExport(
            f"this text is {n:,} tokens; an exported page holds every weight of its run ({size:,.1f} MiB of them here) "
            f"and has no long-run mode, so it takes up to {limit:,} tokens (dense_max_tokens; `manyeyes export` and the "
            "server's /export read MANYEYES_DENSE_MAX_TOKENS: raise it for a bigger file): export a shorter text, or open this one in "
            "`manyeyes serve`, whose page reads long runs")
    result = model.run([encoded])[0]
    n_layers, n_heads, n_tokens = result.attention.shape[:3]
    view = View(list(range(n_layers)), list(range(n_heads)), format or pick_format(n_layers, n_heads, n_tokens))
    run = Run(run_id_for(model.info.id, text, text_pair, truncate), model.info.id, result.tokens, result.truncated, result.attention)
    timing = {"tokenize": 0.0, "queue": 0.0, "forward": 0.0}
    body = orjson.loads(b"".join(render_result(run, model.info, view, timing)))
    return build_html(render_page(), embed(body, model_entry(model.info), text, text_pair, layer, head, truncate))
