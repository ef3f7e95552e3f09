"""Who a connection is: the client's address (through trusted proxies) and the seat it takes.

- Address. With no `trusted_proxies` named, the peer of the TCP connection is the client and
  forwarded headers are ignored (anyone can write them). With proxies named (addresses or
  networks, such as `10.0.0.5 172.16.0.0/12`), a request that arrives from one of them takes its
  client's address from the header `client_address_header` (X-Forwarded-For by default): the
  right-most hop that is not itself a trusted proxy, since every proxy appends the peer it saw
  and only the hops our own proxies appended can be believed (RFC 7239's model; the same walk as
  werkzeug's ProxyFix with a known number of proxies). The scheme the page used comes from
  X-Forwarded-Proto the same way (the proxy ends TLS; the origin check compares schemes).
- Seat. The connection limits count seats: `seat_for(request)` names the key a connection counts
  against and that key's limit. The default (`address_seat`) is the client's address under
  `max_connections_per_address`. A deployment that groups clients otherwise (a classroom's room,
  whose students share one school address) installs its own function on the Runtime
  (`runtime.seat_for = ...`): a room member's connection then counts against its room's limit,
  while anonymous visitors keep the per-address one.
"""

import ipaddress
from dataclasses import dataclass

FORWARDED_PROTO = "X-Forwarded-Proto"


@dataclass(frozen=True)
class Seat:
    key: str            # what the connection counts against ("address:203.0.113.7", "room:abc" ...)
    limit: int          # connections that key may hold at once
    setting: str        # the limit's name, for the refusal ("max_connections_per_address")


def parse_networks(text: str) -> tuple:
    """`trusted_proxies` -> ip networks (a bare address is a network of one). Raises ValueError."""
    return tuple(ipaddress.ip_network(item, strict=False) for item in text.split())


def _trusted(address: str, networks: tuple) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return False
    return any(ip in net for net in networks)


def client_address(peer: str | None, headers, networks: tuple, header: str) -> str:
    """The client's address: the peer, or, when the peer is a trusted proxy, the right-most
    untrusted hop of `header` (the left-most hop if every hop is trusted)."""
    peer = peer or "?"
    if not networks or not _trusted(peer, networks):
        return peer
    hops = [h.strip() for h in ",".join(headers.getlist(header)).split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, networks):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return peer          # not an address: the proxy's word is unusable, count the proxy
    return hops[0] if hops else peer


def client_scheme(peer: str | None, headers, scheme: str, networks: tuple) -> str:
    """http or https as the page saw it: the request's own, or a trusted proxy's X-Forwarded-Proto."""
    if networks and _trusted(peer or "", networks):
        forwarded = headers.get(FORWARDED_PROTO, "").split(",")[-1].strip().lower()
        if forwarded in ("http", "https"):
            return forwarded
    return scheme


def address_seat(address: str, config) -> Seat:
    """The default seat: one of the client address's `max_connections_per_address`."""
    return Seat(f"address:{address}", config.max_connections_per_address, "max_connections_per_address")
