"""Who is asking: optional API keys (Authorization: Bearer), and the client identity that fair
shares are counted by (the key, else the address; X-Forwarded-For only from trusted proxies)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from pathlib import Path

from fastapi import Request

from manyeyes.app.middleware import LOOPBACK_HOSTS, send_error

log = logging.getLogger("manyeyes")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def tenant_secret(key: str) -> str:
    """What keeps a key's run and view ids its own (hex): worked out from the key itself, never
    from its SHA-256 digest, which the key file holds: a reader of that file with any one valid
    key could otherwise compute another key's run id for a guessed text and read that run."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=32, person=b"manyeyes-tenant").hexdigest()


def canonical_address(address: str) -> str:
    """One spelling per client for fair shares: an IPv4-mapped IPv6 address is its IPv4 one, and
    an IPv6 host counts as its /64 (one host is usually given a whole /64, and each of its 2^64
    addresses was a share of its own); anything that is not an address is kept as it came."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6 and not ip.is_loopback:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def without_port(hop: str) -> str:
    """An X-Forwarded-For hop's address without the port some proxies add (`203.0.113.7:50312`,
    `[2001:db8::1]:50312`): with it, each of a client's connections counted as a client of its
    own, with a fresh share. A bare IPv6 address (colons, no brackets) is kept whole."""
    if hop.startswith("["):
        return hop[1:].partition("]")[0]
    host, colon, port = hop.rpartition(":")
    return host if colon and port.isdigit() and host.count(".") == 3 and ":" not in host else hop


class KeyRing:
    """The accepted keys, held only as SHA-256 digests. A file holds one hex digest per line
    (`printf %s "$KEY" | sha256sum`); blank lines and `#` comments are skipped."""

    def __init__(self, keys: list[str] = (), key_file: Path | None = None) -> None:
        digests = [key_digest(k) for k in keys if k]
        if key_file is not None:
            try:
                # utf-8-sig: a file saved by an editor that writes a byte-order mark read its first
                # digest as not a digest.
                lines = Path(key_file).read_text(encoding="utf-8-sig").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"MANYEYES_API_KEYS_FILE {key_file}: cannot be read ({exc.__class__.__name__}: {exc})") from None
            before = len(digests)
            for number, line in enumerate(lines, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                words = line.split()
                try:
                    digest = bytes.fromhex(words[0])
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    # A raw key is the likeliest slip: the file holds digests, never keys.
                    raise ValueError(f"MANYEYES_API_KEYS_FILE {key_file}:{number}: expected a 64-digit SHA-256 hex "
                                     "digest of a key, not the key itself (printf %s \"$KEY\" | sha256sum)")
                # What follows a digest is a label (sha256sum writes "-"): a second digest there
                # was silently dropped, and that key refused.
                if any(len(word) == 64 and all(c in "0123456789abcdefABCDEF" for c in word) for word in words[1:]):
                    raise ValueError(f"{key_file}:{number}: one digest a line (a second one follows the first)")
                digests.append(digest)
            # An operator who names a key file wants keys: an empty one must not leave the API open.
            if len(digests) == before:
                raise ValueError(f"MANYEYES_API_KEYS_FILE {key_file}: holds no key digests (one SHA-256 hex digest a line)")
        self.digests = digests

    def __bool__(self) -> bool:
        return bool(self.digests)

    def digest_of(self, key: str) -> str | None:
        """The matching key's whole digest (hex), or None: a secret each key's holder has and no
        other client can work out, unlike its id (key_id) that logs and metrics show. Every stored
        digest is compared, each in constant time, so the time taken says nothing about which is close."""
        presented = key_digest(key)
        found = None
        for digest in self.digests:
            if hmac.compare_digest(presented, digest):
                found = digest
        return found.hex() if found is not None else None


def configured_keys(api_keys: list[str] | None, key_file: Path | None) -> KeyRing:
    """The KeyRing of MANYEYES_API_KEYS (None: not set) and MANYEYES_API_KEYS_FILE. ValueError,
    its message one line, for either set but holding no key: meant to hold keys, it never leaves
    the API open (MANYEYES_API_KEYS="$KEYS" with KEYS unset was an open API without a word)."""
    if api_keys is not None and not any(api_keys):
        raise ValueError("MANYEYES_API_KEYS is set but holds no key: unset it to serve without keys, or give "
                         "the keys separated by commas")
    return KeyRing(api_keys or (), key_file)


def key_id(digest: str) -> str:
    """A key's client id, as logs and metrics show it: its digest's first 12 hex digits."""
    return "key:" + digest[:12]


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"authorization":
            # UTF-8, as configured keys are hashed: bytes that are not UTF-8 match no key.
            scheme, _, token = value.decode("utf-8", errors="replace").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class TrustedProxies:
    def __init__(self, entries: list[str]) -> None:
        self.networks = [ipaddress.ip_network(e.strip(), strict=False) for e in entries if e.strip()]

    def __contains__(self, address: str) -> bool:
        if not self.networks:  # the usual case: no proxies to believe, no address to parse
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        # Served on "::", an IPv4 proxy comes as ::ffff:127.0.0.1 and matched no IPv4 entry: every
        # proxied user was then one client, sharing one share.
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.networks)

    def client_address(self, peer: str, headers: list[tuple[bytes, bytes]]) -> str:
        """The peer, or, when the peer is a trusted proxy, the nearest X-Forwarded-For hop that is
        not itself one (hops further left are whatever the client chose to write)."""
        if peer not in self:
            return peer
        hops = []
        for name, value in headers:
            if name == b"x-forwarded-for":
                hops += [without_port(h.strip()) for h in value.decode("latin-1").split(",") if h.strip()]
        for hop in reversed(hops):
            if hop not in self:
                return hop
        return peer

    def address_id(self, scope) -> str:
        """A request's client id by its address, as ClientIdentity gives one without a key: the
        access log's, for a request refused before ClientIdentity saw it (AllowedHosts' 421)."""
        peer = (scope.get("client") or ("", 0))[0]
        return "addr:" + canonical_address(self.client_address(peer, scope["headers"]))


def on_loopback(address: str) -> bool:
    """Whether a client address (as the server reads it, or from a trusted X-Forwarded-For) is
    this machine: 127.0.0.0/8, ::1, IPv4-mapped loopback, or none at all (a Unix socket)."""
    return not address or address.startswith(("127.", "::ffff:127.")) or address == "::1"


class ClientIdentity:
    """Pure ASGI: refuses /api and /export (and /metrics when closed) without a valid key when keys
    are configured, and records the client's identity in scope["state"]["client"].

    It also drops Accept-Encoding from a client on loopback (unless compress_loopback): there an
    answer crosses no link that compression could speed up, and compressing it only costs time
    (a T=128 u8 frame: 21 ms as it is, 32 ms with zstd). Everything after this middleware (the
    attention service, GZipMiddleware) then answers that client uncompressed."""

    def __init__(self, app, keys: KeyRing, proxies: TrustedProxies, close_metrics: bool, compress_loopback: bool = False) -> None:
        self.app = app
        self.keys = keys
        self.proxies = proxies
        self.close_metrics = close_metrics
        self.compress_loopback = compress_loopback

    def guarded(self, path: str) -> bool:
        """Whether the request needs a key. Closed metrics do even on a server without keys (none
        can open them); /export runs the model like the API does."""
        if self.close_metrics and path == "/metrics":
            return True
        return bool(self.keys) and (path.startswith("/api/") or path == "/export")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        peer = (scope.get("client") or ("", 0))[0]
        address = self.proxies.client_address(peer, scope["headers"])
        state = scope.setdefault("state", {})
        # Set before the key is checked: the access log names whose key was refused by its address.
        state["client"] = "addr:" + canonical_address(address)
        if not self.compress_loopback and on_loopback(address):
            scope["headers"] = [h for h in scope["headers"] if h[0] != b"accept-encoding"]
        if self.guarded(scope["path"]):
            token = bearer(scope["headers"])
            digest = self.keys.digest_of(token) if token else None  # no keys: nothing matches
            if digest is None:
                if not self.keys:
                    message = "/metrics is closed (MANYEYES_CLOSE_METRICS) and this server has no API keys to open it"
                elif token is None and any(name == b"authorization" for name, _ in scope["headers"]):
                    # "Bearer\tkey" or "Basic ..." was told that no key had been sent.
                    message = "the Authorization header is not a Bearer key: send Authorization: Bearer <key>, one space between"
                elif token is None:
                    message = "this server needs an API key: send Authorization: Bearer <key>"
                else:
                    message = "the API key is not valid"
                await send_error(send, 401, "unauthorized", message, [(b"www-authenticate", b'Bearer realm="manyeyes"')])
                return
            state["client"] = key_id(digest)
            # Its runs' ids are its own (run_id_for): with one cache shared by every key, an id
            # worked out from a guessed text told whether another key had run it, and read its run.
            state["tenant"] = tenant_secret(token)
        await self.app(scope, receive, send)


def client_of(request: Request) -> str:
    return request.scope.get("state", {}).get("client", "")


def tenant_of(request: Request) -> str:
    """The secret that keeps a key's run ids its own; "" on a server without keys (one tenant)."""
    return request.scope.get("state", {}).get("tenant", "")


