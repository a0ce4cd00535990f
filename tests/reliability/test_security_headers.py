"""Security headers on the page, the API, errors and static files; CORS off unless configured."""

from __future__ import annotations

import httpx
import pytest

from tests.reliability.conftest import live_server

PATHS = [
    ("GET", "/"),
    ("GET", "/vendor/plotly.min.js"),
    ("GET", "/static/js/main.js"),
    ("GET", "/api/v1/models"),
    ("GET", "/healthz"),
    ("GET", "/no/such/page"),
    ("POST", "/api/v1/attention"),
]


@pytest.fixture(scope="module")
def server():
    with live_server() as s:
        yield s


def directives(csp: str) -> dict[str, list[str]]:
    return {name: values for name, *values in (part.split() for part in csp.split(";") if part.strip())}


@pytest.mark.parametrize("method,path", PATHS)
def test_every_response_carries_the_security_headers(server, method, path):
    r = httpx.request(method, server.url + path, json={"text": "Hi."} if method == "POST" else None, timeout=60)
    assert r.status_code < 500
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"
    csp = directives(r.headers["content-security-policy"])
    # Only this server: no CDN, no other host, no inline or eval'd script.
    for name in ("default-src", "script-src", "connect-src", "img-src", "style-src", "font-src"):
        assert csp[name][0] == "'self'", (name, csp[name])
        assert not any("http" in v or v == "*" for v in csp[name]), (name, csp[name])
    assert csp["script-src"] == ["'self'"]
    assert csp["object-src"] == ["'none'"] and csp["frame-ancestors"] == ["'none'"]


