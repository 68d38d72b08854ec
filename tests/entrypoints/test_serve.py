"""`python -m jaxserve.launch.serve` as a subprocess on the tiny dummy model: it warms up, opens
the port, serves the openai client, and on SIGTERM lets a stream in flight finish, then exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from serving_testing import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_subprocess_and_sigterm_drain(tmp_path):
    port = free_port()
    cmd = [
        sys.executable, "-m", "jaxserve.launch.serve", "--model=tiny", "--load_format=dummy",
        "--dtype=float32", "--num_slots=8", "--max_model_len=64", "--page_size=32",
        "--prefill_chunk_size=16", "--slot_buckets=8", "--max_num_batched_tokens=16", f"--port={port}", "--served_model_name=tiny-served",
        "--api_key=k",
    ]  # fmt: skip
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert "warm-up took" in (tmp_path / "serve.log").read_text()  # before the port opened
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-served"]
        r = client.completions.create(model="tiny-served", prompt=[5, 6, 7], max_tokens=4)
        assert len(r.choices[0].token_ids) >= 1

        got = {}

        def stream():
            s = client.completions.create(
                model="tiny-served", prompt=[5, 6, 7], max_tokens=50, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            ids = []
            for c in s:
                ids += [t for ch in c.choices for t in ch.token_ids]
                started.set()
                time.sleep(0.01)  # a slow reader: the stream is surely in flight at SIGTERM
            got["ids"] = ids

        started = threading.Event()
        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert len(got["ids"]) == 50  # drained, not cut off
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_auto_tool_choice_needs_a_parser():
    """As vLLM's --enable-auto-tool-choice: without --tool_call_parser the server refuses to start
    (exit 2, before loading anything)."""
    r = subprocess.run(
        [sys.executable, "-m", "jaxserve.launch.serve", "--enable_auto_tool_choice"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--enable_auto_tool_choice needs --tool_call_parser" in r.stderr
