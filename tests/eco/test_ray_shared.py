"""`manyeyes serve --replicas` on a Ray cluster it shares: another team's application on the Serve
already running there outlives manyeyes' stop, and a port other than that Serve's is refused, not
announced where nothing listens (review h50b). A local Ray of its own, as tests/eco/test_ray.py's."""

from __future__ import annotations

import os
import signal
import sys

import httpx
import pytest

from tests.eco.test_ray import ray  # as that module has it: a missing Ray fails in CI, skips elsewhere
from tests.servers import free_port, wait_ready

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a local test cluster: no token to generate and store
    from ray import serve

    from manyeyes.scale import NAMESPACE

    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy_other(name: str = "other", route_prefix: str = "/other") -> None:
    """An application that is not manyeyes', on the Serve running."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Other:
        async def __call__(self, request) -> str:
            return "the other application answers"

    serve.run(Other.bind(), name=name, route_prefix=route_prefix)


@pytest.fixture
def other_serve(local_ray):
    """Serve started by someone else, with their application on it: its port."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy_other()
    try:
        yield port
    finally:
        serve.shutdown()


def answers(port: int, path: str = "/other") -> str:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30).text


def test_stopping_manyeyes_leaves_another_application_and_its_serve_running(other_serve, monkeypatch, capsys):
    """Ctrl-C called serve.shutdown(): the other application, Serve's proxy and controller went.
    A supervisor's SIGTERM stops it as Ctrl-C does (Ray printed a crash dump for it). The
    replicas' shared directory and view shelf (detached, they outlived it) go once no other
    application runs on Serve: one of them may be a `serve run` of app_builder, sharing them."""
    from ray import serve

    from manyeyes import scale
    from manyeyes.app.config import Settings

    seen = {}
    real_sleep = scale.time.sleep

    def sigterm_once_served(seconds: float) -> None:
        if seconds != 3600:  # Ray's own waits
            return real_sleep(seconds)
        seen["readyz"] = httpx.get(f"http://127.0.0.1:{other_serve}/readyz", timeout=30).status_code
        seen["shared"] = [bool(ray.get_actor(name, namespace=scale.NAMESPACE)) for name in (scale.DIRECTORY, scale.VIEWS)]
        os.kill(os.getpid(), signal.SIGTERM)
        real_sleep(30)  # the handler raises in here

    monkeypatch.setattr(scale.time, "sleep", sigterm_once_served)

    def init_as_ray_does(*args, **kwargs):
        """ray.init (the cluster is this module's, up already) sets the driver's SIGTERM handler,
        sys.exit: set after the stop handlers, it replaced them, and SIGTERM aborted the driver."""
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    asked = []
    real_is_initialized = scale.ray.is_initialized
    # Not yet, to serve_replicas' first question; Ray's own calls get the truth.
    monkeypatch.setattr(scale.ray, "is_initialized", lambda: bool(asked.append(1) or len(asked) > 1) and real_is_initialized())
    monkeypatch.setattr(scale.ray, "init", init_as_ray_does)
    settings = Settings(models={"tiny-gpt": "tiny-gpt"}, device="cpu")
    before = signal.getsignal(signal.SIGTERM)
    assert scale.serve_replicas(settings, host="127.0.0.1", port=other_serve, replicas=1, threads=1) == 0
    assert signal.getsignal(signal.SIGTERM) is not before  # Ray's own, as ray.init leaves it
    assert all(ray.get_actor(name, namespace=scale.NAMESPACE) for name in (scale.DIRECTORY, scale.VIEWS))
    banner = f"manyeyes: 1 replicas on Ray Serve at http://127.0.0.1:{other_serve} (1 thread each)"
    assert banner in capsys.readouterr().out.splitlines()  # among Ray's lines, which it prints on stdout too
    assert seen == {"readyz": 200, "shared": [True, True]}  # served where the banner said
    assert set(serve.status().applications) == {"other"}
    assert answers(other_serve) == "the other application answers"
    serve.delete("other")
    scale.stop(started_serve=False)  # nothing else on Serve now: the shared actors go, Serve stays
    for name in (scale.DIRECTORY, scale.VIEWS):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=scale.NAMESPACE)
    assert scale.running_serve() == ("127.0.0.1", other_serve)
    deploy_other()

    # A start that fails (a model that cannot load) stopped it all the same way.
    monkeypatch.setattr(scale.serve, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("Deploying failed.")))
    assert scale.serve_replicas(settings, host="127.0.0.1", port=other_serve, replicas=1, threads=1) == 2
    assert answers(other_serve) == "the other application answers"


