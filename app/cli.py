"""The `manyeyes` command line."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
import unicodedata
from contextlib import contextmanager

SHADES = " .:-=+*#%@"  # ten steps, light to dark
TABLE_MAX_KEYS = 64  # a head's matrix is 6 characters a key wide: past this, no terminal shows a row on one line
ROW_TOP_KEYS = 5  # the keys listed per query instead


def _shown(text: str) -> str:
    """A token's text as the terminal should show it: control and format characters escaped
    (a newline split its row in two; ESC and bidi overrides reached the terminal as commands)."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _columns(text: str) -> int:
    """Terminal columns a label takes: 2 for a wide character (CJK, most emoji), 0 for a combining
    mark. By len(), a row labelled 東京 stood two columns right of the others."""
    return sum(0 if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me")
               else 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1 for ch in text)


def _clipped(label: str, width: int) -> str:
    if _columns(label) <= width:
        return label
    while _columns(label) > width - 1:
        label = label[:-1]
    return label + "…"


def _right_aligned(label: str, width: int) -> str:
    """`label` padded on the left to `width` terminal columns (_columns)."""
    return " " * (width - _columns(label)) + label


def _format_head(tokens: list[str], weights, blocked=None, width: int = 12) -> str:
    """A readable matrix: rows are queries, columns keys, values to 2 decimals plus a shade. Keys a
    query cannot see (`blocked`: a causal model's later ones, those behind a sliding window) are
    "·": printed 0.00 they read as weights the head gave nothing, as the figures and page grey them."""
    labels = [_clipped(t, width) for t in tokens]
    pad = max(_columns(lab) for lab in labels)
    index = len(str(len(tokens) - 1))  # row numbers as wide as the largest: row 10 had pushed its cells right
    lines = [" " * (pad + index + 2) + " ".join(f"{i:>5}" for i in range(len(tokens)))]
    hidden = blocked.tolist() if blocked is not None else [[False] * len(tokens)] * len(tokens)
    for i, (lab, row) in enumerate(zip(labels, weights.tolist())):
        cells = " ".join("    ·" if off else f"{v:5.2f}" for v, off in zip(row, hidden[i]))
        # a NaN weight (a float16 run that overflowed) is a "?", not a crash of int()
        shade = "".join(SHADES[min(int(v * len(SHADES)), len(SHADES) - 1)] if v == v else "?" for v in row)
        lines.append(f"{_right_aligned(lab, pad)} {i:>{index}} {cells}  |{shade}|")
    return "\n".join(lines)


def _bad_text(args) -> bool:
    """Says so (one line) when the text or pair holds only whitespace, or bytes that were not
    UTF-8 (Python keeps them as lone surrogates, which no tokenizer takes), as the API's 422 does."""
    for name, value in (("text", args.text), ("pair", args.pair)):
        if value is None:
            continue
        if not value.strip():
            print(f"error: {name} must contain something other than whitespace", file=sys.stderr)
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            print(f"error: {name} is not UTF-8 text (character {exc.start} came from bytes that are not); "
                  "check the terminal's encoding", file=sys.stderr)
            return True
    return False


def _outside(info, layer: int, head: int) -> bool:
    """Says so (one line) when the model has no such layer or head."""
    if 0 <= layer < info.n_layers and 0 <= head < info.n_heads:
        return False
    print(f"error: layer must be in 0..{info.n_layers - 1} and head in 0..{info.n_heads - 1}", file=sys.stderr)
    return True


