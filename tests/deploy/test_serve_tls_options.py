"""The HTTP options ``flotilla serve`` starts Serve's proxy with: TLS from ``--ssl-certfile``,
``--ssl-keyfile`` and ``--ssl-keyfile-password`` (an encrypted key), checked by Serve's own
``HTTPOptions`` and by the TLS context uvicorn builds from them (``ssl.SSLContext.load_cert_chain``)."""

import ssl
import subprocess
from types import SimpleNamespace

import pytest
from ray.serve.config import HTTPOptions

from flotilla.deploy.serve_cmd import http_options, serves_tls


@pytest.fixture(scope="module")
def encrypted_key(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls-encrypted")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", "/CN=127.0.0.1", "-passout", "pass:hunter2"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def config(**tls):
    fields = dict(host="127.0.0.1", port=8443, ssl_certfile=None, ssl_keyfile=None, ssl_keyfile_password=None)
    return SimpleNamespace(**{**fields, **tls})


def test_plain_http_without_the_tls_flags():
    assert not serves_tls(config())
    assert http_options(config()) == {"host": "127.0.0.1", "port": 8443}


def test_an_encrypted_key_reaches_serve_with_its_password(encrypted_key):
    cert, key = encrypted_key
    options = http_options(config(ssl_certfile=str(cert), ssl_keyfile=str(key), ssl_keyfile_password="hunter2"))
    assert options == {"host": "127.0.0.1", "port": 8443, "ssl_certfile": str(cert), "ssl_keyfile": str(key),
                       "ssl_keyfile_password": "hunter2"}  # fmt: skip
    parsed = HTTPOptions(**options)
    assert (parsed.ssl_certfile, parsed.ssl_keyfile, parsed.ssl_keyfile_password) == (str(cert), str(key), "hunter2")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(parsed.ssl_certfile, parsed.ssl_keyfile, parsed.ssl_keyfile_password)
    with pytest.raises(ssl.SSLError):
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key), "wrong")
