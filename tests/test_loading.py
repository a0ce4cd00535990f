"""Book checkpoints load strictly; every way a checkpoint can be wrong gives one clear error."""

import io
import json
import os
import pickle
import re
import shlex
import shutil

import pytest
import torch

from manyeyes.model import ModelLoadError, load
from manyeyes.model.gpt import GPTConfig, GPTModel
from tests.book_reference import GPTModel as BookGPTModel

BOOK_CFG = {"vocab_size": 0, "context_length": 32, "emb_dim": 30, "n_heads": 5, "n_layers": 2,
            "drop_rate": 0.1, "qkv_bias": False}


@pytest.fixture()
def book_folder(tmp_path, bytelevel_tokenizer):
    """A checkpoint saved from the book's own GPTModel class, with its config and a tokenizer."""
    tok_path, vocab = bytelevel_tokenizer
    cfg = dict(BOOK_CFG, vocab_size=vocab)
    torch.manual_seed(7)
    book = BookGPTModel(cfg).eval()
    torch.save(book.state_dict(), tmp_path / "model.pth")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tok_path, tmp_path / "tokenizer.json")
    return tmp_path, book, cfg


def test_book_state_dict_loads_strictly_into_our_gptmodel(book_folder):
    folder, book, cfg = book_folder
    ours = GPTModel(GPTConfig.from_dict(cfg))
    ours.load_state_dict(torch.load(folder / "model.pth", weights_only=True), strict=True)
    ours.eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 11))
    with torch.no_grad():
        assert (ours(ids) - book(ids)).abs().max() <= 1e-5


def test_load_book_folder_and_file_forms(book_folder, tmp_path_factory):
    folder, book, cfg = book_folder
    m = load(folder, device="cpu")
    assert m.info.family == "gpt" and m.info.causal and m.info.n_heads == 5 and m.info.max_tokens == 32
    r = m.attend("The quick brown fox.")
    ids = torch.tensor([[t.id for t in r.tokens]])
    with torch.no_grad():
        assert (book(ids)[0] - r.logits).abs().max() <= 1e-5

    # A dict holding model_state_dict (the book's training checkpoints), config by argument.
    other = tmp_path_factory.mktemp("ckpt")
    torch.save({"model_state_dict": book.state_dict(), "optimizer_state_dict": {}}, other / "ckpt.pth")
    (other / "my.json").write_text(json.dumps(cfg))
    m2 = load(f"{other / 'ckpt.pth'}?config={other / 'my.json'}&tokenizer={folder / 'tokenizer.json'}", device="cpu")
    assert torch.equal(m2.attend("The quick brown fox.").attention, r.attention)


def test_presets_are_known_and_checked(tmp_path, bytelevel_tokenizer):
    tok_path, vocab = bytelevel_tokenizer
    book = BookGPTModel(dict(BOOK_CFG, vocab_size=vocab))
    torch.save(book.state_dict(), tmp_path / "small.pth")
    # A real preset whose shapes do not match names the first mismatching key.
    with pytest.raises(ModelLoadError, match=r"shape mismatch for 'tok_emb.weight'.*small.pth|small.pth.*tok_emb"):
        load(tmp_path / "small.pth", config="gpt2-small", tokenizer=tok_path)


@pytest.mark.parametrize(
    "config,message",
    [
        (None, "needs its config"),
        ("gpt2-tiny", "gpt2-tiny"),
        ({"vocab_size": 10}, "missing config keys: context_length, emb_dim, n_heads, n_layers"),
        ({**BOOK_CFG, "vocab_size": 50, "n_heads": 7}, "not divisible by n_heads"),
        ({**BOOK_CFG, "heads": 5}, "unknown config keys: heads"),
        # These reached the model's constructor: a ZeroDivisionError and a TypeError, unnamed.
        ({**BOOK_CFG, "vocab_size": 50, "n_heads": 0}, "x.pth .*n_heads must be at least 1, got 0"),
        ({**BOOK_CFG, "vocab_size": 50, "n_layers": "2"}, "x.pth .*n_layers must be int, got '2'"),
    ],
)
def test_book_config_errors(tmp_path, config, message):
    torch.save({"tok_emb.weight": torch.zeros(2, 2)}, tmp_path / "x.pth")
    with pytest.raises(ModelLoadError, match=message):
        load(tmp_path / "x.pth", config=config)


def test_book_key_errors(book_folder):
    folder, book, cfg = book_folder
    state = book.state_dict()
    del state["trf_blocks.1.ff.layers.2.bias"]
    torch.save(state, folder / "model.pth")
    with pytest.raises(ModelLoadError, match=r"model.pth: missing key 'trf_blocks.1.ff.layers.2.bias'"):
        load(folder)
    state = book.state_dict()
    state["trf_blocks.0.att.extra"] = torch.zeros(1)
    torch.save(state, folder / "model.pth")
    with pytest.raises(ModelLoadError, match="unexpected key 'trf_blocks.0.att.extra'"):
        load(folder)
    torch.save([1, 2, 3], folder / "model.pth")
    with pytest.raises(ModelLoadError, match="expected a state_dict"):
        load(folder)


