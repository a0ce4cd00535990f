"""Hugging Face ids ("gpt2", "org/name", "org/name@revision") to a local snapshot folder.

The cache comes first, through huggingface_hub's own functions and constants, so HF_HOME,
HF_HUB_CACHE and HF_HUB_OFFLINE mean here what they mean to every other HF tool. Only when the
cache lacks what we need, and downloads are allowed, are the needed files fetched: the config,
tokenizer.json, generation_config.json where the repo has one, and the weights (safetensors,
sharded or not; `.bin` only when a repo has no safetensors). Every failure is a
`ModelLoadError` that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from manyeyes.model.errors import CorruptFileError, ModelLoadError

log = logging.getLogger(__name__)

# (bytes_done, bytes_total) while files download; the CLI draws a bar, the service fills /readyz.
Progress = Callable[[int, int], None]

# A repo id as the Hub spells them (an optional namespace), then an optional @revision.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[\w./-]+))?$")

# A commit written short, as `git log --oneline` and the Hub's pages show it: 7 hex digits or more,
# fewer than a full SHA's 40. huggingface_hub resolves only full SHAs (and refs) in the cache.
SHORT_COMMIT = re.compile(r"[0-9a-fA-F]{7,39}")
FULL_COMMIT = re.compile(r"[0-9a-f]{40}")
TOO_SHORT = re.compile(r"[0-9a-fA-F]{4,6}")  # git's own minimum is 4: said so when one such names a snapshot

NEEDED = ("config.json", "tokenizer.json")
# Fetched where the repo has it, never required: its eos_token_id may name more ends of text
# (an instruct model's end of turn) than the config's.
OPTIONAL = ("generation_config.json",)
# Weight layouts in order of preference: one file or an index naming its shards.
WEIGHT_LAYOUTS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(spec: str) -> HubId | None:
    """A HubId when `spec` can only be one; paths (with a suffix, ~, ./, or absolute) never are."""
    if spec.endswith((".pth", ".pt", ".bin", ".safetensors", ".json")) or spec.startswith(("/", ".", "~")):
        return None
    match = HUB_ID.fullmatch(spec)  # not .match: its `$` also matches before a trailing newline
    if match is None or ".." in spec:
        return None
    return HubId(match["repo"], match["revision"])


def weight_files(folder: Path) -> tuple[list[Path], Path] | None:
    """The weight files a folder holds in the preferred layout, and the file errors should name
    (the lone file, or the shards' index); None when it holds no complete set."""
    for single, index in WEIGHT_LAYOUTS:
        if (folder / single).exists():
            return [folder / single], folder / single
        if (folder / index).exists():
            shards = shard_names(folder / index)
            if all((folder / s).exists() for s in shards):
                return [folder / s for s in shards], folder / index
    return None


def shard_map(index: Path) -> dict[str, str]:
    """The index's weight_map: each tensor's key, the shard file it names for it."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptFileError(f"cannot read the shard index {index}: {exc}") from exc
    if not names or not all(isinstance(n, str) and "/" not in n and ".." not in n for n in names):
        raise ModelLoadError(f"{index}: weight_map must name shard files in the same folder")
    return weight_map


def shard_names(index: Path) -> list[str]:
    return sorted(set(shard_map(index).values()))


def _absent(path: Path, why: str = "") -> str:
    """How to name a file that is not there: a cache snapshot's link whose blob is gone says so."""
    notes = [why] if why else []
    if path.is_symlink():
        notes.append(f"a link to the missing blob {path.resolve()}")
    return path.name + (f" ({'; '.join(notes)})" if notes else "")


def missing_files(folder: Path) -> list[str]:
    """What the folder lacks, each named (a shard with the index that names it, a dangling link
    with the blob it points at), so a user knows which file to fetch again."""
    missing = [_absent(folder / name) for name in NEEDED if not (folder / name).exists()]
    if weight_files(folder) is None:
        for single, index in WEIGHT_LAYOUTS:
            if (folder / index).exists():
                missing += [_absent(folder / s, f"named by {index}") for s in shard_names(folder / index)
                            if not (folder / s).exists()]
                break
            if (folder / single).is_symlink() or (folder / index).is_symlink():
                missing.append(_absent(folder / (single if (folder / single).is_symlink() else index)))
                break
        else:
            missing.append("weights (model.safetensors, its index and shards, or pytorch_model.bin)")
    return missing


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}"


