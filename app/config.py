"""Service settings, read from the environment with the MANYEYES_ prefix (e.g. MANYEYES_DEVICE=cuda)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from manyeyes.app.schemas import MAX_BATCH_TEXTS


def builtin_models() -> dict[str, str]:
    """The models that ship with manyeyes: the MiniLM encoder, the causal tiny-gpt and the long-context tiny-llama."""
    return {"minilm": "minilm", "tiny-gpt": "tiny-gpt", "tiny-llama": "tiny-llama"}


def parse_model_specs(specs: list[str] | str) -> dict[str, str]:
    """"ID=SPEC" pairs (a bare SPEC is its own ID), from CLI flags or a comma-separated variable."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",")]
    models = {}
    for raw in specs:
        item = raw.strip()
        if not item:
            continue
        model_id, sep, spec = item.partition("=")
        # A bare book spec, `model.pth?config=...` (its "=" comes after the "?"), or a path that
        # exists as written: `runs/lr=0.001/model` served "runs/lr" from a Hub id "0.001/model".
        if "?" in model_id or (sep and os.path.exists(os.path.expanduser(item.partition("?")[0]))):
            model_id, sep, spec = item, "", ""
        if sep and (not model_id.strip() or not spec.strip()):
            raise ValueError(f"model {raw!r} must look like ID=PATH_OR_SPEC")
        add_model(models, model_id.strip(), spec.strip() if sep else model_id.strip())
    return models


def add_model(models: dict[str, str], model_id: str, spec: str) -> None:
    """models[model_id] = spec, refusing an id `models` already gives another spec: the later one
    silently replaced the first, a built-in `minilm` included (the page then listed a 2-layer GPT
    as minilm)."""
    if models.get(model_id, spec) != spec:
        raise ValueError(
            f"model id {model_id!r} names two models ({models[model_id]} and {spec}); give each its own ID "
            "(ID=PATH_OR_SPEC), or set MANYEYES_MODELS to replace the built-in ones"
        )
    models[model_id] = spec


def check_added(models: dict[str, str], added: dict[str, str]) -> None:
    """ValueError where `added` (extra models) gives one of `models`' ids another spec."""
    merged = dict(models)
    for model_id, spec in added.items():
        add_model(merged, model_id, spec)


# A DNS name (labels of letters, digits, "-" or "_"; a final dot allowed) or an IPv4 address,
# optionally with a port, as a Host header carries it.
HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?(:\d{1,5})?", re.IGNORECASE)


def is_host_pattern(entry: str) -> bool:
    """Whether an entry of MANYEYES_ALLOWED_HOSTS can match a Host header as AllowedHosts compares
    them (app/middleware.py): a name or address, "*.name" for its subdomains, or "*"."""
    if entry == "*":
        return True
    if entry.startswith("["):  # "[::1]", "[::1]:8000"
        address, bracket, port = entry[1:].partition("]")
        if not bracket or (port and not re.fullmatch(r":\d{1,5}", port)):
            return False
    elif entry.count(":") > 1:  # a bare IPv6 address
        address = entry
    else:
        name = entry.removeprefix("*.")
        if HOST_NAME.fullmatch(name) is None:
            return False
        labels = name.partition(":")[0].rstrip(".").split(".")
        # All digits reads as an IPv4 address, which 999.999.999.999 is not
        return not all(label.isdigit() for label in labels) or is_ipv4(".".join(labels))
    if "%" in address:  # a zone id (fe80::1%eth0) never reaches a Host header: curl drops it
        return False
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


# A CORS origin as a browser's Origin header carries it, which the middleware compares as text: a
# scheme and a host in lower case (an IPv6 one in brackets), maybe a port, no user, path or "*".
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9._~-]+)(:(\d{1,5}))?")
DEFAULT_PORTS = {"http": 80, "https": 443}


# The longest wait any setting takes: 1e308 s passed as a number and meant for ever, as inf did.
DAY_S = 86_400.0


