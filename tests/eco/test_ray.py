"""Ray Serve with 2 replicas on a local Ray (2 CPUs, dashboard and auth off): slices of a run work
on any replica, overload is the app's JSON 429, never Ray's 503."""

from __future__ import annotations

import concurrent.futures as cf
import os

import httpx
import numpy as np
import pytest

from tests.servers import free_port, wait_ready

pytestmark = pytest.mark.slow
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    import ray  # CI installs the scale extra: a missing Ray fails there, never skips
else:
    ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test cluster: no token to generate and store
    from ray import serve

    from manyeyes.app.config import Settings
    from manyeyes.scale import NAMESPACE, deployment

    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # A small queue and a slow forward, so that 24 requests at once overflow two replicas.
        settings = Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu", max_queue=3, debug_forward_delay_s=0.25)
        serve.run(deployment(settings, replicas=2, threads=1), name="manyeyes", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, timeout_s=120)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_are_running_and_healthy(cluster):
    from ray import serve

    status = serve.status().applications["manyeyes"]
    deployment = status.deployments["manyeyes"]
    assert status.status == "RUNNING" and deployment.status == "HEALTHY"
    assert deployment.replica_states.get("RUNNING") == 2


def test_100_slices_across_replicas_with_no_errors(cluster, tiny_gpt):
    texts = [f"And the {w} was good." for w in ("light", "land", "sea", "sky", "grass", "tree", "sun", "moon", "star", "beast")]
    with httpx.Client(base_url=cluster, timeout=60) as http:
        run_ids = []
        for text in texts:
            r = http.post("/api/v1/attention", json={"text": text, "layers": [0], "heads": [0], "format": "u8"})
            assert r.status_code == 200, r.text
            run_ids.append(r.json()["run_id"])
        statuses, recomputed = [], 0
        for i in range(100):
            k, layer, head = i % len(texts), i % 2, (i * 3) % 8
            r = http.get(f"/api/v1/runs/{run_ids[k]}/attention", params={"layers": layer, "heads": head, "format": "json"})
            statuses.append(r.status_code)
            if r.status_code == 200:
                got = np.asarray(r.json()["attention"]["data"], dtype=np.float32)[0, 0]
                np.testing.assert_allclose(got, tiny_gpt.attend(texts[k]).attention[layer, head].numpy(), atol=1e-5)
                recomputed += r.headers.get("x-manyeyes-recomputed") == "1"
    assert statuses.count(200) == 100, {s: statuses.count(s) for s in set(statuses)}
    # Without the shared directory these would have been 404s: the slice reached a replica that
    # had not computed the run.
    assert recomputed > 0
    print(f"100 slices: 0 errors, {recomputed} answered by a replica that recomputed the run")


def test_a_frame_larger_than_one_write_comes_through_ray(cluster, tiny_gpt):
    """Answers over 256 KiB are sent as memoryview pieces, which Ray cannot pickle: every larger
    frame (the page's and the Python client's default) was a plain-text 500 (a review by use)."""
    from manyeyes.app.services.wire import FRAME_MEDIA_TYPE, read_frame

    text = "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness."
    r = httpx.post(f"{cluster}/api/v1/attention", json={"text": text, "format": "f16"},
                   headers={"accept": FRAME_MEDIA_TYPE}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 256 * 1024 and r.headers["content-type"] == FRAME_MEDIA_TYPE
    header, data = read_frame(r.content)
    got = np.frombuffer(data, dtype=np.float16).reshape(header["attention"]["shape"]).astype(np.float32)
    np.testing.assert_allclose(got, tiny_gpt.attend(text).attention.numpy(), atol=1e-3)


def test_an_unknown_run_is_still_a_404_json(cluster):
    r = httpx.get(f"{cluster}/api/v1/runs/{'0' * 32}/attention")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_run"


def test_overload_is_the_apps_json_429_never_rays_503(cluster):
    def post(i: int) -> httpx.Response:
        return httpx.post(f"{cluster}/api/v1/attention", json={"text": f"Verse number {i} of many.", "format": "u8"}, timeout=60)

    with cf.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(post, range(24)))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}, codes
    busy = [a for a in answers if a.status_code == 429]
    assert busy and codes.count(200) >= 2
    for a in busy:
        assert a.headers["content-type"] == "application/json" and int(a.headers["retry-after"]) >= 1
        assert a.json()["error"]["code"] == "queue_full"


