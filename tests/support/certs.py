"""A throwaway CA and certificates for loopback TLS tests, made with the openssl CLI."""
from __future__ import annotations

import pathlib
import subprocess


def _run(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca_and_certs(out: pathlib.Path, names: tuple[str, ...] = ("server", "client")) -> pathlib.Path:
    """Writes ca.pem and NAME.pem/NAME.key for each name (SAN: localhost, 127.0.0.1)."""
    out.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
         "-keyout", "ca.key", "-out", "ca.pem", cwd=out)
    (out / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in names:
        _run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=out)
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=out)
    return out
