"""Optional API keys: every /api route needs `Authorization: Bearer <key>` once keys are set."""

from __future__ import annotations

import hashlib
import re
import time

import pytest

from manyeyes.app import clients
from manyeyes.app.clients import KeyRing, TrustedProxies, exposure_warning
from manyeyes.app.config import Settings
from tests.api.conftest import serve

KEYS = ["alpha-key-0123456789", "beta-key-9876543210"]


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    # One key given raw, one only as its SHA-256 digest in a file, as an operator would keep it.
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# operators' keys\n\n{hashlib.sha256(KEYS[1].encode()).hexdigest()}  bob\n")
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, api_keys=[KEYS[0]],
                            api_keys_file=key_file, close_metrics=True))
    yield client
    client.__exit__(None, None, None)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


API_CALLS = [
    ("GET", "/api/v1/models", None),
    ("POST", "/api/v1/attention", {"text": "The bank.", "format": "u8"}),
    ("POST", "/api/v1/attention/batch", {"texts": ["The bank."], "format": "u8"}),
    ("GET", "/api/v1/runs/0123456789abcdef0123456789abcdef/attention", None),
]


@pytest.mark.parametrize("method, path, body", API_CALLS)
def test_api_routes_refuse_missing_or_wrong_keys_with_401_json(locked, method, path, body):
    for headers in ({}, auth("wrong"), {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": "Bearer "}, auth(KEYS[0] + "x")):
        r = locked.request(method, path, json=body, headers=headers)
        assert r.status_code == 401, (headers, r.status_code)
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert KEYS[0] not in r.text
    for key in KEYS:  # the raw key and the one kept only as a digest both open every route
        r = locked.request(method, path, json=body, headers=auth(key))
        assert r.status_code in (200, 404), r.text
        if path.startswith("/api/v1/runs/"):
            assert r.json()["error"]["code"] == "unknown_run"


def test_a_401_says_whether_a_key_was_sent_and_in_what_form(locked):
    """"Bearer<TAB>key" and "Basic ..." were told that no key had been sent (h56a)."""
    said = {}
    for name, headers in (("none", {}), ("tab", {"Authorization": f"Bearer\t{KEYS[0]}"}),
                          ("basic", {"Authorization": f"Basic {KEYS[0]}"}), ("wrong", auth("wrong"))):
        said[name] = locked.get("/api/v1/models", headers=headers).json()["error"]["message"]
    assert said == {
        "none": "this server needs an API key: send Authorization: Bearer <key>",
        "tab": "the Authorization header is not a Bearer key: send Authorization: Bearer <key>, one space between",
        "basic": "the Authorization header is not a Bearer key: send Authorization: Bearer <key>, one space between",
        "wrong": "the API key is not valid",
    }, said


def test_health_and_page_stay_open_and_metrics_can_be_closed(locked):
    assert locked.get("/healthz").status_code == 200
    assert locked.get("/readyz").status_code == 200
    assert locked.get("/").status_code == 200  # the page itself, which then asks for the key
    assert locked.get("/metrics").status_code == 401
    assert locked.get("/metrics", headers=auth(KEYS[1])).status_code == 200


def test_export_runs_the_model_so_it_needs_the_key_too(locked):
    params = {"text": "The bank.", "model": "minilm"}
    r = locked.get("/export", params=params)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    r = locked.get("/export", params=params, headers=auth(KEYS[0]))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")


def test_closed_metrics_stay_closed_on_a_server_without_keys():
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, close_metrics=True))
    try:
        r = client.get("/metrics")
        assert r.status_code == 401 and "no API keys" in r.json()["error"]["message"]
        assert client.get("/api/v1/models").status_code == 200  # no keys: the API itself is open
    finally:
        client.__exit__(None, None, None)


def test_keys_are_utf8_on_both_sides():
    """Configured keys (and `sha256sum` of them) hash their UTF-8 bytes; so must the header."""
    ring = KeyRing(["kéy"])
    assert ring.digest_of(clients.bearer([(b"authorization", "Bearer kéy".encode("utf-8"))]))
    assert ring.digest_of(clients.bearer([(b"authorization", "Bearer kéy".encode("latin-1"))])) is None


@pytest.mark.parametrize("content, message", [
    ("# nothing but a comment\n\n", "holds no key digests"),
    (b"\xff\xfe not text", "cannot be read"),
])
def test_a_key_file_that_gives_no_keys_fails_instead_of_opening_the_api(tmp_path, content, message):
    key_file = tmp_path / "keys.txt"
    key_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        KeyRing([], key_file)