class Settings(BaseSettings):
    # allow_inf_nan=False: "inf" was a float like any other, and MANYEYES_SHUTDOWN_GRACE_S=inf
    # drained for ever behind one client that never finished its request.
    model_config = SettingsConfigDict(env_prefix="MANYEYES_", extra="ignore", allow_inf_nan=False)

    # Models: id -> load() spec. MANYEYES_MODELS (a JSON object) replaces the built-ins;
    # MANYEYES_EXTRA_MODELS="mine=/path/to/folder,other=x.pth" adds to them, as `--model` does.
    models: dict[str, str] = Field(default_factory=builtin_models)
    extra_models: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    default_model: str | None = None  # None: the first configured model
    device: str | None = None  # None: CUDA, then MPS, then CPU
    half: bool = False  # float16 autocast on CUDA only: `manyeyes serve` refuses it on another device
    # serve: matmuls under autocast (the softmax and the weights stay float32); works on any device.
    autocast: Literal["off", "float16", "bfloat16"] = "off"
    # Quantise attention to the request's format on the device, before the copy to the host
    # (services/device.py). None: on for accelerators, off on the CPU (no copy to save there).
    device_quantise: bool | None = None
    # How the server's threads wait for a CUDA GPU (services/device.py, set_cuda_wait): "block"
    # sleeps, where CUDA's default ("auto") spins a core for as long as the GPU is busy.
    cuda_wait: Literal["block", "spin", "yield", "auto"] = "block"
    # Weights' dtype; None/auto: as stored on CUDA (bf16/fp16 checkpoints stay so), float32 elsewhere.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # CPU, float32: lay each linear's weight out for oneDNN once (model/packed.py). 1.3x faster at
    # T=128, 2x on the linears at T=16; costs a second copy of those weights (MiniLM: 43 MB).
    pack_weights: bool = True

    # Dynamic micro-batching: one padded forward per batch, bounded in padded tokens and in wait.
    max_batch_tokens: int = Field(8192, ge=1)  # rows x longest row, padding included
    max_batch_items: int = Field(64, ge=1)
    # Attention weights one forward may produce (rows x layers x heads x width^2; 4 bytes each):
    # the batch's tensor and its rows' copies are the largest transient memory the server has.
    # 40M cells (160 MB) holds two MiniLM rows at T=512 and any number of short ones; batching
    # long inputs gains little anyway, the forward is compute-bound there.
    max_batch_cells: int = Field(40_000_000, ge=1)
    # Answers encoded (u8/f16/json bytes, base64, compression) at once; more than the cores gains
    # nothing and each holds a copy of its answer (19 MB for u8 at T=512) while it works.
    max_concurrent_renders: int = Field(2, ge=1)
    # Bytes of answers on their way out at once (services/slots.py FairBytes): each request's runs
    # and its encoded answer, reckoned before its forward pass and held until the answer is sent.
    # A request waits its turn for them (round-robin across clients, half the budget a client at
    # most, one larger than all of it alone); 0: no budget. SECURITY.md, "Memory".
    answer_bytes: int = Field(256 * 2**20, ge=0)
    max_wait_ms: float = Field(5.0, ge=0, le=60_000)
    # `serve --workers N` only: one more process runs every worker's batches of inputs up to
    # shared_forward_max_tokens as shared forwards (services/shared_forward.py; README, "GPU").
    shared_forward: bool = False
    shared_forward_max_tokens: int = Field(128, ge=1)
    # Capacity: inputs admitted at once (tokenizing, waiting or in the running forward); beyond it, 429.
    max_queue: int = Field(256, ge=1)
    request_timeout_s: float = Field(30.0, gt=0, le=DAY_S)  # per-request budget: queue + forward, else 504
    # Admission by work: a request is queued only if the work ahead of it and its own, at the
    # model's recent forward rate, fit in this fraction of its remaining budget; else 429 with
    # Retry-After at once instead of a 504 when the budget runs out. The rest of the budget is
    # for tokenizing, encoding and the estimate's error. 0: admission by count only.
    work_budget_fraction: float = Field(0.8, ge=0, le=1)

    # Limits on what one request may ask for.
    max_body_bytes: int = Field(1_000_000, ge=1)  # 413 before any JSON is parsed
    max_json_cells: int = Field(2_000_000, ge=1)  # format=json only: ~30 MB of text; u8 has no such cost
    max_batch_texts: int = Field(32, ge=1, le=MAX_BATCH_TEXTS)
    # Checked before tokenizing: a 512-token model needs ~3,000 characters, so this leaves room for
    # truncate=true on long pastes while keeping the tokenizer's work per request small.
    max_text_chars: int = Field(100_000, ge=1)

    # Exposure (see SECURITY.md). CORS is off unless origins are listed, e.g.
    # MANYEYES_CORS_ORIGINS='["https://viz.example.org"]'.
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # API keys (see SECURITY.md): with any configured, every /api route needs
    # `Authorization: Bearer <key>`. MANYEYES_API_KEYS="k1,k2", or a file of SHA-256 hex digests.
    # None: not set. Set but holding no key ("", ",", "[]"; a blank file name) is refused at start-up
    # (configured_keys, _a_named_file): it was read as no keys, which left the API open to whoever
    # templated an empty variable.
    api_keys: Annotated[list[str] | None, NoDecode] = None
    api_keys_file: Path | None = None
    close_metrics: bool = False  # True: /metrics needs a key too (/healthz and /readyz stay open)
    # Fair shares: each client (API key, else address) has its own queue, served round-robin into
    # the batches, so a flood from one delays another's request by at most one batch. Beyond
    # max_client_queue inputs in the system a client gets 429 while others are still admitted.
    # None: max_queue, no cap of its own, since many users behind one NAT or an untrusted proxy
    # share an address; a public service sets it (e.g. 64) so no one client can fill the queue.
    # X-Forwarded-For is believed only from these proxy addresses or networks, e.g.
    # MANYEYES_TRUSTED_PROXIES="127.0.0.1,10.0.0.0/8".
    max_client_queue: int | None = Field(None, ge=1)
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Host names requests may be addressed to (the Host header; any port), "*" for any, "*.example.org"
    # for its subdomains. None: `manyeyes serve` decides (app/clients.py, default_allowed_hosts):
    # bound to loopback with no trusted proxies, localhost, 127.0.0.1 and [::1] only, so that a page
    # that points its own name at 127.0.0.1 (DNS rebinding) cannot use a keyless local server; else any.
    allowed_hosts: Annotated[list[str] | None, NoDecode] = None
    # glibc malloc: blocks from this size up get their own mmap, returned to the OS when freed.
    # Without it, attention tensors of mixed sizes fragment the heap and RSS climbs far past the
    # run cache's bound (see SECURITY.md, "Memory"). 1 MiB keeps a forward's activations up to
    # T=128 on the heap, where they are reused without page faults. 0 leaves the allocator as it is.
    # At most glibc's own ceiling (32 MiB on 64-bit): mallopt takes an int, and 4 GiB wrapped to 0.
    malloc_mmap_threshold: int = Field(1024 * 1024, ge=0, le=32 * 1024 * 1024)
    # glibc malloc: a heap's free top is given back to the OS only past this size, so that the
    # blocks under the mmap threshold a forward frees and takes again layer after layer keep their
    # pages (see app/memory.py). Counted once per malloc arena at most, and taken during warm-up.
    malloc_trim_threshold: int = Field(64 * 1024 * 1024, ge=0, le=2**31 - 1)  # mallopt takes an int
    # Buffers from the mmap threshold up (a forward's weights, an answer's bytes) are written into
    # the mappings of finished ones, up to this many bytes of them kept: a fresh mapping's pages
    # cost 1 to 8 ms per 4.5 MiB on a virtual machine (model/buffers.py). 0: a fresh one each time.
    buffer_pool_bytes: int = Field(96 * 1024 * 1024, ge=0)
    # Fresh buffers from 4 MiB advised for transparent huge pages: faster where the host keeps the
    # memory backed, up to 5x slower where it takes freed memory back (model/buffers.py).
    huge_pages: bool = False
    switch_interval_ms: float = Field(0.5, ge=0, le=1000)  # the GIL's; 0 leaves Python's 5 ms (see main.py)
    # Once the models have loaded, what is alive (models, libraries, the app) leaves the garbage
    # collector's reach (app/memory.py, freeze_long_lived): full collections under load then
    # take 11-16 ms instead of 200-260. The test suite turns it off (tests/conftest.py): its apps come
    # and go within one process, and a frozen app's reference cycles would never be collected.
    gc_freeze: bool = True
    # FastAPI's own OpenTelemetry (a span, metrics and logs per request, through the global
    # providers that an OpenTelemetry SDK in the deployment sets up). Off unless asked for: with no
    # SDK configured it exports nothing, yet looked the providers up on every request (0.04 ms of
    # a T=16 answer's 1 ms beyond the forward); /metrics has the server's own Prometheus metrics.
    opentelemetry: bool = False

    # On SIGTERM: stop accepting, let in-flight requests finish for at most this long, then exit.
    shutdown_grace_s: float = Field(30.0, ge=0, le=DAY_S)
    # A connection must deliver each whole request (head and body) within this many seconds of its
    # first byte; slower ones are cut off (app/protocol.py). Idling between requests is uvicorn's keep-alive.
    request_read_timeout_s: float = Field(30.0, gt=0, le=DAY_S)
    # The request line and headers of one request, at most (431 beyond; app/server.py).
    max_header_bytes: int = Field(64 * 1024, ge=1024)

    # Every cached run: 3/4 for recent runs (their weights, or queries and keys), 1/4 for the
    # measures' captured forwards, each an LRU of its own.
    cache_bytes: int = Field(512 * 2**20, ge=0)

    # Long inputs (issue 10, README "Long inputs"). Above dense_max_tokens a run keeps its queries
    # and keys instead of the (L, H, T, T) weights (`keep: "auto"`), and serves any window of any
    # head from them: /runs/{id}/tile, /topk, /overview. 1024: MiniLM/tiny-gpt inputs all stay
    # dense, byte for byte as before; a 6-layer, 12-head run at T=1024 is 300 MB of weights.
    dense_max_tokens: int = Field(1024, ge=1)
    # A tile answer is at most max_tile_side x max_tile_side cells: a bigger window is pooled to the
    # request's rows/cols, and without them refused (413 too_many_cells).
    max_tile_side: int = Field(1024, ge=1)
    # Weights a tile or top-k request regenerates at once (a row block of its window): with the
    # answer, the most one request allocates, whatever the run's length.
    tile_block_bytes: int = Field(8 * 2**20, ge=4096)
    max_topk: int = Field(64, ge=1, le=64)
    gzip_level: int = Field(5, ge=1, le=6)  # small JSON (models, errors, docs) through GZipMiddleware
    gzip_min_bytes: int = Field(1024, ge=0)
    # Attention answers are compressed by the service, off the event loop (see services/wire.py),
    # with zstd at zstd_level or ISA-L gzip at attention_gzip_level (0-3), whichever the client
    # ranks higher: `json` text of gzip_min_bytes or more, compact answers (u8, f16, frames) of
    # zstd_min_bytes or more (0: never for compact ones).
    attention_gzip_level: int = Field(1, ge=0, le=3)
    zstd_level: int = Field(1, ge=1, le=22)
    zstd_min_bytes: int = Field(64 * 1024, ge=0)
    # A client on loopback (or a Unix socket) gets answers as they are, whatever Accept-Encoding
    # says: there compressing only adds time (bench/link_bench.py). True compresses for it too.
    compress_loopback: bool = False
    # Before /readyz says ready: one forward at each model's longest input up to dense_max_tokens,
    # and three timed short ones that seed admission by work's first rate (registry.warm_up).
    # False: no seeded rate, so a fresh server's first burst is admitted by count alone.
    warmup: bool = True

    # Generation (POST /api/v1/generate): new tokens per request, and generations running at once.
    max_new_tokens: int = Field(256, ge=1)
    max_generations: int = Field(4, ge=1)
    # Experiments (POST /api/v1/experiments/*): each runs two forwards on a worker thread; beyond this many at once, 429.
    max_experiments: int = Field(2, ge=1)

    # Test hooks: make a forward or the model loading slow, to exercise timeouts, 429 and /readyz.
    debug_forward_delay_s: float = Field(0.0, ge=0, le=DAY_S)
    debug_load_delay_s: float = Field(0.0, ge=0, le=DAY_S)

    @field_validator("api_keys", "trusted_proxies", "allowed_hosts", "cors_origins", mode="before")
    @classmethod
    def _split_list(cls, value):
        if not isinstance(value, str):
            return value
        if value.strip().startswith("["):
            # The JSON list MANYEYES_CORS_ORIGINS takes: split on commas, '["k1"]' was one key,
            # brackets and quotes included, and no intended key worked.
            try:
                listed = json.loads(value)
            except json.JSONDecodeError:
                listed = None
            if not (isinstance(listed, list) and all(isinstance(v, str) for v in listed)):
                raise ValueError("starts with '[' but is no JSON list of strings: write a JSON list "
                                 "such as '[\"a\", \"b\"]', or the values separated by commas")
            return [v.strip() for v in listed if v.strip()]
        return [v.strip() for v in value.split(",") if v.strip()]

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        # Checked here, not when the app is built: "proxy.local" was a traceback after "serving on".
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is no IP address or network (such as 10.0.0.1 or 10.0.0.0/8): "
                                 "name proxies by address") from None
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        # "viz.example.org" or "https://viz.example.org/" matches no Origin a browser sends: accepted,
        # every preflight from the real origin got 400 and no word said why.
        for entry in value:
            origin = ORIGIN.fullmatch(entry)
            if entry != "*" and (origin is None or (origin[3] and not 0 < int(origin[3]) <= 65535)):
                raise ValueError(f"{entry!r} is no origin: write it as a browser sends it, scheme and host in lower "
                                 "case (and a port if not the scheme's), no path, trailing slash, user or '*' in it: "
                                 "https://viz.example.org, or '*' alone for any origin")
            # A browser leaves its scheme's own port out of the Origin it sends: ":443" matched none.
            if origin is not None and origin[3] and DEFAULT_PORTS.get(entry.split("://")[0]) == int(origin[3]):
                raise ValueError(f"{entry!r} names its scheme's own port, which a browser leaves out of the Origin it "
                                 f"sends: write {entry.rsplit(':', 1)[0]}")
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _some_host(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("names no host: list host names (any port), '*' for any, or unset it for the default")
        # A URL or a path matches no Host header: accepted, it made the server answer 421 to every request.
        for entry in value or ():
            if not is_host_pattern(entry):
                raise ValueError(f"{entry!r} is no host name: list names as a Host header gives them (viz.example.org, "
                                 "10.0.0.5 or [::1], any port), '*.example.org' for its subdomains, or '*' for any; "
                                 "no scheme, path or spaces")
        return value

    @field_validator("api_keys_file", mode="before")
    @classmethod
    def _a_named_file(cls, value):
        # MANYEYES_API_KEYS_FILE="$KEYFILE" with KEYFILE unset was read as no file, and the API served
        # open without a word: refused, as an empty MANYEYES_API_KEYS is (configured_keys).
        if isinstance(value, str) and not value.strip():
            raise ValueError("is set but names no file: unset it to serve without keys, or give the path of a file of "
                             "SHA-256 digests")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _models_named(cls, value):
        # {"": ...} served a model no request could name, and {"a": ""} started and then failed to
        # load, where --model refuses them both.
        if isinstance(value, dict):
            for model_id, spec in value.items():
                if isinstance(model_id, str) and not model_id.strip():
                    raise ValueError(f"has an empty model id (for {spec!r}): each model needs an id to be asked for by")
                if isinstance(spec, str) and not spec.strip():
                    raise ValueError(f"gives model {model_id!r} an empty spec: a built-in name, a folder, a file or a Hub id")
        return value

    @field_validator("extra_models", mode="before")
    @classmethod
    def _split_extra(cls, value):
        if isinstance(value, str) and value.strip().startswith("{"):
            # MANYEYES_MODELS's JSON here was split on its commas into specs such as '{"mine": "x"'.
            raise ValueError("takes ID=PATH_OR_SPEC pairs separated by commas (mine=/models/mine,gpt2=gpt2), "
                             "not JSON; MANYEYES_MODELS is the JSON object, and replaces the built-in models")
        return parse_model_specs(value) if isinstance(value, (str, list)) else value

    @model_validator(mode="after")
    def _extra_models_add(self):
        check_added(self.models, self.extra_models)
        return self

    def drain_s(self) -> float:
        """How long a shutdown lets in-flight requests run before uvicorn cancels them: the grace
        but a second kept for the lifespan's shutdown and the exit (server_config)."""
        return max(self.shutdown_grace_s - 1.0, 0.0)

    def all_models(self) -> dict[str, str]:
        return {**self.models, **self.extra_models}

    def default_model_id(self) -> str:
        return self.default_model or next(iter(self.all_models()))


class AttendSettings(BaseSettings):
    """The one setting `manyeyes attend` reads (README, "Long inputs"): it runs no server, so the
    server's other MANYEYES_* variables are none of its business. It validated every one of them,
    and MANYEYES_MAX_TOPK=100, meant for a server, stopped `manyeyes attend "hi"` with status 2."""

    model_config = SettingsConfigDict(env_prefix="MANYEYES_", extra="ignore")

    dense_max_tokens: int = Field(Settings.model_fields["dense_max_tokens"].default, ge=1)
