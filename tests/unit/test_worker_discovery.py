import ipaddress
import random
import socket

import pytest

from common.worker_discovery import WorkerDiscoveryError, resolve_worker_addresses


@pytest.fixture
def dns(monkeypatch):
    """A stand-in DNS: tests fill `forward` (name -> IPs) and `reverse` (IP -> name). Forward
    answers come shuffled, as from a round-robin server; unknown names and addresses fail as
    the real resolver's calls do."""
    forward: dict[str, list[str]] = {}
    reverse: dict[str, str] = {}

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        try:
            ips = [str(ipaddress.ip_address(host))]
        except ValueError:
            if host not in forward:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
            ips = random.sample(forward[host], len(forward[host]))
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) if ipaddress.ip_address(ip).version == 4
                else (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)) for ip in ips]

    def gethostbyaddr(ip):
        if ip not in reverse:
            raise socket.herror(1, "Unknown host")
        return reverse[ip], [], [ip]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyaddr", gethostbyaddr)
    return forward, reverse


def random_replicas(count: int) -> list[str]:
    return [f"172.18.0.{i}" for i in random.sample(range(2, 250), count)]


def test_replicas_are_named_by_their_own_names_in_address_order(dns):
    forward, reverse = dns
    replicas = random_replicas(5)
    forward["worker"] = replicas
    for n, ip in enumerate(replicas):
        reverse[ip] = f"proj-worker-{n}.proj_default"
        forward[reverse[ip]] = [ip]
    expected = [f"{reverse[ip]}:50061" for ip in sorted(replicas, key=ipaddress.ip_address)]
    for _ in range(5):
        assert resolve_worker_addresses("dns:///worker:50061") == expected


def test_replicas_without_a_name_of_their_own_are_named_by_address(dns):
    forward, reverse = dns
    a, b, c, d = sorted(random_replicas(4), key=ipaddress.ip_address)
    forward["worker"] = [a, b, c, d]
    reverse[b] = "worker"                    # the group's name, not b's own
    reverse[c] = "stale-name"                # now points at another address
    forward["stale-name"] = ["172.19.0.1"]
    reverse[d] = "unresolvable-name"         # names nothing; and a has no reverse record
    assert resolve_worker_addresses("dns:///worker:7") == [f"{ip}:7" for ip in (a, b, c, d)]


def test_plain_items_are_kept_as_written_in_order(dns):
    forward, _ = dns
    forward["worker"] = ["10.1.0.9", "10.1.0.10"]
    spec = "b-host:7001, unix:/run/w.sock ,dns:///worker:7002,,a-host:7003"
    assert resolve_worker_addresses(spec) == [
        "b-host:7001", "unix:/run/w.sock", "10.1.0.9:7002", "10.1.0.10:7002", "a-host:7003"]


def test_ipv6_answers_are_bracketed_and_follow_ipv4(dns):
    forward, _ = dns
    forward["w"] = ["fd00::2", "10.0.0.2", "fd00::1"]
    assert resolve_worker_addresses("dns:///w:9") == ["10.0.0.2:9", "[fd00::1]:9", "[fd00::2]:9"]


def test_an_address_named_twice_is_listed_once(dns):
    forward, _ = dns
    forward["w"] = forward["alias"] = ["10.0.0.2"]
    assert resolve_worker_addresses("dns:///w:9,dns:///alias:9,10.0.0.2:9") == ["10.0.0.2:9"]


def test_real_resolution_of_loopback_addresses():
    port = random.randrange(1024, 65536)
    assert resolve_worker_addresses(f"dns:///127.0.0.1:{port}") == [f"127.0.0.1:{port}"]
    assert resolve_worker_addresses(f"dns:///[::1]:{port}") == [f"[::1]:{port}"]
    for address in resolve_worker_addresses(f"dns:///localhost:{port}"):
        host, _, got_port = address.rpartition(":")
        assert int(got_port) == port
        assert {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), port)} <= {"127.0.0.1", "::1"}


@pytest.mark.parametrize("spec", [
    "", " , ", "dns:///worker", "dns:///worker:", "dns:///:50061", "dns:///worker:http",
    "dns:///worker:0", "dns:///worker:70000", "dns://8.8.8.8/worker:50061", "dns:///unknown-name:1",
])
def test_malformed_or_unresolvable_specs_are_refused(dns, spec):
    dns[0]["worker"] = ["10.0.0.2"]
    with pytest.raises(WorkerDiscoveryError):
        resolve_worker_addresses(spec)
