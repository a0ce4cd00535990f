"""Plotly figures for notebooks, from a local `AttentionResult` (manyeyes.load(...).attend) or a
`RemoteResult` (manyeyes.Client): heatmap, grid, head view, per-head measures and a comparison
of two runs.

Offline: call `offline()` once; plotly.js then travels inside the notebook from the installed
plotly package (no CDN), and `to_html` writes standalone files the same way.
"""

from __future__ import annotations

import html
import math
import os
import secrets
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from manyeyes.indices import whole_number
from manyeyes.labels import align, token_label

COLORSCALE = "Blues"
MASKED = "#c8c8c8"  # a causal model's later keys: no colour of the scale, whose 0 is white
MASKED_NOTE = "grey: later keys, which a causal model cannot see"


def _hsl(h: float, s: float, l: float) -> str:
    """static/js/theme.js's hsl(), to the same hex (JS Math.round: halves up)."""
    a = s * min(l, 1 - l)

    def f(n: int) -> int:
        k = (n + h / 30) % 12
        return math.floor(255 * (l - a * max(-1, min(k - 3, 9 - k, 1))) + 0.5)

    return f"#{f(0):02x}{f(8):02x}{f(4):02x}"


# The page's head colours (theme.js, light theme): Tableau 10, then 22 more spread in hue and
# alternating in lightness, so that heads 10..31 never repeat the first ten.
HEAD_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
HEAD_COLORS += [_hsl(i * 360 / 11 + 18, 0.9, (0.28, 0.6)[i % 2]) for i in range(32 - len(HEAD_COLORS))]
MIN_DRAWN = 0.02  # head view: fainter lines only add noise
BUCKETS = 10


def offline() -> None:
    """Render figures in notebooks with plotly.js inlined from the installed package, never a CDN."""
    from plotly.io._base_renderers import NotebookRenderer

    class OfflineNotebook(NotebookRenderer):
        # plotly's own notebook renderer adds MathJax from a CDN to every figure; ours need none.
        def to_mimebundle(self, fig_dict):
            html = pio.to_html(fig_dict, config=self.config, include_plotlyjs=False, include_mathjax=False,
                               full_html=False, default_width="100%", default_height=525, validate=False)
            return {"text/html": html}

        def activate(self):
            """Done by offline() itself. Left to plotly, plotly.js went into the output of the first
            figure shown: running that cell again (or clearing it) dropped it from the notebook,
            and a saved notebook drew every figure blank ("Plotly is not defined")."""

    renderer = OfflineNotebook(connected=False)
    pio.renderers["manyeyes"] = renderer
    pio.renderers.default = "manyeyes"
    if _in_ipython():  # a plain script has no notebook to put it in (IPython would print it)
        NotebookRenderer.activate(renderer)  # plotly.js, once, into this cell's output


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def to_html(fig: go.Figure, path: str | None = None) -> str:
    """A standalone page with plotly.js inside it (about 4.6 MB), written to `path` if given."""
    html = pio.to_html(fig, include_plotlyjs=True, include_mathjax=False, full_html=True)
    if path:
        write_whole(path, html)
    return html


def write_whole(path, text: str) -> None:
    """Writes `text` to `path` whole or not at all: written in place, a full disk (or Ctrl-C) left
    half a page where the good one had been. The text goes to a temporary file beside the target (a
    symlink's target), which then takes its name, and the mode of a file it replaces; on any failure
    it is removed. (A hard link to the old file keeps the old text: the page is a new file.)"""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        # /dev/null or a FIFO has no contents to keep, and renaming over it would replace it; a
        # folder fails here with the error that names it.
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    folder, name = os.path.split(target)
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    try:
        f = open(temporary, "x", encoding="utf-8")  # "x", not mkstemp: the umask's permissions, as a plain open's
    except OSError as exc:
        # A missing or read-only folder: the caller never named the hidden temporary file, so the
        # error names their path (OSError picks the subclass, FileNotFoundError, from the errno).
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None
    try:
        with f:
            f.write(text)
        if os.path.exists(target):  # a file written over keeps its mode: a 600 one held the user's text
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    except BaseException:
        os.remove(temporary)
        raise


