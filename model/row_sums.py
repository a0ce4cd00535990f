"""The head table's per-row sums over keys, in one vectorised pass over a run's weights.

For every head and query row i, with p_j = α_ij:

    Σ_j p_j log p_j,   Σ_j p_j |i - j|,   Σ_j p_j copy_ij,   Σ_j p_j delimiter_j

Eager PyTorch needs a pass (and a T² temporary) per term, and its `log` alone cost as much as
the other three together: the head table came to 30% of MiniLM's forward at T=512 (README,
"What the measures cost"). One compiled loop reads each weight once. numba's own `log` is a
scalar libm call that stops the loop from vectorising, so the logarithm is written out here:
the exponent read from the float's bits, the mantissa reduced to [√½, √2) and its log from the
atanh series, whose first dropped term is below 1e-9 there (float32 rounding dominates).
"""

from __future__ import annotations

import numpy as np

from manyeyes.model.jit import compiled

_LN2 = np.float32(0.6931471805599453)
_MANTISSA_SCALE = np.float32(1.0 / (1 << 23))
_SQRT2 = np.float32(1.4142135623730951)

# fastmath lets LLVM reorder the four running sums into vector lanes (partial sums: closer to the
# exact sum than one sequential float32 accumulator); error_model="numpy" drops the zero-division
# branch that would otherwise keep the loop scalar; nogil lets the server's other threads run.
_compiled = compiled(fastmath=True, nogil=True, boundscheck=False, error_model="numpy")


@_compiled
def _one_row(weights, bits, copies, delimiters, query, visible):
    plogp = np.float32(0.0)
    distance = np.float32(0.0)
    duplicate = np.float32(0.0)
    delimiter = np.float32(0.0)
    row = np.float32(query)
    for key in range(visible):
        p = weights[key]
        raw = bits[key]
        # p = 2^exponent · mantissa. p = 0 reads as 2^-127 · 1: a finite log, times p = 0.
        exponent = np.float32((raw >> 23) - 127)
        mantissa = np.float32(raw & 0x7FFFFF) * _MANTISSA_SCALE + np.float32(1.0)
        halve = np.float32(mantissa > _SQRT2)  # a select, not a branch: the loop stays vectorised
        mantissa = mantissa * (np.float32(1.0) - np.float32(0.5) * halve)
        exponent = exponent + halve
        f = mantissa - np.float32(1.0)
        z = f / (np.float32(2.0) + f)  # log m = 2 atanh z, |z| ≤ 0.172
        z2 = z * z
        series = np.float32(1.0) + z2 * (np.float32(1 / 3) + z2 * (np.float32(1 / 5) + z2 * np.float32(1 / 7)))
        plogp += p * (exponent * _LN2 + np.float32(2.0) * z * series)
        distance += p * abs(row - np.float32(key))
        duplicate += p * copies[key]
        delimiter += p * delimiters[key]
    return plogp, distance, duplicate, delimiter


@_compiled
def _all_rows(weights, copies, delimiters, causal, out):
    n_heads, n_tokens = weights.shape[0], weights.shape[1]
    bits = weights.view(np.int32)
    for head in range(n_heads):
        for query in range(n_tokens):
            # A causal row's weights past the query are exactly 0 (masked before the softmax).
            visible = query + 1 if causal else n_tokens
            sums = _one_row(weights[head, query], bits[head, query], copies[query], delimiters, query, visible)
            for k in range(4):
                out[k, head, query] = sums[k]


def row_sums(weights: np.ndarray, copies: np.ndarray, delimiters: np.ndarray, causal: bool) -> np.ndarray:
    """(4, N, T) float32: Σ p log p, Σ p |i - j|, Σ p copies_ij and Σ p delimiters_j per row.

    weights: (N, T, T) float32 rows of softmax weights; copies: (T, T) float32 0/1 (key j is an
    earlier copy of query i's token); delimiters: (T,) float32 0/1.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    out = np.empty((4,) + weights.shape[:2], dtype=np.float32)
    _all_rows(weights, np.ascontiguousarray(copies, dtype=np.float32),
              np.ascontiguousarray(delimiters, dtype=np.float32), bool(causal), out)
    return out