def test_a_view_saved_through_one_replica_opens_through_every_replica(cluster):
    state = {"text": "And the light was good.", "model": "tiny-gpt", "layer": 1, "head": 2}
    with httpx.Client(base_url=cluster, timeout=60) as http:
        saved = http.post("/api/v1/views", json=state)
        assert saved.status_code == 200, saved.text
        view_id = saved.json()["id"]
        # Ray spreads these over both replicas; without the shared shelf the other one said 404.
        opened = [http.get(f"/api/v1/views/{view_id}") for _ in range(20)]
    assert [r.status_code for r in opened] == [200] * 20, [r.text for r in opened if r.status_code != 200]
    assert all(r.json()["text"] == state["text"] and r.json()["head"] == 2 for r in opened)


def test_the_view_shelf_keeps_its_bytes_bound_oldest_out_first(cluster):
    from manyeyes.scale import ViewShelf

    shelf = ViewShelf.remote(100)
    for key in ("a", "b", "c"):
        ray.get(shelf.put.remote(key, key.encode() * 40))
    ray.get(shelf.put.remote("b", b"b" * 40))  # saved again: now the newest, its bytes counted once
    assert ray.get(shelf.read.remote("a")) is None
    assert ray.get(shelf.read.remote("c"))[0] == b"c" * 40 and ray.get(shelf.read.remote("b"))[0] == b"b" * 40
    ray.get(shelf.put.remote("d", b"d" * 40))
    assert ray.get(shelf.read.remote("c")) is None and ray.get(shelf.read.remote("b")) is not None
    # One owner holds at most a quarter: its own oldest go first, the others' stay.
    ray.get(shelf.put.remote("e", b"e" * 10, "addr:1"))
    for key in ("f", "g", "h"):
        ray.get(shelf.put.remote(key, key.encode() * 10, "addr:2"))
    assert [ray.get(shelf.read.remote(k)) is not None for k in "efgh"] == [True, False, True, True]


