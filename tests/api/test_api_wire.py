"""The binary frame and compression negotiation: the same answer, byte for byte, in every form."""

from __future__ import annotations

import base64
import gzip
import struct

import numpy as np
import orjson
import pytest
import zstandard

from manyeyes.app.config import Settings
from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, MAGIC, listed, prefers_frame, read_frame
from tests.api.conftest import decode, serve

FRAME = {"Accept": FRAME_MEDIA_TYPE, "Accept-Encoding": "identity"}
PLAIN = {"Accept-Encoding": "identity"}
TEXT = "The heron waited by the old stone mill while the boats went past."
DTYPES = {"u8": np.uint8, "f16": np.dtype("<f2"), "json": np.dtype("<f4")}


def raw_post(api, body: dict, headers: dict, path: str = "/api/v1/attention"):
    r = api.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text[:300]
    return r


def frame_arrays(body: bytes) -> tuple[dict, list[np.ndarray]]:
    """Decodes a frame as an independent client would: by the documented layout, not our helper."""
    assert body[:4] == MAGIC
    (size,) = struct.unpack_from("<I", body, 4)
    assert (8 + size) % 8 == 0, "the data section must start 8-byte aligned"
    header = orjson.loads(body[8 : 8 + size])
    data = body[8 + size :]
    results = header["results"] if "results" in header else [header]
    arrays = []
    for result in results:
        att = result["attention"]
        assert "data" not in att
        chunk = data[att["offset"] : att["offset"] + att["nbytes"]]
        values = np.frombuffer(chunk, dtype=DTYPES[att["format"]]).reshape(att["shape"]).astype(np.float32)
        arrays.append(values * att["scale"] if att["format"] == "u8" else values)
    end = max(r["attention"]["offset"] + r["attention"]["nbytes"] for r in results)
    assert end == len(data), "the data section holds exactly the results' bytes"
    return header, arrays


@pytest.mark.parametrize("fmt", ["u8", "f16", "json"])
def test_frame_carries_the_same_answer_as_json(api, fmt):
    body = {"text": TEXT, "format": fmt, "layers": [0, 3], "heads": [1, 5, 7]}
    as_json = raw_post(api, body, PLAIN).json()
    r = raw_post(api, body, FRAME)
    assert r.headers["content-type"] == FRAME_MEDIA_TYPE
    assert "content-encoding" not in r.headers
    header, (values,) = frame_arrays(r.content)
    for key in ("run_id", "tokens", "layers", "heads", "n_layers", "n_heads", "causal", "model"):
        assert header[key] == as_json[key], key
    assert header["attention"]["shape"] == as_json["attention"]["shape"] == [2, 3, len(as_json["tokens"]), len(as_json["tokens"])]
    # Exactly the JSON form's numbers: the frame changes the wrapping, never the values.
    np.testing.assert_array_equal(values, decode(as_json["attention"]))
    if fmt != "json":
        assert bytes(read_frame(r.content)[1]) == base64.b64decode(as_json["attention"]["data"])


def test_frame_of_a_batch_and_of_a_cached_slice(api):
    texts = ["I sat by the bank.", "I paid at the bank of the river yesterday.", "Quiet."]
    r = raw_post(api, {"texts": texts, "format": "u8"}, FRAME, "/api/v1/attention/batch")
    header, arrays = frame_arrays(r.content)
    assert [len(res["tokens"]) for res in header["results"]] == [a.shape[-1] for a in arrays]
    offsets = [res["attention"]["offset"] for res in header["results"]]
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(set(offsets)) == 3
    for text, values, res in zip(texts, arrays, header["results"]):
        single = raw_post(api, {"text": text, "format": "u8"}, PLAIN).json()
        assert single["run_id"] == res["run_id"]
        np.testing.assert_array_equal(values, decode(single["attention"]))
    run_id = header["results"][1]["run_id"]
    sliced = api.get(f"/api/v1/runs/{run_id}/attention?layers=5&heads=0,11&format=f16", headers=FRAME)
    assert sliced.status_code == 200 and sliced.headers["content-type"] == FRAME_MEDIA_TYPE
    _, (values,) = frame_arrays(sliced.content)
    np.testing.assert_allclose(values, arrays[1][[5]][:, [0, 11]], atol=0.5 / 255 + 1e-3)