def cmd_attend(args) -> int:
    from manyeyes.model import load
    from manyeyes.model.attention import Capture, blocked_rows
    from manyeyes.model.kept import DenseAttention, topk_rows
    from manyeyes.labels import token_label

    if _bad_text(args):
        return 2
    json_only = [name for name, given in (("--layers", args.layers is not None), ("--heads", args.heads is not None),
                                          ("--format", args.format != "json")) if given]
    if json_only and not args.json:  # the table shows one head, and would drop them without a word
        print(f"error: {', '.join(json_only)} only shape{'s' if len(json_only) == 1 else ''} the --json answer; add "
              "--json, or choose the table's head with --layer and --head", file=sys.stderr)
        return 2
    if args.matrix and args.json:
        print("error: --matrix chooses the table's form; --json prints every head of the API's answer", file=sys.stderr)
        return 2
    table_only = [name for name, value in (("--layer", args.layer), ("--head", args.head)) if value is not None]
    if table_only and args.json:  # --json printed every head, as if they had not been given
        print(f"error: {' and '.join(table_only)} choose{'s' if len(table_only) == 1 else ''} the table's head; with --json "
              "choose heads with --layers and --heads", file=sys.stderr)
        return 2
    args.layer, args.head = args.layer or 0, args.head or 0
    from manyeyes.app.config import AttendSettings

    settings = _settings(AttendSettings)  # MANYEYES_DENSE_MAX_TOKENS alone: the server's others are not read
    if settings is None:
        return 2
    model = load(args.model, device=args.device, dtype=args.dtype, show_progress=True)
    info = model.info
    if args.top_k and not info.predictions:
        print(f"error: model {info.id} has no language-model head, so --top-k has nothing to show", file=sys.stderr)
        return 2
    if _outside(info, args.layer, args.head):
        return 2
    view = _json_view(info, args) if args.json else None
    if args.json and view is None:
        return 2
    started = time.perf_counter()
    encoded = model.encode(args.text, args.pair, truncate=args.truncate)
    tokenized = time.perf_counter()
    # As the server decides (README, "Long inputs"): past dense_max_tokens a run keeps its queries
    # and keys, not (n_layers, n_heads, T, T) weights, which at 2,048 tokens are 1.2 GB for MiniLM.
    long = len(encoded) > settings.dense_max_tokens
    result = model.run([encoded], Capture(keep=True) if long else Capture())[0]
    timing = {"tokenize": tokenized - started, "queue": 0.0, "forward": time.perf_counter() - tokenized, "wait": 0.0}
    if args.json:
        return _print_json(model, args, view, result, timing, settings.dense_max_tokens)
    # The answer's own writing: a full disk or a closed stdout is one line (main), not a traceback
    # or a silent exit 0.
    with _output():
        heads = result.kept if long else DenseAttention(result.attention)
        # Labelled as the page's default labels and the figures label them: a byte-level model's bytes
        # of a split character as ‹E6› (each had read as the whole character), a space as ␣ (blank).
        texts = [token_label(t) for t in result.tokens]
        print(f"model {info.id} ({info.family}, {'causal' if info.causal else 'bidirectional'}, "
              f"{info.n_layers} layers x {info.n_heads} heads) on {info.device}")
        print(f"{len(texts)} tokens{' (truncated)' if result.truncated else ''}:")
        print("  " + " ".join(f"[{i}]{t}" for i, t in enumerate(texts)))
        if args.matrix or len(texts) <= TABLE_MAX_KEYS:
            print(f"\nlayer {args.layer}, head {args.head} (rows: queries, columns: keys)")
            n = len(texts)
            blocked = blocked_rows(0, n, 0, n, offset=0, causal=info.causal, sliding_window=model.sliding_windows[args.layer],
                                   device="cpu")
            print(_format_head(texts, heads.block(args.layer, [args.head], 0, n, 0, n)[0], blocked))
        else:
            top = topk_rows(heads, args.layer, args.head, ROW_TOP_KEYS, 0, len(texts))
            print(f"\nlayer {args.layer}, head {args.head}: each query's {ROW_TOP_KEYS} strongest keys, and the weight "
                  f"left to the rest ({len(texts):,} keys are too many columns for a terminal; --matrix prints them all)")
            print(_format_top_keys(texts, top))
        if args.top_k:
            _print_predictions(model, result, texts, args.top_k)
    return 0


def _format_top_keys(tokens: list[str], top, width: int = 12) -> str:
    """One line per query: `row token -> [key]token weight ...  rest w`. Keys a row cannot see
    (a causal row's future) have weight 0 and are left out rather than listed as ties."""
    labels = [_clipped(t, width) for t in tokens]  # by columns: 東京 by len() stood a column off
    pad = max(_columns(lab) for lab in labels)
    index = len(str(len(tokens) - 1))
    lines = []
    for i, (weights, keys, rest) in enumerate(zip(top.values.tolist(), top.indices.tolist(), top.rest.tolist())):
        strongest = "  ".join(f"[{k}]{labels[k]} {w:.2f}" for w, k in zip(weights, keys) if w > 0)
        lines.append(f"{i:>{index}} {_right_aligned(labels[i], pad)} -> {strongest}  (rest {rest:.2f})")
    return "\n".join(lines)


def _print_predictions(model, result, texts: list[str], top_k: int) -> None:
    found = model.predictions(result, top_k)
    what = "next token after each position" if model.info.causal else "masked token at each mask"
    print(f"\npredictions ({what}, top {top_k}):")
    if not found:
        print("  none: the text has no mask token")
    for pos, preds in found.items():
        print(f"  [{pos}]{texts[pos]} -> " + ", ".join(f"{_guess_shown(p)} {p.prob:.3f}" for p in preds))


