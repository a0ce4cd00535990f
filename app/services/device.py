"""The accelerator path: attention leaves the device already quantised, through pinned memory.

u8 of MiniLM at T=512 is 19 MB against 75 MB of float32, so quantising before the copy moves a
quarter of the bytes over PCIe, and a pinned (page-locked) staging buffer lets that copy run at
full DMA speed. The code is the same on every device; on the CPU there is no copy to save, so
the server keeps float32 there by default, but tests run this path on the CPU too."""

from __future__ import annotations

import ctypes
import threading

import torch

# Most precise first: a batch is kept at the precision its most demanding request needs.
PRECISION = {"json": 0, "f16": 1, "u8": 2}
KEPT_DTYPE = {"json": torch.float32, "f16": torch.float16, "u8": torch.uint8}
KEPT_FORMAT = {dtype: fmt for fmt, dtype in KEPT_DTYPE.items()}  # the most precise format a dtype serves
AUTOCAST = {"off": None, "float16": torch.float16, "bfloat16": torch.bfloat16}
# CUDA's CU_CTX_SCHED_* flags: how a host thread waits for the GPU in a synchronising call.
CUDA_WAIT_FLAGS = {"auto": 0x0, "spin": 0x1, "yield": 0x2, "block": 0x4}


def quantises_on_device(device: str, setting: bool | None = None) -> bool:
    """Whether batches on `device` leave it quantised: as set, else everywhere but the CPU (where
    there is no copy to save, and the run cache keeps float32 for any later format)."""
    return device != "cpu" if setting is None else setting


def set_cuda_wait(policy: str, driver: ctypes.CDLL | None = None) -> str | None:
    """How this process's threads wait for its GPUs: "block" sleeps until the GPU signals, "spin"
    polls, "auto" is CUDA's own choice (spin while the process has fewer contexts than cores, so
    every server process spins). Set on each device's primary context, the one torch uses, so it
    must come before torch's first CUDA call that makes a context. Returns what was done, for the
    start-up log, or None where there is no CUDA driver or device (a CPU machine: nothing to say).

    Why: a spinning wait holds a core for as long as the GPU is busy, and with --workers the GPU
    is busy with every worker's forwards, so each wait spins through the others' too."""
    if policy == "auto":
        return "auto (CUDA's default)"
    try:
        driver = driver or ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int()
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return None
    # The _v2 entry point is what cuda.h names cuDevicePrimaryCtxSetFlags since CUDA 11.
    set_flags = getattr(driver, "cuDevicePrimaryCtxSetFlags_v2", None) or driver.cuDevicePrimaryCtxSetFlags
    for index in range(count.value):
        device = ctypes.c_int()
        if driver.cuDeviceGet(ctypes.byref(device), index) != 0:
            return f"cuDeviceGet({index}) failed"
        status = set_flags(device, CUDA_WAIT_FLAGS[policy])
        if status != 0:
            return f"cuDevicePrimaryCtxSetFlags on device {index} failed with CUDA error {status}"
    return f"{policy} on {count.value} device(s)"


def most_precise(formats) -> str:
    return min(formats, key=PRECISION.__getitem__)


def serves(kept: torch.dtype, fmt: str) -> bool:
    """Whether attention kept in `kept` can answer `fmt` without losing what the format promises."""
    return PRECISION[KEPT_FORMAT[kept]] <= PRECISION[fmt]


def quantise(weights: torch.Tensor, fmt: str) -> torch.Tensor:
    """On the weights' own device: uint8 as round(w * 255), float16, or float32 as it is. Same
    arithmetic as payload.to_u8/to_f16 on the host, so the bytes are identical either way."""
    if fmt == "u8":
        return torch.mul(weights, 255.0).round_().to(torch.uint8)
    if fmt == "f16":
        return weights.to(torch.float16)
    return weights


def dequantised(kept: torch.dtype):
    """How weights kept as `kept` become float32 again: u8 is byte / 255 (None: a plain .float())."""
    return (lambda weights: weights.float().div_(255.0)) if kept == torch.uint8 else None


class HostCopier:
    """Device -> host copies through reusable pinned staging buffers, one per dtype, grown as
    needed. Only the forward worker thread uses it; the lock keeps a stray second caller safe.

    pin: page-locked staging (needs CUDA). always_stage: stage CPU tensors too, so the CPU
    tests run the very code a GPU runs (with ordinary memory in place of pinned)."""

    def __init__(self, pin: bool | None = None, always_stage: bool = False) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.always_stage = always_stage
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._landed: dict[torch.device, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    def _stage(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._staging[dtype] = buf
        return buf[:numel]

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not self.always_stage:
            return tensor  # already host memory: no staging, no copy
        with self._lock:
            staged = self._stage(tensor.dtype, tensor.numel()).view(tensor.shape)
            staged.copy_(tensor, non_blocking=True)
            if tensor.device.type == "cuda":
                self._wait_for_copy(tensor.device)
            # Out of the staging buffer into memory the run cache may keep (a host memcpy).
            return staged.clone()

    def _wait_for_copy(self, device: torch.device) -> None:
        # Asleep until the copy lands, not spinning: a stream's synchronize() held a core for the
        # whole forward, and on an H200 with --workers 8 those cores were what the workers lacked.
        event = self._landed.get(device)
        if event is None:
            event = self._landed[device] = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(device))
        event.synchronize()


def device_to_host(copier: HostCopier, fmt: str):
    """The `to_host` the batcher hands to AttentionModel.run for a batch kept at `fmt`."""

    def to_host(weights: torch.Tensor) -> torch.Tensor:
        return copier.to_host(quantise(weights, fmt).contiguous())

    return to_host
