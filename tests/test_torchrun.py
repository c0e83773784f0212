"""More than one machine, played on this one: two torchrun launches (--nnodes 2, node ranks 0 and 1, against
127.0.0.1), each one process, make a 2-stage engine; rank 0 serves, rank 1 works until rank 0 ends."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port, hf_greedy, random_prompts

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """import json, sys
from nanoserve import LLM, SamplingParams
llm = LLM(sys.argv[1], pipeline_parallel_size=2, num_kvcache_blocks=64)  # (on rank 1: a worker, never returns)
outputs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outputs]), flush=True)
"""


def launch_nodes(args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """`torchrun --nnodes 2 --node-rank R ... ARGS` for R = 0, 1, each in a session of its own, output in a log."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nodes = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *args]
        with open(tmp_path / f"node{rank}.log", "w") as log:
            nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return nodes


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def wait_all(nodes: list[subprocess.Popen], timeout: float) -> list[int]:
    """The nodes' exit codes, once every one has exited (killing them all past the timeout, and failing)."""
    deadline = time.monotonic() + timeout
    try:
        return [node.wait(timeout=max(0.1, deadline - time.monotonic())) for node in nodes]
    except subprocess.TimeoutExpired:
        kill_all(nodes)
        raise


def kill_all(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        for pid in [*children(node.pid), node.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait()


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # (an exited child is reaped by its parent a moment later; a busy machine's later)
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def start_server_nodes(model: str, tmp_path: Path) -> tuple[str, list[subprocess.Popen], list[int]]:
    """Two nodes serving `model` in 2 stages; returns rank 0's URL, the torchrun processes and their workers."""
    port = free_port()
    nodes = launch_nodes(["-m", "nanoserve.serving", model, "--pipeline-parallel-size", "2", "--port", str(port),
                          "--num-kvcache-blocks", "64"], tmp_path)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if any(node.poll() is not None for node in nodes) or time.monotonic() > deadline:
            kill_all(nodes)
            pytest.fail("the nodes did not start:\n" + "\n".join(
                (tmp_path / f"node{r}.log").read_text() for r in (0, 1)))
        time.sleep(0.5)
    workers = [pid for node in nodes for pid in children(node.pid)]
    assert len(workers) == 2  # one rank per node
    return url, nodes, workers


def test_llm_under_torchrun_on_two_nodes_equals_transformers(tiny_models, tmp_path):
    prompts = random_prompts(4, seed=5)
    (tmp_path / "generate.py").write_text(SCRIPT)
    nodes = launch_nodes([str(tmp_path / "generate.py"), tiny_models["qwen3"], json.dumps(prompts)], tmp_path)
    assert wait_all(nodes, timeout=240) == [0, 0], (tmp_path / "node0.log").read_text()
    line = next(x for x in (tmp_path / "node0.log").read_text().splitlines() if x.startswith("TOKENS"))
    assert json.loads(line.removeprefix("TOKENS ")) == hf_greedy(tiny_models["qwen3"], prompts, 16)
    assert "TOKENS" not in (tmp_path / "node1.log").read_text()  # rank 1 was a worker only


def test_two_nodes_serve_a_request_and_sigterm_ends_both(tiny_models, tmp_path):
    url, nodes, workers = start_server_nodes(tiny_models["qwen3"], tmp_path)
    try:
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        os.kill(workers[0], signal.SIGTERM)  # the server stops (as on Ctrl-C), says goodbye to rank 1, which ends
        assert wait_all(nodes, timeout=30) == [0, 0]  # and so do both torchruns, each with its node's rank done
    finally:
        kill_all(nodes)
    assert_gone(workers)
    assert "nanoserve worker rank 1" not in (tmp_path / "node1.log").read_text()  # (its error message)


@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_node_ends_the_other_with_an_error_within_seconds(tiny_models, tmp_path, victim):
    url, nodes, workers = start_server_nodes(tiny_models["qwen3"], tmp_path)
    try:
        os.kill(workers[victim], signal.SIGKILL)  # the node's rank dies; its torchrun then fails too
        # Without the watch (torchrun.watch_workers) an idle server would wait forever: a generous bound tells the
        # two apart on a loaded machine too (a few seconds when idle); the logs below show which path ended them.
        codes = wait_all(nodes, timeout=90)
    finally:
        kill_all(nodes)
    assert all(code != 0 for code in codes)
    survivor = (tmp_path / f"node{1 - victim}.log").read_text()
    assert ("worker rank 1 has exited (its node died?)" if victim == 1 else "nanoserve worker rank 1:") in survivor
    assert_gone(workers)
