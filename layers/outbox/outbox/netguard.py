"""The SSRF guard for outbound HTTP (webhooks).

A URL is checked twice: by shape at enqueue (``check_url``: scheme, no
credentials, no numeric host spellings, no literal forbidden address) and by
address at send (``resolve``: the host is resolved once, *every* answer must
be a public unicast address, and the caller connects to the checked address
it gets back, so a DNS answer that changes between check and connect, DNS
rebinding, cannot reach an internal address).

Refused: loopback, private (RFC 1918, RFC 4193 fc00::/7), link-local,
multicast, unspecified, reserved and documentation ranges, shared/CGNAT
100.64.0.0/10, the instance metadata addresses (169.254.169.254,
fd00:ec2::254), and those same addresses hidden inside IPv6 (IPv4-mapped,
IPv4-compatible, 6to4, Teredo, NAT64). Decimal, octal and hex host spellings
(``2130706433``, ``0x7f.1``, ``017700000001``) are refused outright.

Local development only: ``allow_insecure`` permits plain ``http`` and
loopback receivers; nothing else.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, quote, urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
_SHARED = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
# A host made only of numbers in C's inet_aton forms: 1 to 4 parts, each
# decimal, octal (leading 0) or hex (0x).
# A host name as resolvers take it (an IPv6 address comes without brackets).
_HOST_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")
_NUMERIC_PART = re.compile(r"^(0x[0-9a-f]*|[0-9]+)$", re.IGNORECASE)
_MAX_URL_LENGTH = 2048
# Whitespace (``\s`` is str.isspace(): Unicode's too) and control characters.
_SPACE_OR_CONTROL = re.compile(r"[\s\x00-\x1f\x7f]")


class ForbiddenDestination(ValueError):
    """The URL or its address is not allowed; the message never echoes the URL."""


@dataclass(frozen=True)
class Target:
    """A checked destination: connect to ``address``, speak to ``hostname``."""

    scheme: str
    hostname: str  # for SNI, certificate checks and the Host header
    port: int
    path: str  # path and query, as sent on the request line
    address: str  # the checked IP to connect to

    @property
    def host_header(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or ip in _NAT64_LOCAL:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # IPv4-compatible ::a.b.c.d (deprecated)
        return ipaddress.IPv4Address(int(ip))
    return None


def _article(noun: str) -> str:
    return "an" if noun[:1] in "aeiouAEIOU" else "a"


def why_forbidden(ip: IPAddress, *, allow_loopback: bool = False) -> str | None:
    """Why connecting to ``ip`` is refused, or None when it is a public unicast address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "scoped IPv6 address"
        inner = _embedded_ipv4(ip)
        if inner is not None:
            reason = why_forbidden(inner, allow_loopback=allow_loopback)
            return f"IPv6 address embedding an IPv4 {reason}" if reason else None
    if ip in METADATA:
        return "instance metadata address"
    if ip.is_loopback:
        return None if allow_loopback else "loopback address"
    if ip.is_unspecified:
        return "unspecified address"
    if ip.is_link_local:
        return "link-local address"
    if ip.is_multicast:
        return "multicast address"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED:
        return "shared (CGNAT) address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local address"
    if ip.is_private:
        return "private address"
    if ip.is_reserved:
        return "reserved address"
    if not ip.is_global:
        return "non-global address"
    return None


