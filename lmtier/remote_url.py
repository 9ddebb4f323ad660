"""The one parser of remote-tier URLs (``remote_url``): Redis / Valkey (single instance or cluster)
and Mooncake Store (``mooncakestore://``).

Pure Python (no redis-py import): :mod:`lmtier.config` parses ``remote_url`` with it at load time
and :class:`lmtier.tiers.redis.RedisTier` is built from the resulting :class:`RedisEndpoint`, so a
URL is parsed once and both agree on what it means.

Accepted forms::

    redis://[[user]:password@]host[:port][/db]           (port 6379 by default, db 0)
    rediss://...                                          TLS (query parameters below)
    unix:///path/to/redis.sock[?db=N]
    redis-cluster://[[user]:password@]host[:port],host[:port],...   (rediss-cluster:// for TLS)

* **Credentials.** ``user:password@``; ``:password@`` (no user); a lone ``secret@`` is a
  **password**, not a user name (redis-py's ``from_url`` reads it as a user: a password is what
  such URLs carry in practice, and what lmtier's config always documented). The password may
  instead be given as the query parameter ``password=`` (any scheme; the form the unix socket
  examples use) or come from an environment variable (``password_env``); setting it in two of
  these places is an error. An empty password means none. Percent-escapes are decoded in the
  user, the password and the socket path.
* **Database**: the path (``/3``) or ``?db=3`` for ``redis``/``rediss``/``unix`` (not both);
  Redis Cluster has none.
* **Hosts**: ``host``, ``host:port``, ``[ipv6]:port``; several only for the cluster schemes, each
  node once (``a,a:6379``, ``A:1,a:1`` or ``[::1]:1,[0::1]:1`` name one node twice: an error).
* **TLS** (``rediss``, ``rediss-cluster`` only): ``ssl_ca_certs``, ``ssl_certfile``,
  ``ssl_keyfile`` (existing files), ``ssl_cert_reqs`` (``required`` | ``optional`` | ``none``;
  ``none`` also turns hostname checking off), ``ssl_check_hostname`` (true/false).
* Schemes are case-insensitive; any other query parameter, a parameter given twice and a
  ``#`` fragment are errors.

Mooncake Store (:func:`parse_mooncake_url` -> :class:`MooncakeEndpoint`; LMCache's form)::

    mooncakestore://MASTER_HOST:PORT[/]                   (the master's RPC address; no default port)

No credentials, path or query. :func:`parse_remote_url` picks the parser by scheme.

Passwords never appear in :func:`redact_url`, :meth:`RedisEndpoint.describe` or the endpoint's
repr.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from urllib.parse import parse_qs, unquote

from lmtier.errors import LMTierError

__all__ = [
    "SCHEMES",
    "MOONCAKE_SCHEME",
    "DEFAULT_PORT",
    "RemoteURLError",
    "TLSOptions",
    "RedisEndpoint",
    "MooncakeEndpoint",
    "RemoteEndpoint",
    "parse_redis_url",
    "parse_mooncake_url",
    "parse_remote_url",
    "redact_url",
    "node_address",
]

SCHEMES = ("redis", "rediss", "unix", "redis-cluster", "rediss-cluster")
MOONCAKE_SCHEME = "mooncakestore"
DEFAULT_PORT = 6379
_TLS_SCHEMES = ("rediss", "rediss-cluster")
_SUN_PATH_BYTES = 108  # Linux sockaddr_un.sun_path, the terminating NUL included
_BOOL_TEXT = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class RemoteURLError(LMTierError, ValueError):
    """A malformed remote URL or password setting.

    Attributes:
        config_key: the config key at fault: ``"remote_url"`` or ``"remote_password_env"``.
        value: the offending value, redacted (never a password).
        why: what is wrong.
    """

    def __init__(self, config_key: str, value: str, why: str) -> None:
        super().__init__(f"{config_key}={value!r}: {why}")
        self.config_key = config_key
        self.value = value
        self.why = why


@dataclass(frozen=True)
class TLSOptions:
    """TLS settings of a ``rediss://`` / ``rediss-cluster://`` endpoint (paths are files that
    existed when the URL was parsed)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True


