"""u8 and f16 decode to the json values: within 1/255 and 1e-3."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.api.conftest import decode

TEXTS = ["The bank of the river.", "Attention is all you need, they said, and then " * 6]


@pytest.mark.parametrize("text", TEXTS)
def test_compact_formats_decode_to_the_json_values(api, text):
    as_json = api.post("/api/v1/attention", json={"text": text, "format": "json"}).json()
    reference = decode(as_json["attention"])
    assert reference.shape[2] > 5

    u8 = api.post("/api/v1/attention", json={"text": text, "format": "u8"}).json()["attention"]
    assert (u8["dtype"], u8["shape"], u8["scale"]) == ("uint8", list(reference.shape), 1 / 255)
    assert len(base64.b64decode(u8["data"])) == reference.size
    assert np.abs(decode(u8) - reference).max() <= 1 / 255

    f16 = api.post("/api/v1/attention", json={"text": text, "format": "f16"}).json()["attention"]
    assert (f16["dtype"], f16["shape"]) == ("float16", list(reference.shape)) and "scale" not in f16
    assert len(base64.b64decode(f16["data"])) == 2 * reference.size
    assert np.abs(decode(f16) - reference).max() <= 1e-3


def test_u8_rounds_to_nearest_and_keeps_ones_and_zeros(api):
    # Layer 0 of MiniLM has heads near one-hot; rounding (not truncation) keeps 1.0 as 255.
    body = api.post("/api/v1/attention", json={"text": "One two three.", "format": "json"}).json()
    reference = decode(body["attention"])
    u8 = api.post("/api/v1/attention", json={"text": "One two three.", "format": "u8"}).json()["attention"]
    raw = np.frombuffer(base64.b64decode(u8["data"]), dtype=np.uint8).reshape(reference.shape)
    np.testing.assert_array_equal(raw, np.rint(reference * 255).astype(np.uint8))


def test_f16_is_little_endian_row_major(api):
    """Every element in C order: query rows, then keys. First and last elements alone are the same
    in row- and column-major order, so the whole head is compared, and it is not symmetric."""
    request = {"text": "Rows and columns differ.", "layers": [2], "heads": [5]}
    body = api.post("/api/v1/attention", json={**request, "format": "json"}).json()
    f16 = api.post("/api/v1/attention", json={**request, "format": "f16"}).json()["attention"]
    reference = np.asarray(body["attention"]["data"], dtype=np.float32)  # (1, 1, T, T), nested lists: unambiguous
    head = reference[0, 0]
    assert np.abs(head - head.T).max() > 0.05  # a transposed layout would show
    flat = np.frombuffer(base64.b64decode(f16["data"]), dtype="<f2").astype(np.float32)
    assert np.abs(flat - head.reshape(-1)).max() <= 1e-3  # row-major: row r starts at r * T
    assert np.abs(flat - head.T.reshape(-1)).max() > 0.05
