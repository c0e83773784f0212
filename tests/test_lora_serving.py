"""LoRA adapters at the server (serving/lora.py): `nanoserve serve --enable-lora --lora-modules ...` parsed by the
CLI's own parser, the app served in-process; a request's "model" picks the adapter, and greedy answers equal the
offline LLM's with that adapter, adapter and base requests in one batch; /v1/models lists the adapters, an unknown
name is a 404, and the runtime load/unload routes exist only with --allow-runtime-lora-updating."""
import argparse
import asyncio
import json
import shutil

import httpx
import pytest
from fastapi.testclient import TestClient
from test_lora import make_adapter

from conftest import Listener, make_model
from nanoserve import LLM, AsyncLLM, LoRARequest, SamplingParams
from nanoserve.serving.app import build_app
from nanoserve.serving.cli import add_serve_flags, app_from_args, engine_options, main

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
POOL = ["--num-kvcache-blocks", "256", "--max-model-len", "256"]
ADAPTERS = {  # name -> (seed, LoraConfig options)
    "style": (1, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])),
    "terse": (2, dict(r=4, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj"], use_rslora=True)),
    "extra": (3, dict(r=2, lora_alpha=4, target_modules=["k_proj"])),
    "too_big": (4, dict(r=16, lora_alpha=16, target_modules=["q_proj"])),  # over --max-lora-rank 8
}
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def model(converted, tmp_path_factory) -> str:
    """A tiny random llama with the demo model's vocabulary and tokenizer: text and chat in, fast steps."""
    path = tmp_path_factory.mktemp("lora-serving") / "model"
    make_model(path, "llama", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(converted[1] / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-serving-adapters")
    return {name: make_adapter(model, root / name, seed, **opts) for name, (seed, opts) in ADAPTERS.items()}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def served(model, adapters):
    """(the engine, its app with --allow-runtime-lora-updating, the same engine's app without it): adapters given
    as name=path and as vLLM's JSON item."""
    args = parse([model, "--served-model-name", "base", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                  *POOL, "--lora-modules", f"style={adapters['style']}",
                  json.dumps({"name": "terse", "path": adapters["terse"]}), "--allow-runtime-lora-updating",
                  "--step-records"])
    engine = AsyncLLM(args.model, **engine_options(args))
    try:
        yield engine, app_from_args(engine, args), build_app(engine, "base")
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def llm(model) -> LLM:
    return LLM(model, enable_lora=True, max_loras=3, max_lora_rank=8, num_kvcache_blocks=256, max_model_len=256)


def offline(llm: LLM, adapters: dict[str, str], name: str | None, prompts=PROMPTS, chat: bool = False) -> list[str]:
    lora = None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1, adapters[name])
    outputs = llm.chat(prompts, GREEDY, use_tqdm=False, lora_request=lora) if chat else \
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].text for o in outputs]


def test_model_picks_the_adapter_in_one_batch(served, llm, adapters):
    """Completions for the base model and both adapters at once, then chat and the Responses API by name."""
    engine, app, _ = served
    recorder = engine.engine_core.step_recorder
    batches = []
    recorder.listeners.append(Listener(lambda rec: rec and batches.append({r.lora_name for r in rec.scheduled})))
    body = dict(prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)

    async def complete_all() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            names = ["base", "style", "terse"]
            answers = await asyncio.gather(*[client.post("/v1/completions", json={**body, "model": m}, timeout=120)
                                             for m in names])
            return dict(zip(names, answers))

    try:
        answers = asyncio.run(complete_all())
    finally:
        recorder.listeners.pop()
    texts = {}
    for name, answer in answers.items():
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name
        texts[name] = [c["text"] for c in sorted(answer.json()["choices"], key=lambda c: c["index"])]
        assert texts[name] == offline(llm, adapters, None if name == "base" else name), name
    assert texts["style"] != texts["base"] != texts["terse"]  # each adapter changes the answer
    assert {None, "style", "terse"} in batches  # the three were served in the same steps
    client = TestClient(app)
    chat = client.post("/v1/chat/completions", json=dict(model="style", messages=QUESTION, max_tokens=MAX_TOKENS,
                                                          temperature=0, ignore_eos=True))
    assert chat.json()["choices"][0]["message"]["content"] == offline(llm, adapters, "style", [QUESTION], True)[0]
    response = client.post("/v1/responses", json=dict(model="terse", input=QUESTION[0]["content"], temperature=0,
                                                      max_output_tokens=MAX_TOKENS))
    assert response.json()["model"] == "terse"
    text = response.json()["output"][0]["content"][0]["text"]
    assert text == offline(llm, adapters, "terse", [QUESTION], True)[0][:len(text)]  # (it stops at EOS)