@dataclass(frozen=True, repr=False)
class RedisEndpoint:
    """Where and how to connect to the remote tier (the result of :func:`parse_redis_url`).

    Attributes:
        scheme: one of :data:`SCHEMES` (lower case).
        hosts: ``((host, port), ...)``: one for ``redis``/``rediss``, one or more for the cluster
            schemes, empty for ``unix``.
        socket_path: the socket path for ``unix``, else None.
        db: database number (0 for clusters).
        username: from the URL, or None.
        password: from the URL or the environment, or None; excluded from repr and equality.
        tls: TLS settings for ``rediss``/``rediss-cluster``, else None.
    """

    scheme: str
    hosts: tuple[tuple[str, int], ...] = ()
    socket_path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, compare=False)
    tls: TLSOptions | None = None

    @property
    def kind(self) -> str:
        """``"tcp"`` (redis, rediss), ``"unix"`` or ``"cluster"``."""
        if self.scheme == "unix":
            return "unix"
        return "cluster" if self.scheme.endswith("-cluster") else "tcp"

    @property
    def host(self) -> str:
        """The single host of a ``tcp`` endpoint ("" otherwise)."""
        return self.hosts[0][0] if self.kind == "tcp" else ""

    @property
    def port(self) -> int:
        """The single port of a ``tcp`` endpoint (:data:`DEFAULT_PORT` otherwise)."""
        return self.hosts[0][1] if self.kind == "tcp" else DEFAULT_PORT

    def describe(self) -> str:
        """A URL for logs: no credentials, no query."""
        if self.kind == "unix":
            return f"unix://{self.socket_path}" + (f"?db={self.db}" if self.db else "")
        nodes = ",".join(node_address(h, p) for h, p in self.hosts)
        return f"{self.scheme}://{nodes}" + ("" if self.kind == "cluster" else f"/{self.db}")

    def with_password(self, password: str | None) -> RedisEndpoint:
        """A copy with ``password`` replaced."""
        return replace(self, password=password or None)

    def __repr__(self) -> str:
        auth = f", username={self.username!r}" if self.username else ""
        return (
            f"RedisEndpoint({self.describe()!r}{auth}, password={'***' if self.password else None}, tls={self.tls!r})"
        )


def redact_url(url: str) -> str:
    """``url`` with the password (userinfo or ``password=`` query parameter) replaced by ``***``.
    A lone userinfo (``redis://secret@host``) is a password and is masked as a whole."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, qmark, query = rest.partition("?")
    if "@" in rest:  # rpartition: a "/" or "@" inside the password is masked too
        creds, _, tail = rest.rpartition("@")
        masked = creds.split(":", 1)[0] + ":***" if ":" in creds else "***"
        rest = f"{masked}@{tail}"
    if qmark:
        parts = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            parts.append(f"{name}=***" if eq and unquote(name) == "password" else item)
        query = "&".join(parts)
    return f"{scheme}://{rest}{qmark}{query}"


@dataclass(frozen=True)
class MooncakeEndpoint:
    """A Mooncake Store master (the result of :func:`parse_mooncake_url`).

    Attributes:
        host: the master's host name or address (IPv6 without brackets).
        port: the master's RPC port.
    """

    host: str
    port: int

    @property
    def scheme(self) -> str:
        return MOONCAKE_SCHEME

    @property
    def hosts(self) -> tuple[tuple[str, int], ...]:
        return ((self.host, self.port),)

    @property
    def master_address(self) -> str:
        """``host:port`` (``[v6]:port``), Mooncake's ``master_server_address``."""
        return node_address(self.host, self.port)

    def describe(self) -> str:
        """The URL, for logs."""
        return f"{MOONCAKE_SCHEME}://{self.master_address}/"


RemoteEndpoint = RedisEndpoint | MooncakeEndpoint
"""What :func:`parse_remote_url` returns."""


