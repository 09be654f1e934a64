"""The API's docs pages (/docs, /redoc) come from packaged files: they name no http(s) address, and
every file they load is served by the app itself (FastAPI's own pages load from a CDN)."""
import json
import re

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("fastapi_offline")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from kvwire.serve import create_app  # noqa: E402
from kvwire.serve.api_docs import install_api_docs  # noqa: E402

from .serve_fixtures import tiny_chat_lm  # noqa: E402


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(tiny_chat_lm(), "tiny", max_length=64))


def loaded(html):
    """The addresses a page loads: src/href attributes, and the spec it is pointed at."""
    return (re.findall(r'(?:src|href)="([^"]*)"', html) + re.findall(r"url: '([^']*)'", html)
            + re.findall(r'spec-url="([^"]*)"', html))


def check_offline(client, path, spec_in):
    page = client.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?://", page.text), re.findall(r"https?://\S+", page.text)
    addresses = loaded(page.text)
    assert len(addresses) >= 3, addresses  # script, style or icon, the spec
    for address in addresses:
        assert address.startswith("/"), address
        response = client.get(address)
        assert response.status_code == 200 and len(response.content) > 0, address
    assert spec_in(page.text)
    return addresses


def test_swagger_ui_needs_no_network(client):
    addresses = check_offline(client, "/docs", lambda html: "url: '/openapi.json'" in html)
    assert "/docs-assets/swagger-ui-bundle.js" in addresses and "/docs-assets/swagger-ui.css" in addresses
    spec = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_redoc_needs_no_network(client):
    addresses = check_offline(client, "/redoc", lambda html: 'spec-url="/openapi.json"' in html)
    assert "/docs-assets/redoc.standalone.js" in addresses


def test_docs_pages_stay_out_of_the_schema(client):
    assert not {"/docs", "/redoc", "/docs/oauth2-redirect"} & set(client.get("/openapi.json").json()["paths"])


def test_install_api_docs_on_a_plain_app_and_behind_a_root_path():
    app = FastAPI(title="t", docs_url=None, redoc_url=None)
    install_api_docs(app)
    page = TestClient(app, root_path="/api").get("/docs").text
    assert "/api/docs-assets/swagger-ui-bundle.js" in page and "url: '/api/openapi.json'" in page
    assert TestClient(app).get("/docs/oauth2-redirect").status_code == 200


def test_install_api_docs_refuses_an_app_with_fastapis_own_pages():
    with pytest.raises(ValueError, match=r"docs_url='/docs', redoc_url='/redoc'\), which load from a CDN; "
                                         r"create it with docs_url=None, redoc_url=None"):
        install_api_docs(FastAPI())
    with pytest.raises(ValueError, match="no OpenAPI schema"):
        install_api_docs(FastAPI(docs_url=None, redoc_url=None, openapi_url=None))


def test_swagger_parameters_pass_through():
    app = FastAPI(docs_url=None, redoc_url=None, swagger_ui_parameters={"defaultModelsExpandDepth": -1})
    install_api_docs(app)
    assert json.dumps("defaultModelsExpandDepth") in TestClient(app).get("/docs").text