def test_frame_is_raw_bytes_where_json_has_base64(api):
    body = {"text": TEXT * 3, "format": "u8"}
    framed = raw_post(api, body, FRAME).content
    as_json = raw_post(api, body, PLAIN).content
    header, data = read_frame(framed)
    cells = int(np.prod(header["attention"]["shape"]))
    assert len(data) == cells == header["attention"]["nbytes"]
    # Header plus one byte a weight, against 4/3 of a byte a weight in base64.
    assert len(framed) < cells + 8 + len(orjson.dumps(header)) + 8
    assert len(as_json) > cells * 4 / 3


def unzstd(raw: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompressobj().decompress(raw)


class Sent:
    """An answer's headers and its body exactly as it went on the wire (not decoded)."""

    def __init__(self, api, body: dict | None, headers: dict, path: str = "/api/v1/attention") -> None:
        with api.stream("POST" if body is not None else "GET", path, json=body, headers=headers) as r:
            self.status_code, self.headers, self.content = r.status_code, r.headers, b"".join(r.iter_raw())


def test_compact_answers_compressed_only_when_asked_and_only_when_big(api):
    body = {"text": TEXT * 4, "format": "u8"}
    plain = orjson.loads(raw_post(api, body, PLAIN).content)
    for accept in ("zstd", "gzip, deflate, br, zstd"):
        r = Sent(api, body, {"Accept-Encoding": accept})
        assert r.headers["content-encoding"] == "zstd"
        assert "Accept-Encoding" in r.headers["vary"]
        assert int(r.headers["content-length"]) == len(r.content) < len(orjson.dumps(plain)) / 2
        assert orjson.loads(unzstd(r.content))["attention"] == plain["attention"]
    framed = Sent(api, body, {"Accept": FRAME_MEDIA_TYPE, "Accept-Encoding": "zstd"})
    assert framed.headers["content-encoding"] == "zstd"
    _, (values,) = frame_arrays(unzstd(framed.content))
    np.testing.assert_array_equal(values, decode(plain["attention"]))
    # q=0 refuses it; identity is no compression.
    for refused in ("zstd;q=0", "identity"):
        r = Sent(api, body, {"Accept-Encoding": refused})
        assert "content-encoding" not in r.headers, refused
        assert orjson.loads(r.content)["attention"] == plain["attention"]
    # A browser over plain http offers gzip, never zstd: its compact answers and frames are gzipped.
    for accept, wire in (("gzip, deflate", {}), ("gzip, deflate", {"Accept": FRAME_MEDIA_TYPE})):
        r = Sent(api, body, {"Accept-Encoding": accept, **wire})
        assert r.headers["content-encoding"] == "gzip"
        assert int(r.headers["content-length"]) == len(r.content) < len(orjson.dumps(plain)) / 2
        if wire:
            np.testing.assert_array_equal(frame_arrays(gzip.decompress(r.content))[1][0], values)
        else:
            assert orjson.loads(gzip.decompress(r.content))["attention"] == plain["attention"]
    # The size is in the zstd frame's header: a client's one-call decompress needs it.
    assert zstandard.ZstdDecompressor().decompress(framed.content) == unzstd(framed.content)
    # Small answers are not worth it, whatever the client accepts.
    small = Sent(api, {"text": "Hi.", "format": "u8", "layers": [0], "heads": [0]}, {"Accept-Encoding": "zstd"})
    assert "content-encoding" not in small.headers


def test_json_text_is_gzipped_for_gzip_clients_and_decodes_to_the_same_numbers(api):
    body = {"text": TEXT, "format": "json", "layers": [1]}
    plain = raw_post(api, body, PLAIN).json()
    r = Sent(api, body, {"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip"
    assert orjson.loads(gzip.decompress(r.content))["attention"]["data"] == plain["attention"]["data"]
    assert len(r.content) < len(orjson.dumps(plain)) / 2
    r = Sent(api, body, {"Accept-Encoding": "zstd, gzip"})
    assert r.headers["content-encoding"] == "zstd"
    assert orjson.loads(unzstd(r.content))["attention"]["data"] == plain["attention"]["data"]


@pytest.mark.parametrize(
    "header, token, expected",
    [
        ("gzip, deflate, br, zstd", "zstd", True),
        ("gzip;q=1.0, zstd;q=0", "zstd", False),
        ("ZSTD", "zstd", True),
        ("xzstd, zstdx", "zstd", False),
        (None, "gzip", False),
        ("application/json, application/vnd.manyeyes.frame;q=0.9", FRAME_MEDIA_TYPE, True),
        ("*/*", FRAME_MEDIA_TYPE, False),  # only a client that names the frame gets one
        # RFC 9110's qvalue is 0 to 1 with at most three decimals; float() read these as q > 0.
        ("zstd;q=inf", "zstd", False),
        ("zstd;q=1e999", "zstd", False),
        ("zstd;q=2", "zstd", False),
        ("zstd;q=0.001", "zstd", True),
        ("zstd; q = 0.5", "zstd", True),
    ],
)
def test_a_header_lists_a_token_with_a_q_above_0(header, token, expected):
    assert ((listed(header, token) or 0.0) > 0) is expected


@pytest.mark.parametrize(
    "accept_encoding, nbytes, text, expected",
    [
        ("gzip, deflate, br, zstd", 2000, True, "zstd"),  # a tie goes to zstd
        ("gzip;q=1, zstd;q=0.5", 2000, True, "gzip"),  # the client's ranking wins
        ("gzip;q=0.5, zstd;q=1", 2000, True, "zstd"),
        ("gzip;q=1, zstd;q=0.5", 100_000, False, "gzip"),
        # A browser over plain http offers no zstd: its 19 MB answers went uncompressed.
        ("gzip, deflate", 100_000, False, "gzip"),
        ("zstd", 1000, False, None),  # compact, under zstd_min_bytes
        ("zstd, gzip", 500, True, None),  # text under gzip_min_bytes
        ("zstd;q=0, gzip;q=0.1", 2000, True, "gzip"),
        # `*` is every coding the header does not name (RFC 9110, 12.5.3): it went unread.
        ("*", 2000, True, "zstd"),
        ("*", 100_000, False, "zstd"),
        ("gzip;q=0.5, *;q=1", 2000, True, "zstd"),
        ("zstd;q=0, *", 2000, True, "gzip"),
        ("*;q=0", 2000, True, None),
    ],
)
def test_compression_follows_the_clients_ranking(accept_encoding, nbytes, text, expected):
    from manyeyes.app.services.wire import Compression

    assert Compression(1, 65536, 1, 1024).choose(accept_encoding, nbytes, text) == expected


def test_zstd_min_bytes_0_turns_compression_off_for_compact_bodies_only():
    from manyeyes.app.services.wire import Compression

    off = Compression(1, 0, 1, 1024)
    assert off.choose("zstd", 10**6, False) is None
    assert off.choose("gzip", 10**6, False) is None
    assert off.choose("zstd", 10**6, True) == "zstd"
    assert off.choose("gzip", 10**6, True) == "gzip"


@pytest.mark.parametrize(
    "accept, frame",
    [
        (FRAME_MEDIA_TYPE, True),
        (f"{FRAME_MEDIA_TYPE}, application/json;q=0.5", True),  # what the page and the Python client send
        (f"{FRAME_MEDIA_TYPE};q=0.1, application/json;q=1", False),  # JSON preferred
        (f"application/json;q=0.5, {FRAME_MEDIA_TYPE};q=0.5", True),  # a tie goes to the one named
        (f"{FRAME_MEDIA_TYPE};q=0.5, */*", False),  # anything else, at 1, covers JSON
        (f"{FRAME_MEDIA_TYPE};q=0.5, application/*;q=0.4, */*", True),  # the most specific range counts
        (f"{FRAME_MEDIA_TYPE};q=0", False),
        # The compact JSON form's own type ranks JSON too: it was not read, and the frame came.
        (f"application/vnd.manyeyes+json, {FRAME_MEDIA_TYPE};q=0.5", False),
        (f"application/vnd.manyeyes+json;q=1, {FRAME_MEDIA_TYPE};q=0.9", False),
        (f"application/vnd.manyeyes+json;q=0.2, {FRAME_MEDIA_TYPE};q=0.9", True),
        (f"application/vnd.manyeyes+json;q=0.2, application/json, {FRAME_MEDIA_TYPE};q=0.9", False),
        ("*/*", False),
        (None, False),
    ],
)
def test_the_frame_only_when_the_client_does_not_rank_json_higher(accept, frame):
    assert prefers_frame(accept) is frame


def test_a_header_sent_on_two_lines_is_read_as_one_list(api):
    body = {"text": "The bank.", "format": "u8"}
    r = api.post("/api/v1/attention", json=body,
                 headers=[("Accept", "application/json;q=0.1"), ("Accept", FRAME_MEDIA_TYPE)])
    assert r.headers["content-type"] == FRAME_MEDIA_TYPE
    r = api.post("/api/v1/attention", json={"text": "The bank.", "format": "json"},
                 headers=[("Accept-Encoding", "gzip;q=0"), ("Accept-Encoding", "zstd")])
    assert r.headers["content-encoding"] == "zstd"  # read from the second line


def test_other_routes_gzip_only_for_a_client_that_accepts_it(api):
    # Starlette's GZipMiddleware looked for the substring "gzip": "gzip;q=0" got gzip anyway.
    # `*` is every coding not named (RFC 9110, 12.5.3), as the attention routes read it; and a
    # name in capitals is the same name: neither got gzip here (review h47i).
    for header, expected in (("gzip", "gzip"), ("gzip;q=0", None), ("gzip;q=0, zstd", None), ("br;q=1, gzip;q=0.5", "gzip"),
                             ("*", "gzip"), ("br, *;q=0.5", "gzip"), ("gzip;q=0, *", None), ("*;q=0", None), ("GZIP", "gzip")):
        r = api.get("/openapi.json", headers={"Accept-Encoding": header})
        assert r.status_code == 200 and r.headers.get("content-encoding") == expected, header
        assert r.json()["info"]["title"]  # httpx decoded what was sent, compressed or not


@pytest.mark.parametrize("encoding", ["identity", "gzip", "br", "zstd"])
def test_vary_names_each_header_once(api, encoding):
    """Starlette's gzip added Accept-Encoding to the answers' own "Accept, Accept-Encoding"."""
    long_text = "The bank of the river was full of fish. " * 5  # answers past every compression threshold
    for body in ({"text": long_text}, {"text": long_text, "format": "u8"}):
        r = api.post("/api/v1/attention", json=body, headers={"Accept-Encoding": encoding})
        assert r.status_code == 200 and r.headers.get_list("vary") == ["Accept, Accept-Encoding"], r.headers
    r = api.get("/openapi.json", headers={"Accept-Encoding": encoding})
    assert r.headers.get_list("vary") in ([], ["Accept-Encoding"]), r.headers


def test_gzip_middleware_passes_the_answers_of_routes_that_encode_themselves_as_they_are():
    import asyncio

    from manyeyes.app.middleware import Gzip

    body = b'{"text": "' + b"a" * 4000 + b'"}'
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}

    async def app(scope, receive, send):
        await send({**start, "headers": list(start["headers"])})  # Starlette's gzip adds to the list it is sent
        await send({"type": "http.response.body", "body": body})

    def answer(path: str) -> list[dict]:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"accept-encoding", b"gzip")]}
        asyncio.run(Gzip(app, encodes_itself=["/own", "/runs/{run_id}/own"], minimum_size=1024)(scope, None, send))
        return sent

    for own in ("/own", "/runs/0123/own"):  # a template is matched as the router matches it
        assert answer(own) == [start, {"type": "http.response.body", "body": body}], own
    for other in ("/other", "/runs/0123/other", "/runs/0123/own/more", "/runs//own"):
        sent = answer(other)
        assert (b"content-encoding", b"gzip") in sent[0]["headers"], other
        assert gzip.decompress(b"".join(m.get("body", b"") for m in sent[1:])) == body


