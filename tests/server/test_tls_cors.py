"""vLLM's TLS and CORS flags on a real server: HTTPS with a certificate from a test CA (trustme) through
the official `openai` client, plain HTTP refused on that port; CORS preflights answered for the
allowed origin before the API key check, refused for others; the default (every origin) elsewhere."""
from __future__ import annotations

import ssl
import urllib.error

import openai
import pytest
import trustme

from tests.server.server_process import ServerProcess, request
from tests.tiny_models import make_tiny_checkpoint

KEY = "tls-key"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_path, cert_path, ca_path = tmp / "key.pem", tmp / "cert.pem", tmp / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    ca.cert_pem.write_to_path(str(ca_path))
    context = ssl.create_default_context(cafile=str(ca_path))
    ckpt = make_tiny_checkpoint(str(tmp / "ckpt"), "llama")
    srv = ServerProcess([ckpt, "--kv-cache-memory", "16MiB", "--served-model-name", "tiny", "--api-key", KEY,
                         "--ssl-keyfile", str(key_path), "--ssl-certfile", str(cert_path),
                         "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]'],
                        str(tmp / "server.log"), tls=context)
    yield srv, str(ca_path)
    srv.stop()


def test_https_with_the_openai_client(tls_server):
    srv, _ = tls_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                           http_client=openai.DefaultHttpxClient(verify=srv.tls))
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    with pytest.raises(urllib.error.URLError):   # the client does not trust a certificate it cannot check
        request("GET", srv.url + "/health", timeout=10, context=ssl.create_default_context())
    plain = srv.url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        request("GET", plain + "/health", timeout=10)


def _preflight(srv, origin: str):
    return request("OPTIONS", srv.url + "/v1/chat/completions", timeout=10, context=srv.tls,
                   headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                            "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_preflight_for_the_allowed_origin_only(tls_server):
    srv, _ = tls_server
    status, _, headers = _preflight(srv, ORIGIN)   # no API key on a preflight: answered before auth
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    status, _, headers = _preflight(srv, "https://evil.example")
    assert status == 400 and "access-control-allow-origin" not in {k.lower() for k in headers}
    status, _, headers = request("GET", srv.url + "/v1/models", timeout=10, context=srv.tls,
                                 headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