def parse_mooncake_url(url: str) -> MooncakeEndpoint:
    """Parse ``mooncakestore://HOST:PORT[/]`` (see the module doc).

    Raises:
        RemoteURLError: another scheme, a missing host or port, credentials, a path or a query.
    """
    if not isinstance(url, str):
        raise RemoteURLError("remote_url", repr(url), "must be a string")

    def bad(why: str) -> RemoteURLError:
        return RemoteURLError("remote_url", url, why)

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != MOONCAKE_SCHEME:
        raise bad(f"scheme must be {MOONCAKE_SCHEME}://")
    if "?" in rest or "#" in rest:
        raise bad("mooncakestore:// takes no query (client settings: MOONCAKE_CONFIG_PATH or the mooncake_* keys)")
    authority, _, path = rest.partition("/")
    if path:
        raise bad(f"unexpected path {'/' + path!r}: the form is mooncakestore://HOST:PORT/")
    if "@" in authority:
        raise bad("mooncakestore:// takes no credentials")
    if "," in authority:
        raise bad("one master only (HA masters are not supported)")
    if not authority.rpartition(":")[2].isdigit() or authority.endswith("]"):
        raise bad("missing port: the form is mooncakestore://HOST:PORT/")
    host, port = _parse_host_port(bad, authority)
    return MooncakeEndpoint(host, port)


def parse_remote_url(
    url: str, *, password_env: str | None = None, env: Mapping[str, str] | None = None
) -> RemoteEndpoint:
    """``remote_url`` by its scheme: :func:`parse_mooncake_url` for ``mooncakestore://`` (where
    ``password_env`` must be None), else :func:`parse_redis_url`.

    Raises:
        RemoteURLError: as the parser chosen; ``remote_password_env`` with a Mooncake URL.
    """
    if isinstance(url, str) and "://" in url:
        scheme = url.partition("://")[0].lower()
        if scheme == MOONCAKE_SCHEME:
            if password_env is not None:
                raise RemoteURLError("remote_password_env", password_env, "Mooncake Store takes no password")
            return parse_mooncake_url(url)
        if scheme not in SCHEMES:
            raise RemoteURLError(
                "remote_url",
                redact_url(url),
                f"scheme must be one of {[s + '://' for s in (*SCHEMES, MOONCAKE_SCHEME)]}",
            )
    return parse_redis_url(url, password_env=password_env, env=env)


def parse_redis_url(
    url: str, *, password_env: str | None = None, env: Mapping[str, str] | None = None
) -> RedisEndpoint:
    """Parse a remote URL (see the module doc) into a :class:`RedisEndpoint`.

    Args:
        url: the URL.
        password_env: name of an environment variable holding the password (``remote_password_env``);
            it must be set, and the URL must not carry a password too.
        env: the environment to read ``password_env`` from (default ``os.environ``).

    Raises:
        RemoteURLError: malformed URL, a cluster node listed twice, a TLS file that does not exist, a
            password given twice, an unset ``password_env`` (``config_key`` says which key is at fault).
    """
    if not isinstance(url, str):
        raise RemoteURLError("remote_url", repr(url), "must be a string")
    shown = redact_url(url)

    def bad(why: str) -> RemoteURLError:
        return RemoteURLError("remote_url", shown, why)

    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise bad(f"scheme must be one of {[s + '://' for s in SCHEMES]} (a Redis/Valkey URL)")
    # Split by hand: urlsplit cannot parse comma-separated hosts. The query goes first: its values
    # may contain "/" (ssl_ca_certs=/path/ca.pem).
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    path = slash + path
    username = password = None
    if "@" in authority:
        creds, _, authority = authority.rpartition("@")
        user_text, colon, pass_text = creds.partition(":")
        username = unquote(user_text) or None
        password = unquote(pass_text) if colon else None
        if not colon:  # redis://secret@host: the lone userinfo is a password
            password, username = username, None
    if "#" in authority or "#" in path or "#" in query:
        raise bad("'#' is not allowed (a URL fragment; percent-encode a '#' in a password as %23)")
    parsed = parse_qs(query, keep_blank_values=True)
    twice = sorted(k for k, v in parsed.items() if len(v) > 1)
    if twice:
        raise bad(f"query parameter(s) {twice} given twice")
    params = {k: v[0] for k, v in parsed.items()}
    if "password" in params:
        query_pw = params.pop("password")
        if password:
            raise bad("the password is given twice (userinfo and ?password=)")
        password = query_pw
    password = password or None
    hosts: tuple[tuple[str, int], ...] = ()
    socket_path = None
    db_text = params.pop("db", None)
    if scheme == "unix":
        if authority:
            raise bad("unix:// URL must be unix:///absolute/path/to/socket[?db=N]")
        if not path or path == "/":
            raise bad("missing socket path")
        socket_path = unquote(path)
        if len(os.fsencode(socket_path)) >= _SUN_PATH_BYTES:
            raise bad(f"socket path longer than {_SUN_PATH_BYTES - 1} bytes (AF_UNIX cannot connect to it)")
    else:
        if not authority:
            raise bad("missing host")
        items = authority.split(",")
        if not scheme.endswith("-cluster") and len(items) > 1:
            raise bad("several hosts need redis-cluster://")
        hosts = tuple(_parse_host_port(bad, it.strip()) for it in items)
        _refuse_duplicate_hosts(bad, items, hosts)
        path_db = path.strip("/")
        if path_db:
            if db_text is not None:
                raise bad("the database is given twice (path and ?db=)")
            db_text = path_db
        if scheme.endswith("-cluster") and db_text is not None:
            raise bad("Redis Cluster has no database number")
    db = 0
    if db_text is not None:
        if not _is_decimal(db_text):
            raise bad(f"database {db_text!r} is not a non-negative integer")
        db = int(db_text)
    tls = None
    if scheme in _TLS_SCHEMES:
        files = {}
        for f in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if f in params:
                files[f] = unquote(params.pop(f))
                if not os.path.isfile(files[f]):
                    raise bad(f"{f} is not a file")
        reqs = params.pop("ssl_cert_reqs", "required").lower()
        if reqs not in ("required", "optional", "none"):
            raise bad(f"ssl_cert_reqs {reqs!r} is not required/optional/none")
        check = _BOOL_TEXT.get(params.pop("ssl_check_hostname", "true").lower())
        if check is None:
            raise bad("ssl_check_hostname must be true or false")
        tls = TLSOptions(
            ca_certs=files.get("ssl_ca_certs"),
            certfile=files.get("ssl_certfile"),
            keyfile=files.get("ssl_keyfile"),
            cert_reqs=reqs,
            check_hostname=check and reqs != "none",
        )
    if params:
        raise bad(f"unsupported query parameters {sorted(params)}")
    if password_env is not None:
        if not password_env:
            raise RemoteURLError("remote_password_env", password_env, "must be a variable name")
        if password is not None:
            raise RemoteURLError(
                "remote_password_env", password_env, "remote_url already contains a password; set only one"
            )
        environ = os.environ if env is None else env
        if password_env not in environ:
            raise RemoteURLError("remote_password_env", password_env, "environment variable is not set")
        password = environ[password_env] or None
    return RedisEndpoint(
        scheme=scheme, hosts=hosts, socket_path=socket_path, db=db, username=username, password=password, tls=tls
    )


