"""Runs shared between copies of the app (workers, replicas): a copy asked for a run another copy
computed recomputes it once, for a client with a valid key, and says when it cannot for now.

Two copies in one process sharing a folder, as `manyeyes serve --workers 2` runs them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient

from manyeyes.app.config import Settings
from manyeyes.app.main import create_app
from manyeyes.app.services.errors import QueueFull
from manyeyes.app.shared_runs import FileDirectory, SharedFiles
from tests.api.conftest import wait_ready

KEY = "a-key-long-enough-to-be-one"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    settings = Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", warmup=False, api_keys=[KEY])
    first, second = (TestClient(create_app(settings, run_directory=FileDirectory(SharedFiles(folder, slot, 1 << 20))))
                     for slot in ("0", "1"))
    with first, second:
        for client in (first, second):
            client.headers.update(AUTH)
            wait_ready(client)
        yield first, second, folder


@pytest.fixture
def counted(copies, monkeypatch) -> list[str]:
    """The texts the second copy computes."""
    service = copies[1].app.state.service
    attend = service.attend
    texts: list[str] = []

    async def counting(texts_in, *args, **kwargs):
        texts.extend(text for text, _ in texts_in)
        return await attend(texts_in, *args, **kwargs)

    monkeypatch.setattr(service, "attend", counting)
    return texts


def posted(copies, text: str, **more) -> dict:
    """A run the first copy computed, recorded before its answer."""
    first, _, folder = copies
    body = first.post("/api/v1/attention", json={"text": text, "format": "json", **more}).json()
    assert (folder / "0" / f"run-{body['run_id']}").exists()
    return body


def test_the_run_itself_and_a_head_request_are_recomputed(copies, counted):
    """RUN_PATH wanted a slash after the id: GET /runs/{id} (the `links.run` of a long run) was
    404 on every copy but the one that computed it; HEAD was 404 where GET was 200."""
    _, second, _ = copies
    run = posted(copies, "The first copy computed this one.")
    r = second.get(f"/api/v1/runs/{run['run_id']}")
    assert r.status_code == 200 and r.headers["x-manyeyes-recomputed"] == "1", r.text
    assert r.json()["tokens"] == run["tokens"]
    other = posted(copies, "And this one, read by HEAD.")
    head = second.head(f"/api/v1/runs/{other['run_id']}/attention", params={"format": "json"})
    assert head.status_code == 200 and head.headers["x-manyeyes-recomputed"] == "1" and head.content == b""
    assert counted == ["The first copy computed this one.", "And this one, read by HEAD."]


def test_a_request_without_a_key_starts_no_forward_and_learns_nothing(copies, counted):
    """The wrapper ran before the key check: an unkeyed GET was a 401 carrying
    X-Manyeyes-Recomputed: 1, after a forward, so anyone could learn whether a text had been run."""
    _, second, _ = copies
    run = posted(copies, "A text somebody analysed.")
    path = f"/api/v1/runs/{run['run_id']}/attention"
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        r = second.get(path, headers=headers)
        assert r.status_code == 401 and "x-manyeyes-recomputed" not in r.headers, r.headers
    assert counted == [] and second.app.state.service.cache.get(run["run_id"]) is None
    r = second.get(path, params={"format": "json"})
    assert r.status_code == 200 and r.headers["x-manyeyes-recomputed"] == "1"
    np.testing.assert_allclose(r.json()["attention"]["data"], run["attention"]["data"], atol=1e-6, rtol=0)


def test_requests_for_the_same_run_at_once_share_one_recompute(copies, counted, monkeypatch):
    """Each of eight requests that found the run missing recomputed it (a page's tiles: eight
    forwards for one run)."""
    _, second, _ = copies
    run = posted(copies, "Eight readers want this run at the same moment.")
    service = second.app.state.service
    attend = service.attend

    async def slow(*args, **kwargs):  # so that the eight overlap
        import asyncio

        # 1 s, not 0.3: on a loaded machine (CI beside other work) the pool's last request came
        # after the recompute had landed, found the run cached, and the test read that as a miss.
        await asyncio.sleep(1.0)
        return await attend(*args, **kwargs)

    monkeypatch.setattr(service, "attend", slow)
    routes = ["", "/attention", "/mean", "/overview", "/topk?layer=0&head=1&k=2", "/tile?layer=1&head=0",
              "/attention?layers=1", "/mean?layers=0"]
    with ThreadPoolExecutor(len(routes)) as pool:
        answers = list(pool.map(lambda route: second.get(f"/api/v1/runs/{run['run_id']}{route}"), routes))
    assert [r.status_code for r in answers] == [200] * len(routes), [r.text for r in answers if r.status_code != 200]
    assert all(r.headers.get("x-manyeyes-recomputed") == "1" for r in answers)  # each waited for it
    assert counted == ["Eight readers want this run at the same moment."]


def test_a_recompute_refused_for_now_is_that_refusal_not_a_404(copies, counted, monkeypatch):
    """A recompute the queue refused fell through to the app's 404 "POST it again", with no
    Retry-After, sending the client to repeat its POST into the same load."""
    _, second, _ = copies
    run = posted(copies, "A busy copy is asked for this run.")
    service = second.app.state.service
    attend = service.attend

    async def busy(*args, **kwargs):
        raise QueueFull("this server has 256 inputs in flight; retry shortly", 3)

    monkeypatch.setattr(service, "attend", busy)
    r = second.get(f"/api/v1/runs/{run['run_id']}/attention")
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and r.json()["error"]["code"] == "queue_full", r.text
    monkeypatch.setattr(service, "attend", attend)
    r = second.get(f"/api/v1/runs/{run['run_id']}/attention")
    assert r.status_code == 200 and r.headers["x-manyeyes-recomputed"] == "1"
    unseen = second.get("/api/v1/runs/" + "0" * 32 + "/attention")  # never computed anywhere: still the 404
    assert unseen.status_code == 404 and unseen.json()["error"]["code"] == "unknown_run"


def test_a_run_is_recomputed_kept_as_the_copy_that_made_it_keeps_it(copies, counted):
    """The record held no `keep`: a run kept as queries and keys by one copy was recomputed as
    weights by the other, so its slices were 422 kept_qk or 200 by the copy that answered."""
    first, second, _ = copies
    run = posted(copies, "Kept as queries and keys.", keep="qk")
    for copy in (first, second):
        assert copy.get(f"/api/v1/runs/{run['run_id']}").json()["kept"] == "qk"
        r = copy.get(f"/api/v1/runs/{run['run_id']}/attention", params={"layers": "0", "heads": "0"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "kept_qk", r.text
    assert counted == ["Kept as queries and keys."]


def test_a_long_texts_record_is_small_and_records_of_runs_still_held_go_last(copies, tmp_path):
    """Each record held its whole text as JSON (six bytes a control character): 70 runs of a
    100,000-character text cut to fit filled a worker's share of the folder, and the other worker
    answered 404 for runs the first still served (a review by use)."""
    first, _, folder = copies
    long = posted(copies, "cut " + "\x01" * 99_900, truncate=True)
    assert (folder / "0" / f"run-{long['run_id']}").stat().st_size < 5_000  # 600,000 as JSON
    # The copy's records know which of its runs it holds.
    records = first.app.state.service.run_directory.files
    assert records.keep_first(f"run-{long['run_id']}") and not records.keep_first(f"run-{'0' * 32}")

    files = SharedFiles(tmp_path, "0", max_bytes=300)
    held = {"k0", "k1"}  # the oldest two: their runs are still in the cache
    files.keep_first = lambda key: key in held
    for i in range(5):
        files.put(f"k{i}", b"x" * 100)
    assert sorted(p.name for p in (tmp_path / "0").iterdir()) == ["k0", "k1", "k4"]
    held.clear()
    files.put("k5", b"x" * 100)  # none held now: the oldest go first again
    assert sorted(p.name for p in (tmp_path / "0").iterdir()) == ["k1", "k4", "k5"]


def test_a_record_an_older_version_wrote_is_still_recomputed(copies, counted):
    """Ray's run directory is a detached actor: it outlives an upgrade, with records of five fields
    (no keep, no format), which the recompute unpacked as seven and failed with a 500."""
    import zlib

    import orjson

    _, second, folder = copies
    run = posted(copies, "Recorded by an older version.")
    record = folder / "0" / f"run-{run['run_id']}"
    record.write_bytes(zlib.compress(orjson.dumps(orjson.loads(zlib.decompress(record.read_bytes()))[:5])))
    r = second.get(f"/api/v1/runs/{run['run_id']}/attention", params={"format": "json"})
    assert r.status_code == 200 and r.headers["x-manyeyes-recomputed"] == "1", r.text
    np.testing.assert_allclose(r.json()["attention"]["data"], run["attention"]["data"], atol=1e-6, rtol=0)
    assert counted == ["Recorded by an older version."]
