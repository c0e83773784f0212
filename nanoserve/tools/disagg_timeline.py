"""One request's timeline across a disaggregated pair (docs/images/disagg_timeline.png).

    python -m nanoserve.tools.disagg_timeline [--prompt-len 256] [--chunk 64] [--max-tokens 16]
        [--out PATH]

A producer and a consumer engine of the demo model, in this process (each with its connector's
thread), serve one request the way the proxy does: the producer computes the prompt in chunks of
--chunk tokens (chunked prefill) and keeps its KV blocks; the consumer pulls them over their
torch.distributed group, writes them into its own blocks, computes the prompt's last token and
decodes. Each engine step is timed and drawn on its engine's lane.
"""
import argparse
import random
import socket
from time import perf_counter

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nanoserve import LLM, KVTransferConfig, SamplingParams

COLOURS = {"prefill chunk": "#4c72b0", "transfer (pull)": "#dd8452",
           "last prompt token + loaded KV": "#c44e52", "decode": "#55a868"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeline(prompt_len: int = 256, chunk: int = 64, max_tokens: int = 16,
             seed: int = 0) -> list[tuple[str, str, float, float]]:
    """(lane, what, start, end) in seconds from the request's arrival, for every step and the
    transfer."""
    port = free_port()
    pair = {role: KVTransferConfig(kv_connector="P2pConnector", kv_role=role, kv_port=port)
            for role in ("kv_producer", "kv_consumer")}
    producer = LLM(enable_chunked_prefill=True, max_num_batched_tokens=chunk,
                   kv_transfer_config=pair["kv_producer"])
    consumer = LLM(kv_transfer_config=pair["kv_consumer"])
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 40000) for _ in range(prompt_len)]
    events = []
    start = perf_counter()

    def run(llm: LLM, lane: str, kinds: list[str]) -> None:
        for kind in kinds:
            begin = perf_counter()
            llm.engine.step()
            events.append((lane, kind, begin - start, perf_counter() - start))
            if not llm.engine.has_unfinished_requests():
                return

    prefill_params = SamplingParams(temperature=0, max_tokens=1,
                                    kv_transfer_params={"do_remote_decode": True})
    producer.engine.add_request("0", prompt, prefill_params)
    run(producer, "prefill instance", ["prefill chunk"] * -(-prompt_len // chunk))
    begin = perf_counter()
    decode_params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                   kv_transfer_params={"do_remote_prefill": True})
    consumer.engine.add_request("0", prompt, decode_params)
    # (the queue's admits seam waits so)
    consumer.engine.seams.features["kv_transfer"].pulls["0"].future.result()
    events.append(("decode instance", "transfer (pull)", begin - start, perf_counter() - start))
    run(consumer, "decode instance",
        ["last prompt token + loaded KV"] + ["decode"] * (max_tokens - 1))
    stats = consumer.engine.seams.features["kv_transfer"].stats
    print(f"{stats.num_received_blocks} blocks received, {stats.num_received_tokens} "
          f"of {prompt_len} prompt tokens not computed on the decode instance")
    return events


def draw(events: list[tuple[str, str, float, float]], out: str, prompt_len: int,
         chunk: int) -> None:
    fig = Figure(figsize=(11, 3.2))
    ax = fig.subplots()
    lanes = ["decode instance", "prefill instance"]
    for lane, kind, begin, end in events:
        ax.barh(lanes.index(lane), (end - begin) * 1000, left=begin * 1000, height=0.5,
                color=COLOURS[kind], edgecolor="white", linewidth=0.6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms since the request arrived")
    transfer = next(e for e in events if e[1] == "transfer (pull)")
    ax.set_title(f"One request, a {prompt_len}-token prompt: prefilled in chunks of {chunk} tokens "
                 "on one engine, its KV pulled by the other "
                 f"({(transfer[3] - transfer[2]) * 1000:.0f} ms), which decodes",
                 fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.3), ncol=4, frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="docs/images/disagg_timeline.png")
    args = parser.parse_args()
    events = timeline(args.prompt_len, args.chunk, args.max_tokens)
    for lane, kind, begin, end in events:
        print(f"{lane:17} {kind:30} {begin * 1000:8.1f} -> {end * 1000:8.1f} ms")
    draw(events, args.out, args.prompt_len, args.chunk)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
