"""Generation stops at the model's end-of-text token, as transformers' generate does: locally, over
the API's stream, in the client; and where a model's end-of-text ids come from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from manyeyes.app.config import Settings
from manyeyes.client import Client, GenerationFailed
from manyeyes.model import load
from manyeyes.model.generate import generate
from manyeyes.model.loading import end_of_text_ids
from tests.api.conftest import serve
from tests.conftest import save_random_gpt2
from tests.test_parity_decoders import save_random

PROMPT = "The quick brown fox"
N = 10


def set_eos(folder: Path, config=None, generation=None) -> None:
    """config.json's eos_token_id (None: null); generation_config.json's, or none such file."""
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"eos_token_id": config}))
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))


@pytest.fixture(scope="module")
def stopping(tmp_path_factory, bytelevel_tokenizer):
    """A random llama folder whose config names, as its end of text, the token greedy generation
    first makes at step k (k + 1 < N): the unstopped run's steps say which, before it is named."""
    folder = tmp_path_factory.mktemp("eos") / "llama"
    folder.mkdir()
    ref = save_random(folder, bytelevel_tokenizer, "llama", 31, num_key_value_heads=2)
    set_eos(folder)  # save_pretrained wrote LlamaConfig's default, 2: no end of text for the plain run
    plain = load(folder, device="cpu")
    assert plain.info.eos_ids == frozenset()
    unstopped = list(generate(plain, PROMPT, N))
    ids = [s.token.id for s in unstopped]
    k = next(i for i in range(3, N - 1) if ids[i] not in ids[:i])  # its first time: the run stops there, not before
    set_eos(folder, ids[k])
    return SimpleNamespace(folder=folder, ref=ref, unstopped=unstopped, k=k, eos=ids[k])


def test_generation_ends_with_the_end_of_text_step_and_its_row(stopping):
    model = load(stopping.folder, device="cpu")
    assert model.info.eos_ids == frozenset({stopping.eos})
    k, unstopped = stopping.k, stopping.unstopped
    for use_cache in (True, False):
        steps = list(generate(model, PROMPT, N, use_cache=use_cache))
        assert len(steps) == k + 1 and steps[-1].token.id == stopping.eos and steps[-1].index == k
        assert [s.ends_text for s in steps] == [False] * k + [True]  # what the stream's "eos" reads
        assert [s.token.id for s in steps] == [s.token.id for s in unstopped[: k + 1]]
        # The last row is what the model looked at as it ended the text.
        assert steps[-1].position == unstopped[k].position
        assert torch.allclose(steps[-1].attention, unstopped[k].attention, atol=1e-6, rtol=0)
    # transformers stops at the same token, and includes it.
    ids = torch.tensor([model.encode(PROMPT).ids])
    with torch.no_grad():
        expected = stopping.ref.generate(ids, max_new_tokens=N, do_sample=False, attention_mask=torch.ones_like(ids),
                                         pad_token_id=0, eos_token_id=stopping.eos)
    assert [s.token.id for s in steps] == expected[0, ids.shape[1]:].tolist()


def test_stop_at_eos_false_makes_every_token_as_before(stopping):
    model = load(stopping.folder, device="cpu")
    steps = list(generate(model, PROMPT, N, stop_at_eos=False))
    assert [s.token.id for s in steps] == [s.token.id for s in stopping.unstopped] and len(steps) == N
    assert steps[stopping.k].token.id == stopping.eos  # it went on past the end of text
    assert not any(s.ends_text for s in steps)
    for got, want in zip(steps, stopping.unstopped):
        assert torch.equal(got.attention, want.attention) and got.token.prob == want.token.prob


@pytest.mark.parametrize("config, generation, expected", [
    (5, None, {5}),
    ([5, 7], None, {5, 7}),
    # Past the vocabulary (352), negative, or not an id at all: no token ends the text there.
    ([5, 352, 50256, -1, True, "7", None], None, {5}),
    (50256, None, set()),  # a random config's GPT-2 default over a small vocabulary
    # generation_config.json adds its own (an instruct model's end of turn), an id or a list.
    (5, [7, 9], {5, 7, 9}),
    (None, 11, {11}),
    (None, None, set()),  # neither names one, and this tokenizer has no <|endoftext|>
])
def test_eos_ids_come_from_config_and_generation_config(stopping, tmp_path, config, generation, expected):
    folder = tmp_path / "copy"
    shutil.copytree(stopping.folder, folder)
    set_eos(folder, config, generation)
    assert load(folder, device="cpu").info.eos_ids == frozenset(expected)


