"""`nanoserve proxy --prefill URL --decode URL` (and `python -m nanoserve.serving.proxy`): one OpenAI-compatible
address in front of a disaggregated pair (docs/disaggregated.md), as vLLM's disaggregated-prefill proxies.

Each completion or chat request goes through both instances. First the prefill instance (`kv_role` kv_producer)
computes the prompt: the same body with max_tokens=1, not streamed, and kv_transfer_params {"do_remote_decode":
true}; its answer holds kv_transfer_params for the decode instance. Then the decode instance (kv_consumer) gets the
client's own body with those params: it pulls the prompt's KV blocks from the prefill instance and generates, and its
answer, streamed or not, is passed to the client as it comes. An error from either instance reaches the client as
the instance sent it (OpenAI's shape, its status); one the proxy meets itself (an instance it cannot reach) is a 502.
"""
import argparse
import logging

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.serving.protocol import APIError

logger = logging.getLogger("nanoserve.proxy")
# Fields that must not reach the prefill instance: it computes the prompt and one token, once, not streamed.
PREFILL_DROPS = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of", "use_beam_search")


def prefill_body(body: dict) -> dict:
    """The client's body as the prefill instance gets it."""
    body = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    return body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


def unreachable(which: str, url: str, error: Exception) -> JSONResponse:
    message = f"the {which} instance at {url} did not answer: {type(error).__name__}: {error}"
    return JSONResponse(APIError(502, message, type="server_error").body(), 502)


def build_proxy(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    """The proxy's app: /v1/completions and /v1/chat/completions through both instances, /v1/models and /health
    from the decode instance."""
    app = FastAPI(title="nanoserve proxy", summary="disaggregated prefill: a prefill and a decode instance")
    client = httpx.AsyncClient(timeout=timeout)
    app.router.on_shutdown.append(client.aclose)

    async def through_both(raw: Request, path: str) -> Response:
        body = await raw.json()
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        try:
            prefill = await client.post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as error:
            return unreachable("prefill", prefill_url, error)
        if prefill.status_code != 200:  # a bad request: the prefill instance said why, in OpenAI's shape
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
        """Healthy when both instances are."""
        for which, url in (("prefill", prefill_url), ("decode", decode_url)):
            try:
                (await client.get(f"{url}/health")).raise_for_status()
            except httpx.HTTPError as error:
                return unreachable(which, url, error)
        return {}

    return app


def add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", required=True, metavar="URL", help="the prefill instance (kv_producer)")
    parser.add_argument("--decode", required=True, metavar="URL", help="the decode instance (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    logger.info("proxying http://%s:%d to prefill %s and decode %s", args.host, args.port, args.prefill, args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)


def main(argv: list[str] | None = None) -> None:
    """`python -m nanoserve.serving.proxy --prefill URL --decode URL`."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.serving.proxy", description=__doc__.split("\n\n")[0])
    add_proxy_flags(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