def test_a_key_file_with_a_byte_order_mark_reads_and_two_digests_on_a_line_are_refused(tmp_path):
    digest = hashlib.sha256(b"k").hexdigest()
    marked = tmp_path / "bom.txt"
    marked.write_text(digest + "\n", encoding="utf-8-sig")
    assert KeyRing(key_file=marked).digest_of("k") == digest
    doubled = tmp_path / "two.txt"
    doubled.write_text(f"{digest} {hashlib.sha256(b'j').hexdigest()}\n")
    with pytest.raises(ValueError, match="one digest a line"):
        KeyRing(key_file=doubled)


def test_a_key_file_holding_a_raw_key_says_it_wants_the_keys_digest(tmp_path):
    raw = tmp_path / "keys.txt"
    raw.write_text("secret\n")
    with pytest.raises(ValueError, match=re.escape(f"MANYEYES_API_KEYS_FILE {raw}:1: expected a 64-digit SHA-256 hex digest "
                                                   'of a key, not the key itself (printf %s "$KEY" | sha256sum)')):
        KeyRing(key_file=raw)


@pytest.mark.parametrize("name", ["missing.txt", "."])  # no such file; a directory
def test_a_key_file_that_cannot_be_opened_is_named_in_the_error(tmp_path, name):
    with pytest.raises(ValueError, match=r"MANYEYES_API_KEYS_FILE .* cannot be read"):
        KeyRing([], tmp_path / name)


def test_serve_stops_with_one_line_on_an_unusable_key_file(monkeypatch, tmp_path, capsys):
    import uvicorn

    from manyeyes.app.cli import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("the server started"))
    monkeypatch.setenv("MANYEYES_API_KEYS_FILE", str(tmp_path / "missing.txt"))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: MANYEYES_API_KEYS_FILE") and "Traceback" not in err


@pytest.mark.parametrize("value", ["", "  "])
def test_a_key_file_variable_set_but_naming_no_file_stops_start_up_in_one_line(monkeypatch, capsys, value):
    """It was read as no file: `MANYEYES_API_KEYS_FILE="$KEYFILE"` with KEYFILE unset served the API
    open without a word (review h47b), where an empty MANYEYES_API_KEYS is refused."""
    import uvicorn
    from pydantic import ValidationError

    from manyeyes.app.cli import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("the server started"))
    monkeypatch.setenv("MANYEYES_API_KEYS_FILE", value)
    assert main(["serve", "--port", "8761"]) == 2
    assert capsys.readouterr().err == (
        f"error: a MANYEYES_* setting in the environment is malformed: MANYEYES_API_KEYS_FILE={value!r}: is set but "
        "names no file: unset it to serve without keys, or give the path of a file of SHA-256 digests\n")
    with pytest.raises(ValidationError, match="names no file"):  # an app built elsewhere (Ray Serve) too
        Settings()


def test_an_unauthorised_body_is_refused_before_it_is_read(locked):
    r = locked.post("/api/v1/attention", content=b"x" * 5_000_000, headers={"content-type": "application/json"})
    assert r.status_code == 401


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    ring = KeyRing([f"key-{i}" for i in range(5)])
    calls = []
    real = clients.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(clients.hmac, "compare_digest", spy)
    for presented, expected in (("key-0", True), ("key-4", True), ("key-9", False), ("", False), ("k" * 10_000, False)):
        calls.clear()
        found = ring.digest_of(presented)
        assert (found is not None) is expected
        # Every stored key is compared, whichever matched, and always digest against digest: the
        # time taken depends neither on the key's length nor on how early it matched.
        assert calls == [(32, 32)] * 5
    assert ring.digest_of("key-3") == hashlib.sha256(b"key-3").hexdigest()
    assert clients.key_id(ring.digest_of("key-3")) == "key:" + hashlib.sha256(b"key-3").hexdigest()[:12]


def test_a_bad_key_file_fails_at_start_up(tmp_path):
    bad = tmp_path / "keys.txt"
    bad.write_text("not-a-digest\n")
    with pytest.raises(ValueError, match="keys.txt:1"):
        KeyRing([], bad)


def test_open_server_without_keys_answers_and_warns_only_beyond_loopback():
    for host in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(host, has_keys=False) is None
    assert exposure_warning("0.0.0.0", has_keys=True) is None
    warning = exposure_warning("0.0.0.0", has_keys=False)
    assert "without API keys" in warning and "MANYEYES_API_KEYS" in warning