def not_deployed(*args, **kwargs):
    raise AssertionError("manyeyes was deployed")  # and would have blocked, served


def test_a_port_or_host_other_than_the_running_serves_is_refused_in_one_line(other_serve, monkeypatch, capsys):
    """--port was dropped for the running Serve's, while the banner named the one asked for."""
    from ray import serve

    from manyeyes import scale
    from manyeyes.app.config import Settings

    monkeypatch.setattr(scale.serve, "run", not_deployed)
    elsewhere = free_port()
    for host, port in (("127.0.0.1", elsewhere), ("0.0.0.0", other_serve)):
        assert scale.serve_replicas(Settings(), host=host, port=port, replicas=1, threads=1) == 2
        assert capsys.readouterr().err == (
            f"error: Ray Serve already runs on this Ray cluster and takes HTTP on 127.0.0.1:{other_serve}, not "
            f"{host}:{port}: run with --host 127.0.0.1 --port {other_serve} to serve there\n")
    assert set(serve.status().applications) == {"other"}
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{elsewhere}/readyz")


def test_an_application_named_manyeyes_already_running_is_not_replaced(other_serve, monkeypatch, capsys):
    """Deploying under the name replaced that application, and stopping then removed it."""
    from ray import serve

    from manyeyes import scale
    from manyeyes.app.config import Settings

    deploy_other(name="manyeyes", route_prefix="/theirs")
    monkeypatch.setattr(scale.serve, "run", not_deployed)
    assert scale.serve_replicas(Settings(), host="127.0.0.1", port=other_serve, replicas=1, threads=1) == 2
    assert capsys.readouterr().err == ("error: an application named manyeyes already runs on this Ray Serve: stop it first "
                                       "(Ctrl-C the manyeyes serve that started it; one left behind goes with "
                                       "ray.serve.delete('manyeyes'))\n")
    assert set(serve.status().applications) == {"other", "manyeyes"}
    assert answers(other_serve, "/theirs") == "the other application answers"


def test_serve_that_manyeyes_started_goes_with_it_unless_another_application_runs_there(local_ray, monkeypatch):
    """On a cluster joined through RAY_ADDRESS, Serve's actors outlive manyeyes: left running, its
    proxy would hold the port with nothing behind it."""
    from ray import serve

    from manyeyes import scale
    from manyeyes.app.config import Settings

    serve.shutdown()  # none running: this start makes it
    port = free_port()
    monkeypatch.setattr(scale.serve, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert scale.serve_replicas(Settings(), host="127.0.0.1", port=port, replicas=1, threads=1) == 130
    assert scale.running_serve() is None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/readyz")

    # Someone deployed on it meanwhile: their application keeps it.
    def another_deploys_then_ctrl_c(*args, **kwargs):
        monkeypatch.undo()  # Serve's own run again, for their deployment
        deploy_other()
        raise KeyboardInterrupt

    monkeypatch.setattr(scale.serve, "run", another_deploys_then_ctrl_c)
    assert scale.serve_replicas(Settings(), host="127.0.0.1", port=port, replicas=1, threads=1) == 130
    wait_ready(f"http://127.0.0.1:{port}", route="/other", what="the other application")
    assert scale.running_serve() == ("127.0.0.1", port)
