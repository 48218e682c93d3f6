"""Turns the scheduler's --workers value into the list of worker addresses to connect to.

The value is a comma-separated list. An item `dns:///NAME:PORT` stands for every address NAME
resolves to, so one name can stand for all replicas of a scaled service: Docker Compose gives
the service name `worker` one A record per replica (`docker compose up --scale worker=3`), as
a Kubernetes headless service does per pod. Any other item (host:port, unix:PATH, ...) is kept
as written; gRPC resolves it when it connects, to one server.

    resolve_worker_addresses("dns:///worker:50061")        -> ["172.18.0.3:50061", "172.18.0.4:50061"]
    resolve_worker_addresses("10.0.0.5:50061,unix:/w.sock") -> ["10.0.0.5:50061", "unix:/w.sock"]
"""
from __future__ import annotations

import ipaddress
import socket

DNS_SCHEME = "dns:"


class WorkerDiscoveryError(ValueError):
    """A --workers item is malformed or its name resolves to no address."""


def resolve_worker_addresses(spec: str) -> list[str]:
    """Expands every dns: item of `spec` into the addresses its name has now, in a stable
    order (sorted, so each replica lands in the same place of the list whatever order the DNS
    server answers in), and returns them with the other items, in the order of `spec`."""
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
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise WorkerDiscoveryError(f"{item!r}: cannot resolve {host!r}: {err.strerror}") from err
    ips = sorted({ipaddress.ip_address(info[4][0]) for info in infos},
                 key=lambda ip: (ip.version, ip))
    return [f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}" for ip in ips]


def _split_host_port(item: str, target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WorkerDiscoveryError(f"{item!r}: expected dns:///HOST:PORT")
    return host, int(port)
