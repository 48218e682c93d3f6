"""Turns the scheduler's --workers value into the list of worker addresses to connect to.

The value is a comma-separated list. An item `dns:///NAME:PORT` stands for every address NAME
resolves to, so one name can stand for all replicas of a scaled service: Docker Compose gives
the service name `worker` one A record per replica (`docker compose up --scale worker=3`), as
a Kubernetes headless service does per pod. Any other item (host:port, unix:PATH, ...) is kept
as written; gRPC resolves it when it connects, to one server.

A replica is named by its own DNS name where it has one (Docker answers the reverse lookup of a
container's address with the container's name): a restarted container gets a new address, and
gRPC re-resolves a name when it reconnects, while an address would go stale.

    resolve_worker_addresses("dns:///worker:50061")
        -> ["proj-worker-1.proj_default:50061", "proj-worker-2.proj_default:50061"]
    resolve_worker_addresses("10.0.0.5:50061,unix:/w.sock") -> ["10.0.0.5:50061", "unix:/w.sock"]
"""
from __future__ import annotations

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DNS_SCHEME = "dns:"


class WorkerDiscoveryError(ValueError):
    """A --workers item is malformed or its name resolves to no address."""


def resolve_worker_addresses(spec: str) -> list[str]:
    """Expands every dns: item of `spec` into one address per server its name resolves to now
    (the server's own name where it has one, else its IP), ordered by IP so the list does not
    depend on the order the DNS server answers in, and returns them with the other items, in
    the order of `spec`, each address once."""
    addresses: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        for address in _resolve_dns_item(item) if item.startswith(DNS_SCHEME) else [item]:
            if address not in addresses:
                addresses.append(address)
    if not addresses:
        raise WorkerDiscoveryError(f"no worker address in {spec!r}")
    return addresses


def _resolve_dns_item(item: str) -> list[str]:
    # gRPC's form is dns:[//AUTHORITY/]HOST:PORT; AUTHORITY names a DNS server to ask, which
    # the system resolver cannot do, so only the empty authority (the system's) is accepted.
    target = item[len(DNS_SCHEME):]
    if target.startswith("//"):
        authority, _, target = target[2:].partition("/")
        if authority:
            raise WorkerDiscoveryError(f"{item!r}: a DNS server in the address is not supported; use dns:///HOST:PORT")
    host, port = _split_host_port(item, target)
    ips = _lookup(host, port)
    if _is_ip_literal(host):
        return [_join(str(ips[0]), port)]
    return [_join(_own_name(ip, port) or str(ip), port) for ip in ips]


def _lookup(host: str, port: int) -> list[IPAddress]:
    """The addresses `host` resolves to, sorted (IPv4 first) so the order does not depend on
    the order the DNS server answers in."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise WorkerDiscoveryError(f"cannot resolve {host!r}: {err.strerror}") from err
    return sorted({ipaddress.ip_address(info[4][0]) for info in infos}, key=lambda ip: (ip.version, ip))


def _own_name(ip: IPAddress, port: int) -> str | None:
    """The name the reverse lookup of `ip` gives, if that name resolves to `ip` alone (so it
    names this one replica, not a group)."""
    try:
        name = socket.gethostbyaddr(str(ip))[0]
        return name if _lookup(name, port) == [ip] else None
    except (OSError, WorkerDiscoveryError):
        return None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_host_port(item: str, target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WorkerDiscoveryError(f"{item!r}: expected dns:///HOST:PORT")
    return host, int(port)