def _split(url: str, allow_insecure: bool) -> tuple[SplitResult, str, int]:
    if not isinstance(url, str) or len(url) > _MAX_URL_LENGTH:
        raise ForbiddenDestination(f"must be a URL of at most {_MAX_URL_LENGTH} characters")
    if _SPACE_OR_CONTROL.search(url):
        raise ForbiddenDestination("must not contain whitespace or control characters")
    if not url.isascii():
        try:
            url.encode("utf-8")  # what the path is percent-encoded from at send
        except UnicodeEncodeError:
            raise ForbiddenDestination("must be valid Unicode (no lone surrogates)") from None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        # (the parser's own message quotes the bad part: a password, a token)
        raise ForbiddenDestination("is not a valid URL (bad host or port)") from None
    schemes = ("https", "http") if allow_insecure else ("https",)
    if parts.scheme not in schemes:
        raise ForbiddenDestination(
            "must use https" if not allow_insecure else "must use https or http"
        )
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ForbiddenDestination("must not carry credentials")
    if parts.fragment:
        raise ForbiddenDestination("must not have a fragment")
    host = _ascii_host(parts.hostname or "").rstrip(".")
    if not host:
        raise ForbiddenDestination("must name a host")
    if ":" not in host and not _HOST_NAME.match(host):
        # "*" above all: the key of a channel-wide limit, never a receiver
        raise ForbiddenDestination("must name a host: letters, digits, '-' and '_' between dots")
    if port == 0:
        raise ForbiddenDestination("must not use port 0")
    return parts, host, port or (443 if parts.scheme == "https" else 80)


def _ascii_host(host: str) -> str:
    """The host as resolvers will see it. Full-width digits and full stops,
    and ideographic full stops (U+FF11 U+FF12 U+FF17 U+3002 ...) spell
    127.0.0.1 to IDNA, so every check runs on the IDNA (ASCII) form, the one
    the connection will use."""
    if host.isascii():
        return host
    try:
        return host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise ForbiddenDestination("has a host name that is not valid IDNA") from None


def _literal(host: str) -> IPAddress | None:
    """The address a numeric host stands for; refuses ambiguous numeric spellings."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    parts = host.split(".")
    if len(parts) <= 4 and all(_NUMERIC_PART.match(p) for p in parts):
        # 2130706433, 0x7f.1, 017700000001, 127.1: resolvers read these as IPv4
        # addresses; refuse rather than guess which one a library will pick.
        raise ForbiddenDestination("uses a decimal, octal or hex host spelling")
    return None


def check_url(url: str, *, allow_insecure: bool = False) -> None:
    """The checks that need no DNS (run at enqueue); raises ForbiddenDestination."""
    _, host, _ = _split(url, allow_insecure)
    ip = _literal(host)
    if ip is not None:
        reason = why_forbidden(ip, allow_loopback=allow_insecure)
        if reason:
            raise ForbiddenDestination(f"points at {_article(reason)} {reason}")


# Resolves (host, port) to IP address strings; tests substitute their own.
Resolver = Callable[[str, int], list[str]]


def getaddrinfo_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


def resolve(url: str, *, allow_insecure: bool = False, resolver: Resolver | None = None) -> Target:
    """Resolve the URL's host once and check every address it resolves to.

    Raises ForbiddenDestination for a refused URL or address, OSError when the
    name does not resolve. Connect to ``Target.address``, never to the name.
    """
    parts, host, port = _split(url, allow_insecure)
    ip = _literal(host)
    if ip is not None:
        addresses = [ip]
    else:
        lookup = resolver or getaddrinfo_resolver
        answers = lookup(host, port)
        addresses = []
        for answer in answers:
            try:
                addresses.append(ipaddress.ip_address(answer))
            except ValueError:
                raise ForbiddenDestination("resolved to something that is not an address") from None
        if not addresses:
            raise OSError("the host resolved to no address")
    for address in addresses:
        reason = why_forbidden(address, allow_loopback=allow_insecure)
        if reason:
            raise ForbiddenDestination(f"resolves to {_article(reason)} {reason}")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return Target(parts.scheme, host, port, request_target(path), str(addresses[0]))


def request_target(path: str) -> str:
    """The path and query as a request line carries them: ASCII only. A URL
    that is an IRI (``/café``) has its other characters percent-encoded as
    UTF-8 (RFC 3987, 3.1), as browsers do; what is ASCII, ``%41`` included,
    stays as it was."""
    if path.isascii():
        return path
    return "".join(c if c.isascii() else quote(c, safe="") for c in path)
