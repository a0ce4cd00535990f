"""Every large answer in the answers' budget (MANYEYES_ANSWER_BYTES), as POST /attention's is: the
GET routes of a cached run, the experiments, exported pages, and the measures POST /attention adds.

GET /runs/{id}/measures answers tens of MB at T=512 (value norms and the word view in f16: 96 MB),
encoded once a render slot let it compute, then held until its reader took it. Outside the
budget, 300 slow readers of one run's measures took the server to 3,042 MiB against its bound of
1,568 (bench/flood.py --route measures --format f16 --tokens 500 --slow). A mean, a tile, top-k
rows and an overview are up to 15 MB each in json (T=1,024), an experiment's difference or an
exported page (plotly.js inside) megabytes, and all were outside it too."""

from __future__ import annotations

import asyncio

import pytest

from manyeyes.app.services.measures import MATRIX_MEASURES
from tests.api.conftest import metric

IDENTITY = {"Accept-Encoding": "identity"}  # the bytes as encoded, not as compressed on the way

TEXT = "Naïve readers — “quoted” — hold 12 answers: ça va?"


@pytest.fixture
def run_id(api) -> str:
    r = api.post("/api/v1/attention", json={"text": TEXT, "format": "u8", "layers": [0], "heads": [0]})
    assert r.status_code == 200, r.text
    return r.json()["run_id"]


@pytest.fixture
def reserved(api, monkeypatch) -> list[int]:
    """The bytes each request asks of the answers' budget, in order."""
    service = api.app.state.service
    asked: list[int] = []
    reserve = service.reserve

    async def recorded(nbytes, deadline, client, *before_waiting):
        asked.append(nbytes)
        return await reserve(nbytes, deadline, client, *before_waiting)

    monkeypatch.setattr(service, "reserve", recorded)
    return asked


@pytest.mark.parametrize("fmt", ["json", "f16", "u8"])
def test_the_bytes_reckoned_cover_the_measures_answer(api, run_id, reserved, fmt):
    """Reckoned before the work, the bytes must cover what is then sent (else the budget bounds
    less than it says), and not be wildly more (else it refuses answers it had room for)."""
    service = api.app.state.service
    for names, params in ((list(MATRIX_MEASURES), {}), (["value_norms"], {"layers": "1,2", "heads": "0,5,7"}),
                          (["words"], {}), (["heads"], {})):
        r = api.get(f"/api/v1/runs/{run_id}/measures", params={"names": ",".join(names), "format": fmt, **params},
                    headers=IDENTITY)
        assert r.status_code == 200, r.text
        measures = r.content[r.content.index(b'"measures":') + len(b'"measures":'):-1]
        reckoned = reserved.pop()
        assert reckoned >= len(measures), (names, reckoned, len(measures))
        assert reckoned <= 3 * len(measures) + 32 * 1024, (names, reckoned, len(measures))
    assert service.answers.held == 0


@pytest.mark.parametrize("path, params, accept", [
    ("mean", {"format": "json"}, None),
    ("mean", {"format": "f16", "layers": "0,3"}, None),
    ("mean", {"format": "u8"}, "application/vnd.manyeyes.frame"),
    ("tile", {"layer": 2, "head": 3, "format": "json"}, None),
    ("tile", {"layer": 2, "head": "mean", "rows": 5, "cols": 7, "pool": "max", "format": "u8"}, None),
    ("tile", {"layer": 0, "head": 1, "format": "f16"}, "application/vnd.manyeyes.frame"),
    ("topk", {"layer": 1, "head": 4, "k": 5, "format": "json"}, None),
    ("topk", {"layer": 1, "head": 4, "k": 3, "format": "u8"}, "application/vnd.manyeyes.frame"),
    ("overview", {"format": "json"}, None),
    ("overview", {"format": "u8"}, "application/vnd.manyeyes.frame"),
])
def test_the_bytes_reckoned_cover_a_mean_tile_topk_or_overview(api, run_id, reserved, path, params, accept):
    headers = {**IDENTITY, **({"Accept": accept} if accept else {})}
    r = api.get(f"/api/v1/runs/{run_id}/{path}", params=params, headers=headers)
    assert r.status_code == 200, r.text
    assert len(reserved) == 1 and reserved[0] >= len(r.content), (reserved, len(r.content))
    assert api.app.state.service.answers.held == 0


def test_a_measures_answer_holds_its_bytes_until_sent_and_the_next_waits_for_them(api, run_id):
    """One client's share of the budget fits one such answer: the second is computed only once the
    first is given back."""
    measures = api.app.state.measures
    answers = measures.attention.answers
    names = ["rollout", "words", "value_norms"]
    limit = answers.limit

    async def main():
        answers.limit = 0  # no budget: what one answer reckons
        reply = await measures.measures(run_id, names, None, None, "f16", "reader")
        one, size = reply.hand_over().nbytes, sum(map(len, reply.body))
        answers.limit = 2 * one + 2  # a client holds at most half: one answer, not two
        first = await measures.measures(run_id, names, None, None, "f16", "reader")
        grant = first.hand_over()
        held = answers.held
        second = asyncio.create_task(measures.measures(run_id, names, None, None, "f16", "reader"))
        await asyncio.sleep(0.5)
        waited = not second.done()
        grant.release()
        again = await asyncio.wait_for(second, 60)
        again.hand_over().release()
        return one, size, held, waited, again.body == first.body, answers.held

    try:
        one, size, held, waited, same, after = asyncio.run(main())
    finally:
        answers.limit = limit
    assert one >= size and held == one, (one, size, held)
    assert waited and same and after == 0


