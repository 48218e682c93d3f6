import ipaddress
import random
import socket

import pytest

from common.worker_discovery import WorkerDiscoveryError, resolve_worker_addresses


def fake_resolver(records: dict[str, list[str]]):
    """A stand-in for socket.getaddrinfo that answers from `records`, shuffled each call as a
    round-robin DNS server does, and fails like the real one for unknown names."""
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host not in records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        answers = []
        for ip in random.sample(records[host], len(records[host])):
            if ipaddress.ip_address(ip).version == 4:
                answers.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)))
            else:
                answers.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)))
        return answers
    return getaddrinfo


def test_dns_item_expands_to_every_replica_in_a_stable_order(monkeypatch):
    replicas = [f"172.18.0.{i}" for i in random.sample(range(2, 250), 5)]
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver({"worker": replicas}))
    expected = [f"{ip}:50061" for ip in sorted(replicas, key=ipaddress.ip_address)]
    for _ in range(5):
        assert resolve_worker_addresses("dns:///worker:50061") == expected


def test_plain_items_are_kept_as_written_in_order(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver({"worker": ["10.1.0.9", "10.1.0.10"]}))
    spec = "b-host:7001, unix:/run/w.sock ,dns:///worker:7002,,a-host:7003"
    assert resolve_worker_addresses(spec) == [
        "b-host:7001", "unix:/run/w.sock", "10.1.0.9:7002", "10.1.0.10:7002", "a-host:7003"]


def test_ipv6_answers_are_bracketed_and_follow_ipv4(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver({"w": ["fd00::2", "10.0.0.2", "fd00::1"]}))
    assert resolve_worker_addresses("dns:///w:9") == ["10.0.0.2:9", "[fd00::1]:9", "[fd00::2]:9"]


def test_an_address_named_twice_is_listed_once(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver({"w": ["10.0.0.2"], "alias": ["10.0.0.2"]}))
    assert resolve_worker_addresses("dns:///w:9,dns:///alias:9") == ["10.0.0.2:9"]


def test_real_resolution_of_loopback_names():
    port = random.randrange(1024, 65536)
    assert resolve_worker_addresses(f"dns:///127.0.0.1:{port}") == [f"127.0.0.1:{port}"]
    assert resolve_worker_addresses(f"dns:///[::1]:{port}") == [f"[::1]:{port}"]
    assert f"127.0.0.1:{port}" in resolve_worker_addresses(f"dns:///localhost:{port}")


@pytest.mark.parametrize("spec", [
    "", " , ", "dns:///worker", "dns:///worker:", "dns:///:50061", "dns:///worker:http",
    "dns:///worker:0", "dns:///worker:70000", "dns://8.8.8.8/worker:50061", "dns:///unknown-name:1",
])
def test_malformed_or_unresolvable_specs_are_refused(monkeypatch, spec):
    monkeypatch.setattr(socket, "getaddrinfo", fake_resolver({"worker": ["10.0.0.2"]}))
    with pytest.raises(WorkerDiscoveryError):
        resolve_worker_addresses(spec)
