"""The API's documentation pages, /docs (Swagger UI) and /redoc, from assets installed with the
package `fastapi-offline`: FastAPI's own pages load their JavaScript and CSS from a CDN, so they
are blank on a machine without internet access."""
from importlib.resources import files

from fastapi import Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"


def install_api_docs(app, docs_url="/docs", redoc_url="/redoc"):
    """Serve Swagger UI at `docs_url` and ReDoc at `redoc_url` (None: not served) over
    `app.openapi_url`, with their files under /docs-assets/. ReDoc is left out when the installed
    package lacks its script.

    Args:
        app: a FastAPI app created with `docs_url=None, redoc_url=None` (its own pages would answer
            first, with CDN addresses).

    Example:
        >>> app = FastAPI(title="kvwire", docs_url=None, redoc_url=None)
        >>> install_api_docs(app)
    """
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError(f"the app serves FastAPI's own docs pages (docs_url={app.docs_url!r}, redoc_url="
                         f"{app.redoc_url!r}), which load from a CDN; create it with docs_url=None, redoc_url=None")
    if app.openapi_url is None:
        raise ValueError("the app has no OpenAPI schema (openapi_url=None): the docs pages would have nothing to show")
    try:
        assets = files("fastapi_offline") / "static"
    except ModuleNotFoundError:
        raise ImportError("the API docs pages need the package fastapi-offline (pip install fastapi-offline)") from None
    app.mount(ASSETS_URL, StaticFiles(directory=str(assets)), name="docs-assets")
    title, redirect = app.title, app.swagger_ui_oauth2_redirect_url

    def root(request):
        return request.scope.get("root_path", "")

    if docs_url is not None:
        @app.get(docs_url, include_in_schema=False)
        async def swagger(request: Request):
            base = root(request)
            return get_swagger_ui_html(openapi_url=base + app.openapi_url, title=f"{title} - Swagger UI",
                                       swagger_js_url=f"{base}{ASSETS_URL}/swagger-ui-bundle.js",
                                       swagger_css_url=f"{base}{ASSETS_URL}/swagger-ui.css",
                                       swagger_favicon_url=f"{base}{ASSETS_URL}/favicon.png",
                                       oauth2_redirect_url=redirect, swagger_ui_parameters=app.swagger_ui_parameters)

        if redirect is not None:
            @app.get(redirect, include_in_schema=False)
            async def swagger_redirect():
                return get_swagger_ui_oauth2_redirect_html()

    if redoc_url is not None and (assets / "redoc.standalone.js").is_file():
        @app.get(redoc_url, include_in_schema=False)
        async def redoc(request: Request):
            base = root(request)
            return get_redoc_html(openapi_url=base + app.openapi_url, title=f"{title} - ReDoc",
                                  redoc_js_url=f"{base}{ASSETS_URL}/redoc.standalone.js",
                                  redoc_favicon_url=f"{base}{ASSETS_URL}/favicon.png", with_google_fonts=False)