@pytest.fixture(scope="module")
def gzips_from_256():
    """A server that compresses JSON text from 256 bytes: a MiniLM cell's answer is 935."""
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, gzip_min_bytes=256))
    yield client
    client.__exit__(None, None, None)


@pytest.mark.parametrize("accept_encoding, chosen", [("*", "zstd"), ("zstd;q=1, *;q=0.5", "zstd"),
                                                     ("ZSTD;q=0.2, GZIP;q=0.1", "zstd"), ("gzip;q=1, zstd;q=0.5", "gzip")])
def test_every_get_of_a_run_that_encodes_itself_chooses_as_post_attention_does(gzips_from_256, accept_encoding, chosen):
    """The gzip middleware knew these routes by their templates but compared them with the request's
    path, so it stood in front of them and replaced an Accept-Encoding without the word "gzip" by a
    bare "gzip" before they read it: `*` got zstd from POST /attention and gzip here (review h52c)."""
    api = gzips_from_256
    assert Sent(api, {"text": TEXT}, {"Accept-Encoding": accept_encoding}).headers.get("content-encoding") == chosen
    base = f"/api/v1/runs/{raw_post(api, {'text': TEXT, 'format': 'u8'}, PLAIN).json()['run_id']}"
    for path in (f"{base}/attention?format=json", f"{base}/tile?layer=0&head=0&format=json",
                 f"{base}/topk?layer=0&head=0&format=json", f"{base}/overview?format=json",
                 f"{base}/cell?query=1&key=0&format=json", f"{base}/mean?format=json"):
        r = Sent(api, None, {"Accept-Encoding": accept_encoding}, path)
        assert r.status_code == 200 and r.headers.get("content-encoding") == chosen, (path, r.headers)
    # The run's other JSON (its info, its measures) is still the middleware's: gzip or nothing.
    for path in (base, f"{base}/measures?names=rollout"):
        r = Sent(api, None, {"Accept-Encoding": accept_encoding}, path)
        assert r.status_code == 200 and r.headers.get("content-encoding") == "gzip", (path, r.headers)
    r = Sent(api, None, {"Accept-Encoding": accept_encoding}, f"{base}/nothing")
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"


