"""What a kept run's views hold at their peak, counted by the allocator.

Every allocation and free of a call is recorded by torch's profiler (profile_memory) in order, so
the peak of the bytes alive beyond the answer is exact and deterministic, not a timing.
`KeptAttention.block` holds its answer plus one block of scores (`block_cells`); a tile or top-k
request (`pooled`, `topk_rows`) holds the block of weights it pools or ranks besides, so about two
blocks (README, "Bounded work"). Before, a block call held 2 to 4 blocks beyond its answer (the previous
block's scores until the next ones existed, a float copy of the causal mask, a gathered copy of
every asked head's keys: for a layer mean, larger than the scores themselves), and a tile 3 to 5.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from manyeyes.model.kept import KeptAttention, pooled, topk_rows

T, HEADS, KV_HEADS, HEAD_DIM = 1024, 4, 2, 16
BLOCK_CELLS = 1 << 16  # 256 KiB of float32 scores
# Beyond the block: a few KiB whatever its size (one head's scaled queries, the rows' max and sum).
SLACK_BYTES = 16 * 1024


def kept_run(causal: bool, window: int | None) -> tuple[KeptAttention, torch.Tensor]:
    """A kept run of random queries and keys (grouped-query, two query heads per key head), with
    each row's max and sum as the forward keeps them, and its weights as a float64 softmax."""
    g = torch.Generator().manual_seed(0)
    queries = torch.randn(1, HEADS, T, HEAD_DIM, generator=g)
    keys = torch.randn(1, KV_HEADS, T, HEAD_DIM, generator=g)
    # (heads, T, head_dim) @ (heads, head_dim, T): query head h reads key head h // 2
    scores = (queries[0] * HEAD_DIM**-0.5) @ keys[0].repeat_interleave(HEADS // KV_HEADS, 0).transpose(1, 2)
    pos = torch.arange(T)
    blocked = torch.zeros(T, T, dtype=torch.bool)
    if causal:
        blocked |= pos[None, :] > pos[:, None]
    if window is not None:
        blocked |= pos[None, :] <= pos[:, None] - window
    scores = scores.masked_fill(blocked, -torch.inf)
    row_max = scores.amax(-1)
    row_sum = (scores - row_max[..., None]).exp().sum(-1)
    kept = KeptAttention(queries, keys, row_max[None], row_sum[None], torch.zeros(1, HEADS, 1, 1), causal, (window,),
                         block_rows=64, key_align=32)
    return kept, torch.softmax(scores.double(), -1)


def peak_beyond_answer(fn) -> tuple[torch.Tensor, int]:
    """fn()'s answer, and the most bytes alive at once during the call besides that answer."""
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    records = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert records, "the profiler recorded no allocations"
    alive = peak = 0
    for nbytes in records:  # + an allocation, - a free, in the order they happened
        alive += nbytes
        peak = max(peak, alive)
    answer = out.numel() * out.element_size()
    assert alive == answer, "the count is complete: all that is left is the answer"
    return out, peak - answer


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 100)])
@pytest.mark.parametrize("heads", [[1], [0, 1, 2, 3]], ids=["one-head", "layer-mean"])
@pytest.mark.parametrize("q0,q1,k0,k1", [(0, T, 0, T), (300, 700, 100, 900)], ids=["whole", "window"])
def test_a_block_call_holds_its_answer_plus_one_block(causal, window, heads, q0, q1, k0, k1):
    kept, reference = kept_run(causal, window)
    out, extra = peak_beyond_answer(lambda: kept.block(0, heads, q0, q1, k0, k1, block_cells=BLOCK_CELLS))
    block_bytes = 4 * BLOCK_CELLS
    assert extra <= block_bytes + SLACK_BYTES, f"held {extra / block_bytes:.2f} blocks beyond its answer"
    # ... and the weights are still the softmax's (float32 against float64).
    assert (out.double() - reference[heads, q0:q1, k0:k1]).abs().max() <= 1e-6


def test_a_row_over_the_budget_is_one_row_at_a_time():
    """When one row of the asked heads outgrows block_cells, a block is that one row."""
    kept, reference = kept_run(True, None)
    tiny = 256  # cells: under one row of four heads over the 1,024 keys
    out, extra = peak_beyond_answer(lambda: kept.block(0, [0, 1, 2, 3], 900, 964, 0, T, block_cells=tiny))
    assert extra <= 4 * 4 * T + SLACK_BYTES, f"held {extra:,} bytes beyond its answer: more than one row"
    assert (out.double() - reference[:, 900:964]).abs().max() <= 1e-6


@pytest.mark.parametrize("view", ["tile", "tile-mean-pool", "tile-of-the-layer-mean", "tall-bins", "topk"])
def test_a_tile_or_topk_request_holds_its_answer_plus_about_two_blocks(view):
    """The block of weights handed to the pooling (or the top-k), and the scores it is made in."""
    kept, reference = kept_run(True, None)
    calls = {
        "tile": lambda: pooled(kept, 0, [1], 0, T, 0, T, 256, 256, "max", BLOCK_CELLS).values,
        "tile-mean-pool": lambda: pooled(kept, 0, [1], 0, T, 0, T, 256, 256, "mean", BLOCK_CELLS).values,
        "tile-of-the-layer-mean": lambda: pooled(kept, 0, None, 100, 900, 0, T, 200, 256, "max", BLOCK_CELLS).values,
        "tall-bins": lambda: pooled(kept, 0, None, 0, T, 0, T, 1, 5, "max", BLOCK_CELLS).values,
        "topk": lambda: topk_rows(kept, 0, 1, 8, 0, T, BLOCK_CELLS).values,
    }
    out, extra = peak_beyond_answer(calls[view])
    # 2.0 to 2.3 blocks: pool=mean pads a copy of the block, top-k sorts in its own buffers.
    assert extra <= 2.5 * 4 * BLOCK_CELLS, f"held {extra / (4 * BLOCK_CELLS):.2f} blocks beyond its answer"
    if view == "tile":  # 4 x 4 max-pooled bins of the float64 softmax
        want = reference[1].view(256, 4, 256, 4).amax((1, 3))
        assert (out.double() - want).abs().max() <= 1e-6
    if view == "topk":
        assert (out.double() - reference[1].topk(8, -1).values).abs().max() <= 1e-6