def _guess_shown(guess) -> str:
    """A guess's text, quoted; where that is not whole characters ("\ufffd", the same for every
    byte-level piece of part of a character) its piece as the page labels one: whole characters,
    and each byte of a split character as ‹E5›; a piece in no byte alphabet as it is ("<0xE5>")."""
    from manyeyes.labels import bytes_label, piece_bytes

    if "\ufffd" not in guess.token or not guess.piece:
        return repr(guess.token)
    raw = piece_bytes(guess.piece)
    if raw is None or raw.decode("utf-8", "replace") != guess.token:  # not the bytes the text was read from
        return _shown(guess.piece) if guess.piece != guess.token else repr(guess.token)
    return bytes_label(raw, _shown)


def _json_view(info, args):
    """The --json answer's layers, heads and format, or None after one line saying what is wrong
    (before the forward pass, as the API refuses them)."""
    from manyeyes.app.services.attention import parse_index_list, resolve_indices
    from manyeyes.app.services.errors import ApiError
    from manyeyes.app.services.payload import View

    try:
        return View(
            resolve_indices(parse_index_list(None if args.layers is None else [args.layers], "layer"), info.n_layers, "layer", info.id),
            resolve_indices(parse_index_list(None if args.heads is None else [args.heads], "head"), info.n_heads, "head", info.id),
            args.format,
        )
    except ApiError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return None


def _print_json(model, args, view, result, timing: dict, dense_max_tokens: int) -> int:
    """The exact body POST /api/v1/attention returns for the same text and options (with its
    default "keep": "auto"): past dense_max_tokens, `attention: null` and the routes that would
    serve the run's heads."""
    from manyeyes.app.services.attention import predictions_body
    from manyeyes.app.services.cache import Run, run_id_for
    from manyeyes.app.services.payload import render_kept, render_result

    info = model.info
    run_id = run_id_for(info.id, args.text, args.pair, args.truncate)
    run = Run(run_id, info.id, result.tokens, result.truncated, result.attention, result.top_ids, result.top_probs,
              result.kept)
    predictions = predictions_body(model, run, args.top_k or None)
    if run.kind == "qk":
        print(f"note: {run.n_tokens:,} tokens is over MANYEYES_DENSE_MAX_TOKENS ({dense_max_tokens:,}), so, as the "
              "server's, this answer keeps queries and keys: `attention` is null, and a server reads the heads "
              "through the routes under `links`. The table form (no --json) prints a head's strongest keys",
              file=sys.stderr)
        body = render_kept(run, info, view, timing, predictions)
    else:
        body = render_result(run, info, view, timing, predictions)
    _write_all(b"".join(body) + b"\n")
    sys.stdout.flush()
    return 0


# The least MANYEYES_CACHE_BYTES `serve` takes, 0 (no cache) aside: less is a unit mistake (512
# meant as MiB, 1000 as kB), a cache that holds no run worth keeping, and 1000 answered every
# request 413. Not 1 MiB: a small model's runs are a few kB, and 200 kB holds a dozen of them.
MIN_CACHE_BYTES = 64 * 1024