def test_replicas_that_cannot_load_say_why_in_one_line_and_exit_2(monkeypatch, capsys):
    """The driver died in a 30-line traceback ending "Failed to update the deployments
    ['manyeyes']"; why (a model path that does not exist) was only in the replicas' logs. Ray
    Serve's own retries take a minute, so its serve.run is stood in for here: a replica that failed
    left its reason where the driver reads it, as build_app's lifespan does on a real cluster."""
    from manyeyes import scale
    from manyeyes.app.config import Settings

    stored, calls = {}, []

    def put(key, value, overwrite=True, *, namespace=None):
        stored[(namespace, key)] = value

    def failed_run(*args, **kwargs):
        calls.append("run")
        scale.record_failure("model loading failed: ModelLoadError: no such model file or folder: nonexistent-dir")
        raise RuntimeError("Deploying application manyeyes failed: Failed to update the deployments ['manyeyes'].")

    from ray.experimental import internal_kv
    from ray.serve.schema import ServeStatus

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, *, namespace=None: stored.get((namespace, key)))
    monkeypatch.setattr(internal_kv, "_internal_kv_del",
                        lambda key, *, del_by_prefix=False, namespace=None: stored.pop((namespace, key), None) and 1)
    monkeypatch.setattr(scale.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(scale.serve, "start", lambda **kwargs: calls.append("start"))
    monkeypatch.setattr(scale.serve, "run", failed_run)
    # No Serve ran before: the one this start made goes again, once manyeyes' app is off it.
    monkeypatch.setattr(scale, "running_serve", lambda: None)
    monkeypatch.setattr(scale.serve, "delete", lambda name: calls.append(f"delete {name}"))
    monkeypatch.setattr(scale.serve, "status", ServeStatus)  # no application runs
    monkeypatch.setattr(scale.serve, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(scale, "drop_shared", lambda: calls.append("drop shared"))
    stored[(scale.NAMESPACE, scale.FAILURE_KEY)] = b"an earlier deployment's reason"
    settings = Settings(models={"bad": "./nonexistent-dir"})
    assert scale.serve_replicas(settings, host="127.0.0.1", port=9, replicas=1, threads=1) == 2
    assert capsys.readouterr().err == (
        "error: the replicas did not start: model loading failed: ModelLoadError: no such model file or folder: nonexistent-dir\n")
    assert calls == ["start", "run", "delete manyeyes", "drop shared", "shutdown"]

    # Nothing left by a replica: Ray's line, and where to look.
    monkeypatch.setattr(scale.serve, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("Deploying failed.\nmore")))
    assert scale.serve_replicas(settings, host="127.0.0.1", port=9, replicas=1, threads=1) == 2
    assert capsys.readouterr().err == "error: the replicas did not start: Deploying failed. (the replicas' logs say why)\n"

    # Ctrl-C while the replicas start: Ray's wait loop's traceback said nothing; 130, as a shell counts it.
    monkeypatch.setattr(scale.serve, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert scale.serve_replicas(settings, host="127.0.0.1", port=9, replicas=1, threads=1) == 130
    assert calls[-1] == "shutdown" and capsys.readouterr().err == ""


def test_every_answer_carries_one_request_id(cluster):
    """Ray's proxy puts X-Request-ID on every answer, and the app its own: each answer had two
    (review h50b), which clients that join headers read as "id, id"."""
    made = httpx.get(f"{cluster}/readyz")
    assert made.status_code == 200 and len(made.headers.get_list("x-request-id")) == 1
    sent = httpx.post(f"{cluster}/api/v1/attention", json={"text": "A short verse.", "layers": [0], "heads": [0]},
                      headers={"x-request-id": "trace-42"}, timeout=60)
    assert sent.status_code == 200 and sent.headers.get_list("x-request-id") == ["trace-42"]


def test_app_builder_refuses_an_argument_it_does_not_read():
    """`serve run manyeyes.scale:app_builder replicas=2 port=8869` served on Serve's port, port=8869
    dropped without a word (review h50b)."""
    from manyeyes.scale import app_builder

    with pytest.raises(ValueError, match=r"^app_builder takes replicas and threads, not host, port \(.*serve start --http-port"):
        app_builder({"replicas": "2", "port": "8869", "host": "0.0.0.0"})
    with pytest.raises(ValueError, match=r"^app_builder's threads is a whole number of at least 1, not '0'$"):
        app_builder({"threads": "0"})
    from ray import serve

    assert isinstance(app_builder({"replicas": 2, "threads": "1"}), serve.Application)  # a config file's numbers, the CLI's text


def test_a_stop_after_the_local_rays_own_processes_died_does_not_wait_on_them(monkeypatch, capsys):
    """A SIGTERM to the whole process group (`timeout`, systemd's cgroup) stopped the local GCS with
    the driver: serve.delete waited 60 s on it, then Ray ended the process with status 1."""
    from types import SimpleNamespace

    from manyeyes import scale

    def process(returncode):
        return SimpleNamespace(process=SimpleNamespace(poll=lambda: returncode))

    deleted = []
    monkeypatch.setattr(scale.serve, "delete", lambda name: deleted.append(name))
    monkeypatch.setattr(scale.serve, "status", lambda: SimpleNamespace(applications={"other": None}))
    node = SimpleNamespace(all_processes={"gcs_server": [process(-15)], "raylet": [process(None)]})
    monkeypatch.setattr(ray._private.worker, "_global_node", node)
    scale.stop(started_serve=True)
    assert deleted == [] and "Ray's own processes were stopped by the same signal" in capsys.readouterr().err
    # Alive, the application is taken off Serve as before (after the short wait for a group's signal).
    node.all_processes["gcs_server"] = [process(None)]
    scale.stop(started_serve=True)
    assert deleted == ["manyeyes"]
    monkeypatch.setattr(ray._private.worker, "_global_node", None)  # a cluster joined, or none
    assert not scale.local_cluster_gone(wait_s=0)