def _parse_host_port(bad, item: str) -> tuple[str, int]:
    if item.startswith("["):  # [ipv6]:port
        host, bracket, rest = item[1:].partition("]")
        if not bracket:
            raise bad(f"malformed host {item!r}: no closing ']'")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise bad(f"malformed host {item!r}")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise bad(f"missing host in {item!r}")
    if port_text == "":
        port = DEFAULT_PORT
    else:
        if not _is_decimal(port_text):
            raise bad(f"port {port_text!r} is not a number")
        port = int(port_text)
    if not 1 <= port <= 65535:
        raise bad(f"port {port} outside 1..65535")
    return host, port


def node_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (``[::1]:6379``), as URLs and logs write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _node_identity(host: str, port: int) -> tuple[str, int]:
    """What makes two cluster seed entries the same node: an IP address in its canonical form
    (``0::1`` is ``::1``), a host name case-folded (DNS names are case-insensitive), and the port."""
    try:
        return ipaddress.ip_address(host).compressed, port
    except ValueError:
        return host.lower(), port


def _refuse_duplicate_hosts(bad, items: list[str], hosts: tuple[tuple[str, int], ...]) -> None:
    """Raise ``bad(...)`` naming the first node listed twice (a typo in a seed list, or a node meant to
    be another one; redis-py would quietly keep one of them)."""
    seen: dict[tuple[str, int], str] = {}
    for item, (host, port) in zip(items, hosts):
        ident = _node_identity(host, port)
        if ident in seen:
            first = seen[ident]
            same = "" if first == item.strip() else f" (as {first!r})"
            raise bad(f"host {item.strip()!r} listed twice{same}: each cluster node once")
        seen[ident] = item.strip()


def _is_decimal(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes ``"²"``, which ``int`` refuses)."""
    return text.isascii() and text.isdigit()
