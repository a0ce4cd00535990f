"""figures.head_view on a long run: a window of max_tokens tokens from `start`, not every token.

At 1,200 tokens head_view drew every one, 18 px each: a figure 21,720 px tall whose labels and
lines no one could follow. The other figures max-pool; a head view's lines go from one token to
another, so it shows a window of the run, with the run's own weights."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from manyeyes import figures

N = 1200


def _result(attention: np.ndarray, special: list[bool] | None = None):
    n = attention.shape[-1]
    special = special or [False] * n
    texts = [f"w{i}" for i in range(n)]
    return SimpleNamespace(attention=attention, layers=list(range(attention.shape[0])), heads=list(range(attention.shape[1])),
                           tokens=[SimpleNamespace(text=t, special=s) for t, s in zip(texts, special)])


@pytest.fixture(scope="module")
def long_run() -> np.ndarray:
    """(1, 2, N, N): each row a few sharp weights (a sink, itself, the token before, a random key
    earlier) of varied sizes and a faint rest, so lines of every bucket are drawn."""
    rng = np.random.default_rng(7)
    a = np.zeros((1, 2, N, N), dtype=np.float64)
    q = np.arange(N)
    for h in range(2):
        a[0, h] = rng.uniform(0, 1e-4, (N, N))
        a[0, h, q, 0] += rng.uniform(0, 3, N)
        a[0, h, q, q] += rng.uniform(0, 2, N)
        a[0, h, q[1:], q[1:] - 1] += rng.uniform(0, 4 if h else 1, N - 1)
        a[0, h, q, (rng.random(N) * (q + 1)).astype(int)] += rng.uniform(0, 2, N)
        a[0, h] = np.tril(a[0, h])
    a /= a.sum(-1, keepdims=True)
    return a.astype(np.float32)


def drawn_lines(fig, head: int) -> dict[tuple[int, int], float]:
    """(query, key) -> line width of every line the head's traces draw (y is the token's index)."""
    color = figures.HEAD_COLORS[head]
    lines = {}
    for t in fig.data:
        if t.mode != "lines" or t.x[0] is None or t.line.color != color:
            continue
        ys = np.asarray(t.y, dtype=float).reshape(-1, 3)
        for q, k, _ in ys:
            assert (int(q), int(k)) not in lines
            lines[int(q), int(k)] = t.line.width
    return lines


def label_traces(fig):
    return [t for t in fig.data if t.mode == "text"]


def test_a_1200_token_head_view_is_a_readable_window_not_21800_px(long_run):
    fig = figures.head_view(_result(long_run), layer=0)
    assert fig.layout.height == 120 + 18 * figures.HEAD_VIEW_TOKENS == 1272  # was 120 + 18 * 1200 = 21,720
    queries, keys = label_traces(fig)
    # 64 labels a side, each with its position in the run (a window does not start at 0 in general).
    assert list(queries.text) == list(keys.text) == [f"{i} w{i}" for i in range(64)]
    assert list(queries.y) == list(range(64))
    assert "tokens 0–63 (64 of 1,200; start=0, max_tokens=64): weights to keys outside them are not drawn" \
        in fig.layout.title.text
    lines = drawn_lines(fig, 1)
    assert lines and all(q < 64 and k < 64 for q, k in lines)


@pytest.mark.parametrize("start, max_tokens", [(600, 40), (1170, 64), (0, 1)])
def test_the_window_draws_the_runs_own_weights_of_its_tokens(long_run, start, max_tokens):
    fig = figures.head_view(_result(long_run), layer=0, heads=[0, 1], start=start, max_tokens=max_tokens)
    end = min(start + max_tokens, N)
    assert fig.layout.height == 120 + 18 * (end - start)
    queries, keys = label_traces(fig)
    assert list(queries.text) == [f"{i} w{i}" for i in range(start, end)] and list(queries.y) == list(range(start, end))
    for head in (0, 1):
        part = long_run[0, head, start:end, start:end]  # the weights slice, not renormalised
        expected = {}
        for q, k in zip(*np.nonzero(part >= figures.MIN_DRAWN)):
            bucket = min(int(part[q, k] * figures.BUCKETS), figures.BUCKETS - 1)
            expected[int(q) + start, int(k) + start] = 0.5 + 3.5 * (bucket + 1) / figures.BUCKETS
        lines = drawn_lines(fig, head)
        assert lines.keys() == expected.keys()
        np.testing.assert_allclose([lines[qk] for qk in expected], list(expected.values()))
    # A window that runs past the end is cut there and says so.
    assert f"tokens {start:,}–{end - 1:,} ({end - start:,} of 1,200;" in fig.layout.title.text


def test_the_window_moves_past_weights_a_bigger_one_would_show(long_run):
    """Lines to keys before `start` are not drawn: the window's weights are the run's, unrenormalised."""
    a = long_run[0, 0]
    fig = figures.head_view(_result(long_run), layer=0, heads=[0], start=100, max_tokens=10)
    lines = drawn_lines(fig, 0)
    sink = [q for q in range(100, 110) if a[q, 0] >= figures.MIN_DRAWN]
    assert sink and all((q, 0) not in lines for q in sink)
    assert all(100 <= q < 110 and 100 <= k < 110 for q, k in lines)


def test_max_tokens_none_draws_every_token_as_before(long_run):
    short = long_run[:, :, :80, :80] / long_run[:, :, :80, :80].sum(-1, keepdims=True)
    fig = figures.head_view(_result(short), layer=0, max_tokens=None)
    assert fig.layout.height == 120 + 18 * 80 and len(label_traces(fig)[0].text) == 80
    assert list(label_traces(fig)[0].text) == [f"w{i}" for i in range(80)]  # the whole run: plain labels
    assert "tokens" not in fig.layout.title.text
    # A run within the default window is drawn whole, as it always was.
    fig = figures.head_view(_result(short[:, :, :50, :50]), layer=0)
    assert list(label_traces(fig)[0].text) == [f"w{i}" for i in range(50)] and fig.layout.height == 120 + 18 * 50


@pytest.mark.parametrize("kwargs, message", [
    ({"start": 1200}, "start=1200 is outside the run: it has 1,200 tokens, so start must be in 0..1199"),
    ({"start": -1}, "start=-1 is outside the run: it has 1,200 tokens, so start must be in 0..1199"),
    ({"max_tokens": 0}, "max_tokens must be a whole number of tokens, at least 1 (or None for all), got 0"),
    ({"max_tokens": 2.5}, "max_tokens must be a whole number of tokens"),
])
def test_a_window_outside_the_run_is_a_clear_error(long_run, kwargs, message):
    with pytest.raises(ValueError) as raised:
        figures.head_view(_result(long_run), layer=0, **kwargs)
    assert message in str(raised.value)


def test_start_is_a_position_in_the_run_when_tokens_are_hidden():
    n = 100
    rng = np.random.default_rng(3)
    a = np.tril(rng.uniform(0.01, 1, (1, 1, n, n))).astype(np.float32)
    a /= a.sum(-1, keepdims=True)
    special = [i in (0, 50, n - 1) for i in range(n)]
    result = _result(a, special)
    fig = figures.head_view(result, layer=0, hide_special=True, start=50, max_tokens=5)
    queries, _ = label_traces(fig)
    assert list(queries.text) == [f"{p} w{p}" for p in (51, 52, 53, 54, 55)]  # 50 is hidden: the first visible after it
    # The weights are those of the hidden-token view (rows renormalised), over the window.
    w = figures.weights_of(result).without(hide_special=True)
    lo = w.positions.index(51)
    part = w.head(0, 0)[lo:lo + 5, lo:lo + 5]
    assert drawn_lines(fig, 0).keys() == {(int(q) + lo, int(k) + lo) for q, k in zip(*np.nonzero(part >= figures.MIN_DRAWN))}
    with pytest.raises(ValueError, match=r"start=99: every token from there on is hidden \(special tokens\); "
                                         r"the last one drawn is at position 98"):
        figures.head_view(result, layer=0, hide_special=True, start=99)
