"""`nanoserve serve [MODEL]` (and `python -m nanoserve.serving [MODEL]`): start the
OpenAI-compatible server.

Every engine option is a flag spelled as in vLLM (`max_num_seqs` -> `--max-num-seqs`, booleans also
as `--no-...`). The flags are generated from the fields of `Config` and of its chapters' records
(chapter_configs.py), each field's comment as its help, so an option is written down once. The
chapters a request asks for (logprobs, structured outputs, beam search) default on here, off in
LLM(...): SERVE_DEFAULTS.
"""
import argparse
import asyncio
import importlib.util
import inspect
import json
import logging
import os
import re
import types
import typing
from dataclasses import fields

import uvicorn

from nanoserve import AsyncLLM
from nanoserve.chapter_configs import SWITCHES
from nanoserve.config import CHAPTER_RECORDS, Config, core_option_fields, option_defaults
from nanoserve.serving.app import build_app
from nanoserve.serving.lora import LoRAModulePath, parse_lora_module
from nanoserve.serving.protocol import MAX_LOGPROBS
from nanoserve.serving.proxy import add_proxy_flags
from nanoserve.serving.proxy import run as run_proxy
from nanoserve.serving.structured import TOOL_CALL_PARSERS

logger = logging.getLogger("nanoserve.serving")


# The chapters a request asks for, off in LLM(...), on at the server, so that its OpenAI API serves
# logprobs, structured outputs and use_beam_search as vLLM's does. Structured outputs need xgrammar
# (an optional extra): on where it is installed.
SERVE_DEFAULTS = {"max_logprobs": MAX_LOGPROBS,
                  "enable_structured_outputs": importlib.util.find_spec("xgrammar") is not None,
                  "enable_beam_search": True}


def field_comments(cls) -> dict[str, str]:
    """`name: type = default  # comment` lines of a dataclass's source -> {name: comment}."""
    pattern = re.compile(r"^\s+(\w+):[^#]*#\s*(.+)$")
    return {m[1]: m[2] for m in map(pattern.match, inspect.getsource(cls).splitlines()) if m}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per option: the core's fields (Config), then each chapter record's, a group each."""
    core = parser.add_argument_group("engine options (LLM(model, **options), vLLM's names)")
    comments = field_comments(Config)
    for f in core_option_fields():
        add_flag(core, f.name, f.type, f.default, comments.get(f.name, ""))
    for name, (cls, switch) in CHAPTER_RECORDS.items():
        group = parser.add_argument_group(f"{cls.__name__} options (Config.{name}), vLLM's names")
        if switch in SWITCHES:
            add_flag(group, switch, bool, SERVE_DEFAULTS.get(switch, False), SWITCHES[switch])
        comments = field_comments(cls)
        for f in fields(cls):
            add_flag(group, f.name, f.type, SERVE_DEFAULTS.get(f.name, f.default),
                     comments.get(f.name, ""))


def add_flag(group, name: str, kind, default, comment: str) -> None:
    """`--the-name`, its value of the field's type, the field's comment as its help."""
    help_text = f"{comment} (default: {default})".lstrip().replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    if kind in (bool, bool | None):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                           help=help_text)
        return
    if isinstance(kind, types.UnionType):  # int, float, str, or `X | None`: the value's type is X
        kind = next(t for t in typing.get_args(kind) if t is not type(None))
    kind = json.loads if kind is dict else kind  # --speculative-config '{"method": "ngram", ...}'
    group.add_argument(flag, type=kind, default=default, help=help_text)


def engine_options(args: argparse.Namespace) -> dict:
    options = {name: getattr(args, name) for name in option_defaults()}
    options["step_records"] |= args.dashboard  # the dashboard streams the engine's step records
    return options


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a model folder or hub id (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients send as `model` (default: MODEL, or the demo "
                             "model's name)")
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="require `Authorization: Bearer KEY` on /v1 (default: "
                             "$NANOSERVE_API_KEY)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="on SIGTERM/Ctrl-C, seconds to let running requests finish before "
                             "aborting them")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='answer tool_choice "auto": the model decides, and --tool-call-parser '
                             'finds its calls')
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                        help="how the model writes a tool call (hermes: "
                             "<tool_call>{json}</tool_call>)")
    parser.add_argument("--dashboard", action="store_true",
                        help="serve a live view of the engine at /dashboard, for workshops "
                             "(docs/workshop.md)")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=[],
                        metavar="NAME=PATH",
                        help='LoRA adapters (PEFT folders) served as model NAME, with '
                        '--enable-lora; an item may also be JSON: {"name": NAME, "path": PATH} '
                        '(docs/lora.md)')
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): off by default, a client could load "
                        "any folder")
    add_engine_flags(parser)


def lora_module(text: str) -> LoRAModulePath:
    try:
        return parse_lora_module(text)
    except ValueError as e:  # (argparse prints an ArgumentTypeError's message, naming the flag)
        raise argparse.ArgumentTypeError(str(e)) from e


class Server(uvicorn.Server):
    """uvicorn, stopped by SIGINT/SIGTERM: it stops accepting connections and lets running requests
    finish; after `grace` seconds the app aborts those still running (their streams end with an
    error event). uvicorn would re-raise the signal once it is done; a server stopped on purpose has
    done its job, so it exits 0 instead."""

    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace, self.loop = grace, asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        self.loop.call_soon_threadsafe(self.config.app.state.stopping.set)
        self.loop.call_soon_threadsafe(self.loop.call_later, self.grace,
                                       self.config.app.state.shutting_down.set)


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or "SmolLM2-135M-Instruct"


def app_from_args(engine, args: argparse.Namespace):
    """The FastAPI app the flags ask for, on an AsyncLLM built from engine_options(args)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return build_app(engine, served_model_name(args), args.api_key,
                     args.tool_call_parser if args.enable_auto_tool_choice else None,
                     dashboard=args.dashboard, lora_modules=args.lora_modules,
                     allow_runtime_lora_updating=args.allow_runtime_lora_updating)


