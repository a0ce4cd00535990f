"""The oneDNN-packed linears (model/packed.py): same numbers as F.linear, taken when they can be,
following the weight when it changes, and out of the way of autograd and large models."""

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from manyeyes.model import load
from manyeyes.model.attention import Capture
from manyeyes.model.packed import PackedLinear, onednn_available, pack_linears

if not onednn_available():
    # Every x86 wheel of torch ships oneDNN; without it there the speed-up silently vanishes.
    assert platform.machine().lower() not in ("x86_64", "amd64"), "this torch build has no oneDNN"
    pytest.skip("no oneDNN in this torch build", allow_module_level=True)


def packed_copy(linear: nn.Linear) -> nn.Sequential:
    """A one-linear net sharing `linear`'s parameters, packed."""
    net = nn.Sequential(nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None))
    net.load_state_dict(nn.Sequential(linear).state_dict())
    net.requires_grad_(False)
    assert pack_linears(net) == 1
    return net


@pytest.fixture
def no_plain_linear(monkeypatch):
    """Make the fallback fail loudly, so a test proves the packed path ran."""

    def refuse(*args, **kwargs):
        raise AssertionError("F.linear was called: the packed path was not taken")

    monkeypatch.setattr("manyeyes.model.packed.F.linear", refuse)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48), (1, 3, 4, 48)])
def test_packed_linear_matches_f_linear(bias, shape, no_plain_linear):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    net = packed_copy(plain)
    x = torch.randn(shape)
    with torch.inference_mode():
        got = net(x)
    want = x @ plain.weight.detach().T + (plain.bias.detach() if bias else 0)
    assert got.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_strided_input_is_read_as_strided(no_plain_linear):
    torch.manual_seed(1)
    plain = nn.Linear(32, 16)
    net = packed_copy(plain)
    x = torch.randn(4, 32, 6).transpose(1, 2)  # (4, 6, 32), not contiguous
    assert not x.is_contiguous()
    with torch.no_grad():
        got = net(x)
    torch.testing.assert_close(got, x.contiguous() @ plain.weight.detach().T + plain.bias.detach(), rtol=1e-5, atol=1e-5)


def test_the_copy_follows_the_weight():
    torch.manual_seed(2)
    net = packed_copy(nn.Linear(16, 8))
    linear = net[0]
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = net(x)
        linear.weight[0].zero_()  # in place: the version counter moves
        after_edit = net(x)
        assert torch.equal(after_edit[:, 0], linear.bias[0].expand(3))
        assert torch.allclose(after_edit[:, 1:], before[:, 1:], atol=1e-6)
        linear.weight = nn.Parameter(torch.ones(8, 16), requires_grad=False)  # replaced
        after_swap = net(x)
    torch.testing.assert_close(after_swap, x.sum(1, keepdim=True).expand(3, 8) + linear.bias, rtol=1e-5, atol=1e-5)


def test_autograd_goes_through_f_linear():
    torch.manual_seed(3)
    net = packed_copy(nn.Linear(16, 8))
    x = torch.randn(3, 16, requires_grad=True)
    net(x).sum().backward()
    torch.testing.assert_close(x.grad, net[0].weight.sum(0).expand(3, 16))


def test_other_dtypes_go_through_f_linear():
    net = packed_copy(nn.Linear(16, 8))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert net(x).dtype == torch.bfloat16


def test_models_over_the_limit_stay_plain():
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # 2 x 16 KiB of weights
    assert pack_linears(net, limit_bytes=16 * 1024) == 0
    assert all(type(m) is nn.Linear for m in net)
    assert pack_linears(net, limit_bytes=32 * 1024) == 2
    assert all(type(m) is PackedLinear for m in net)


def test_non_float32_or_accelerator_models_stay_plain():
    net = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(net) == 0
    assert type(net[0]) is nn.Linear


def test_loaded_model_is_packed_keeps_its_keys_and_its_numbers(no_plain_linear):
    packed = load("minilm")
    linears = [m for m in packed.net.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    # Same parameters under the same names: a state_dict round-trips strictly into a fresh net.
    plain = load("minilm", pack=False)
    assert all(type(m) is nn.Linear for m in plain.net.modules() if isinstance(m, nn.Linear))
    assert list(packed.net.state_dict()) == list(plain.net.state_dict())
    plain.net.load_state_dict(packed.net.state_dict(), strict=True)

    encoded = [packed.encode("the river bank was full of fish while a heron waited")]
    got = packed.run(encoded, Capture())[0]
    with pytest.raises(AssertionError, match="packed path was not taken"):
        plain.run(encoded, Capture())  # the unpacked model does call F.linear: the fixture bites
    assert got.attention is not None and got.hidden is not None
    assert all(m._packed is not None for m in linears)  # packed at load, not on some later request


def test_packed_and_plain_models_agree():
    packed, plain = load("minilm"), load("minilm", pack=False)
    encoded = [packed.encode("a heron waited by the old stone mill while children ran"), packed.encode("fish")]
    for got, want in zip(packed.run(encoded, Capture()), plain.run(encoded, Capture())):
        torch.testing.assert_close(got.attention, want.attention, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)


GROWTH = """
import os, torch, torch.nn as nn
from manyeyes.model.packed import pack_linears
net = nn.Sequential(nn.Linear(384, 1536), nn.Linear(1536, 384)).requires_grad_(False)
assert pack_linears(net) == 2
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
with torch.inference_mode():
    for m in range(1, 101): net(torch.randn(m, 384))
    before = rss()
    for m in range(101, 401): net(torch.randn(m, 384))
print(rss() - before)
"""


def test_new_lengths_do_not_grow_memory_without_bound():
    """oneDNN keeps a compiled primitive per input shape; uncapped, 300 new token counts took
    ~370 MB here, capped (packed.PRIMITIVE_CACHES) under 50 MB. A fresh process, since the caps
    are read once, when oneDNN first runs. RSS comes from /proc (Linux, as CI)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", GROWTH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 120, f"RSS grew {float(out.stdout):.0f} MB over 300 new lengths"


def test_a_packed_model_pickles_and_deep_copies_and_packs_its_own_copy():
    """load()'s default model could not be pickled, deep-copied or sent to a spawned worker:
    "Cannot access storage of OpaqueTensorImpl" (the oneDNN copy)."""
    import copy
    import pickle

    model = load("tiny-gpt")
    before = model.attend("The cat sat on the mat.").attention
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert torch.equal(twin.attend("The cat sat on the mat.").attention, before)
        packed = [m for m in twin.net.modules() if isinstance(m, PackedLinear)]
        assert packed and all(m._packed is not None for m in packed)  # packed anew on first use
    # An edited copy (an experiment's) leaves the original's numbers alone.
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.net.trf_blocks[0].att.W_query.weight.mul_(2.0)
    assert not torch.equal(twin.attend("The cat sat on the mat.").attention, before)
    assert torch.equal(model.attend("The cat sat on the mat.").attention, before)
