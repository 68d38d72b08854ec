"""The OpenAI-compatible server: `python -m jaxserve.launch.serve [engine flags] [server flags]`.

    python -m jaxserve.launch.serve --port 8000                      # SmolLM2-135M-Instruct
    python -m jaxserve.launch.serve --model=tiny --load_format=dummy --dtype=float32 --port 8000

Dataflow: the engine flags (one per EngineConfig field, shared with every launcher) -> LLM(...)
with warm-up (every step shape compiled) -> AsyncLLM (its engine thread) -> build_app ->
uvicorn on --host:--port, which opens the port only now. SIGTERM / SIGINT: uvicorn stops
accepting, waits for the requests in flight (streams included) to finish, then the engine thread
stops and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

from absl import app, flags

from jaxserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.launch import distributed
from jaxserve.launch import flags as engine_flags

FLAGS = flags.FLAGS
log = logging.getLogger("jaxserve.serve")

flags.adopt_module_key_flags(engine_flags)
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 exposes the server).")
flags.DEFINE_integer("port", 8000, "TCP port to listen on.", lower_bound=0)
flags.DEFINE_string(
    "served_model_name",
    None,
    "Model name clients send in 'model' (and /v1/models lists). Default: --model, else "
    "'HuggingFaceTB/SmolLM2-135M-Instruct'.",
)
flags.DEFINE_string(
    "api_key",
    None,
    "Require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and /version. "
    "Default: $JAXSERVE_API_KEY, else none.",
)
flags.DEFINE_integer(
    "max_queued_requests",
    1024,
    "Requests allowed to wait for a slot; beyond that a request gets 503 with Retry-After.",
    lower_bound=0,
)
flags.DEFINE_float(
    "request_timeout_s",
    None,
    "Seconds a request may take before it is aborted with 408 (a stream ends with an error "
    "event). Default: no limit.",
)
flags.DEFINE_string(
    "chat_template",
    None,
    "A Jinja chat template, or a file holding one, instead of the tokenizer's.",
)
flags.DEFINE_enum(
    "tool_call_parser",
    None,
    list(TOOL_CALL_PARSERS),
    "How tool calls are read out of the model's text for tool_choice='auto' (hermes: "
    "<tool_call>{json}</tool_call>, as Hermes, Qwen2.5 and Qwen3 write them; llama3_json: JSON "
    "objects with name and parameters, as Llama 3.1-3.3 write them; pythonic: a Python list of "
    "calls, as Llama 3.2 and 4 write them; mistral: [TOOL_CALLS] and JSON, as Mistral writes "
    "them).",
)
flags.DEFINE_bool(
    "enable_auto_tool_choice",
    False,
    "Allow tool_choice='auto' (the default when a request gives tools); needs --tool_call_parser.",
)
flags.DEFINE_bool(
    "trust_request_chat_template",
    False,
    "Let a chat request bring its own Jinja template (chat_template, or in chat_template_kwargs); "
    "otherwise such a request is a 400, as in vLLM.",
)
flags.DEFINE_bool(
    "allow_runtime_lora_updating",
    os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
    "Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints). Default: "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING.",
)
flags.DEFINE_float(
    "graceful_shutdown_s", 60.0, "On SIGTERM, how long to wait for requests in flight."
)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM once it has shut down, which would kill the
        process before the engine thread stops; main() installs its own handlers instead."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


DEFAULT_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def read_chat_template(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def engine_kwargs(fv: flags.FlagValues = FLAGS) -> dict:
    """`LLM(**engine_kwargs())`: the engine flags as every launcher takes them, and the server's
    one default of its own: warmup (every step shape compiled before the port opens, so no
    request waits for a compilation; --nowarmup skips it)."""
    return {"warmup": True, **engine_flags.llm_kwargs(fv)}


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print(f"serve: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        return 2
    try:
        kwargs = engine_kwargs()
        if distributed.wanted():
            raise ValueError(
                "serving over many processes is not supported (one HTTP front end would have to "
                "feed every process the same requests); run one server per host, each with "
                "--tensor_parallel_size / --data_parallel_size over its own devices"
            )
        if FLAGS.enable_auto_tool_choice and FLAGS.tool_call_parser is None:
            raise ValueError("--enable_auto_tool_choice needs --tool_call_parser")
        lora_modules = engine_flags.lora_modules()
        if FLAGS.allow_runtime_lora_updating and not kwargs.get("enable_lora"):
            raise ValueError("--allow_runtime_lora_updating needs --enable_lora")
    except ValueError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from jaxserve.entrypoints.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.server import build_app
    from jaxserve.llm import LLM

    llm = LLM(**kwargs)
    if llm.warmup_seconds is not None:
        log.info("warm-up took %.1f s", llm.warmup_seconds)
    async_llm = AsyncLLM.from_llm(llm)
    name = FLAGS.served_model_name or kwargs.get("model") or DEFAULT_NAME
    try:
        application = build_app(
            async_llm,
            name,
            api_key=FLAGS.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
            max_queued_requests=FLAGS.max_queued_requests,
            request_timeout_s=FLAGS.request_timeout_s,
            chat_template=read_chat_template(FLAGS.chat_template),
            tool_call_parser=FLAGS.tool_call_parser,
            enable_auto_tool_choice=FLAGS.enable_auto_tool_choice,
            trust_request_chat_template=FLAGS.trust_request_chat_template,
            lora_modules=lora_modules,
            allow_runtime_lora_updating=FLAGS.allow_runtime_lora_updating,
        )
    except ValueError as e:  # a --lora_modules adapter that cannot be served
        async_llm.shutdown()
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        application,
        host=FLAGS.host,
        port=FLAGS.port,
        log_level="info",
        timeout_graceful_shutdown=FLAGS.graceful_shutdown_s,
    )
    server = _server_class()(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    print(f"serve: {name} on http://{FLAGS.host}:{FLAGS.port}/v1", file=sys.stderr, flush=True)
    server.run()  # returns after SIGTERM/SIGINT once the requests in flight have finished
    async_llm.shutdown()
    log.info("served %s; engine stats %s", name, async_llm.stats())
    return 0


if __name__ == "__main__":
    app.run(main)