def cmd_serve(args) -> int:
    from manyeyes.app.logs import announce, log_to_stderr
    from manyeyes.app.main import create_app
    from manyeyes.app.server import Server, server_config

    log_to_stderr(args.log_level)
    settings = _settings()  # a malformed MANYEYES_* variable: one line naming it, not pydantic's traceback
    if settings is None:
        return 2
    if 0 < settings.cache_bytes < MIN_CACHE_BYTES:
        # Was a server that said "serving" and answered every request 413 run_too_large.
        print(f"error: MANYEYES_CACHE_BYTES={settings.cache_bytes} is in bytes, too few for a cache of runs: give at "
              f"least {MIN_CACHE_BYTES} (536870912 is 512 MiB), or 0 to turn the cache off", file=sys.stderr)
        return 2
    try:
        updates = {"extra_models": _served_models(settings, args.model)}
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.device:
        updates["device"] = args.device
    if args.dtype:
        updates["dtype"] = args.dtype
    from manyeyes.model.errors import ModelLoadError
    from manyeyes.model.runtime import pick_device

    try:  # a device this machine lacks: one line now, not a server that answers 503 for good
        device = pick_device(updates.get("device", settings.device))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # MANYEYES_HALF off CUDA: every model failed to load after "serving", and each request was a
    # 503 for good. Not under --replicas, whose replicas load on Ray's nodes, with devices of their own.
    if settings.half and device.type != "cuda" and not args.replicas:
        print(f"error: MANYEYES_HALF is float16 autocast on CUDA, and this server's device is {device}: unset it, "
              "or use MANYEYES_AUTOCAST=float16, which works on any device", file=sys.stderr)
        return 2
    if args.shared_forward:
        updates["shared_forward"] = True
    settings = settings.model_copy(update=updates)
    if not settings.all_models():  # was a StopIteration traceback
        print("error: no model to serve: MANYEYES_MODELS is empty and no --model or MANYEYES_EXTRA_MODELS adds one",
              file=sys.stderr)
        return 2
    if settings.default_model_id() not in settings.all_models():
        # Was a server that said "serving", loaded nothing and answered 503 for good.
        print(f"error: MANYEYES_DEFAULT_MODEL={settings.default_model!r} is not a served model: use one of "
              f"{', '.join(settings.all_models())}", file=sys.stderr)
        return 2
    from manyeyes.app.clients import configured_keys, default_allowed_hosts, exposure_warning

    try:  # a key file that cannot be used stops start-up with one line, not a traceback
        keys = configured_keys(settings.api_keys, settings.api_keys_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.allowed_hosts is None:  # only serve knows the address it is bound to
        allowed = default_allowed_hosts(args.host, settings.trusted_proxies)
        settings = settings.model_copy(update={"allowed_hosts": allowed})
    if args.replicas and args.workers > 1:
        print("error: --workers and --replicas are two ways to run copies of the app: choose one", file=sys.stderr)
        return 2
    # Bound before anything is said or loaded: a port in use was announced as served, then the
    # interpreter aborted (exit 134) with the model loader's thread still inside torch; and an
    # address that cannot be bound was first warned of as "serving on" it. (Ray binds replicas.)
    if not args.replicas:
        try:
            sock = _listening_socket(args.host, args.port)
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    # serve: a server others can reach that asks nobody for a key says so, loudly, at start-up.
    warning = exposure_warning(args.host, bool(keys), proxied=bool(settings.trusted_proxies))
    if warning:
        print(warning, file=sys.stderr)
    # Settings that are each fine but together do nothing, said once (an operator review).
    if settings.close_metrics and not keys:
        print("manyeyes: MANYEYES_CLOSE_METRICS without API keys: no key can open /metrics, so every scrape gets 401",
              file=sys.stderr)
    if "*" in settings.cors_origins and not keys:
        print("manyeyes: MANYEYES_CORS_ORIGINS='*' without API keys: any web page open in a browser that reaches this "
              "server can call its API and read the answers (this machine's own browser, for a server on loopback); "
              "list the origins that may, or set MANYEYES_API_KEYS", file=sys.stderr)
    if settings.max_client_queue is not None and settings.max_client_queue >= settings.max_queue:
        print(f"manyeyes: MANYEYES_MAX_CLIENT_QUEUE={settings.max_client_queue} is not below MANYEYES_MAX_QUEUE="
              f"{settings.max_queue}: one client can still fill the whole queue", file=sys.stderr)
    if settings.shared_forward and args.workers < 2:
        print("manyeyes: --shared-forward (MANYEYES_SHARED_FORWARD) shares forwards between --workers on one machine; "
              "without them each process runs its own", file=sys.stderr)
    if args.replicas:  # scale-out (issue 15): the same app as a Ray Serve deployment
        try:
            from manyeyes.scale import serve_replicas
        except ImportError as exc:  # without the scale extra: its one line, not a traceback
            print(f"error: {exc}", file=sys.stderr)
            return 2

        return serve_replicas(settings, host=args.host, port=args.port, replicas=args.replicas, threads=args.threads or 1)
    if args.workers > 1:
        from manyeyes.app.workers import default_threads, serve_workers

        threads = args.threads or default_threads(args.workers)
        shared = (f", and one process running their forwards of inputs up to {settings.shared_forward_max_tokens} tokens"
                  if settings.shared_forward else "")
        # Stamped as the log's lines are (app/logs.py); a reason it cannot start ("error: ...") and
        # the warnings about its settings, said before it serves, stay plain lines.
        announce(f"{args.workers} workers ({threads} CPU threads each){shared} serving "
                 f"{', '.join(settings.all_models())} on {_url(args.host, args.port)} (GET /readyz says when every worker "
                 "is ready)")
        # The keys read above, not the file again: a worker started in a dead one's place read it
        # anew, and after the file changed, workers disagreed on which keys open the API.
        code = serve_workers(settings, sock, workers=args.workers, threads=threads, log_level=args.log_level, keys=keys)
        # The workers are gone and their folder removed: the parent's own finalisation took 0.8 s
        # more, past the shutdown grace the workers had just kept to (the stream test, under load).
        leave_now(code)
    if args.threads:  # one process: torch's CPU threads as asked (on a GPU few are needed)
        import torch

        torch.set_num_threads(args.threads)
    announce(f"serving {', '.join(settings.all_models())} on {_url(args.host, args.port)} "
             "(GET /readyz says when the models are loaded; API docs at /docs)")
    app = create_app(settings, keys=keys)
    config = server_config(app, settings, host=args.host, port=args.port, log_level=args.log_level)
    try:
        Server(config, on_exit=app.state.shutdown.begin).run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn shuts down on Ctrl-C, then raises it again for whoever called it (uvicorn.run
        # catches it; we call Server.run): every stop printed a traceback after "Finished".
        pass
    # Stopped while the models load (Ctrl-C; or SIGINT to a server started in the background,
    # where it is ignored and uvicorn returns): Python's finalisation met the loader inside torch
    # on its daemon thread and aborted ("terminate called without an active exception", status
    # 134 and a core file). Nothing is left to run: the process leaves at once, as SIGTERM's ends
    # it by the signal's own action.
    if any(thread.name == "manyeyes-load" and thread.is_alive() for thread in threading.enumerate()):
        leave_now(0)
    return 0


def leave_now(code: int) -> None:
    """Ends the process without Python's finalisation, its logs and output written out first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _url(host: str, port: int) -> str:
    """The server's address as a URL: an IPv6 host in brackets (http://:::8000 was no URL)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _listening_socket(host: str, port: int) -> socket.socket:
    from manyeyes.app.server import bound_socket

    sock = bound_socket(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))
    sock.set_inheritable(True)
    return sock


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("manyeyes")
    except PackageNotFoundError:  # a checkout on sys.path, never installed
        return "(not installed)"


def _whole(value: str, low: int, high: int, what: str) -> int:
    number = int(value) if value.isascii() and value.isdigit() else -1
    if not low <= number <= high:
        raise argparse.ArgumentTypeError(f"{what}, not {value!r}")
    return number


def _port(value: str) -> int:
    return _whole(value, 1, 65535, "a port is a number from 1 to 65535")


def _host(value: str) -> str:
    # "http://0.0.0.0" first printed "WARNING: serving on http://0.0.0.0", then failed to resolve it.
    said = f"{value!r}: give an address or a host name to listen on (127.0.0.1, 0.0.0.0, ::1, ::, myhost)"
    if "/" in value or not value.strip() or value != value.strip():  # a URL, a network, blanks
        raise argparse.ArgumentTypeError(f"{said}, not a URL")
    if value.startswith("["):
        raise argparse.ArgumentTypeError(f"{said}: an IPv6 address without its brackets ({value.strip('[]')})")
    if value.count(":") == 1:
        raise argparse.ArgumentTypeError(f"{said}, and the port with --port")
    return value


def _positive(value: str) -> int:
    # torch and the process table take C ints: 4294967296 threads was an overflow traceback, and
    # under --workers each worker's, restarted for ever.
    return _whole(value, 1, 4096, "a whole number from 1 to 4096")


def _model_flag(value: str) -> dict[str, str]:
    from manyeyes.app.config import parse_model_specs

    if not value.strip():
        raise argparse.ArgumentTypeError("name a model: NAME=SPEC or SPEC (a built-in name, HF folder or .pth)")
    try:
        return parse_model_specs([value])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _served_models(settings, flags: list[dict[str, str]]) -> dict[str, str]:
    """The extra models: MANYEYES_EXTRA_MODELS, then each --model, which wins over the variable's
    model of its id. ValueError for an id that two flags, or a flag and a configured model (a
    built-in), give different specs."""
    from manyeyes.app.config import add_model, check_added

    given: dict[str, str] = {}
    for flag in flags:
        for model_id, spec in flag.items():
            add_model(given, model_id, spec)
    check_added(settings.models, given)
    return {**settings.extra_models, **given}


TRAIN_OPTIONS = {  # option: (type, help); None means "TrainConfig's default, or the checkpoint's on --resume"
    "layers": (int, "transformer blocks (default 4)"),
    "heads": (int, "attention heads per block (default 4)"),
    "emb_dim": (int, "width of the residual stream (default 128)"),
    "context": (int, "positions, the longest input (default 128)"),
    "vocab_size": (int, "BPE vocabulary size, at least 257 (default 2048)"),
    "steps": (int, "optimizer steps in total (default 2000)"),
    "batch_size": (int, "windows per step (default 16)"),
    "lr": (float, "peak learning rate (default 1e-3)"),
    "seed": (int, "seed for init and batches; same seed, same model on the CPU (default 1337)"),
    "device": (str, "cpu, cuda, mps or auto (default auto)"),
    "warmup": (int, "linear warmup steps (default a tenth of --steps, at most 200)"),
    "eval_every": (int, "steps between validation and checkpoint (default a tenth of --steps)"),
    "save_dtype": (str, "model.pth storage: float32 or float16 (default float32)"),
    "pos_init": (str, "position embeddings start as random (default) or sinusoidal; trained either way"),
    "weight_init": (str, "gpt2 (N(0, 0.02), default) or torch (each module's PyTorch default: larger, attention sharp from the start)"),
    "freeze_ff": (bool, "freeze the feed-forward blocks (on a fresh model at zero output: attention only); a later --init-from run trains them"),
    "corpus_name": (str, "how card.json names the corpus (default the file names)"),
    "licence": (str, "the corpus licence, for card.json"),
    "arch": (str, "gpt (the book's GPTModel, default) or llama (RoPE, RMSNorm, SwiGLU; saved as a Hugging Face llama folder)"),
    "kv_heads": (int, "llama: key/value heads, grouped-query attention (default --heads)"),
    "ff_dim": (int, "llama: SwiGLU hidden width (default 8/3 of --emb-dim, rounded up to 32)"),
    "rope_theta": (float, "llama: RoPE base wavelength (default 10000)"),
    "attention_bias": (bool, "llama: biases on the q, k, v and o projections (HF attention_bias), a constant that rotary heads can aim by position"),
    "init_from": (str, "start from the weights of a folder manyeyes train wrote; its --arch, shape options and tokenizer are reused (a llama may change --context)"),
}


def cmd_train(args) -> int:
    import shlex

    from manyeyes.model.train import TrainError, make_config, train

    options = {name: getattr(args, name) for name in TRAIN_OPTIONS}
    # The card records the command in canonical form: every option given, nothing else.
    words = ["manyeyes", "train", "--text", *args.text, "--out", args.out]
    for name, value in options.items():
        if value is True:
            words += [f"--{name.replace('_', '-')}"]
        elif value is not None:
            words += [f"--{name.replace('_', '-')}", str(value)]
    words += ["--resume"] if args.resume else []
    try:
        cfg = make_config({"text": args.text, "out": args.out, **options}, resume=args.resume)
        train(cfg, resume=args.resume, command=shlex.join(words))
    except TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        # --emb-dim 1000000000000 was the allocator's traceback ("you tried to allocate 1.2e15 bytes").
        print("error: the model or a batch does not fit this machine's memory: lower --emb-dim, --layers, "
              "--batch-size or --context", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = "weights' dtype (default auto: as stored on CUDA, float32 elsewhere); attention stays float32"


# ---- export (issue 15): one self-contained HTML file of one run --------------------------------


def _settings(settings_class=None):
    """The MANYEYES_* settings (the server's, or those of `settings_class`: attend's one), or None
    after one line naming each variable that is malformed (pydantic's own report is a dozen lines
    and a documentation URL)."""
    import re

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from manyeyes.app.config import Settings

    try:
        return (settings_class or Settings)()
    except SettingsError as exc:  # a JSON-valued setting (MANYEYES_MODELS) that does not parse: a traceback
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"MANYEYES_{field[1].upper()}" if field else "a MANYEYES_* setting"
        print(f"error: {name} in the environment is not valid JSON ({exc.__cause__ or exc})", file=sys.stderr)
        return None
    except ValidationError as exc:
        def shown(error) -> str:  # keys are secrets: a terminal's scrollback and a service's log keep this line
            return "(the keys, not shown)" if error["loc"][0] == "api_keys" else repr(error.get("input"))

        problems = "; ".join(
            f"MANYEYES_{'_'.join(str(part) for part in error['loc'][:1]).upper()}={shown(error)}: "
            f"{error['msg'].removeprefix('Value error, ')}"
            if error["loc"] else error["msg"].removeprefix("Value error, ") for error in exc.errors())
        print(f"error: a MANYEYES_* setting in the environment is malformed: {problems}", file=sys.stderr)
        return None
    finally:
        _warn_unknown_settings(Settings)


# MANYEYES_* variables read by something other than the settings: the example notebook's server.
NOT_SETTINGS = frozenset({"MANYEYES_URL", "MANYEYES_TEST_ACCEL"})


def _warn_unknown_settings(settings_class) -> None:
    """A mistyped MANYEYES_* variable (MANYEYES_CACHE_BYTE) was ignored without a word, and the
    server ran on the default the operator meant to change."""
    import difflib

    known = [name.upper() for name in settings_class.model_fields]
    for name in sorted(os.environ):
        # Compared in upper case, as the settings read them (case_sensitive is off): MANYEYES_Cache_Bytes
        # was applied, and warned of as a setting manyeyes does not read.
        upper = name.upper()
        if upper.startswith("MANYEYES_") and upper.removeprefix("MANYEYES_") not in known and upper not in NOT_SETTINGS:
            close = difflib.get_close_matches(upper.removeprefix("MANYEYES_"), known, n=1, cutoff=0.75)
            print(f"warning: {name} is not a setting manyeyes reads"
                  + (f" (did you mean MANYEYES_{close[0]}?)" if close else ""), file=sys.stderr)


def cmd_export(args) -> int:
    from manyeyes.export import TooLongToExport, export_html
    from manyeyes.figures import write_whole
    from manyeyes.model import load

    if _bad_text(args):
        return 2
    if not args.output.strip():  # "" is the folder the command runs in: "cannot write : Is a directory"
        print("error: -o names no file: give the file to write, or - for standard output", file=sys.stderr)
        return 2
    settings = _settings()  # before the model loads: the bound of the server's /export, here too
    if settings is None:
        return 2
    # As the server would: MANYEYES_DEVICE and MANYEYES_DTYPE where no flag says otherwise.
    model = load(args.model, device=args.device or settings.device, dtype=args.dtype or settings.dtype)
    info = model.info
    if _outside(info, args.layer, args.head):
        return 2
    try:
        html = export_html(model, args.text, args.pair, layer=args.layer, head=args.head, truncate=args.truncate,
                           format=args.format, dense_max_tokens=settings.dense_max_tokens)
    except TooLongToExport as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":  # as most tools read it (it wrote a file named "-")
        _write_all(html.encode("utf-8"))
        return 0
    try:
        write_whole(args.output, html)  # a full disk leaves the file that was there, not half a new one
    except OSError as exc:
        print(f"error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({len(html.encode('utf-8')) / 2**20:.1f} MiB): opens from disk, no server needed", file=sys.stderr)
    return 0


def add_export_command(sub) -> None:
    export = sub.add_parser("export", help="write one self-contained HTML file with the viewer and one run")
    export.add_argument("text", help="the sentence to run (quote it); up to MANYEYES_DENSE_MAX_TOKENS tokens (default 1024)")
    export.add_argument("--pair", default=None, help="optional second sentence (pair models)")
    export.add_argument("--model", default="minilm", help="built-in name, Hugging Face id, HF folder or book .pth (default: minilm)")
    export.add_argument("-o", "--output", default="manyeyes-view.html", help="file to write, - for standard output (default: manyeyes-view.html)")
    export.add_argument("--layer", type=int, default=0, help="layer focused when the file opens (default 0)")
    export.add_argument("--head", type=int, default=0, help="head focused when the file opens (default 0)")
    export.add_argument("--truncate", action="store_true", help="cut input longer than the model's positions")
    export.add_argument("--format", choices=("f16", "u8"), default=None,
                        help="stored precision (default: f16 up to 16 MiB of weights, else u8)")
    export.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps or auto (default: MANYEYES_DEVICE if set, else auto)")
    export.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help=DTYPE_HELP.replace("default auto", "default: MANYEYES_DTYPE if set, else auto"))
    export.set_defaults(func=cmd_export)


# ---- end export --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="manyeyes", description="See what every attention head does.")
    parser.add_argument("--version", action="version", version=f"manyeyes {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    attend = sub.add_parser("attend", help="print the attention of one head for a sentence")
    attend.add_argument("text", help="the sentence to run (quote it)")
    attend.add_argument("--pair", default=None, help="optional second sentence (pair models)")
    attend.add_argument(
        "--model", default="minilm",
        help="built-in name, Hugging Face id (gpt2, org/name@revision), local folder or book .pth (default: minilm)",
    )
    # None when not given: --json refuses them rather than print every head regardless.
    attend.add_argument("--layer", type=int, default=None, help="layer of the head shown (default 0)")
    attend.add_argument("--head", type=int, default=None, help="head shown (default 0)")
    attend.add_argument("--truncate", action="store_true", help="cut input longer than the model's positions")
    attend.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps or auto (default: auto, the best available)")
    attend.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help=DTYPE_HELP)
    attend.add_argument("--top-k", type=int, default=0, choices=range(1, 21), metavar="K",
                        help="also print the model's own top-K predictions (models with an LM head; 1..20)")
    attend.add_argument("--matrix", action="store_true",
                        help=f"print the head's whole matrix even past {TABLE_MAX_KEYS} tokens, where the table lists "
                             f"each query's {ROW_TOP_KEYS} strongest keys instead")
    attend.add_argument("--json", action="store_true", help="print the API's JSON response instead of a table")
    attend.add_argument("--format", choices=("json", "f16", "u8"), default="json", help="attention encoding for --json (default json)")
    attend.add_argument("--layers", default=None, help="comma-separated layers for --json (default: all)")
    attend.add_argument("--heads", default=None, help="comma-separated heads for --json (default: all)")
    attend.set_defaults(func=cmd_attend)

    trainer = sub.add_parser("train", help="train the book's GPTModel (or --arch llama) on text files into a folder load() reads")
    trainer.add_argument("--text", nargs="+", required=True, metavar="FILE", help="UTF-8 text files")
    trainer.add_argument("--out", required=True, metavar="DIR", help="folder for model.pth, config.json, ...")
    for name, (kind, text) in TRAIN_OPTIONS.items():
        if kind is bool:
            trainer.add_argument(f"--{name.replace('_', '-')}", action="store_true", default=None, help=text)
        else:
            trainer.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
    trainer.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt up to --steps (or finish a run stopped after its last step)")
    trainer.set_defaults(func=cmd_train)

    serve = sub.add_parser(
        "serve", help="run the attention API and the browser visualizer",
        description="Run the attention API and the browser visualizer. Everything beyond these flags (API keys, "
                    "limits, the run cache, CORS, trusted proxies, the models served) is a MANYEYES_* environment "
                    "variable: README.md, \"Settings\"; exposure and keys: SECURITY.md.",
    )
    serve.add_argument("--host", type=_host, default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    serve.add_argument(
        "--model", action="append", type=_model_flag, default=[], metavar="ID=PATH_OR_SPEC",
        help="serve another model (repeatable): a Hugging Face id (gpt2, org/name@revision), a folder or a "
        ".pth, optionally named ID=SPEC; added to MANYEYES_MODELS (by default the built-in ones), whose default "
        "stays the default (MANYEYES_DEFAULT_MODEL, else its first model: minilm)",
    )
    serve.add_argument("--device", default=None,
                       help="cpu, cuda, cuda:N, mps or auto (default: MANYEYES_DEVICE if set, else best available)")
    serve.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                       help=DTYPE_HELP.replace("default auto", "default: MANYEYES_DTYPE if set, else auto"))
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="the server's logging level (default info)")
    serve.add_argument("--replicas", type=_positive, default=None, metavar="N",
                       help="run N replicas on Ray Serve (needs ray[serve]: pip install '.[scale]' in a checkout; joins RAY_ADDRESS if set)")
    serve.add_argument("--workers", type=_positive, default=1, metavar="N",
                       help="serve from N processes on this machine, each with its own copy of the models (default 1)")
    serve.add_argument("--threads", type=_positive, default=None,
                       help="torch's CPU threads: of the one process (default: torch's own choice), per worker "
                            "(default: the cores shared out) or per Ray Serve replica (default 1)")
    serve.add_argument("--shared-forward", action="store_true",
                       help="with --workers: one more process runs every worker's forwards of short inputs (up to "
                            "MANYEYES_SHARED_FORWARD_MAX_TOKENS, 128) as shared batches; for a GPU, where a short "
                            "input's forward is mostly kernel launches (README, \"GPU\")")
    serve.set_defaults(func=cmd_serve)
    add_export_command(sub)
    return parser


