"""The head table's per-row sums over keys, in one vectorised pass over a run's weights.

For every head and query row i, with p_j = α_ij:

    Σ_j p_j log p_j,   Σ_j p_j |i - j|,   Σ_j p_j copy_ij,   Σ_j p_j delimiter_j

and, from the same read of the row, its argmax (the positional tag's input) and the weights
α_ii, α_i,i-1 and α_i0. A separate numpy argmax was a second pass over every weight (a fifth of
the head table's time at T=512), and reading a diagonal from (N, T, T) touches a cache line per
row, three times over.

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
# int32 constants: with Python ints numba widens the bits to int64, and AVX2 has no 64-bit
# arithmetic shift, so each lane went out and back (a quarter of the loop's time).
_EXPONENT_SHIFT = np.int32(23)
_EXPONENT_BIAS = np.int32(127)
_MANTISSA_MASK = np.int32(0x7FFFFF)

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
    # Weights are ≥ 0, where a float's order is its bits' order as an int32: an integer maximum
    # keeps the loop vectorised (a float max or a running argmax did not).
    top = np.int32(-1)
    row = np.float32(query)
    # The key's position as a float32 counted alongside: float32(key) from the int64 loop index
    # was eight scalar conversions per vector. Exact up to 2^24 positions.
    at = np.float32(0.0)
    for key in range(visible):
        p = weights[key]
        raw = bits[key]
        # p = 2^exponent · mantissa. p = 0 reads as 2^-127 · 1: a finite log, times p = 0.
        exponent = np.float32(np.int32(raw >> _EXPONENT_SHIFT) - _EXPONENT_BIAS)
        mantissa = np.float32(raw & _MANTISSA_MASK) * _MANTISSA_SCALE + np.float32(1.0)
        halve = np.float32(mantissa > _SQRT2)  # a select, not a branch: the loop stays vectorised
        mantissa = mantissa * (np.float32(1.0) - np.float32(0.5) * halve)
        exponent = exponent + halve
        f = mantissa - np.float32(1.0)
        z = f / (np.float32(2.0) + f)  # log m = 2 atanh z, |z| ≤ 0.172
        z2 = z * z
        series = np.float32(1.0) + z2 * (np.float32(1 / 3) + z2 * (np.float32(1 / 5) + z2 * np.float32(1 / 7)))
        plogp += p * (exponent * _LN2 + np.float32(2.0) * z * series)
        distance += p * abs(row - at)
        at += np.float32(1.0)
        duplicate += p * copies[key]
        delimiter += p * delimiters[key]
        top = raw if raw > top else top
    first = 0  # the first maximum, as numpy's argmax; the row is in cache by now
    while first < visible - 1 and bits[first] != top:
        first += 1
    return plogp, distance, duplicate, delimiter, first


@_compiled
def _all_rows(weights, copies, delimiters, causal, out, argmax):
    n_heads, n_tokens = weights.shape[0], weights.shape[1]
    bits = weights.view(np.int32)
    for head in range(n_heads):
        for query in range(n_tokens):
            # A causal row's weights past the query are exactly 0 (masked before the softmax).
            visible = query + 1 if causal else n_tokens
            row = weights[head, query]
            plogp, distance, duplicate, delimiter, first = _one_row(
                row, bits[head, query], copies[query], delimiters, query, visible)
            out[0, head, query] = plogp
            out[1, head, query] = distance
            out[2, head, query] = duplicate
            out[3, head, query] = delimiter
            out[4, head, query] = row[query]
            out[5, head, query] = row[query - 1] if query > 0 else np.float32(0.0)
            out[6, head, query] = row[0]
            argmax[head, query] = first


def row_sums(weights: np.ndarray, copies: np.ndarray, delimiters: np.ndarray,
             causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(7, N, T) float32 per row: Σ p log p, Σ p |i - j|, Σ p copies_ij, Σ p delimiters_j, then
    α_ii, α_i,i-1 (0 on the first row) and α_i0; and (N, T) int64: each row's first argmax (a
    causal row's among the keys it sees).

    weights: (N, T, T) float32 rows of softmax weights; copies: (T, T) float32 0/1 (key j is an
    earlier copy of query i's token); delimiters: (T,) float32 0/1.
    """
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    out = np.empty((7,) + weights.shape[:2], dtype=np.float32)
    argmax = np.empty(weights.shape[:2], dtype=np.int64)
    _all_rows(weights, np.ascontiguousarray(copies, dtype=np.float32),
              np.ascontiguousarray(delimiters, dtype=np.float32), bool(causal), out, argmax)
    return out, argmax