def _cache_entry_problem(cache: Path, hub_id: HubId) -> str:
    """Why a repo whose snapshot could not be found is "not in the cache", when its folder is there
    (a ref to a deleted snapshot, no ref at all), or the cached spelling of a mistyped id."""
    root = repo_folder(cache, hub_id.repo)
    if not root.is_dir():
        wanted = root.name.lower()
        try:
            near = sorted(p.name for p in cache.iterdir() if p.name.lower() == wanted and p.name != root.name)
        except OSError:
            near = []
        return f"; did you mean {near[0].removeprefix('models--').replace('--', '/')}?" if near else ""
    revision = hub_id.revision or "main"
    ref = root / "refs" / revision
    try:
        snapshots = sorted(p.name for p in (root / "snapshots").iterdir() if p.is_dir())
    except OSError:
        snapshots = []
    if ref.is_file():
        try:
            commit = ref.read_text(encoding="utf-8")
        except (OSError, ValueError):
            commit = "?"
        if not commit.strip() or "/" in commit or commit.strip() in (".", ".."):
            return f"; its refs/{revision} holds {commit!r}, not a commit hash"
        if commit != commit.strip():  # huggingface_hub reads the ref as it is, newline and all
            return (f"; its refs/{revision} holds {commit!r}: the commit with white space around it, which "
                    f"huggingface_hub does not read (write the file again without it)")
        return (f"; refs/{revision} points at commit {commit}, but its snapshot folder "
                f"{root / 'snapshots' / commit} is missing")
    if hub_id.revision is None and snapshots:
        return (f"; its folder has no refs/main, only the snapshot(s) {', '.join(snapshots)}: load one as "
                f"{hub_id.repo}@{snapshots[0]}")
    return ""


def _snapshots_starting(cache: Path, hub_id: HubId) -> list[str]:
    """The cached snapshots whose commit starts with the id's revision (in either case), sorted."""
    try:
        return sorted(p.name for p in (repo_folder(cache, hub_id.repo) / "snapshots").iterdir()
                      if FULL_COMMIT.fullmatch(p.name) and p.name.startswith(hub_id.revision.lower()) and p.is_dir())
    except OSError:
        return []


def short_commit(revision: str | None) -> bool:
    return revision is not None and SHORT_COMMIT.fullmatch(revision) is not None


def expand_short_commit(cache: Path, hub_id: HubId) -> HubId | None:
    """`org/x@dfc58f4` as the one cached snapshot whose commit starts with dfc58f4 (case aside),
    as git reads a short SHA. A ref of that name wins (git's order too), and any other revision is
    returned as it is; None for a short SHA that no cached snapshot matches (the not-cached error,
    or a download, follows); several matches are an error that lists them."""
    revision = hub_id.revision
    root = repo_folder(cache, hub_id.repo)
    if revision is not None and FULL_COMMIT.fullmatch(revision.lower()) and revision != revision.lower():
        # A full SHA in capitals (as some tools print them) was "not in the cache", where 7 to 39
        # of its digits in capitals were found: the cache names snapshots in lower case.
        return hub_id if (root / "refs" / revision).is_file() else HubId(hub_id.repo, revision.lower())
    if not short_commit(revision):
        return hub_id
    if (root / "refs" / revision).is_file():
        return hub_id
    matches = _snapshots_starting(cache, hub_id)
    if len(matches) > 1:
        raise ModelLoadError(
            f"model {hub_id}: the short commit {revision} matches {len(matches)} snapshots in the Hugging Face cache "
            f"({root / 'snapshots'}): {', '.join(matches)}; give more of the SHA to choose one "
            f"(e.g. {hub_id.repo}@{matches[0]})"
        )
    return HubId(hub_id.repo, matches[0]) if matches else None