def test_models_list_and_unknown_model(served):
    client = TestClient(served[1])
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("base", None), ("style", "base"), ("terse", "base")]
    answer = client.post("/v1/completions", json=dict(model="nope", prompt="Hi", max_tokens=2))
    assert answer.status_code == 404
    assert answer.json()["error"] == {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                      "param": "model", "code": "model_not_found"}
    assert client.post("/tokenize", json=dict(model="style", prompt="Hi")).status_code == 200


def test_runtime_load_and_unload_behind_the_flag(served, llm, adapters):
    _, app, app_without_flag = served
    without = TestClient(app_without_flag)
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert without.post(route, json=dict(lora_name="extra", lora_path=adapters["extra"])).status_code == 404
    client = TestClient(app)

    def load(name: str, path: str) -> httpx.Response:
        return client.post("/v1/load_lora_adapter", json=dict(lora_name=name, lora_path=path))

    def complete(name: str) -> httpx.Response:
        return client.post("/v1/completions", json=dict(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                        temperature=0, ignore_eos=True))

    for name, path, param, says in [("extra", adapters["extra"] + "-missing", "lora_path", "does not exist"),
                                    ("extra", adapters["too_big"], "lora_path", "exceeds max_lora_rank (8)"),
                                    ("style", adapters["extra"], "lora_name", "already served")]:
        error = load(name, path)
        assert error.status_code == 400 and error.json()["error"]["param"] == param and says in error.text
    assert complete("style").status_code == 200  # the server serves on
    answer = load("extra", adapters["extra"])
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'extra' added successfully."
    assert "extra" in [c["id"] for c in client.get("/v1/models").json()["data"]]
    assert complete("extra").json()["choices"][0]["text"] == offline(llm, adapters, "extra", PROMPTS[:1])[0]
    assert client.post("/v1/unload_lora_adapter", json=dict(lora_name="extra")).status_code == 200
    assert complete("extra").status_code == 404
    assert client.post("/v1/unload_lora_adapter", json=dict(lora_name="extra")).status_code == 404


def test_cli_refuses_bad_lora_flags(model, adapters, capsys):
    for argv, says in [(["--enable-lora", "--lora-modules", "style"], "must be name=path"),
                       (["--lora-modules", f"style={adapters['style']}"], "start it with --enable-lora")]:
        with pytest.raises(SystemExit) as exit_:
            main(["serve", model, *POOL, *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_workshop_script_trains_serves_and_draws(model, tmp_path, capsys):
    """nanoserve/tools/lora_picture.py (docs/workshop.md), on the tiny model and two training steps: it saves a PEFT
    adapter, serves base and adapter questions in one engine (the table marks the adapter's rows), draws the
    picture."""
    from nanoserve.tools.lora_picture import ASK, main

    main(["--model", model, "--adapter", str(tmp_path / "pirate"), "--train-steps", "2",
          "--out", str(tmp_path / "steps.png")])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "pirate").iterdir()}
    out = capsys.readouterr().out
    assert "training step 1: loss" in out and "Q1:" in out and "Q2:" in out
    assert any("Q1:1 Q2:1+pirate" in line for line in out.splitlines())  # base and adapter rows in one step
    assert [line.split(" ", 2)[1] for line in out.splitlines() if line.startswith("Q")][-len(ASK):] == \
        ["(base)", "(pirate)"] * (len(ASK) // 2)
    assert (tmp_path / "steps.png").stat().st_size > 10_000