def test_forwarded_for_is_believed_only_from_trusted_proxies():
    proxies = TrustedProxies(["10.0.0.0/8", "127.0.0.1"])
    headers = [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.7, 10.1.2.3")]
    assert proxies.client_address("127.0.0.1", headers) == "203.0.113.7"  # nearest hop not a proxy
    assert proxies.client_address("192.0.2.1", headers) == "192.0.2.1"  # not a proxy: its own address
    assert proxies.client_address("127.0.0.1", []) == "127.0.0.1"
    assert TrustedProxies([]).client_address("127.0.0.1", headers) == "127.0.0.1"


def test_a_forwarded_hop_with_a_port_counts_as_its_address():
    """Some proxies write "address:port": each of a client's connections was a client of its own,
    with a fresh share (review h54c)."""
    proxies = TrustedProxies(["127.0.0.1", "10.0.0.0/8"])
    for hop, address in ((b"203.0.113.7:50312", "203.0.113.7"), (b"[2001:db8::1]:50312", "2001:db8::1"),
                         (b"[2001:db8::1]", "2001:db8::1"), (b"2001:db8::1", "2001:db8::1"), (b"unknown", "unknown")):
        assert proxies.client_address("127.0.0.1", [(b"x-forwarded-for", hop)]) == address, hop
    # A trusted proxy's own hop with a port is still a proxy: the client is the one before it.
    assert proxies.client_address("127.0.0.1", [(b"x-forwarded-for", b"203.0.113.7:1, 10.1.2.3:8080")]) == "203.0.113.7"


def test_an_ipv4_proxy_is_trusted_on_a_server_listening_on_ipv6_too():
    """Served on "::", an IPv4 proxy's address is IPv4-mapped (::ffff:127.0.0.1), and matched no
    IPv4 entry: every proxied user counted as the proxy, one share for all."""
    headers = [(b"x-forwarded-for", b"203.0.113.7")]
    assert TrustedProxies(["127.0.0.1"]).client_address("::ffff:127.0.0.1", headers) == "203.0.113.7"
    assert TrustedProxies(["127.0.0.1"]).client_address("::ffff:127.0.0.2", headers) == "::ffff:127.0.0.2"


def test_one_client_is_one_share_however_its_address_is_spelled():
    same = {clients.canonical_address(a) for a in ("2001:db8::1", "2001:DB8:0:0:0:0:0:1", "2001:db8::ffff:2")}
    assert same == {"2001:db8::/64"}  # one IPv6 host: its /64, not 2^64 shares
    assert clients.canonical_address("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert clients.canonical_address("::ffff:10.0.0.1") == "10.0.0.1"
    assert clients.canonical_address("::1") == "::1" and clients.canonical_address("10.0.0.1") == "10.0.0.1"
    assert clients.canonical_address("testclient") == "testclient"  # not an address: as it came


def test_loopback_addresses_are_told_from_others():
    for local in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", ""):  # "": a Unix socket
        assert clients.on_loopback(local), local
    for remote in ("10.0.0.1", "192.0.2.1", "::2", "2001:db8::1", "::ffff:10.0.0.1", "1127.0.0.1", "testclient"):
        assert not clients.on_loopback(remote), remote


@pytest.mark.parametrize("peer, forwarded, compress_loopback, kept", [
    ("127.0.0.1", None, False, False),
    ("::1", None, False, False),
    (None, None, False, False),  # a Unix socket: no client address
    ("127.0.0.1", None, True, True),
    ("192.0.2.1", None, False, True),
    ("127.0.0.1", b"203.0.113.7", False, True),  # a trusted proxy on loopback, a remote client
    ("192.0.2.9", b"127.0.0.1", False, True),  # not a trusted proxy: its own (remote) address counts
])
def test_accept_encoding_is_dropped_only_for_a_client_on_loopback(peer, forwarded, compress_loopback, kept):
    import asyncio

    seen = {}

    async def app(scope, receive, send):
        seen["headers"] = scope["headers"]
        seen["client"] = scope["state"]["client"]

    identity = clients.ClientIdentity(app, KeyRing([]), TrustedProxies(["127.0.0.1"]), close_metrics=False,
                                      compress_loopback=compress_loopback)
    headers = [(b"accept", b"*/*"), (b"accept-encoding", b"zstd, gzip")]
    if forwarded:
        headers.append((b"x-forwarded-for", forwarded))
    scope = {"type": "http", "path": "/api/v1/attention", "headers": headers, "client": (peer, 5000) if peer else None}
    asyncio.run(identity(scope, None, None))
    assert ((b"accept-encoding", b"zstd, gzip") in seen["headers"]) is kept
    assert (b"accept", b"*/*") in seen["headers"]  # nothing else is touched
    assert seen["client"] == "addr:" + (forwarded.decode() if forwarded and peer == "127.0.0.1" else peer or "")


def test_a_keys_run_ids_are_its_own_so_no_other_key_can_guess_them(locked):
    """Run ids were a hash of the text alone, over one cache shared by every key: another key
    worked out the id of a guessed text and read whether it was run, and the run itself."""
    from manyeyes.app.services.cache import run_id_for

    text = "A text only alpha has sent."
    mine = locked.post("/api/v1/attention", json={"text": text, "format": "u8"}, headers=auth(KEYS[0])).json()["run_id"]
    guessed = run_id_for("minilm", text, None, False)  # what an id was, and what a server without keys still gives
    assert mine != guessed
    assert locked.get(f"/api/v1/runs/{guessed}", headers=auth(KEYS[1])).status_code == 404
    assert locked.get(f"/api/v1/runs/{guessed}", headers=auth(KEYS[0])).status_code == 404
    theirs = locked.post("/api/v1/attention", json={"text": text, "format": "u8"}, headers=auth(KEYS[1])).json()["run_id"]
    assert theirs not in (mine, guessed)
    again = locked.post("/api/v1/attention", json={"text": text, "format": "u8"}, headers=auth(KEYS[0]))
    assert again.json()["run_id"] == mine  # a key's own repeats still come from the cache
    # An id handed over is enough to read the run: it is a link, as a view's id is.
    assert locked.get(f"/api/v1/runs/{mine}", headers=auth(KEYS[1])).status_code == 200
    # The key file holds SHA-256 digests: whoever reads it still cannot work out a key's run ids.
    from_file = run_id_for("minilm", text, None, False, hashlib.sha256(KEYS[1].encode()).hexdigest())
    assert from_file != theirs


@pytest.mark.parametrize("value", [",", "[]", " ", '[""]', ""])
def test_a_key_variable_set_but_holding_no_key_stops_start_up_in_one_line(monkeypatch, capsys, value):
    """It was read as no keys: the API open to all, as an empty key file never leaves it (audit
    h46b; `MANYEYES_API_KEYS="$KEYS"` with KEYS unset is all it takes)."""
    import uvicorn

    from manyeyes.app.cli import main
    from manyeyes.app.main import create_app

    monkeypatch.setattr(uvicorn.Server, "run", lambda *a, **kw: pytest.fail("the server started"))
    monkeypatch.setenv("MANYEYES_API_KEYS", value)
    assert main(["serve", "--port", "8799"]) == 2
    assert capsys.readouterr().err == ("error: MANYEYES_API_KEYS is set but holds no key: unset it to serve without "
                                       "keys, or give the keys separated by commas\n")
    with pytest.raises(ValueError, match="set but holds no key"):  # an app built elsewhere (Ray Serve) too
        create_app(Settings())
    monkeypatch.delenv("MANYEYES_API_KEYS")
    assert not clients.configured_keys(Settings().api_keys, None)  # unset: no keys, as ever


def test_a_keyless_server_behind_trusted_proxies_warns_even_on_loopback():
    """README's recommended deployment (127.0.0.1 behind a proxy) never warned without keys."""
    warning = exposure_warning("127.0.0.1", has_keys=False, proxied=True)
    assert "without API keys" in warning and "MANYEYES_TRUSTED_PROXIES" in warning
    assert exposure_warning("127.0.0.1", has_keys=True, proxied=True) is None
    assert exposure_warning("127.0.0.2", has_keys=False) is None  # any loopback address is this machine alone


def test_readyz_names_no_folder_of_a_model_that_failed_on_a_server_with_keys(tmp_path):
    """/readyz answers anyone; on a server with keys the operator's folders are not everyone's."""
    from fastapi.testclient import TestClient

    from manyeyes.app.main import create_app

    missing = tmp_path / "customer-acme" / "weights.pth"

    def failure(**more) -> str:
        with TestClient(create_app(Settings(models={"broken": str(missing)}, device="cpu", warmup=False, **more))) as client:
            for _ in range(600):
                r = client.get("/readyz")
                if r.status_code == 503 and r.json()["status"] == "failed":
                    return r.json()["error"]["message"]
                time.sleep(0.05)
        pytest.fail("the failure was never reported")

    keyed = failure(api_keys=["k"])
    assert str(tmp_path) not in keyed and "customer-acme" not in keyed, keyed
    assert ".../weights.pth" in keyed and "no such model file or folder" in keyed, keyed
    assert str(missing) in failure()  # without keys, as documented: the whole path
