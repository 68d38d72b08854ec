"""Helpers of the server tests: uvicorn serving an app in a background thread on a free loopback
port (quicker than a subprocess; test_serve.py runs that), an engine over the fake runner, and a
wait for the engine to be idle."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import uvicorn

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.engine import LLMEngine
from jaxserve.testing.fake_runner import FakeRunner

TINY_KW = dict(
    load_format="dummy",
    dtype="float32",
    num_slots=32,
    max_model_len=64,
    page_size=32,  # two pages per sequence: few compilations
    prefill_chunk_size=16,
    max_num_batched_tokens=32,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; `url` is its /v1 base."""

    def __init__(self, app):
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def fake_engine(num_slots=2, num_pages=64, page_size=4, max_model_len=64, runner_cls=FakeRunner):
    """An LLMEngine over the numpy fake runner (vocab 64, eos 1): no jax, microsecond steps."""
    mc = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=64, eos_token_ids=(1,))
    ec = EngineConfig(
        num_slots=num_slots,
        max_model_len=max_model_len,
        page_size=page_size,
        num_pages=num_pages,
        dtype="float32",
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
    )
    runner = runner_cls(num_slots, num_pages, page_size, 1, chunk=8)
    return LLMEngine(runner, mc, ec, num_pages)


def wait_idle(engine, timeout: float = 10.0) -> None:
    """Waits until the engine holds no request, slot or page (aborts land at the next step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.scheduler
        if not s.running and not s.waiting and s.allocator.num_used_pages == 0:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine not idle: {len(engine.scheduler.running)} running, "
        f"{len(engine.scheduler.waiting)} waiting, "
        f"{engine.scheduler.allocator.num_used_pages} pages used"
    )


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 128, rng.integers(lo, hi)).tolist() for _ in range(n)]


PROMPTS = prompts(64)
MAX_TOKENS = 8