def test_unique_vary_keeps_order_and_other_headers():
    from manyeyes.app.middleware import unique_vary

    raw = [(b"content-type", b"application/json"), (b"vary", b"Accept, accept-encoding, Accept-Encoding"),
           (b"Vary", b"Accept , Origin"), (b"x-other", b"a, a")]
    assert unique_vary(raw) == [(b"content-type", b"application/json"), (b"vary", b"Accept, accept-encoding"),
                                (b"Vary", b"Origin"), (b"x-other", b"a, a")]


def test_a_raw_frame_renders_on_the_event_loop_and_slower_forms_on_a_worker_thread(api, monkeypatch):
    """A raw frame only quantises or views the weights, cheaper than a hop to a worker thread
    and back; base64, compression and frames past MiniLM's T=128 go to the worker thread."""
    import asyncio

    service = api.app.state.service
    real_render = service._render
    where = []

    def render(*args):
        try:
            asyncio.get_running_loop()
            where.append("loop")
        except RuntimeError:
            where.append("worker")
        return real_render(*args)

    monkeypatch.setattr(service, "_render", render)

    def thread_for(words: int, fmt: str, headers: dict) -> str:
        text = " ".join(f"w{i}" for i in range(words))  # each "w<i>" is two tokens, plus [CLS] and [SEP]
        raw_post(api, {"text": text, "format": fmt}, headers)
        return where.pop()

    assert thread_for(30, "u8", FRAME) == "loop"  # T=62: 277K cells, over the 100K of other forms
    assert thread_for(30, "f16", FRAME) == "loop"
    assert thread_for(30, "json", FRAME) == "loop"  # float32 frames are a view of the weights
    assert thread_for(30, "u8", {**FRAME, "Accept-Encoding": "zstd"}) == "worker"  # 277 KB to compress
    assert thread_for(30, "u8", PLAIN) == "worker"  # base64 in JSON
    assert thread_for(80, "u8", FRAME) == "worker"  # T=162: 1.9M cells
    assert thread_for(4, "u8", PLAIN) == "loop"  # T=10: small in any form