def test_body_limit_refusals_carry_them_too(server):
    r = httpx.post(f"{server.url}/api/v1/attention", content=b"x" * 1_100_000, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert "content-security-policy" in r.headers and r.headers["x-content-type-options"] == "nosniff"


def test_cors_is_off_by_default(server):
    origin = {"Origin": "https://evil.example"}
    r = httpx.post(f"{server.url}/api/v1/attention", json={"text": "Hi."}, headers=origin, timeout=60)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = httpx.options(
        f"{server.url}/api/v1/attention",
        headers={**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"},
        timeout=60,
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code >= 400


def test_cors_allows_exactly_the_configured_origins():
    allowed = "https://viz.example.org"
    with live_server(cors_origins=[allowed]) as server:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = httpx.options(f"{server.url}/api/v1/attention", headers={"Origin": allowed, **ask}, timeout=60)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
        r = httpx.post(f"{server.url}/api/v1/attention", json={"text": "Hi."}, headers={"Origin": allowed}, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        other = httpx.options(f"{server.url}/api/v1/attention", headers={"Origin": "https://evil.example", **ask}, timeout=60)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # Refused preflights were Starlette's plain text ("Disallowed CORS origin"): JSON like every refusal.
        refusals = [other, httpx.options(f"{server.url}/api/v1/attention", timeout=60, headers={
            "Origin": allowed, "Access-Control-Request-Method": "DELETE", "Access-Control-Request-Headers": "x-evil"})]
        for refused, what in zip(refusals, ("origin", "method, headers")):
            assert refused.status_code == 400 and refused.headers["content-type"] == "application/json", refused.text
            error = refused.json()["error"]
            assert error["code"] == "cors_refused" and f"request is refused for its {what} (allowed here: " in error["message"], error


def test_docs_are_local_and_under_the_same_policy(server):
    get = lambda path: httpx.get(server.url + path, timeout=60)  # noqa: E731
    page = get("/docs")
    assert page.status_code == 200
    assert page.headers["content-security-policy"] == get("/").headers["content-security-policy"]
    assert "http" not in page.text  # every asset is a path on this server
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = get(f"/vendor/swagger-ui/{asset}")
        assert r.status_code == 200 and len(r.content) > 100_000
    assert get("/vendor/swagger-ui/..%2Fswagger-initializer.js").status_code == 404
    assert get("/vendor/swagger-ui/index.html").status_code == 404
    assert get("/redoc").status_code == 404


def test_a_request_addressed_to_another_name_is_refused_where_only_local_names_are_allowed():
    """MANYEYES_ALLOWED_HOSTS, as `manyeyes serve` sets it on loopback: a page whose name its DNS
    points at 127.0.0.1 (DNS rebinding) is, to the browser, its own origin. Its requests still say
    its name in Host, and get a 421; the server's own names, on any port, are served."""
    import socket

    import orjson

    from tests.reliability.conftest import HOST

    with live_server(allowed_hosts=["localhost", "127.0.0.1", "[::1]"]) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for host in (None, f"localhost:{server.port}", "[::1]:8000", "LocalHost.", "127.0.0.1"):
                r = client.get("/api/v1/models", headers={"host": host} if host else None)
                assert r.status_code == 200, (host, r.text[:200])
            # The last four read as loopback names to a parser that took what came first (review h51k).
            for host in ("rebound.example", f"rebound.example:{server.port}", "127.0.0.1.rebound.example", "localhost.example",
                         "[::1]rebound.example", "[::1].rebound.example", f"localhost:{server.port}@rebound.example",
                         "localhost/rebound.example"):
                for method, path in (("GET", "/api/v1/models"), ("POST", "/api/v1/attention"), ("GET", "/"),
                                     ("GET", "/readyz")):
                    r = client.request(method, path, headers={"host": host}, json={"text": "Hi."} if method == "POST" else None)
                    assert r.status_code == 421, (host, path, r.status_code)
                    assert r.json()["error"]["code"] == "host_not_allowed" and "MANYEYES_ALLOWED_HOSTS" in r.json()["error"]["message"]
                    assert r.headers["x-content-type-options"] == "nosniff" and "content-security-policy" in r.headers
                # A liveness probe of any kind reaches /healthz, which says nothing but "ok".
                assert client.get("/healthz", headers={"host": host}).json() == {"status": "ok"}
        def raw(request: bytes) -> tuple[bytes, dict]:
            with socket.create_connection((HOST, server.port)) as sock:
                sock.settimeout(30)
                sock.sendall(request)
                said = b""
                while chunk := sock.recv(65536):
                    said += chunk
            head, _, body = said.partition(b"\r\n\r\n")
            return head, orjson.loads(body)

        # No Host at all: no name this server answers to, and the client's to mend (it was told to
        # add "the name you reach it by" to MANYEYES_ALLOWED_HOSTS; h56a).
        for version in (b"1.0", b"1.1"):
            head, body = raw(b"GET /api/v1/models HTTP/" + version + b"\r\nConnection: close\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and body["error"] == {
                "code": "bad_host", "message": "this request has no Host header: send one naming this server as you reach it "
                "(one of localhost, 127.0.0.1, [::1], any port)"}, (head, body)
        # Two Host headers, an allowed name first: only the first was checked (RFC 9112: a 400).
        head, body = raw(b"GET /api/v1/models HTTP/1.1\r\nHost: localhost\r\nHost: rebound.example\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and body["error"]["code"] == "bad_host", (head, body)
        # A target in absolute form names the host, and Host is ignored (RFC 9112, 3.2.2): it was the
        # other way round, and a request for another name went through on `Host: localhost`.
        for scheme in ("http", "ftp"):  # any scheme's absolute form
            head, body = raw(f"GET {scheme}://rebound.example/api/v1/models HTTP/1.1\r\nHost: localhost\r\n"
                             "Connection: close\r\n\r\n".encode())
            assert head.startswith(b"HTTP/1.1 421 ") and "'rebound.example'" in body["error"]["message"], (head, body)
        # With no Host, the target's name does not stand in for one: still no name this server answers to.
        head, body = raw(f"GET http://localhost:{server.port}/api/v1/models HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
        assert head.startswith(b"HTTP/1.1 400 ") and body["error"]["code"] == "bad_host", (head, body)
        for target in (f"http://localhost:{server.port}", "HTTP://[::1]", "http://127.0.0.1:1"):
            head, body = raw(f"GET {target}/api/v1/models HTTP/1.1\r\nHost: rebound.example\r\nConnection: close\r\n\r\n".encode())
            assert head.startswith(b"HTTP/1.1 200 ") and body["models"], (target, head, body)
    # Any name where the setting says "*", or is not set (create_app without `manyeyes serve`).
    for hosts in (["*"], None):
        with live_server(allowed_hosts=hosts) as server:
            assert httpx.get(server.url + "/api/v1/models", headers={"host": "viz.example.org"}, timeout=60).status_code == 200