TINY_LLAMA = Path(__file__).resolve().parents[1] / "model" / "data" / "tiny-llama"


@pytest.mark.parametrize("config", [{"a": 1}, [999_999], -4, "0"])
def test_a_config_naming_no_id_the_model_outputs_falls_back_to_the_tokenizers(tmp_path, config):
    """The tokenizer's <|endoftext|> counted only where the config named nothing at all: a config
    whose every id was dropped left a model with no end of text (review h47i)."""
    folder = tmp_path / "tiny-llama"
    shutil.copytree(TINY_LLAMA, folder)
    set_eos(folder, config)
    assert load(folder, device="cpu").info.eos_ids == frozenset({0})


@pytest.mark.parametrize("broken", ["{not json", "[1, 2]", '"x"'])
def test_a_broken_generation_config_is_passed_over_not_fatal(tmp_path, caplog, broken):
    """generation_config.json is never required (transformers falls back to the config): a broken
    one stopped the model loading (review h47i). It is passed over, and said so."""
    folder = tmp_path / "tiny-llama"
    shutil.copytree(TINY_LLAMA, folder)
    set_eos(folder, 0)
    (folder / "generation_config.json").write_text(broken)
    with caplog.at_level("WARNING", logger="manyeyes.model.loading"):
        model = load(folder, device="cpu")
    assert model.info.eos_ids == frozenset({0})
    assert "generation_config.json" in caplog.text and "end-of-text ids are not read" in caplog.text


def test_eos_ids_of_the_built_ins_a_random_gpt2_and_an_encoder(tmp_path, bytelevel_tokenizer, minilm):
    # tiny-gpt (a book checkpoint) and tiny-llama (a llama folder whose config names none) have
    # <|endoftext|> as id 0 in their tokenizer.json, as `manyeyes train` writes it.
    for name in ("tiny-gpt", "tiny-llama"):
        model = load(name, device="cpu")
        assert model.info.eos_ids == frozenset({0}) and model.tokenizer.token_text(0) == "<|endoftext|>"
    save_random_gpt2(tmp_path, bytelevel_tokenizer, 4, n_embd=48, n_layer=2, n_head=4)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 50256
    assert load(tmp_path, device="cpu").info.eos_ids == frozenset()  # 50256 is past its 352 ids
    assert minilm.info.eos_ids == frozenset()  # an encoder ends no text


@pytest.mark.parametrize("vocab_size, expected", [(50257, {50256}), (50304, {50256}), (1000, set())])
def test_a_tiktoken_gpt2_vocabulary_ends_at_its_endoftext_where_the_model_has_it(vocab_size, expected):
    """A book checkpoint read with tiktoken's gpt2 encoding (no config to name one): 50256, in
    GPT-2's vocabulary and nanoGPT's padded 50,304, and in no shrunk one."""
    tiktoken_like = SimpleNamespace(end_of_text_id=50256)
    assert end_of_text_ids([], tiktoken_like, vocab_size) == frozenset(expected)
    assert end_of_text_ids([], SimpleNamespace(end_of_text_id=None), vocab_size) == frozenset()


# ---------------------------------------------------------------------------- the API and the client


@pytest.fixture(scope="module")
def api(stopping):
    client = serve(Settings(models={"eos-llama": str(stopping.folder)}, device="cpu", warmup=False))
    yield client
    client.__exit__(None, None, None)