@pytest.mark.parametrize("fmt", ["u8", "f16", "json"])
def test_a_mean_comes_as_a_frame_and_compressed_as_a_slice_does(api, fmt):
    """GET /mean answered JSON whatever Accept said, and its compact answers were never compressed,
    unlike the slices beside it."""
    run_id = raw_post(api, {"text": TEXT * 20, "format": "u8", "layers": [0], "heads": [0]}, PLAIN).json()["run_id"]
    path = f"/api/v1/runs/{run_id}/mean?layers=1,2&format={fmt}"
    as_json = api.get(path, headers=PLAIN).json()
    framed = api.get(path, headers=FRAME)
    assert framed.status_code == 200 and framed.headers["content-type"] == FRAME_MEDIA_TYPE
    assert framed.headers["vary"] == "Accept, Accept-Encoding"
    header, (values,) = frame_arrays(framed.content)
    np.testing.assert_array_equal(values, decode(as_json["attention"]))
    for key in ("run_id", "tokens", "layers", "heads", "n_layers", "n_heads", "mean_of"):
        assert header[key] == as_json[key], key
    assert header["mean_of"]["layers"] == [1, 2] and values.shape == (1, 1, len(header["tokens"]), len(header["tokens"]))
    for wire in ({}, {"Accept": FRAME_MEDIA_TYPE}):
        r = Sent(api, None, {"Accept-Encoding": "zstd", **wire}, path)
        assert r.status_code == 200 and r.headers["content-encoding"] == "zstd", (wire, r.headers)
        body = unzstd(r.content)
        assert len(r.content) < len(body)
        if wire:
            np.testing.assert_array_equal(frame_arrays(body)[1][0], values)
        else:
            assert orjson.loads(body)["attention"] == as_json["attention"]