class OutputError(OSError):
    """The answer could not be written to stdout (a full disk, a closed stdout): main says so in
    one line. Its own class, so that another I/O error (a checkpoint's write) is not blamed on it."""


@contextmanager
def _output():
    if sys.stdout is None:  # started with stdout closed (`>&-`): print() wrote nothing, with status 0
        raise OutputError(errno.EBADF, "standard output is closed")
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:  # a reader gone: main stops quietly, as Unix tools do
        raise
    except OutputError:
        raise
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OutputError(exc.errno, exc.strerror or str(exc)) from exc


def _write_all(data: bytes) -> None:
    """All of `data` to stdout. A stdout left non-blocking (by whoever started us) takes part of
    it and refuses the rest (BlockingIOError, or a short count): the rest was dropped with status
    0. Here each refusal waits until the descriptor takes more (a minute at most)."""
    with _output():
        out = sys.stdout.buffer
        view = memoryview(data)
        while view:
            try:
                written = out.write(view)
            except BlockingIOError as exc:
                written = exc.characters_written
            if not written:
                _wait_writable(out)
            view = view[written or 0:]
        while True:
            try:
                out.flush()
                return
            except BlockingIOError:
                _wait_writable(out)


def _wait_writable(out) -> None:
    import select

    if not select.select([], [out.fileno()], [], 60)[1]:
        raise OutputError(errno.EIO, "the output took nothing for a minute")


def main(argv: list[str] | None = None) -> int:
    # A terminal that cannot show a token's character (an ASCII locale, a Windows code page) gets
    # its escape, not a UnicodeEncodeError traceback half-way through the table.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        # Imported here, not at the top: the model package imports torch, the second or two in
        # which a Ctrl-C met no handler of ours.
        from manyeyes.model.errors import ModelLoadError, TooLongError

        try:
            return args.func(args)
        except TooLongError as exc:
            # Its own words name the API's option; here it is a flag.
            print(f"error: input is {exc.n_tokens:,} tokens long but the model takes at most {exc.max_tokens:,}; "
                  "shorten it or pass --truncate", file=sys.stderr)
            return 2
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C: stop as `train` does, with the shell's status and no traceback
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # The reader went away (`manyeyes attend ... | head -1`): stop as Unix tools do, without a
        # traceback, and without another at exit, when Python flushes stdout into the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OutputError as exc:
        print(f"error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