async def serve(args: argparse.Namespace) -> None:
    engine = AsyncLLM(args.model, **engine_options(args))
    try:
        name = served_model_name(args)
        app = app_from_args(engine, args)
        # uvicorn's own deadline is a backstop: by then the app has ended every stream itself
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5)
        logger.info("serving %s on http://%s:%d", name, args.host, args.port)
        if args.dashboard:
            logger.info("the dashboard: http://%s:%d/dashboard%s", args.host, args.port,
                        "?api_key=KEY" if args.api_key else "")
        await Server(config, grace=args.shutdown_timeout).serve()
    finally:
        engine.shutdown()  # stops the engine's busy loop


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except ValueError as e:  # a bad option or model: the engine names it
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    """The `nanoserve` console script: `nanoserve serve [MODEL] [flags]`,
    `nanoserve proxy --prefill A --decode B`."""
    parser = argparse.ArgumentParser(prog="nanoserve",
                                     description="nanoserve: a small, readable LLM engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                                       description=__doc__.split("\n\n")[0])
    add_serve_flags(serve_parser)
    proxy_parser = commands.add_parser(
        "proxy", help="put one address in front of a prefill and a decode instance",
        description="disaggregated prefill's proxy (nanoserve/serving/proxy.py)")
    add_proxy_flags(proxy_parser)
    args = parser.parse_args(argv)
    if args.command == "proxy":
        return run_proxy(args)
    run(args, serve_parser)


def serve_main(argv: list[str] | None = None) -> None:
    """`python -m nanoserve.serving [MODEL] [flags]`, the same as `nanoserve serve`."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.serving",
                                     description=__doc__.split("\n\n")[0])
    add_serve_flags(parser)
    run(parser.parse_args(argv), parser)