def test_missing_tokenizer_for_book_checkpoint(book_folder, monkeypatch, tmp_path):
    folder, _, _ = book_folder
    (folder / "tokenizer.json").unlink()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load(folder)
    with pytest.raises(ModelLoadError, match="missing file: .*nope.json"):
        load(folder, tokenizer=tmp_path / "nope.json")


@pytest.fixture()
def hf_copy(tmp_path, minilm_dir):
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    return tmp_path


def test_hf_missing_files(hf_copy):
    (hf_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights in .*expected model.safetensors or pytorch_model.bin"):
        load(hf_copy)
    (hf_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*config.json"):
        load(hf_copy)
    with pytest.raises(ModelLoadError, match="no such model file or folder") as err:
        load(hf_copy / "absent")
    assert "looked for" not in str(err.value)  # an absolute path says where already


def test_a_relative_model_path_that_is_not_there_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """"no such model file or folder: model" left an operator (systemd, docker) guessing the folder."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load("./weights/mine.pth")
    assert f"no such model file or folder: weights/mine.pth (looked for {tmp_path}/weights/mine.pth)" in str(err.value)


def test_a_stray_folder_named_as_a_hub_id_says_it_was_read_as_that_folder(tmp_path, monkeypatch):
    """An empty org/tiny/ where the process runs hid the Hub id: "missing file: org/tiny/config.json"
    for an id that loaded from any other folder (review h55a)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    with pytest.raises(ModelLoadError) as err:
        load("org/tiny")
    message = str(err.value)
    assert message.startswith(f"'org/tiny' is read as the folder {tmp_path}/org/tiny, which exists here") and "Hugging Face id" in message
    # Written as a path, it is one: the folder's own error.
    with pytest.raises(ModelLoadError, match=r"missing file: org/tiny/config.json"):
        load("./org/tiny")


def test_a_file_of_a_hugging_face_folder_is_told_to_pass_the_folder(hf_copy):
    """load(".../model.safetensors") was read as a book checkpoint, and the error listed the
    folder's config keys (architectures, attention_bias, ...) as unknown book settings."""
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with pytest.raises(ModelLoadError, match=rf"{name} is one file of a model.*pass its folder \({re.escape(str(hf_copy))}"):
            load(hf_copy / name)
    torch.save({"x": torch.zeros(1)}, hf_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin is one file of a model"):
        load(hf_copy / "pytorch_model.bin")


def test_a_book_checkpoint_saved_as_bin_beside_its_config_still_loads(book_folder):
    folder, _, _ = book_folder  # its config.json names no model_type
    shutil.copy(folder / "model.pth", folder / "weights.bin")
    assert load(f"{folder / 'weights.bin'}?tokenizer={folder / 'tokenizer.json'}", device="cpu").info.family == "gpt"


def test_config_and_tokenizer_options_on_a_hugging_face_folder_are_refused(hf_copy):
    """They were ignored without a word: the folder's own config.json and tokenizer.json loaded."""
    for options in ({"tokenizer": "/nonexistent.json"}, {"config": "gpt2-small"}):
        with pytest.raises(ModelLoadError, match="Hugging Face folder.*apply to a book .pth checkpoint only"):
            load(hf_copy, **options)
    with pytest.raises(ModelLoadError, match="Hugging Face folder"):
        load(f"{hf_copy}?tokenizer=/nonexistent.json")


def test_hf_missing_tokenizer(hf_copy):
    (hf_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file: .*tokenizer.json"):
        load(hf_copy)


def test_hf_unknown_model_type_and_bad_json(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps(cfg | {"model_type": "t5"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 't5'"):
        load(hf_copy)
    (hf_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read JSON .*config.json"):
        load(hf_copy)
    (hf_copy / "config.json").write_text(json.dumps(cfg | {"hidden_act": "swish"}))
    with pytest.raises(ModelLoadError, match="unsupported activation hidden_act='swish'; this family runs gelu, gelu_new, gelu_pytorch_tanh, gelu_fast"):
        load(hf_copy)


def test_hf_corrupt_weights(hf_copy):
    data = (hf_copy / "model.safetensors").read_bytes()
    (hf_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match=r"corrupt weights file .*model.safetensors"):
        load(hf_copy)
    (hf_copy / "model.safetensors").unlink()
    (hf_copy / "pytorch_model.bin").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ModelLoadError, match=r"corrupt or unreadable checkpoint .*pytorch_model.bin"):
        load(hf_copy)


def test_hf_missing_key_and_shape_mismatch(hf_copy):
    from safetensors.torch import load_file, save_file

    # Copies: load_file's tensors may read straight from the file that save_file is about to
    # overwrite (a bus error on safetensors before 0.8).
    state = {name: tensor.clone() for name, tensor in load_file(str(hf_copy / "model.safetensors")).items()}
    broken = dict(state)
    del broken["encoder.layer.3.attention.self.key.bias"]
    save_file(broken, str(hf_copy / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing key 'encoder.layer.3.attention.self.key.bias'"):
        load(hf_copy)
    broken = dict(state)
    broken["encoder.layer.2.output.dense.weight"] = torch.zeros(384, 100)
    save_file(broken, str(hf_copy / "model.safetensors"))
    # Named both ways: ours, and the key to look for in the checkpoint.
    with pytest.raises(ModelLoadError, match=r"shape mismatch for 'trf_blocks.2.ff.layers.2.weight' "
                                             r"\(the checkpoint's 'encoder.layer.2.output.dense.weight'\)"):
        load(hf_copy)
    broken = dict(state)
    broken["encoder.layer.0.attention.self.rotary"] = torch.zeros(1)
    save_file(broken, str(hf_copy / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected key 'encoder.layer.0.attention.self.rotary'"):
        load(hf_copy)


def test_tokenizer_larger_than_model_vocab(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    state = {name: tensor.clone() for name, tensor in load_file(str(hf_copy / "model.safetensors")).items()}
    state["embeddings.word_embeddings.weight"] = state["embeddings.word_embeddings.weight"][:1000]
    save_file(state, str(hf_copy / "model.safetensors"))
    (hf_copy / "config.json").write_text(json.dumps(cfg | {"vocab_size": 1000}))
    with pytest.raises(ModelLoadError, match="tokenizer has ids up to 30521 but the model embeds only 1000"):
        load(hf_copy)


def test_half_precision_needs_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal applies only without it")
    with pytest.raises(ModelLoadError, match="half precision needs a CUDA device"):
        load("minilm", device="cpu", half=True)


def test_unknown_spec_option():
    with pytest.raises(ModelLoadError, match="unknown option"):
        load("minilm?colour=blue")


def test_book_models_match_the_book_at_every_position(book_folder):
    """Up to the last position each model has: a position table read wrongly past some index
    shows only there (the short texts above stop at 11 tokens)."""
    from manyeyes.model.loading import builtin_path

    folder, book, cfg = book_folder
    tiny_folder = builtin_path("tiny-gpt")
    tiny_cfg = json.loads((tiny_folder / "config.json").read_text())
    tiny_book = BookGPTModel(tiny_cfg).eval()
    tiny_book.load_state_dict(torch.load(tiny_folder / "model.pth", weights_only=True), strict=True)
    for ours, reference, config in ((load(folder, device="cpu"), book, cfg), (load("tiny-gpt", device="cpu"), tiny_book, tiny_cfg)):
        r = ours.attend("In the beginning was the Word, and the Word was with God. " * 40, truncate=True)
        assert r.truncated and len(r.tokens) == config["context_length"] == ours.info.max_tokens
        ids = torch.tensor([[t.id for t in r.tokens]])
        with torch.no_grad():
            assert (reference(ids)[0] - r.logits).abs().max() <= 1e-4


def test_a_gpt2_shape_mismatch_names_the_fused_c_attn_it_came_from(tmp_path, bytelevel_tokenizer):
    """c_attn is split three ways into our W_query/W_key/W_value; the error named only ours, then
    the key without the "transformer." the file saves it under."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import save_random_gpt2

    save_random_gpt2(tmp_path, bytelevel_tokenizer, 0, n_embd=24, n_layer=2, n_head=3)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["transformer.h.1.attn.c_attn.weight"] = torch.zeros(24, 3 * 20)  # divisible in three, but 20 wide, not 24
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"shape mismatch for 'trf_blocks.1.att.W_query.weight' "
                                             r"\(the checkpoint's 'transformer.h.1.attn.c_attn.weight'\)"):
        load(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"layer_norm_eps": "1e-12"}, "layer_norm_eps must be a number > 0, got '1e-12'"),
    ({"layer_norm_eps": 0}, "layer_norm_eps must be a number > 0"),
    ({"max_position_embeddings": "96"}, "max_position_embeddings must be a whole number >= 1"),  # blamed tokenizer.json
    ({"num_attention_heads": True}, "num_attention_heads must be a whole number >= 1"),
    ({"pad_token_id": 40000}, "pad_token_id must be a token id below vocab_size"),  # nn.Embedding's AssertionError
    ({"pad_token_id": -40000}, "pad_token_id must be a token id below vocab_size (30522), or a negative one down to -30522"),
    ({"pad_token_id": 1.5}, "pad_token_id must be a whole number"),
])
def test_config_numbers_are_checked_by_name_before_the_model_is_built(hf_copy, change, message):
    """Each of these passed the constructor and failed at the first forward pass (TypeError,
    AssertionError) or was blamed on tokenizer.json."""
    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps(cfg | change))
    with pytest.raises(ModelLoadError, match=re.escape(f"config.json: {message}")):
        load(hf_copy)


@pytest.mark.parametrize("rope", [{"rope_theta": 0.0}, {"rope_scaling": {"rope_type": "linear", "factor": 0.0}}])
def test_a_rope_that_makes_nan_angles_is_refused(tmp_path, bytelevel_tokenizer, rope):
    """A factor of 0 loaded, warmed up and answered every request with null weights."""
    from tests.test_parity_decoders import save_random

    save_random(tmp_path, bytelevel_tokenizer, "llama", 0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"rope_theta": 10000.0} | rope))
    with pytest.raises(ModelLoadError, match="must be (a number )?> 0"):
        load(tmp_path)


def test_book_config_types_and_gelu_are_checked(tmp_path):
    """gelu "gelu_new" or "relu" silently ran erf; ln_eps "1e-5" failed at the first forward."""
    torch.save({"tok_emb.weight": torch.zeros(2, 2)}, tmp_path / "x.pth")
    for change, message in (({"gelu": "relu"}, "gelu must be 'tanh' or 'erf', got 'relu'"),
                            ({"ln_eps": "1e-5"}, "ln_eps must be a number, got '1e-5'"),
                            ({"qkv_bias": 1}, "qkv_bias must be bool"),
                            ({"drop_rate": 1.5}, "drop_rate in [0, 1)")):
        with pytest.raises(ModelLoadError, match=re.escape(message)):
            load(tmp_path / "x.pth", config={**BOOK_CFG, "vocab_size": 50, **change})


def test_a_book_checkpoint_without_its_masks_gets_the_models_own(book_folder):
    folder, book, cfg = book_folder
    state = {k: v for k, v in book.state_dict().items() if not k.endswith(".att.mask")}
    torch.save(state, folder / "model.pth")
    ours = load(folder, device="cpu")  # the default is CUDA where there is one; the book's mask is on the CPU
    assert torch.equal(ours.net.trf_blocks[0].att.mask, book.trf_blocks[0].att.mask.bool())


def test_a_corrupt_checkpoint_is_named_without_torchs_advice(book_folder):
    """torch's reasons were "101" (a KeyError) for a text file, nothing for an empty one, and for
    a pickled whole model the advice to call torch.serialization.add_safe_globals."""
    folder, book, _ = book_folder
    pickled = io.BytesIO()
    torch.save(book, pickled)
    pickled_whole = "it holds a pickled tests.book_reference.GPTModel, not a state_dict of tensors: save model.state_dict() instead"
    for content, reason in ((b"not a checkpoint at all", "not a file torch.save wrote"), (b"", "the file is empty"),
                            (b"\x80\x02}q\x00", "not plain tensors and data:"), (pickled.getvalue(), pickled_whole)):
        (folder / "model.pth").write_bytes(content)
        with pytest.raises(ModelLoadError) as raised:
            load(folder)
        message = str(raised.value)
        assert message.startswith(f"corrupt or unreadable checkpoint {folder / 'model.pth'} ({reason}"), message
        assert "weights_only set to False" not in message and "file an issue" not in message and "\n" not in message
        assert "add_safe_globals" not in message


class Hostile:
    """Unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_a_hostile_pickle_is_refused_unrun_and_without_torchs_advice(book_folder, tmp_path, writer):
    """torch 2.13 words a blocked call "unsupported GLOBAL posix.system whose module posix is
    blocked", which the reason's pattern missed: the error repeated torch's advice to re-run with
    weights_only=False, which would have run the file's command."""
    folder, _, _ = book_folder
    marker = tmp_path.parent / f"{tmp_path.name}-pwned"  # outside the model folder, which holds tmp_path
    with open(folder / "model.pth", "wb") as f:
        if writer == "torch.save":
            torch.save({"tok_emb.weight": torch.zeros(2), "x": Hostile(marker)}, f)
        else:
            pickle.dump({"x": Hostile(marker)}, f)
    with pytest.raises(ModelLoadError) as raised:
        load(folder, device="cpu")
    message = str(raised.value)
    assert message.startswith(f"corrupt or unreadable checkpoint {folder / 'model.pth'} ("), message
    assert message.endswith("; manyeyes never unpickles code)") and "\n" not in message, message
    for advice in ("weights_only", "Re-running", "arbitrary code", "trusted source", "safe_globals"):
        assert advice not in message, message
    assert not marker.exists()


def test_an_unknown_preset_is_named_as_one_not_as_a_missing_file(tmp_path):
    torch.save({"tok_emb.weight": torch.zeros(2, 2)}, tmp_path / "x.pth")
    with pytest.raises(ModelLoadError, match=re.escape("config 'gpt2-tiny' is neither a preset (gpt2-small,")):
        load(tmp_path / "x.pth", config="gpt2-tiny")


def test_a_neox_fused_bias_of_the_wrong_rank_is_named(tmp_path, bytelevel_tokenizer):
    """A 0-dim query_key_value.bias was an IndexError inside the split; then named without the
    "gpt_neox." the file saves it under."""
    from safetensors.torch import load_file, save_file

    from tests.test_parity_decoders import save_random

    save_random(tmp_path, bytelevel_tokenizer, "gpt_neox", 0)
    state = load_file(str(tmp_path / "model.safetensors"))
    key = next(k for k in state if k.endswith("layers.1.attention.query_key_value.bias"))
    state[key] = torch.tensor(0.5)
    save_file(state, str(tmp_path / "model.safetensors"))
    assert key == "gpt_neox.layers.1.attention.query_key_value.bias"
    with pytest.raises(ModelLoadError, match=rf"'{re.escape(key)}' has shape \(\)"):
        load(tmp_path)


def test_integer_weights_are_refused_by_name_not_cast(minilm_dir, book_folder, tmp_path, bytelevel_tokenizer):
    """An int8 tensor where a weight belongs (a quantised checkpoint, or another tensor under the
    name) was cast to float and loaded: numbers that mean nothing, with no word said."""
    from safetensors.torch import load_file, save_file

    from tests.test_parity_decoders import save_random

    def quantise(path, key):
        state = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
        state[key] = state[key].round().to(torch.int8)
        save_file(state, str(path))

    bert = tmp_path / "bert"  # book_folder holds tmp_path itself
    shutil.copytree(minilm_dir, bert)
    quantise(bert / "model.safetensors", "encoder.layer.1.attention.self.query.weight")  # a row of the key table
    with pytest.raises(ModelLoadError, match="'encoder.layer.1.attention.self.query.weight' holds int8 values"):
        load(bert)
    for family, prefix, key in (("gpt_neox", "gpt_neox.", "layers.0.attention.query_key_value.weight"), ("llama", "", "lm_head.weight")):
        folder = tmp_path / family
        save_random(folder, bytelevel_tokenizer, family, 0, tie_word_embeddings=False)
        quantise(folder / "model.safetensors", prefix + key)  # a fused tensor split by hand; an untied head
        # named as the file saves it, prefix and all
        with pytest.raises(ModelLoadError, match=f"'{re.escape(prefix + key)}' holds int8 values, not floating-point weights"):
            load(folder)
    folder, book, _ = book_folder
    state = book.state_dict()
    state["trf_blocks.0.att.W_key.weight"] = state["trf_blocks.0.att.W_key.weight"].long()
    torch.save(state, folder / "model.pth")
    with pytest.raises(ModelLoadError, match="'trf_blocks.0.att.W_key.weight' holds int64 values"):
        load(folder)


@pytest.mark.parametrize("content, message", [
    (lambda w: w | {"epoch": 3}, "but 'epoch' holds int, not a tensor"),
    (lambda w: w | {"transformer.ln_f.weight": 1.0}, "but 'transformer.ln_f.weight' holds float, not a tensor"),
    (lambda w: w | {"transformer.ln_f.weight": None}, "but 'transformer.ln_f.weight' holds None, not a tensor"),
    # transformers reads no wrapper either: the weights inside would be missing keys to it.
    (lambda w: {"state_dict": w}, "but 'state_dict' holds dict, not a tensor"),
    (lambda w: w | {0: torch.zeros(1)}, "but it has the key 0, not a name"),
    (lambda w: list(w.values()), "got a list"),
    (lambda w: torch.zeros(3), "got a Tensor"),
], ids=["extra-int", "float-weight", "none-weight", "state_dict-wrapper", "int-key", "list", "tensor"])
def test_a_bin_that_is_no_dict_of_tensors_is_refused_naming_file_and_key(tmp_path, bytelevel_tokenizer, content, message):
    """torch.load(weights_only=True) accepts any plain data: an AttributeError traceback from
    stored_dtype, or "its configuration does not make a model" for a list."""
    from safetensors.torch import load_file

    from tests.conftest import save_random_gpt2

    save_random_gpt2(tmp_path, bytelevel_tokenizer, 0, n_embd=24, n_layer=1, n_head=2)
    weights = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    torch.save(content(weights), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as raised:
        load(tmp_path, device="cpu")
    assert str(raised.value) == f"{tmp_path / 'pytorch_model.bin'}: expected a state_dict (a dict of tensors), {message}"


def test_a_book_training_checkpoint_with_a_non_tensor_beside_its_weights_names_the_key(book_folder):
    folder, book, _ = book_folder
    torch.save({"model_state_dict": book.state_dict() | {"step": 3}}, folder / "model.pth")
    with pytest.raises(ModelLoadError, match=re.escape(f"{folder / 'model.pth'}: expected a state_dict or a dict "
                                                       "holding 'model_state_dict', but 'step' holds int, not a tensor")):
        load(folder, device="cpu")


def _null(folder, key):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {key: None}))


@pytest.mark.parametrize("family, key", [
    ("llama", "max_position_embeddings"),  # blamed tokenizer.json
    ("llama", "hidden_size"), ("llama", "vocab_size"), ("llama", "num_hidden_layers"),
    ("llama", "intermediate_size"), ("llama", "num_attention_heads"),
    ("gpt_neox", "max_position_embeddings"),
    ("gpt2", "n_embd"), ("gpt2", "n_positions"),
    ("bert", "type_vocab_size"),  # read as "no segments": "unexpected key 'type_emb.weight'"
    ("bert", "intermediate_size"),
])
def test_a_null_config_number_the_model_needs_is_refused_by_name(tmp_path, bytelevel_tokenizer, minilm_dir, family, key):
    """A null passed check_numbers and failed in a constructor ("empty(): argument 'size' ...")
    naming no key, or at the tokenizer."""
    from tests.conftest import save_random_gpt2
    from tests.test_parity_decoders import save_random

    if family == "bert":
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            shutil.copy(minilm_dir / name, tmp_path / name)
    elif family == "gpt2":
        save_random_gpt2(tmp_path, bytelevel_tokenizer, 0, n_embd=24, n_layer=1, n_head=2)
    else:
        save_random(tmp_path, bytelevel_tokenizer, family, 0)
    _null(tmp_path, key)
    with pytest.raises(ModelLoadError) as raised:
        load(tmp_path, device="cpu")
    assert str(raised.value) == f"{tmp_path / 'config.json'}: {key} is null, but the model cannot be built without it"


@pytest.mark.parametrize("family, key", [("llama", "head_dim"), ("llama", "num_key_value_heads"), ("gpt2", "n_inner")])
def test_a_null_that_transformers_derives_still_loads(tmp_path, bytelevel_tokenizer, family, key):
    from tests.conftest import save_random_gpt2
    from tests.test_parity_decoders import save_random

    if family == "gpt2":
        save_random_gpt2(tmp_path, bytelevel_tokenizer, 0, n_embd=24, n_layer=1, n_head=2)
    else:
        save_random(tmp_path, bytelevel_tokenizer, family, 0)
    _null(tmp_path, key)
    m = load(tmp_path, device="cpu")
    assert (m.info.n_heads, m.info.n_kv_heads, m.info.head_dim) == ((6, 6, 8) if family == "llama" else (2, 2, 12))


@pytest.mark.parametrize("family, head_key", [("gpt2", "lm_head.weight"), ("llama", "lm_head.weight"), ("gpt_neox", "embed_out.weight")])
def test_a_tied_head_reads_the_embeddings_whatever_a_saved_copy_holds(tmp_path, bytelevel_tokenizer, family, head_key):
    """GPT-2 alone read a differing saved lm_head.weight; README says a tied head reads the
    embeddings (transformers 4 tied it; transformers 5 warns and keeps the copy)."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import save_random_gpt2
    from tests.test_parity_decoders import save_random

    if family == "gpt2":
        save_random_gpt2(tmp_path, bytelevel_tokenizer, 0, n_embd=24, n_layer=1, n_head=2)
    else:
        save_random(tmp_path, bytelevel_tokenizer, family, 0, tie_word_embeddings=True)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    tied = load(tmp_path, device="cpu").attend("The quick brown fox.").logits
    weights = load_file(str(tmp_path / "model.safetensors"))
    embeddings = next(v for k, v in weights.items() if k.endswith(("wte.weight", "embed_tokens.weight", "embed_in.weight")))
    weights[head_key] = torch.randn_like(embeddings)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    m = load(tmp_path, device="cpu")
    assert torch.equal(m.net.out_head.weight, embeddings) and torch.equal(m.net.tok_emb.weight, embeddings)
    assert torch.equal(m.attend("The quick brown fox.").logits, tied)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_finite_check_sees_one_bad_value_anywhere(dtype):
    # Checked through the extremes (aminmax), which vectorised kernels compute lane by lane: one
    # bad value in any lane, the first, the last or a tail past the vectors, must still show.
    from manyeyes.model.keymap import all_finite

    weights = torch.randn(131, dtype=torch.float32).to(dtype)
    assert all_finite(weights) and all_finite(weights[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for position in range(len(weights)):
            broken = weights.clone()
            broken[position] = bad
            assert not all_finite(broken), (bad, position)
    assert all_finite(torch.full((9,), torch.finfo(dtype).max, dtype=dtype)), "large is not infinite"


# ---------------------------------------------------------------------------- errors name the checkpoint's key


def _head_cases():
    """(family, transformers model, config, the checkpoint key to misshape): each head tensor a
    family maps outside its table rows (a masked-LM head merged in, an untied decoder or lm_head)."""
    import transformers as tf

    from manyeyes.model.families import bert, distilbert, gpt2, gpt_neox, llama, roberta

    enc = dict(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
               max_position_embeddings=20)
    dec = dict(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
               max_position_embeddings=20, tie_word_embeddings=False)
    distil = dict(vocab_size=40, dim=8, n_layers=1, n_heads=2, hidden_dim=16, max_position_embeddings=20)
    untied = dict(tie_word_embeddings=False)
    return [
        (bert, tf.BertForMaskedLM, tf.BertConfig(**enc), "cls.predictions.transform.dense.weight"),
        (bert, tf.BertForMaskedLM, tf.BertConfig(**enc, **untied), "cls.predictions.decoder.weight"),
        (roberta, tf.RobertaForMaskedLM, tf.RobertaConfig(**enc), "lm_head.dense.weight"),
        (roberta, tf.RobertaForMaskedLM, tf.RobertaConfig(**enc, **untied), "lm_head.decoder.weight"),
        (distilbert, tf.DistilBertForMaskedLM, tf.DistilBertConfig(**distil), "vocab_transform.weight"),
        (distilbert, tf.DistilBertForMaskedLM, tf.DistilBertConfig(**distil, **untied), "vocab_projector.weight"),
        (gpt2, tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=40, n_positions=20, n_embd=8, n_layer=1, n_head=2, **untied),
         "lm_head.weight"),
        (llama, tf.LlamaForCausalLM, tf.LlamaConfig(**dec), "lm_head.weight"),
        (gpt_neox, tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**dec, rotary_pct=0.5), "embed_out.weight"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_misshapen_head_tensor_is_named_by_its_checkpoint_key(tmp_path, case):
    """The masked-LM head was merged in without its sources, and an untied decoder or lm_head was
    set with none: a wrong-vocabulary lm_head.weight was reported only as 'out_head.weight'."""
    from manyeyes.model.keymap import load_strict

    family, model_cls, config, key = _head_cases()[case]
    torch.manual_seed(0)
    state = {name: tensor.clone() for name, tensor in model_cls(config).state_dict().items()}
    if key == "embed_out.weight":  # GPT-NeoX's name on disk; transformers 5 names it lm_head.weight in memory
        state[key] = state.pop("lm_head.weight")
    rows, cols = state[key].shape
    state[key] = torch.zeros(rows + 1, cols)
    net = family.build(config.to_dict(), tmp_path)
    with pytest.raises(ModelLoadError, match=rf"shape mismatch for '[\w.]+' \(the checkpoint's '{re.escape(key)}'\)"):
        load_strict(net, family.convert(state, net, tmp_path), tmp_path)


@pytest.mark.parametrize("family_name", ["bert", "gpt2", "llama", "gpt_neox"])
def test_a_tied_head_is_named_by_the_embeddings_key_it_is_tied_to(tmp_path, family_name):
    """A tied head is the word embeddings' tensor: an error about it names the embeddings' key and says so."""
    import transformers as tf

    from manyeyes.model import families

    family = getattr(families, family_name)
    small = dict(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                 max_position_embeddings=20, tie_word_embeddings=True)
    model_cls, config, ours, embeddings = {
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**small), "mlm_head.out_head.weight", "bert.embeddings.word_embeddings.weight"),
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=40, n_positions=20, n_embd=8, n_layer=1, n_head=2),
                 "out_head.weight", "transformer.wte.weight"),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**small), "out_head.weight", "model.embed_tokens.weight"),
        "gpt_neox": (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**small, rotary_pct=0.5), "out_head.weight", "gpt_neox.embed_in.weight"),
    }[family_name]
    state = dict(model_cls(config).state_dict())
    net = family.build(config.to_dict(), tmp_path)
    mapped = family.convert(state, net, tmp_path)
    assert mapped[ours] is mapped["tok_emb.weight"]
    assert mapped.theirs(ours) == f" (tied to the word embeddings: the checkpoint's '{embeddings}')"


def test_a_checkpoint_with_damaged_bytes_is_refused_by_its_checksums(book_folder):
    """torch.load reads a torch.save zip without checking its CRC-32s: bytes flipped inside a
    weight (still finite values) loaded as that damaged model, with no word."""
    import zipfile

    folder, _, _ = book_folder
    path = folder / "model.pth"
    with zipfile.ZipFile(path) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    raw = bytearray(path.read_bytes())
    name_length, extra_length = (int.from_bytes(raw[entry.header_offset + at: entry.header_offset + at + 2], "little") for at in (26, 28))
    start = entry.header_offset + 30 + name_length + extra_length
    for i in range(0, min(entry.file_size, 4000), 4):
        raw[start + i] ^= 1  # the lowest mantissa bit of a float32: a finite value either way
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=re.escape(f"corrupt checkpoint {path}: its entry {entry.filename} does not match its checksum")):
        load(folder, device="cpu")


def test_a_checkpoint_saved_without_checksums_still_loads(book_folder):
    """torch.serialization.set_crc32_options(False) writes 0 for every entry's CRC, and torch
    loads such a file: the checksum pass refused it as damaged (review h56h)."""
    folder, book, _ = book_folder
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(book.state_dict(), folder / "model.pth")
    finally:
        torch.serialization.set_crc32_options(True)
    assert load(folder, device="cpu").info.n_heads == 5


def test_a_folder_whose_book_checkpoint_is_not_model_pth_is_told_to_pass_the_file(book_folder):
    """It was read as a Hugging Face folder: "config.json has no model_type ... add the one it was
    saved as", which a book config cannot take."""
    folder, book, _ = book_folder
    (folder / "model.pth").rename(folder / "gpt.pth")
    with pytest.raises(ModelLoadError) as raised:
        load(folder, device="cpu")
    assert str(raised.value) == (f"{folder} holds a book checkpoint (gpt.pth) but no model.pth, and its config.json has no "
                                 f"model_type, as a Hugging Face folder's has: load the file itself ({folder / 'gpt.pth'}), "
                                 "or name it model.pth")
    assert load(folder / "gpt.pth", device="cpu").info.n_heads == 5  # as told: its config.json beside it


@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_a_saved_mask_that_is_not_the_causal_one_is_refused(book_folder, fill):
    """The file's mask was trusted: zeros let query 0 see later tokens in the dense path (the
    long-input path masks by position: the two disagreed by 0.92), ones made attention NaN."""
    folder, book, _ = book_folder
    state = book.state_dict()
    state["trf_blocks.1.att.mask"] = torch.full_like(state["trf_blocks.1.att.mask"], fill)
    torch.save(state, folder / "model.pth")
    with pytest.raises(ModelLoadError, match=re.escape(f"{folder / 'model.pth'}: 'trf_blocks.1.att.mask' is not the mask "
                                                       "this model derives from its config")):
        load(folder, device="cpu")


@pytest.mark.parametrize("spec", [None, 3, ["minilm"]])
def test_a_spec_that_is_no_name_or_path_is_a_type_error(spec):
    """load(None) looked up "None" in the Hugging Face cache, and fetched it from the Hub when online."""
    with pytest.raises(TypeError, match=re.escape(f"spec must be a model name, a path or a Hugging Face id (a str or a Path), got {spec!r}")):
        load(spec)


def test_a_folder_named_as_a_built_in_model_is_said_not_to_be_loaded(tmp_path, monkeypatch, caplog):
    """The training recipe writes --out tiny-gpt; `--model tiny-gpt` beside it then showed the
    shipped model's heads as if they were the new one's, with no word."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-gpt").mkdir()
    with caplog.at_level("WARNING", logger="manyeyes.model.loading"):
        model = load("tiny-gpt", device="cpu")
    assert model.info.id == "tiny-gpt"
    assert [r.getMessage() for r in caplog.records] == [
        f"'tiny-gpt' is the built-in model; the folder {tmp_path / 'tiny-gpt'} here is not loaded: name it ./tiny-gpt to load it"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="manyeyes.model.loading"):
        load("minilm", device="cpu")
    assert caplog.records == []


def test_tokenizer_with_a_gap_in_its_ids_past_the_model_vocab(hf_copy):
    """The same count of ids, one moved past the embedding's rows: the count passed, and "the" was
    an IndexError at the first forward pass that said it (a 500 from the server)."""
    path = hf_copy / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["vocab"]["the"] = 30600
    path.write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match=r"tokenizer has ids up to 30600 but the model embeds only 30522 \(ids 0-30521\)"):
        load(hf_copy)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_a_quantised_checkpoint_is_refused_as_quantised_by_its_config(hf_copy, method):
    """Its weights sit under names of their own (q_proj.qweight, weight_scale_inv): the key table
    said a key was missing, or asked whether the folder held that family's checkpoint at all."""
    path = hf_copy / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"quantization_config": {"quant_method": method, "bits": 4}}))
    with pytest.raises(ModelLoadError, match=rf"config.json: a quantised checkpoint \(quantization_config: {method}\) "
                                             r"is not supported.*load the model's unquantised checkpoint"):
        load(hf_copy)