def stream(api, **body) -> list[dict]:
    with api.stream("POST", "/api/v1/generate", json={"text": PROMPT, "model": "eos-llama", **body}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def test_the_stream_ends_with_reason_eos_after_the_end_of_text_step(api, stopping):
    k = stopping.k
    events = stream(api, max_new_tokens=N)
    steps = [e for e in events if e["type"] == "step"]
    assert events[-1] == {"type": "end", "reason": "eos", "tokens": k + 1}
    assert len(steps) == k + 1 and steps[-1]["token"]["id"] == stopping.eos and steps[-1]["index"] == k
    assert torch.allclose(torch.tensor(steps[-1]["attention"]), stopping.unstopped[k].attention, atol=1e-6, rtol=0)
    # The last token asked for ends the text: the model ended it, not the length.
    assert stream(api, max_new_tokens=k + 1)[-1] == {"type": "end", "reason": "eos", "tokens": k + 1}
    events = stream(api, max_new_tokens=N, stop_at_eos=False)
    assert events[-1] == {"type": "end", "reason": "length", "tokens": N}
    assert [e["token"]["id"] for e in events if e["type"] == "step"] == [s.token.id for s in stopping.unstopped]
    [entry] = api.get("/api/v1/models").json()["models"]
    assert entry["eos_ids"] == [stopping.eos]


def test_stop_at_eos_is_a_strict_bool(api):
    body = {"text": PROMPT, "model": "eos-llama", "max_new_tokens": 2}
    for value in (True, False):
        r = api.post("/api/v1/generate", json=body | {"stop_at_eos": value})
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["type"] == "end", r.text
    for value in ("false", 0, 1, None, [True]):
        r = api.post("/api/v1/generate", json=body | {"stop_at_eos": value})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert "stop_at_eos" in r.json()["error"]["message"]


def through(api) -> httpx.MockTransport:
    """The app behind the test client as a transport for manyeyes.Client, each answer read whole
    (and decoded: its content-encoding goes)."""
    def send(request):
        r = api.request(request.method, str(request.url), content=request.read(), headers=dict(request.headers))
        headers = {k: v for k, v in r.headers.items() if k not in ("content-encoding", "content-length")}
        return httpx.Response(r.status_code, headers=headers, content=r.content)

    return httpx.MockTransport(send)


def test_the_client_reads_an_eos_end_as_a_complete_generation(api, stopping):
    with Client("http://testserver", transport=through(api)) as c:
        generation = c.generate(PROMPT, N, model="eos-llama")
        assert generation.reason is None
        steps = list(generation)
        assert len(steps) == stopping.k + 1 and steps[-1].token.id == stopping.eos and generation.reason == "eos"
        generation = c.generate(PROMPT, N, model="eos-llama", stop_at_eos=False)
        assert len(list(generation)) == N and generation.reason == "length"
        assert c.models()[0].eos_ids == (stopping.eos,)


def test_the_client_sends_stop_at_eos_only_when_off_and_fails_only_on_error_ends():
    """A server from before stop_at_eos refuses the field (extra="forbid"): the default is not sent."""
    sent = []
    start = {"type": "start", "model": "m", "n_layers": 1, "n_heads": 1, "prompt": []}
    step = {"type": "step", "index": 0, "position": 3, "token": {"text": "<|endoftext|>", "id": 0, "prob": 0.5},
            "alternatives": [], "attention": [[[0.25, 0.25, 0.25, 0.25]]]}

    def answer(request):
        sent.append(json.loads(request.content))
        end = {"type": "end", "reason": "eos", "tokens": 1}
        return httpx.Response(200, text="".join(json.dumps(line) + "\n" for line in (start, step, end)))

    with Client("http://manyeyes.test", transport=httpx.MockTransport(answer)) as mocked:
        generation = mocked.generate("Hi", 5)
        assert [s.token.id for s in generation] == [0] and generation.reason == "eos"  # 1 of 5, and no error
        list(mocked.generate("Hi", 5, stop_at_eos=False))
    assert "stop_at_eos" not in sent[0] and sent[1]["stop_at_eos"] is False
    failing = httpx.MockTransport(lambda request: httpx.Response(200, text=json.dumps(start) + "\n" + json.dumps(
        {"type": "end", "reason": "shutdown", "tokens": 0, "error": "the server is shutting down"}) + "\n"))
    with Client("http://manyeyes.test", transport=failing) as mocked, pytest.raises(GenerationFailed):
        list(mocked.generate("Hi", 5))
