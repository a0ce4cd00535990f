"""/metrics labels a client can reach stay bounded, refusals are counted under the route they were
addressed to, and the latency histogram can tell 16 s from 29 s (review h48b, items 4, 7 and 8)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from manyeyes.app.config import Settings
from manyeyes.app.services.metrics import LATENCY_BUCKETS, Metrics
from tests.api.conftest import metric, serve

KEY = "labels-key-0123456789"
STANDARD = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"}
# Methods httptools parses (WebDAV, UPnP, RTSP-ish): each was a label value of its own.
ODD_METHODS = ["PROPFIND", "MKCOL", "COPY", "LOCK", "M-SEARCH", "PURGE", "SUBSCRIBE", "REPORT", "LINK", "TRACE"]


@pytest.fixture(scope="module")
def locked():
    """A server with a key and a small body limit: its 401s and 413s are refused before routing."""
    client = serve(Settings(models={"minilm": "minilm"}, device="cpu", warmup=False, api_keys=[KEY], max_body_bytes=1000))
    yield client
    client.__exit__(None, None, None)


def method_labels(client) -> set[str]:
    return set(re.findall(r'method="([^"]*)"', client.get("/metrics").text))


def test_methods_outside_the_standard_set_are_counted_as_other(api):
    """A client without a key took /metrics from 60 series to 17,019 with 35 methods (spray.py)."""
    before = metric(api, "manyeyes_requests_total", method="other")
    for method in ODD_METHODS:
        for path in ("/api/v1/attention", "/healthz", "/nope"):
            api.request(method, path)
    labels = method_labels(api)
    assert labels <= STANDARD | {"other"}, labels
    assert not set(ODD_METHODS) & labels
    assert metric(api, "manyeyes_requests_total", method="other") == before + 3 * len(ODD_METHODS)


def test_an_unkeyed_spray_of_methods_adds_few_series(locked):
    def label_sets() -> set[tuple]:
        return {tuple(sorted(sample.labels.items())) for family in text_string_to_metric_families(locked.get("/metrics").text)
                if family.name == "manyeyes_requests" for sample in family.samples}

    label_sets()  # the scrape's own GET /metrics counted
    before = label_sets()
    for method in ODD_METHODS:
        for path in ("/api/v1/attention", "/api/v1/models", "/api/v1/runs/0123/attention", "/nope"):
            locked.request(method, path)
    # A (route, "other", status) each, a counter and a histogram's series apiece: not one per method.
    new = label_sets() - before
    assert len(new) <= 5, sorted(new)
    assert {dict(labels)["method"] for labels in new} == {"other"}


def test_a_standard_method_a_route_does_not_serve_is_other(api, locked):
    """The seven standard methods on every route, answered 405 (or 401 before routing), still made
    4,573 series of one spray.py run: a method counts under its name only where the route serves it."""
    for client in (api, locked):
        served = {"GET": metric(client, "manyeyes_requests_total", route="/healthz", method="GET"),
                  "HEAD": metric(client, "manyeyes_requests_total", route="/healthz", method="HEAD")}
        for method in ("PUT", "DELETE", "PATCH", "POST"):
            assert client.request(method, "/healthz").status_code == 405
            assert client.request(method, "/api/v1/models").status_code in (401, 405)
        assert client.get("/healthz").status_code == 200 and client.head("/healthz").status_code == 200
        for route in ("/healthz", "/api/v1/models"):
            assert {"PUT", "DELETE", "PATCH", "POST"}.isdisjoint(
                re.findall(rf'manyeyes_requests_total{{method="([^"]+)",route="{re.escape(route)}"', client.get("/metrics").text))
        assert metric(client, "manyeyes_requests_total", route="/healthz", method="GET") == served["GET"] + 1
        assert metric(client, "manyeyes_requests_total", route="/healthz", method="HEAD") == served["HEAD"] + 1
    assert metric(locked, "manyeyes_requests_total", route="/api/v1/models", method="other", status="401") >= 4


def test_refusals_before_routing_are_counted_under_their_route(locked):
    """Every 401, and BodyLimit's 413, on /api/v1/attention was route="other"."""
    before_401 = metric(locked, "manyeyes_requests_total", route="/api/v1/attention", method="POST", status="401")
    before_413 = metric(locked, "manyeyes_requests_total", route="/api/v1/attention", method="POST", status="413")
    assert locked.post("/api/v1/attention", json={"text": "no key"}).status_code == 401
    big = locked.post("/api/v1/attention", content=b"x" * 5000,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert locked.get("/api/v1/runs/0123456789abcdef/attention").status_code == 401
    assert metric(locked, "manyeyes_requests_total", route="/api/v1/attention", method="POST", status="401") == before_401 + 1
    assert metric(locked, "manyeyes_requests_total", route="/api/v1/attention", method="POST", status="413") == before_413 + 1
    assert metric(locked, "manyeyes_requests_total", route="/api/v1/runs/{run_id}/attention", status="401") >= 1
    # A path no route has stays "other", refused or not; so does one too long to be worth matching.
    other = metric(locked, "manyeyes_requests_total", route="other", status="401")
    assert locked.get("/api/v1/no-such-route").status_code == 401
    assert locked.get("/api/v1/runs/" + "a" * 5000 + "/attention").status_code == 401
    assert metric(locked, "manyeyes_requests_total", route="other", status="401") == other + 2


def test_latency_buckets_between_10_s_and_the_budget():
    """p99 by the histogram read 29.5 s where the log's ms said 15.9 s: nothing lay between 10 and 30."""
    assert {15, 20, 25, 30} <= set(LATENCY_BUCKETS)
    m = Metrics()
    m.latency.labels("/api/v1/attention", "POST", "200").observe(15.9)
    text = m.exposition().decode()
    assert 'manyeyes_request_seconds_bucket{le="15.0",method="POST",route="/api/v1/attention",status="200"} 0.0' in text
    assert 'manyeyes_request_seconds_bucket{le="20.0",method="POST",route="/api/v1/attention",status="200"} 1.0' in text


def bucket_bounds(m: Metrics) -> list[str]:
    m.latency.labels("/api/v1/attention", "POST", "504").observe(1)
    return [s.labels["le"] for s in m.latency.collect()[0].samples if s.name.endswith("_bucket")]


def test_the_request_budget_is_a_bucket_bound():
    """The default budget (MANYEYES_REQUEST_TIMEOUT_S, 30 s) is a bound already; another one is added,
    so requests that ran out their budget stand apart from those just under it."""
    assert bucket_bounds(Metrics(budget_s=30)) == [*(str(float(b)) for b in LATENCY_BUCKETS), "+Inf"]
    bounds = bucket_bounds(Metrics(budget_s=45))
    assert "45.0" in bounds and "30.0" in bounds
    assert bounds == sorted(bounds, key=float)