@dataclass
class Weights:
    """Either kind of result as numpy: attention[i, j] is layer layers[i], head heads[j].
    positions[t]: the token's index in the run (hiding special tokens drops some)."""

    attention: np.ndarray  # (len(layers), len(heads), T, T) float32
    layers: list[int]
    heads: list[int]
    tokens: list[str]
    positions: list[int] | None = None
    special: list[bool] | None = None
    hidden: str = ""  # what a view left out, for titles: "" when nothing
    causal: bool = False  # each query sees no later key: those cells are masked, not weights of 0

    def __post_init__(self):
        n = self.attention.shape[-1]
        self.positions = list(range(n)) if self.positions is None else self.positions
        self.special = [False] * n if self.special is None else self.special

    def head(self, layer: int, head: int) -> np.ndarray:
        try:
            return self.attention[self.layers.index(layer), self.heads.index(head)]
        except ValueError:
            raise KeyError(f"layer {layer}, head {head} is not in this result (layers {self.layers}, heads {self.heads})") from None

    def without(self, hide_special: bool = False, hide_first: bool = False) -> Weights:
        """As the page's "Hide special tokens" / "Hide first token": those tokens leave the rows
        and the columns, and each row is renormalised over the keys left, so it shows the share
        of the visible keys (a row whose weight all went to hidden keys is 0)."""
        if not (hide_special or hide_first):
            return self
        keep = [i for i, special in enumerate(self.special) if not ((hide_special and special) or (hide_first and i == 0))]
        what = [w for w, on in (("special tokens", hide_special), ("first token", hide_first)) if on]
        if not keep:
            raise ValueError(f"hiding the {' and the '.join(what)} leaves no token to draw")
        a = self.attention[..., keep, :][..., keep].astype(np.float64)
        total = a.sum(-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(total > 0, a / total, 0.0).astype(np.float32)
        return Weights(a, self.layers, self.heads, [self.tokens[i] for i in keep], [self.positions[i] for i in keep],
                       [self.special[i] for i in keep], " and ".join(what) + " hidden, rows renormalised", self.causal)


def weights_of(result) -> Weights:
    attention = result.attention
    if attention is None and getattr(result, "kept", None) == "weights":  # a client's answer to keep="qk"
        raise ValueError("this answer carries no weights (it was asked with keep='qk'), but its run holds them: "
                         "draw Client.slice(result) instead")
    if attention is None or getattr(attention, "ndim", 4) != 4:
        raise ValueError(
            "this result kept queries and keys (a long input), not its weights: there is nothing whole to "
            "draw; read its heads with Client.tile / topk / overview (a client's result), result.kept.block or "
            "manyeyes.model.kept.pooled / topk_rows (a local one), or run a shorter text"
        )
    if hasattr(attention, "detach"):  # a torch tensor: a local AttentionResult holds every head
        attention = attention.detach().float().cpu().numpy()
    attention = np.asarray(attention, dtype=np.float32)
    if not attention.shape[-1]:  # a causal model's attend("") has no token; each figure failed deep inside
        raise ValueError("this result has no tokens (its text was empty): there is nothing to draw")
    layers = list(getattr(result, "layers", None) or range(attention.shape[0]))
    heads = list(getattr(result, "heads", None) or range(attention.shape[1]))
    # A client's result says whether its model is causal; a local one does not, and its mask
    # shows: no weight above the diagonal in any head (a softmax over visible keys gives none 0).
    causal = getattr(result, "causal", None)
    if not isinstance(causal, bool):  # a head at a time: the whole triangle copied 74 MiB at T=512 (12 x 12)
        causal = attention.shape[-1] > 1 and not any(np.triu(m, 1).any() for m in attention.reshape(-1, *attention.shape[-2:]))
    return Weights(attention, layers, heads, [plotly_text(token_label(t)) for t in result.tokens],
                   special=[bool(getattr(t, "special", False)) for t in result.tokens], causal=causal)


def plotly_text(text: str) -> str:
    """A token as Plotly draws it literally: its labels and hovers read a small HTML subset, so
    `<s>` (every Llama's and RoBERTa's first token) drew as nothing and `<b>x</b>` as a bold x.
    As the page's plotlyText (static/js/dom.js)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


MIN_FIGURE_PX = 460  # a heatmap's smallest side: the title, tick labels and axis titles take ~200 of it
TICK_CHARS = 20  # longer tick labels end in "…" (the hover has the whole token): 25-character ones squeezed the matrix
TICK_PX = 12  # a tick label needs about a line of 10-11 px text; below this, every k-th token
MAX_SIDE = 600  # heatmap: cells a side before max-pooling (about one pixel a cell at 900 px)
GRID_SIDE = 120  # grid: cells a side of each small panel before max-pooling


def _ticks(tokens: list[str], positions: list[int], side_px: float, step: int = 1) -> dict:
    """Tick labels at the cells' indices (the same word may occur twice): every token when each
    has TICK_PX pixels, else every k-th, then labelled with its position in the run (a byte-level
    model's every other character read as noise). step: tokens per cell of a pooled heatmap."""
    n = len(tokens)
    cells = -(-n // step)
    every = max(1, math.ceil(cells * TICK_PX / max(side_px, 1)))
    if every > 1 or step > 1:  # "1197 t" labels need more room than one token's
        every = max(1, math.ceil(cells * TICK_PX * 1.75 / max(side_px, 1)))
    values = list(range(0, cells, every))
    if every == 1 and step == 1:
        text = [_short(tokens[i]) for i in values]
    else:
        text = [f"{positions[i * step]} {_short(tokens[i * step])}" for i in values]
    return {"tickmode": "array", "tickvals": values, "ticktext": text}


def _short(label: str) -> str:
    """A tick label of at most TICK_CHARS characters; labels arrive escaped (plotly_text), so the
    cut is made on the token's own text and escaped again, never inside an entity."""
    text = html.unescape(label)
    return label if len(text) <= TICK_CHARS else plotly_text(text[: TICK_CHARS - 1] + "…")


def _cells(max_side) -> int:
    """max_side as an int (0 was a ZeroDivisionError)."""
    side = whole_number(max_side, "max_side")
    if side < 1:
        raise ValueError(f"max_side must be at least 1 (cells a side before pooling), got {max_side!r}")
    return side


def _pool(matrix: np.ndarray, step: int) -> np.ndarray:
    """Max over step x step blocks (the last ones ragged): a lone sharp weight stays visible,
    where a picture of more cells than pixels drops it. The page's overview pools the same way."""
    if step == 1:
        return matrix
    n_rows, n_cols = matrix.shape[-2:]
    rows, cols = -(-n_rows // step), -(-n_cols // step)
    padded = np.full(matrix.shape[:-2] + (rows * step, cols * step), -np.inf, dtype=matrix.dtype)
    padded[..., :n_rows, :n_cols] = matrix
    return padded.reshape(matrix.shape[:-2] + (rows, step, cols, step)).max(axis=(-3, -1))


def _masked(matrix: np.ndarray, causal: bool) -> np.ndarray:
    """matrix (..., n, n) with a causal model's later keys NaN: they are masked, not weights of 0.
    Drawn as gaps on grey (MASKED), with hoverongaps=False, as the page greys them ("0.0000" on a
    hover read as a weight the head chose). Pooled too: both axes pool from 0 by the same step, so
    a block right of the diagonal is all masked."""
    if not causal:
        return matrix
    matrix = matrix.astype(np.float32, copy=True)
    matrix[(..., *np.triu_indices(matrix.shape[-1], 1))] = np.nan
    return matrix


def _cell_names(tokens: list[str], positions: list) -> np.ndarray:
    """(n, n, 4) per cell: the query's and the key's tokens, then their positions in the run."""
    tokens, positions = np.array(tokens, dtype=object), np.array(positions, dtype=object)
    return np.stack(np.broadcast_arrays(tokens[:, None], tokens[None, :], positions[:, None], positions[None, :]), axis=-1)


def _check_zmax(zmax) -> None:
    number = isinstance(zmax, (int, float, np.number)) and not isinstance(zmax, (bool, np.bool_))
    if zmax is not None and not (number and 0 < zmax < math.inf):
        raise ValueError(f"zmax must be a number above 0 (1.0: the whole range of a weight), or None; got {zmax!r}")


def heatmap(result, layer: int, head: int, *, title: str | None = None, hide_special: bool = False,
            hide_first: bool = False, max_side: int = MAX_SIDE, zmax: float | None = None) -> go.Figure:
    """One head: queries on rows, keys on columns, token labels, hover
    `query 3 “e” → key 1 “h”: weight` (positions in the run, then the tokens).
    hide_special / hide_first: as the page's options (rows renormalised over the keys left).
    Over max_side tokens the cells are max-pooled, k x k tokens each (the title says k).
    Colours run from 0 to this head's largest weight, as the page's do, so a diffuse head's
    pattern shows; zmax fixes the top (1.0: heads side by side on one scale, as grid's)."""
    layer, head = whole_number(layer, "layer"), whole_number(head, "head")
    _check_zmax(zmax)
    w = weights_of(result).without(hide_special, hide_first)
    matrix = w.head(layer, head)
    n = len(w.tokens)
    step = max(1, math.ceil(n / _cells(max_side)))
    # 14 px a cell, within [MIN_FIGURE_PX, 900]: six tokens had a 60-pixel matrix inside the margins
    size = min(900, max(MIN_FIGURE_PX, 260 + 14 * -(-n // step)))
    if step == 1:
        # Each cell: the query's and the key's tokens, then their positions in the run. %{y} and
        # %{x} read the tick labels, the tokens themselves: a byte-level model repeats each letter,
        # so "query e" could have been any of eight rows.
        custom = _cell_names(w.tokens, w.positions)
        hover = ("query %{customdata[2]} “%{customdata[0]}” → key %{customdata[3]} “%{customdata[1]}”: %{z:.4f}"
                 "<extra></extra>")
    else:
        spans = np.array([f"{w.positions[i]}–{w.positions[min(i + step, n) - 1]}" for i in range(0, n, step)], dtype=object)
        custom = np.stack(np.broadcast_arrays(spans[:, None], spans[None, :]), axis=-1)
        hover = f"queries %{{customdata[0]}} → keys %{{customdata[1]}}: max %{{z:.4f}}<extra>{step}×{step} tokens a cell</extra>"
    pooled = _masked(_pool(matrix, step), w.causal)
    fig = go.Figure(
        go.Heatmap(
            z=pooled, customdata=custom, colorscale=COLORSCALE, zmin=0,
            zmax=float(zmax) if zmax is not None else float(max(np.nanmax(pooled), 1e-9)),
            colorbar={"title": {"text": "weight" if step == 1 else "max weight"}}, hovertemplate=hover, hoverongaps=False,
        )
    )
    notes = [note for note in (w.hidden, step > 1 and f"{n:,} tokens, max over {step}×{step} a cell",
                               w.causal and MASKED_NOTE) if note]
    heading = title or f"Layer {layer}, head {head}"
    fig.update_layout(
        title=heading + (f"<br><sup>{'; '.join(notes)}</sup>" if notes else ""), width=size + 80, height=size,
        plot_bgcolor=MASKED if w.causal else None,
        # constrain="domain": a square plot shrinks its box, rather than padding the axis range
        # (grey bands beside the matrix that read as cells).
        xaxis={**_ticks(w.tokens, w.positions, size - 180, step), "title": "key (attended to)", "tickangle": -60,
               "constrain": "domain"},
        yaxis={**_ticks(w.tokens, w.positions, size - 180, step), "title": "query (attending)", "autorange": "reversed",
               "scaleanchor": "x", "constrain": "domain"},
    )
    return fig


def compare(a, b, layer: int, head: int, *, hide_special: bool = False, hide_first: bool = False,
            zmax: float | None = None, names: tuple[str, str] = ("A", "B")) -> go.Figure:
    """One head in two runs (two texts, or one text on two models of one shape) side by side, on
    one colour scale, and A − B on the tokens they share: difflib lines their tokens up on their
    pieces, as the compare experiment (POST /api/v1/experiments/compare) does, and the difference
    panel's rows and columns are those pairs, labelled by A's tokens. Red: A attends more.
    Each run must be at most MAX_SIDE tokens (every cell is drawn)."""
    layer, head = whole_number(layer, "layer"), whole_number(head, "head")
    _check_zmax(zmax)
    if isinstance(names, str) or len(names) != 2 or not all(isinstance(n, str) for n in names):
        raise ValueError(f"names must be two texts, A's and B's, such as ('river', 'city'); got {names!r}")
    runs = [weights_of(r).without(hide_special, hide_first) for r in (a, b)]
    for name, w in zip(names, runs):
        if len(w.tokens) > MAX_SIDE:
            raise ValueError(f"{name} has {len(w.tokens):,} tokens; compare draws every cell, up to {MAX_SIDE}: "
                             "draw each with heatmap (which pools), or compare shorter texts")
    # Masked before the difference: a later key of either run is no cell of A − B either.
    matrices = [_masked(w.head(layer, head), w.causal) for w in runs]
    # Lined up on the tokens left on screen, by their pieces in the runs.
    pairs = align([a.tokens[p] for p in runs[0].positions], [b.tokens[p] for p in runs[1].positions])
    if not pairs:
        raise ValueError(f"{names[0]} and {names[1]} share no token: there is no difference to draw")
    rows_a, rows_b = [i for i, _ in pairs], [j for _, j in pairs]
    diff = matrices[0][np.ix_(rows_a, rows_a)] - matrices[1][np.ix_(rows_b, rows_b)]
    top = float(zmax) if zmax is not None else float(max(max(np.nanmax(m) for m in matrices), 1e-9))
    span = float(max(np.nanmax(np.abs(diff)), 1e-9))
    shared = [runs[0].tokens[i] for i in rows_a]
    sizes = [len(w.tokens) for w in runs] + [len(pairs)]
    side = min(600, max(300, 14 * max(sizes)))
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09,
                        subplot_titles=[plotly_text(names[0]), plotly_text(names[1]),
                                        plotly_text(f"{names[0]} − {names[1]}") + f" on the {len(pairs)} tokens both have"])
    # Hovers name the tokens and their positions in the runs (the cells' indices are not, once
    # tokens are hidden), as heatmap's do; the difference names both runs' positions.
    for k, (w, matrix) in enumerate(zip(runs, matrices)):
        fig.add_trace(go.Heatmap(
            z=matrix, coloraxis="coloraxis", customdata=_cell_names(w.tokens, w.positions),
            hovertemplate=f"{plotly_text(names[k])}: query %{{customdata[2]}} “%{{customdata[0]}}” → "
                          f"key %{{customdata[3]}} “%{{customdata[1]}}”: %{{z:.4f}}<extra></extra>",
            x=list(range(len(w.tokens))), y=list(range(len(w.tokens))), hoverongaps=False,
        ), row=1, col=k + 1)
    both = [f"{runs[0].positions[i]}|{runs[1].positions[j]}" for i, j in pairs]
    fig.add_trace(go.Heatmap(
        z=diff, colorscale="RdBu", reversescale=True, zmin=-span, zmax=span, zmid=0,
        x=list(range(len(pairs))), y=list(range(len(pairs))), customdata=_cell_names(shared, both),
        colorbar={"title": {"text": plotly_text(f"{names[0]} − {names[1]}")}, "x": 1.08}, hoverongaps=False,
        hovertemplate=f"query %{{customdata[2]}} “%{{customdata[0]}}” → key %{{customdata[3]}} “%{{customdata[1]}}”: "
                      f"{plotly_text(names[0])} − {plotly_text(names[1])} %{{z:.4f}}<extra>positions in {plotly_text(names[0])}|"
                      f"{plotly_text(names[1])}</extra>",
    ), row=1, col=3)
    # Each panel its own labels: a figure's one xaxis/yaxis setting reached the first panel only,
    # and the others drew numbers, bottom-up.
    for k, (tokens, positions) in enumerate(((runs[0].tokens, runs[0].positions), (runs[1].tokens, runs[1].positions),
                                             (shared, [runs[0].positions[i] for i in rows_a]))):
        ticks = _ticks(tokens, positions, side - 120)
        fig.update_xaxes(**ticks, tickangle=-60, constrain="domain", row=1, col=k + 1)
        fig.update_yaxes(**ticks, autorange="reversed", scaleanchor=f"x{k + 1 if k else ''}", constrain="domain", row=1, col=k + 1)
    fig.update_xaxes(title="key (attended to)", row=1, col=2)
    fig.update_yaxes(title="query (attending)", row=1, col=1)
    causal = any(w.causal for w in runs)
    notes = [note for note in (runs[0].hidden, causal and MASKED_NOTE) if note]
    fig.update_layout(
        title=f"Layer {layer}, head {head}" + (f"<br><sup>{'; '.join(notes)}</sup>" if notes else ""),
        plot_bgcolor=MASKED if causal else None,
        coloraxis={"colorscale": COLORSCALE, "cmin": 0, "cmax": top, "colorbar": {"title": {"text": "weight"}, "x": 1.0}},
        width=3 * side + 260, height=side + 160,
    )
    return fig


def grid(result, *, cell_px: int = 90, hide_special: bool = False, hide_first: bool = False,
         max_side: int = GRID_SIDE) -> go.Figure:
    """Every layer × head of the result as small heatmaps: rows are layers, columns heads. Over
    max_side tokens each panel is max-pooled (a 90-pixel panel shows no more anyway)."""
    w = weights_of(result).without(hide_special, hide_first)
    rows, cols = len(w.layers), len(w.heads)
    n = len(w.tokens)
    step = max(1, math.ceil(n / _cells(max_side)))
    starts = [w.positions[i] for i in range(0, n, step)]
    pooled = _masked(_pool(w.attention, step), w.causal)
    fig = make_subplots(rows=rows, cols=cols, horizontal_spacing=0.01, vertical_spacing=0.01,
                        row_titles=[f"L{l}" for l in w.layers], column_titles=[f"H{h}" for h in w.heads])
    for i, layer in enumerate(w.layers):
        for j, head in enumerate(w.heads):
            hover = (f"layer {layer}, head {head}<br>query %{{y}} → key %{{x}}: %{{z:.3f}}<extra></extra>" if step == 1 else
                     f"layer {layer}, head {head}<br>queries from %{{y}} → keys from %{{x}}: max %{{z:.3f}}"
                     f"<extra>{step}×{step} tokens a cell</extra>")
            fig.add_trace(go.Heatmap(z=pooled[i, j], x=starts, y=starts, coloraxis="coloraxis", hovertemplate=hover,
                                     hoverongaps=False), row=i + 1, col=j + 1)
    # Categories, one cell each: on a number axis a hidden token's gap (a pair's middle [SEP])
    # made its neighbours' cells half as wide again.
    fig.update_xaxes(showticklabels=False, type="category")
    fig.update_yaxes(showticklabels=False, autorange="reversed", type="category")
    notes = [note for note in (w.hidden, step > 1 and f"{n:,} tokens, max over {step}×{step} a cell", w.causal and MASKED_NOTE)
             if note]
    fig.update_layout(coloraxis={"colorscale": COLORSCALE, "cmin": 0, "cmax": 1}, plot_bgcolor=MASKED if w.causal else None,
                      title="All heads" + (f" <sup>({'; '.join(notes)})</sup>" if notes else ""),
                      width=80 + cell_px * cols, height=80 + cell_px * rows, margin={"l": 40, "r": 40, "t": 60, "b": 20})
    return fig


HEAD_VIEW_TOKENS = 64  # head view: tokens drawn by default, 18 px each (a 1,272-px figure)


def _window(w: Weights, n_run: int, start: int, max_tokens: int | None) -> tuple[int, int]:
    """The indices [lo, hi) into w's tokens of the head view's window: up to max_tokens visible
    tokens from the first one at or after run position `start` (n_run: the run's tokens)."""
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise TypeError(f"start must be a token position (an int), got {start!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer))
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens must be a whole number of tokens, at least 1 (or None for all), got {max_tokens!r}")
    if not 0 <= start < n_run:
        raise ValueError(f"start={start} is outside the run: it has {n_run:,} tokens, so start must be in 0..{n_run - 1}")
    lo = next((i for i, p in enumerate(w.positions) if p >= start), None)
    if lo is None:
        raise ValueError(f"start={start}: every token from there on is hidden ({w.hidden.split(' hidden')[0]}); "
                         f"the last one drawn is at position {w.positions[-1]}")
    hi = len(w.tokens) if max_tokens is None else min(len(w.tokens), lo + int(max_tokens))
    return lo, hi


def head_view(result, layer: int, heads: list[int] | None = None, *, hide_special: bool = False,
              hide_first: bool = False, start: int = 0, max_tokens: int | None = HEAD_VIEW_TOKENS) -> go.Figure:
    """Lines from each query token (left) to the keys it attends to (right), one colour per head,
    width and opacity by weight (weights under MIN_DRAWN are not drawn).

    A line needs its two labels to be read, so a long run is not squeezed: the view is a window of
    up to `max_tokens` tokens (default 64, 18 px a token) from run position `start` (default 0),
    queries and keys alike, with each line the weight in the run (not renormalised over the window:
    what a query gives to keys outside it is simply not drawn). Over a longer run the title says
    which tokens are shown and the labels carry their positions; move `start` to see the rest, or
    pass max_tokens=None to draw every token. A `start` outside the run is a ValueError naming the
    positions there are. With hide_special / hide_first, `start` is still a position in the run
    (the window begins at the first visible token from there)."""
    layer = whole_number(layer, "layer")
    full = weights_of(result)
    w = full.without(hide_special, hide_first)
    heads = list(w.heads) if heads is None else [whole_number(h, "heads") for h in heads]
    lo, hi = _window(w, len(full.tokens), start, max_tokens)
    windowed = (lo, hi) != (0, len(w.tokens))
    rows = list(range(lo, hi))
    n = len(rows)
    fig = go.Figure()
    for k, head in enumerate(heads):
        matrix = w.head(layer, head)[lo:hi, lo:hi]
        color = HEAD_COLORS[head % len(HEAD_COLORS)]
        # One trace per weight bucket: a few traces, not one per line.
        bucket = np.minimum((matrix * BUCKETS).astype(int), BUCKETS - 1)
        for b in range(BUCKETS):
            qs, ks = np.nonzero((bucket == b) & (matrix >= MIN_DRAWN))
            if not len(qs):
                continue
            xs = np.tile([0.0, 1.0, np.nan], len(qs))
            ys = np.column_stack([qs + lo, ks + lo, np.full(len(qs), np.nan)]).ravel()
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False, legendgroup=f"h{head}",
                line={"color": color, "width": 0.5 + 3.5 * (b + 1) / BUCKETS}, opacity=0.15 + 0.85 * (b + 1) / BUCKETS,
            ))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"color": color, "width": 3},
                                 name=f"head {head}", legendgroup=f"h{head}"))
    # A window's labels say where in the run they are, as a long heatmap's ticks do.
    labels = [f"{w.positions[i]} {w.tokens[i]}" if windowed else w.tokens[i] for i in rows]
    # Queries' labels end where their lines begin (left of x=0), keys' start where theirs end:
    # "middle right" at x=0 had put every query's label over its own lines.
    for x, side in ((0.0, "left"), (1.0, "right")):
        fig.add_trace(go.Scatter(
            x=[x] * n, y=rows, mode="text", text=labels, textposition=f"middle {side}",
            hovertext=[f"{w.positions[i]}: {w.tokens[i]}" for i in rows], hoverinfo="text", showlegend=False,
        ))
    notes = [w.hidden] if w.hidden else []
    if windowed:
        notes.append(f"tokens {w.positions[lo]:,}–{w.positions[hi - 1]:,} ({n:,} of {len(w.tokens):,}"
                     f"{' visible' if w.hidden else ''}; start={start}, max_tokens={max_tokens}): "
                     "weights to keys outside them are not drawn")
    fig.update_layout(
        title=f"Head view, layer {layer}" + (f"<br><sup>{'; '.join(notes)}</sup>" if notes else ""),
        width=520 + (80 if windowed else 0), height=120 + 18 * n,
        xaxis={"visible": False, "range": [-0.6, 1.6]}, yaxis={"visible": False, "autorange": "reversed"},
        # Which side is which: the page's head view says so in its caption, a figure had nothing.
        annotations=[{"x": x, "y": 1, "xref": "x", "yref": "paper", "yanchor": "bottom", "xanchor": anchor,
                      "text": text, "showarrow": False, "font": {"size": 12}}
                     for x, anchor, text in ((0.0, "right", "query (attending)"), (1.0, "left", "key (attended to)"))],
    )
    return fig


def head_measures(result, *, hide_special: bool = False, hide_first: bool = False) -> dict[str, np.ndarray]:
    """Per-head summaries of the weights, each (len(layers), len(heads)), plain means over query
    rows: previous_token (mean weight on the token just before, rows 1..T-1), first_token (on token
    0, an attention sink), diagonal (on itself) and entropy (in nats, not normalised; low is sharp),
    the last three over every row, row 0 included (a causal model's row 0 is all on itself).

    These are not the server's head table (`manyeyes.model.measures.head_table`, the API's measures
    "heads"), although names match: there `entropy` is each row's entropy over the log of the keys
    it sees (0 sharp ... 1 uniform), and `entropy`, `self` and `first` leave out the rows that see a
    single key (a causal model's row 0), `first` also row 0 itself and any row whose sliding window
    no longer reaches token 0. previous_token equals the table's `previous`; diagonal equals `self`
    only where no row sees a single key (a bidirectional model, MiniLM).

    hide_special / hide_first: as the page's options, the measures of the weights left (rows
    renormalised): MiniLM's [CLS] and [SEP] take most of many heads' weight, which hides what
    those heads do among the words; "previous" is then the previous token shown."""
    return _measures_of(weights_of(result).without(hide_special, hide_first))


def _measures_of(w: Weights) -> dict[str, np.ndarray]:
    a = w.attention.astype(np.float64)
    n = a.shape[-1]
    rows = np.arange(1, n)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(np.where(a > 0, a * np.log(a), 0.0), axis=-1).mean(-1)
    return {
        "previous_token": a[..., rows, rows - 1].mean(-1) if n > 1 else np.zeros(a.shape[:2]),
        "first_token": a[..., :, 0].mean(-1),
        "diagonal": np.diagonal(a, axis1=-2, axis2=-1).mean(-1),
        "entropy": entropy,
    }


def measures(result, measure: str = "previous_token", *, hide_special: bool = False,
             hide_first: bool = False) -> go.Figure:
    """A layer × head map of one of `head_measures`: which heads do what, at a glance. `result`
    may be a list of results (of the same model, layers and heads): the map is then the measure's
    mean over them, the question a study of many sentences asks ("which head is previous-token on
    average?"), which had to be stacked by hand and could not be drawn. hide_special / hide_first:
    as head_measures'."""
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    if not results:
        raise ValueError("result is an empty list: pass at least one result")
    views = [weights_of(r).without(hide_special, hide_first) for r in results]
    w = views[0]
    # A client's results name their model (a local result does not): two models of the same shape
    # averaged without a word.
    models = sorted({r.model for r in results if isinstance(getattr(r, "model", None), str)})
    if len(models) > 1:
        raise ValueError(f"every result must come from one model to be averaged; these come from {', '.join(models)}")
    if any((v.layers, v.heads) != (w.layers, w.heads) for v in views[1:]):
        raise ValueError("every result must hold the same layers and heads to be averaged")
    each = [_measures_of(v) for v in views]
    if measure not in each[0]:
        raise ValueError(f"measure must be one of {sorted(each[0])}, got {measure!r}")
    values = np.mean([found[measure] for found in each], axis=0)
    # Weights' means run from 0 to 1, and so does their colour: Plotly's own range (the map's
    # minimum to its maximum) made the lowest head's 0.03 read as none. Entropy has no such top.
    bounds = {} if measure == "entropy" else {"zmin": 0, "zmax": 1}
    unit = "entropy (nats)" if measure == "entropy" else f"mean weight on {measure.replace('_', ' ')}"
    fig = go.Figure(go.Heatmap(
        z=values, x=[f"H{h}" for h in w.heads], y=[f"L{l}" for l in w.layers], colorscale="Viridis", **bounds,
        text=np.round(values, 2), texttemplate="%{text}", colorbar={"title": {"text": unit.split(" on ")[0]}},
        hovertemplate=f"%{{y}} %{{x}}: {unit} %{{z:.3f}}<extra></extra>",
    ))
    over = f", mean over {len(results)} texts" if len(results) > 1 else ""
    fig.update_layout(title=f"{measure.replace('_', ' ')} per head{over}{f' ({w.hidden})' if w.hidden else ''}",
                      xaxis={"title": "head"}, yaxis={"title": "layer", "autorange": "reversed"},
                      # 160 px of rows at least: a 2-layer map's colour bar was 40 px, its ticks on each other
                      width=160 + 60 * len(w.heads), height=160 + max(50 * len(w.layers), 160))
    return fig
