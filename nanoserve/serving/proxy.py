"""`nanoserve proxy --prefill URL --decode URL` (and `python -m nanoserve.serving.proxy`): one
OpenAI-compatible address in front of a disaggregated pair (docs/disaggregated.md), as vLLM's
disaggregated-prefill proxies.

Each completion or chat request goes through both instances. First the prefill instance (`kv_role`
kv_producer) computes the prompt: the same body with max_tokens=1, not streamed, and
kv_transfer_params {"do_remote_decode": true}; its answer holds kv_transfer_params for the decode
instance. Then the decode instance (kv_consumer) gets the client's own body with those params: it
pulls the prompt's KV blocks from the prefill instance and generates, and its answer, streamed or
not, is passed to the client as it comes. An error from either instance reaches the client as the
instance sent it (OpenAI's shape, its status); one the proxy meets itself is in the same shape: a
body that is not a JSON object is a 400, a route it does not serve a 404 naming those it does, an
instance it cannot reach a 502. /health says which instance is down; /metrics gives both instances'
series, each labelled with its kv_role.
"""
import argparse
import json
import logging
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.serving.errors import add_error_handlers
from nanoserve.serving.protocol import APIError

logger = logging.getLogger("nanoserve.proxy")
# Fields that must not reach the prefill instance: it computes the prompt and one token, once, not
# streamed.
PREFILL_DROPS = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of",
                 "use_beam_search")
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
          "GET /metrics")
HEALTH_TIMEOUT = 10.0  # seconds an instance's /health may take before it counts as down


def prefill_body(body: dict) -> dict:
    """The client's body as the prefill instance gets it."""
    body = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    return body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


async def json_object(raw: Request) -> dict:
    """The request's body, which must be a JSON object: else a 400 before an instance sees it."""
    try:
        body = json.loads(await raw.body())
    except ValueError as error:  # (malformed JSON, or bytes that are not UTF-8)
        raise APIError(400, f"body: malformed JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"body: must be a JSON object, got {type(body).__name__}")
    return body


def instance_url(flag: str, url: str) -> str:
    """An instance's base URL as --prefill/--decode give it, checked at start (one line if not)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        parsed = httpx.URL()
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SystemExit(f"nanoserve proxy: {flag} {url!r} is not an http:// or https:// URL with "
                         "a host (e.g. http://127.0.0.1:8100)")
    return url.rstrip("/")


def unreachable(which: str, url: str, error: Exception) -> JSONResponse:
    message = f"the {which} instance at {url} did not answer: {type(error).__name__}: {error}"
    return JSONResponse(APIError(502, message, type="server_error").body(), 502)


def labelled(texts: dict[str, str]) -> bytes:
    """Prometheus texts of the instances as one, each series with a kv_role label saying whose."""
    families: dict[str, Metric] = {}
    for kv_role, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type, family.unit))
            merged.samples += [s._replace(labels={**s.labels, "kv_role": kv_role})
                               for s in family.samples]
    return generate_latest(Parsed(list(families.values())))


@dataclass
class Parsed:
    """Metric families read from text, as generate_latest takes a registry (anything with
    collect())."""

    families: list[Metric]

    def collect(self) -> list[Metric]:
        return self.families


def build_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    """The proxy's app: /v1/completions and /v1/chat/completions through both instances,
    /v1/models from the decode instance, /health and /metrics from both."""
    app = FastAPI(title="nanoserve proxy",
                  summary="disaggregated prefill: a prefill and a decode instance")
    client = httpx.AsyncClient(timeout=timeout)
    app.router.on_shutdown.append(client.aclose)
    instances = {"kv_producer": ("prefill", prefill_url), "kv_consumer": ("decode", decode_url)}

    async def through_both(raw: Request, path: str) -> Response:
        body = await json_object(raw)
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            prefill = await client.post(f"{prefill_url}{path}", json=prefill_body(body),
                                        headers=headers)
        except httpx.HTTPError as error:
            return unreachable("prefill", prefill_url, error)
        if prefill.status_code != 200:
            # a bad request: the prefill instance said why, in OpenAI's shape
            return Response(prefill.content, prefill.status_code, media_type="application/json")
        body["kv_transfer_params"] = prefill.json().get("kv_transfer_params")
        request = client.build_request("POST", f"{decode_url}{path}", json=body, headers=headers)
        try:
            decode = await client.send(request, stream=True)
        except httpx.HTTPError as error:
            return unreachable("decode", decode_url, error)
        media_type = decode.headers.get("content-type", "application/json")
        if not body.get("stream") or decode.status_code != 200:
            content = await decode.aread()
            await decode.aclose()
            return Response(content, decode.status_code, media_type=media_type)

        async def relay():
            try:
                async for chunk in decode.aiter_raw():
                    yield chunk
            finally:
                await decode.aclose()

        return StreamingResponse(relay(), decode.status_code, media_type=media_type)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await through_both(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await through_both(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request):
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            answer = await client.get(f"{decode_url}/v1/models", headers=headers)
        except httpx.HTTPError as error:
            return unreachable("decode", decode_url, error)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        """200 when both instances answer theirs; a 503 naming the one that does not (or both)."""
        down = []
        for which, url in instances.values():
            try:
                (await client.get(f"{url}/health", timeout=HEALTH_TIMEOUT)).raise_for_status()
            except httpx.HTTPError as error:
                down.append(f"the {which} instance at {url} is down: "
                            f"{type(error).__name__}: {error}")
        if down:
            return JSONResponse(APIError(503, "; ".join(down), type="server_error").body(), 503)
        return {}

    @app.get("/metrics")
    async def metrics():
        """Both instances' series, each labelled kv_role="kv_producer" or "kv_consumer"."""
        texts = {}
        for kv_role, (which, url) in instances.items():
            try:
                answer = await client.get(f"{url}/metrics")
                answer.raise_for_status()
            except httpx.HTTPError as error:
                return unreachable(which, url, error)
            texts[kv_role] = answer.text
        return Response(labelled(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    add_error_handlers(app)

    @app.exception_handler(404)
    async def not_found(raw: Request, _):  # (/v1/responses, /tokenize: the decode instance's)
        message = f"{raw.url.path}: the proxy serves only {', '.join(ROUTES)}"
        return JSONResponse(APIError(404, message, code="404").body(), 404)

    return app


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, metavar="URL",
                        help="the prefill instance (kv_producer)")
    parser.add_argument("--decode", required=True, metavar="URL",
                        help="the decode instance (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_proxy(instance_url("--prefill", args.prefill),
                      instance_url("--decode", args.decode))
    logger.info("proxying http://%s:%d to prefill %s and decode %s", args.host, args.port,
                args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)


def main(argv: list[str] | None = None) -> None:
    """`python -m nanoserve.serving.proxy --prefill URL --decode URL`."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.serving.proxy",
                                     description=__doc__.split("\n\n")[0])
    add_proxy_flags(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
