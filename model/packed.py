"""oneDNN's pre-packed weights for the linears of a model served on the CPU in float32.

On CPU, F.linear calls MKL's sgemm, which lays the weight matrix out for its kernels again on every
call. For a forward pass with few tokens that re-layout is most of the work: MiniLM's 32 linears
took 5.4 ms at T=16 through F.linear and 2.8 ms through oneDNN with weights laid out once (13.1
against 16.8 ms at T=128, 49 against 56 ms at T=512; `bench/packed_bench.py` measures it). The
price is a second copy of each weight, so `pack_linears` declines models whose linears would cost
more than `PACK_LIMIT_BYTES`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACK_LIMIT_BYTES = 1 << 30  # the extra memory a model's packed copies may take

# oneDNN builds (and JIT-compiles) a primitive per input shape, and both its cache and PyTorch's
# LRU in front of it keep 1,024 by default: about 1 MB per new token count for MiniLM, so RSS
# climbed with every new length (the soak: peak 1,962 MB against a bound of 1,888). 64 entries
# each hold the cost near 45 MB, whatever the lengths; a first call at a new length pays about
# 0.3 ms a weight shape to build its primitive. Both are read when oneDNN first runs.
PRIMITIVE_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the packed-linear ops (x86 and most arm64 wheels do)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._linear_pointwise) and bool(torch.ops.mkldnn._reorder_linear_weight)
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An nn.Linear that multiplies by a oneDNN copy of its weight when it can, else by the weight.

    It has nn.Linear's parameters and state_dict keys; `pack_linears` turns loaded nn.Linear
    modules into it in place, so hooks and references to them keep working. The copy follows the
    weight: it is made again when the weight is replaced or changed in place (the version counter
    moves). Autograd, other devices and other dtypes go through F.linear.
    """

    _packed: torch.Tensor | None = None
    _packed_for: tuple | None = None
    _packing_failed = False

    def __getstate__(self) -> dict:
        # oneDNN's copy has no storage that pickle or deepcopy can read ("Cannot access storage of
        # OpaqueTensorImpl"): a copied model, or one sent to a worker process, packs its own anew.
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        state.pop("_packed_for", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._can_pack(x):
            packed = self._packed_weight()
            if packed is not None:
                # oneDNN takes (..., in_features) inputs as they come, strides included.
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _can_pack(self, x: torch.Tensor) -> bool:
        weight = self.weight
        return (
            not self._packing_failed
            and x.device.type == "cpu"
            and weight.device.type == "cpu"
            and x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.dim() >= 2
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def _packed_weight(self) -> torch.Tensor | None:
        weight = self.weight
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if self._packed_for != key:
            try:
                # A normal tensor even when first called under inference_mode, so that later
                # calls outside it can use the copy too.
                with torch.inference_mode(False), torch.no_grad():
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            except RuntimeError as error:
                log.warning("oneDNN could not pack a %s weight (%s); using F.linear", tuple(weight.shape), error)
                self._packing_failed = True
                return None
            self._packed, self._packed_for = packed, key
        return self._packed


def pack_linears(net: nn.Module, limit_bytes: int = PACK_LIMIT_BYTES) -> int:
    """Make every plain nn.Linear in `net` a PackedLinear and pack its weight now, so that the memory
    is taken at load rather than on some later request. Returns how many were packed: 0 when oneDNN
    is missing, the weights are not float32 on the CPU, or the copies would exceed `limit_bytes`."""
    linears = [module for module in net.modules() if type(module) is nn.Linear]
    if not linears or not onednn_available():
        return 0
    for name, capacity in PRIMITIVE_CACHES.items():
        os.environ.setdefault(name, capacity)  # a value of the user's own wins
    if any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in linears):
        return 0
    distinct = {m.weight.data_ptr(): m.weight.nbytes for m in linears}
    if sum(distinct.values()) > limit_bytes:
        log.info("not packing %d linears: their copies would take %.0f MiB", len(linears), sum(distinct.values()) / 2**20)
        return 0
    for module in linears:
        module.__class__ = PackedLinear  # same attributes, so a class swap keeps identity and hooks
    return sum(module._packed_weight() is not None for module in linears)