def bound_to_loopback(host: str) -> bool:
    """Whether `serve --host` is this machine alone: localhost, 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(host: str, trusted_proxies: list[str]) -> list[str]:
    """MANYEYES_ALLOWED_HOSTS when unset. On loopback with no proxy in front only this machine's
    own names: a web page whose name its DNS then points at 127.0.0.1 (DNS rebinding) is, to the
    browser, its own origin, and could use a keyless local server and read the runs of texts it
    guessed. Behind a proxy, or bound beyond loopback, a server is reached by names of its own."""
    if bound_to_loopback(host) and not trusted_proxies:
        return list(LOOPBACK_HOSTS)
    return ["*"]


def exposure_warning(host: str, has_keys: bool, proxied: bool = False) -> str | None:
    """The start-up warning for a server others can reach that asks nobody for a key: one bound
    beyond loopback, or one behind the proxies of MANYEYES_TRUSTED_PROXIES (bound to loopback, as
    README recommends, it never warned, however public the proxy)."""
    if has_keys:
        return None
    if not bound_to_loopback(host):
        return (
            f"WARNING: serving on {host} without API keys: anyone who can reach this address can use the API. "
            "Set MANYEYES_API_KEYS (or MANYEYES_API_KEYS_FILE), or serve on 127.0.0.1 behind a proxy; see SECURITY.md."
        )
    if proxied:
        return (
            "WARNING: serving without API keys behind the proxies in MANYEYES_TRUSTED_PROXIES: anyone who can reach "
            "them can use the API. Set MANYEYES_API_KEYS (or MANYEYES_API_KEYS_FILE), or limit who reaches the proxy; "
            "see SECURITY.md."
        )
    return None