def pinned(hub_id: HubId, folder: Path) -> HubId:
    """The id with a short commit written in full, from the snapshot folder it resolved to (so that
    advice such as `hf download --revision` names a commit the Hub and the cache both know)."""
    if short_commit(hub_id.revision) and FULL_COMMIT.fullmatch(folder.name) and folder.name.startswith(hub_id.revision.lower()):
        return HubId(hub_id.repo, folder.name)
    return hub_id


def check_repo_id(spec: str, hub_id: HubId) -> None:
    """huggingface_hub's own rules for a repo id, as one line that says the name is at fault."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(hub_id.repo)
    except HFValidationError as exc:
        raise ModelLoadError(
            f"{spec!r} is neither a local file or folder nor a valid Hugging Face id ({exc}). "
            "Hub ids look like name, org/name or org/name@revision; check the spelling or the path."
        ) from exc


def choose_files(repo_files: list[str]) -> tuple[list[str], str | None]:
    """From a repo's file list: the files to fetch first, and the weight index (if any) whose
    shards follow. Safetensors whenever a repo has them; `.bin` only when it has nothing else."""
    present = set(repo_files)
    lacking = [name for name in NEEDED if name not in present]
    if lacking:
        raise ModelLoadError(f"the repo has no {' or '.join(lacking)}; manyeyes needs {', '.join(NEEDED)}")
    wanted = [*NEEDED, *(name for name in OPTIONAL if name in present)]
    for single, index in WEIGHT_LAYOUTS:
        if single in present:
            return [*wanted, single], None
        if index in present:
            return [*wanted, index], index
    raise ModelLoadError("the repo has no model.safetensors (or shards) and no pytorch_model.bin")


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve(hub_id: HubId, progress: Progress | None = None, show_progress: bool = False) -> Path:
    """The local folder holding `hub_id`'s files, fetching what the cache lacks when allowed."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    check_repo_id(str(hub_id), hub_id)
    expanded = expand_short_commit(cache, hub_id)
    unmatched = expanded is None  # a short SHA that no ref is named and no cached snapshot starts with
    hub_id = expanded or hub_id
    folder = None
    try:
        folder = Path(snapshot_download(hub_id.repo, revision=hub_id.revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    except Exception as exc:  # a malformed id or a broken cache entry
        raise ModelLoadError(f"{hub_id}: cannot read the Hugging Face cache at {cache}: {exc}") from exc
    # Compared resolved: huggingface_hub answers a resolved path, and a cache reached through a
    # symlink (~/.cache on a cluster's other disk), a relative HF_HUB_CACHE or a ".." in it named
    # the same folder otherwise, and a cached model was "not in the cache".
    if folder is not None and folder.resolve().parent != (repo_folder(cache, hub_id.repo) / "snapshots").resolve():
        folder = None  # an empty or odd ref ("", "../..") resolved to some other folder than a snapshot
    lacking = missing_files(folder) if folder is not None else ["everything"]
    if not lacking:
        return folder
    held = "is not in" if folder is None else f"is incomplete (lacks {', '.join(lacking)}) in"
    if offline():
        where = repo_folder(cache, hub_id.repo)
        problem = _cache_entry_problem(cache, hub_id) if folder is None else ""
        if folder is None and unmatched:
            problem += f"; no cached snapshot's commit starts with {hub_id.revision}"
        elif folder is None and hub_id.revision and TOO_SHORT.fullmatch(hub_id.revision) and _snapshots_starting(cache, hub_id):
            problem += f"; a cached snapshot's commit starts with {hub_id.revision}, but a short commit takes 7 hex digits or more"
        raise ModelLoadError(
            f"model {hub_id} {held} the Hugging Face cache ({where}, revision {hub_id.revision or 'main'}{problem}) and "
            f"HF_HUB_OFFLINE is set, so nothing is downloaded. Fetch it on a connected machine with "
            f"`{fetch_command(hub_id)}` (into the same HF_HUB_CACHE), or unset HF_HUB_OFFLINE to let manyeyes download it."
        )
    return download(hub_id, cache, progress, show_progress, held)


def fetch_command(hub_id: HubId) -> str:
    """The command that fetches this very revision into the cache."""
    return f"hf download {hub_id.repo}{f' --revision {hub_id.revision}' if hub_id.revision else ''}"


class _Tally:
    """Bytes fetched so far across every file of one download, reported to a callback."""

    def __init__(self, total: int, report: Progress | None):
        self.total, self.done, self.report = total, 0, report
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.done = min(self.done + n, self.total) if self.total else self.done + n
            done = self.done
        if self.report is not None:
            self.report(done, self.total)


def _tqdm_class(tally: _Tally, show: bool):
    """huggingface_hub's tqdm (it honours HF_HUB_DISABLE_PROGRESS_BARS), counting into `tally`."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Counting(hf_tqdm):
        def __init__(self, *args, **kwargs):
            if not show:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            tally.add(int(n or 0))
            return super().update(n)

    return Counting


# The listing's wait: huggingface_hub's client waits for ever by default, and a Hub that took the
# request and never answered left `serve` "loading" and the CLI silent for good.
INFO_TIMEOUT_S = 30.0


def download(hub_id: HubId, cache: Path, progress: Progress | None, show_progress: bool, held: str = "is not in") -> Path:
    """Fetch `hub_id` into `cache`; `held` says what the cache holds of it now, for the messages
    of a download that fails ("is not in", "is incomplete (lacks tokenizer.json) in").

    Every file is fetched at the commit the listing names (a branch moved meanwhile cannot mix
    two commits), so huggingface_hub writes no ref: the revision's ref is written here once all
    are in, or the cache held a snapshot that neither HF_HUB_OFFLINE nor a Hub down could find."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(hub_id.repo, revision=hub_id.revision, files_metadata=True, timeout=INFO_TIMEOUT_S)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        digests = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if getattr(s, "lfs", None) and s.lfs.sha256}
        first, index = choose_files(list(sizes))
        folder = repo_folder(cache, hub_id.repo) / "snapshots" / info.sha

        def fetch(names: list[str], tally: _Tally) -> None:
            for name in names:
                if (folder / name).exists():  # kept from an earlier try: counted, so that progress ends at its total
                    tally.add(sizes.get(name, 0))
                    continue
                before = tally.done
                hf_hub_download(hub_id.repo, name, revision=info.sha, cache_dir=cache,
                                tqdm_class=_tqdm_class(tally, show_progress))
                # A blob kept from an earlier try is linked, not fetched: no bar counts it.
                tally.add(max(0, sizes.get(name, 0) - (tally.done - before)))
                _check_digest(folder / name, digests.get(name))

        # The shards' sizes are known from the listing, so the total is right from the start.
        index_size = sizes.get(index, 0) if index else 0
        tally = _Tally(sum(sizes[n] for n in first), progress)
        if index:
            fetch([index], _Tally(index_size, None))
            shards = shard_names(folder / index)
            tally.total = sum(sizes[n] for n in first if n != index) + sum(sizes.get(s, 0) for s in shards)
            fetch([n for n in first if n != index] + shards, tally)
        else:
            fetch(first, tally)
    except ModelLoadError as exc:
        raise type(exc)(f"model {hub_id}: {exc}") from exc  # CorruptFileError stays one
    except GatedRepoError as exc:
        raise ModelLoadError(f"model {hub_id} is gated: accept its terms on huggingface.co and log in with `hf auth login`") from exc
    except RepositoryNotFoundError as exc:
        raise ModelLoadError(f"no model {hub_id.repo!r} on the Hugging Face Hub (or it is private: `hf auth login`)") from exc
    except RevisionNotFoundError as exc:
        if short_commit(hub_id.revision):
            raise ModelLoadError(
                f"model {hub_id.repo} has no revision {hub_id.revision!r}: no snapshot in the Hugging Face cache at "
                f"{cache} has a commit that starts with it, and the Hub knows no branch, tag or commit by that name; "
                f"give the full 40-character SHA ({hub_id.repo}@<sha>; the repo's commit history on huggingface.co "
                "lists them)"
            ) from exc
        raise ModelLoadError(f"model {hub_id.repo} has no revision {hub_id.revision!r}") from exc
    except (HfHubHTTPError, OSError) as exc:
        refused = _http_refusal(exc)
        if refused is not None:  # the Hub answered, and refused: not the network's fault
            status, answer = refused
            advice = "log in with a token that may read it (`hf auth login`, HF_TOKEN), or fetch it" if status in (401, 403) \
                else "try again later, or fetch it"
            raise ModelLoadError(
                f"model {hub_id} {held} the Hugging Face cache at {cache} and the Hub refused a file of it: {answer}. "
                f"{advice[0].upper()}{advice[1:]} with `{fetch_command(hub_id)}` and set HF_HUB_OFFLINE=1."
            ) from exc
        raise ModelLoadError(
            f"model {hub_id} {held} the Hugging Face cache at {cache} and downloading it failed: {_one_line(exc)}. "
            f"Check the network, or fetch it with `{fetch_command(hub_id)}` and set HF_HUB_OFFLINE=1."
        ) from exc
    except Exception as exc:  # httpx connection errors and the like: still one clear line
        raise ModelLoadError(
            f"model {hub_id} {held} the Hugging Face cache at {cache} and the Hub could not be reached, or broke off "
            f"({type(exc).__name__}: {_one_line(exc)}). Fetch it on a connected machine with `{fetch_command(hub_id)}`, "
            "or set HF_HUB_OFFLINE=1 to use only the cache."
        ) from exc
    lacking = missing_files(folder)
    if lacking:
        raise ModelLoadError(f"model {hub_id}: downloaded to {folder} but it lacks {', '.join(lacking)}")
    try:
        _write_ref(cache, hub_id, info.sha)
    except OSError as exc:  # a read-only cache, a full disk: the files are in, only offline use lacks the ref
        log.warning("model %s: could not write %s's ref in the Hugging Face cache (%s): offline, load it as %s@%s",
                    hub_id, hub_id.revision or "main", exc.strerror or exc, hub_id.repo, info.sha)
    return folder


def _write_ref(cache: Path, hub_id: HubId, sha: str) -> None:
    """refs/<revision> (main for none) naming the commit fetched, as huggingface_hub writes it
    (no newline; atomically, for a reader beside us), unless the revision is that commit."""
    revision = hub_id.revision or "main"
    if revision == sha:
        return
    refs = repo_folder(cache, hub_id.repo) / "refs"
    ref = refs / revision
    if refs.resolve() not in ref.resolve().parents:  # parse_hub_id refuses "..": never outside refs/
        return
    if ref.exists() and ref.read_text() == sha:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    partial = ref.with_name(f"{ref.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    partial.write_text(sha)
    partial.replace(ref)


def _check_digest(path: Path, expected: str | None) -> None:
    """A weight file the Hub keeps in LFS is named by its SHA-256 in the listing: a download
    damaged on its way (same length, other bytes) loaded as wrong weights with no word. The bad
    copy is removed, so that the next try fetches it again."""
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() == expected:
        return
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise CorruptFileError(
        f"the downloaded {path.name} does not match the SHA-256 the Hub lists for it (a download "
        "damaged on its way); the copy is removed: load it again to fetch it anew"
    )


def _http_refusal(exc: BaseException) -> tuple[int, str] | None:
    """(403, "403 Forbidden for tokenizer.json"): the Hub's refusal, its status and a few words,
    where it answered one. huggingface_hub wraps a refused lookup in "make sure your Internet connection is on",
    and writes its own over three lines."""
    seen = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            url = str(getattr(getattr(response, "request", None), "url", "") or "")
            name = url.rsplit("/", 1)[-1] if "/resolve/" in url else "its listing"
            reason = getattr(response, "reason_phrase", "") or ""
            return status, f"{status} {reason} for {name}".replace("  ", " ")
        seen = seen.__cause__ or seen.__context__
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()).rstrip(".")