def test_post_attention_with_measures_reckons_both_parts_in_one_grant(api, reserved):
    """The weights and the measures are reckoned together before the forward pass, in one grant
    given back once the answer is sent: a request holding its weights' bytes while it waited for
    its measures' could hold them against every other such request until their time ran out."""
    service = api.app.state.service
    body = {"text": TEXT, "format": "u8"}
    plain = api.post("/api/v1/attention", json=body)
    with_measures = api.post("/api/v1/attention", json={**body, "measures": ["value_norms", "words"]}, headers=IDENTITY)
    assert plain.status_code == with_measures.status_code == 200, with_measures.text[:300]
    content = with_measures.content
    measures = content[content.index(b',"measures":'):]
    assert len(reserved) == 2, reserved  # one grant each, the second covering the measures too
    assert reserved[1] - reserved[0] >= len(measures), (reserved, len(measures))
    assert service.answers.held == 0 and metric(api, "manyeyes_answer_bytes") == 0


def test_an_exported_page_is_reckoned_with_its_run_in_one_grant(api, reserved):
    """The one-file page (plotly.js and the run inside: megabytes) is held until it is sent, like
    any answer; reckoned with the run's own answer, so that an export never waits for bytes while
    holding some."""
    r = api.get("/export", params={"text": TEXT, "model": "minilm"}, headers=IDENTITY)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text[:300]
    probe, full = reserved  # the first attend reads the run's length from a one-head answer
    assert full >= len(r.content) > probe, (reserved, len(r.content))
    assert api.app.state.service.answers.held == 0


def test_an_export_gives_its_probes_bytes_back_before_it_asks_for_the_full_runs(api, reserved, monkeypatch):
    """Held until the full answer was granted, the probe's bytes (its run's 75 MB at T=510) and
    the full answer's passed the client's half of the answers' budget: every MiniLM export over
    about 420 tokens waited for its own bytes until its 504 (30 s by default; 5 s here)."""
    service = api.app.state.service
    monkeypatch.setattr(service.settings, "request_timeout_s", 5.0)
    r = api.get("/export", params={"text": "w " * 508, "model": "minilm"}, headers=IDENTITY)
    assert r.status_code == 200, r.text[:300]
    probe, full = reserved
    assert probe + full > service.answers.limit // 2 >= full, (reserved, service.answers.limit)
    assert service.answers.held == 0


@pytest.mark.parametrize("path, body", [
    ("ablate", {"text": TEXT, "ablate": [{"layer": 1, "head": 2}], "attention": {"format": "json"}}),
    ("ablate", {"text": TEXT, "ablate": [{"layer": 0, "head": 0, "mode": "mean"}]}),
    ("change-token", {"text": TEXT, "index": 3, "change": "mask", "difference": {"format": "f16"}}),
    ("compare", {"text_a": TEXT, "text_b": TEXT.replace("readers", "writers <here>"), "difference": {"format": "json"}}),
])
def test_an_experiment_is_reckoned_before_its_forwards_and_gives_its_bytes_back(api, reserved, path, body):
    r = api.post(f"/api/v1/experiments/{path}", json=body, headers=IDENTITY)
    assert r.status_code == 200, r.text[:300]
    assert len(reserved) == 1 and reserved[0] >= len(r.content), (reserved, len(r.content))
    assert api.app.state.service.answers.held == 0


def test_measures_over_the_json_limit_are_refused_before_the_forward_pass():
    """The measures are reckoned with the answer, so json measures beyond max_json_cells are a 413
    before any work: no run computed, no bytes or queue places left held."""
    from manyeyes.app.config import Settings
    from tests.api.conftest import serve

    api = serve(Settings(models={"minilm": "minilm"}, device="cpu", max_json_cells=50_000, warmup=False))
    try:
        text = "A sentence whose weights fit the json limit, and whose measures, twice as many, do not."
        r = api.post("/api/v1/attention", json={"text": text, "format": "json", "measures": ["value_norms", "words"]})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_cells", r.text[:300]
        service = api.app.state.service
        assert metric(api, "manyeyes_forward_seconds_count") == 0
        assert service.answers.held == 0 and api.app.state.registry.get("minilm").batcher._admitted == 0
        assert api.post("/api/v1/attention", json={"text": text, "format": "json"}).status_code == 200
    finally:
        api.__exit__(None, None, None)
