"""`LLM`: the notebook-facing entry point (vLLM's offline `LLM` API on the jaxserve engine).

    llm = LLM("smollm2-135m", dtype="bfloat16", num_slots=32, max_model_len=2048)
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
    for out in llm.stream("Once upon a time"): ...          # incremental snapshots
    for i, out in llm.iter_generate(prompts, params): ...   # (input index, output) as each finishes

The constructor's keyword arguments are exactly `EngineConfig`'s fields, whose defaults and help
text live there once (`help(EngineConfig)`; the launch flags show the same text): it builds
`EngineConfig(model=model, **settings)`, loads the model, then fills the model-dependent defaults
with `config.for_model(model_config)` (max_model_len, the prefill chunk, the step's token budget).
vLLM's spellings are accepted too (`vllm_settings`): max_num_seqs (= num_slots), block_size
(= page_size), dtype "auto" / "float16" / "half" / "float" (jaxserve computes in bfloat16 or
float32: "auto" and the float16 names give bfloat16, as vLLM's auto rule on a platform without
float16), gpu_memory_utilization (the KV cache gets that fraction of device memory less the
params and slot state; ignored on the CPU, as vLLM-CPU does), speculative_config (vLLM's dict,
method "ngram" only: `jaxserve.config.speculative`), tokenizer (a path or Hub id), hf_token (for
Hub ids; else HF_TOKEN or the saved login) and generation_config
("auto": the model directory's generation_config.json sampling defaults apply when
sampling_params is None, and its eos ids stop generation; "vllm": ignored).
Prefix caching (on by default, as in vLLM v1; `enable_prefix_caching=False` turns it off) reuses
the K/V pages of token prefixes a prefill already computed (a shared system prompt, the n samples
of one prompt, a chat's earlier prompts) instead of recomputing them; a hit never changes an
output (core/prefix_cache.py).

A prompt is a str, {"prompt_token_ids": [...]} (works without a tokenizer) or {"prompt": str}.
`sampling_params` is one SamplingParams (or dict) for all prompts or a list with one per prompt.
Where jaxserve deliberately differs from vLLM: a bad prompt or bad per-prompt parameters give
that prompt an output with `error` set (finish_reason "error") while the rest complete, so a
batch never dies of one prompt; vLLM raises instead. `LLM(..., on_bad_request="raise")` raises as
vLLM does: ValueError("prompt i: ...") before anything runs. An unknown constructor argument raises TypeError naming it, a bad value ValueError
naming the field (before the model loads, except a max_model_len beyond the model's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine_args import build_engine
from jaxserve.inputs.chat import render_chat
from jaxserve.inputs.prompts import PromptError, parse_prompt, prompt_list
from jaxserve.lora import LoRARequest

logger = logging.getLogger(__name__)


class LLM:
    """The offline engine: `LLM(model, **settings)`, the settings being `EngineConfig`'s fields.

    Attributes: `engine_config` (filled: `EngineConfig.for_model`), `model_config`, `tokenizer`
    (None for dummy weights), `source` (what was loaded), `num_pages` (the KV pool), `engine`
    (the `LLMEngine`) and `warmup_seconds` (None unless built with warmup=True).
    """

    def __init__(self, model: str | ModelConfig | None = None, *, mesh=None, **settings):
        """mesh: a `jax.sharding.Mesh` with axes ('data', 'model') to run on, for users who
        already hold one; it sets data_parallel_size and tensor_parallel_size (jaxserve.parallel)."""
        built = build_engine(model, mesh=mesh, **settings)
        self.engine = built.engine
        self.engine_config = built.engine_config
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer
        self.source = built.source
        self.num_pages = built.num_pages
        self.default_sampling_params = built.default_sampling_params
        self.warmup_seconds = built.warmup_seconds
        self._outbox: dict[str, list[RequestOutput]] = {}
        logger.info(
            "LLM ready: %s, %d slots, %d KV pages of %d tokens",
            self.source,
            self.engine_config.num_slots,
            self.num_pages,
            self.engine_config.page_size,
        )

    # -- public API -------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `sampling_params=None` means: the model's generation_config.json sampling
        defaults with generation_config="auto" (vLLM's default), else SamplingParams()."""
        return self.default_sampling_params or SamplingParams()

    def warmup(self) -> float:
        """Compiles every step variant now (otherwise the first steps compile); returns seconds."""
        return self.engine.runner.warmup()

    def generate(
        self,
        prompts,
        sampling_params=None,
        use_tqdm: bool = True,
        lora_request=None,
        priority=None,
    ) -> list[RequestOutput]:
        """One output per prompt, in input order. lora_request: a `jaxserve.lora.LoRARequest` for
        every prompt, or a list of one (or None) per prompt (enable_lora=True); priority: one int
        per prompt, lower first, with scheduling_policy="priority" (vLLM's; any other is a
        ValueError under fcfs)."""
        prompts = prompt_list(prompts)
        results: list[RequestOutput | None] = [None] * len(prompts)
        it = self.iter_generate(
            prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            priority=priority,
            lora_request=lora_request,
        )
        for i, out in it:
            results[i] = out
        return results

    def chat(
        self,
        messages,
        sampling_params=None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generates for one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered by the tokenizer's chat template (or `chat_template`), as vLLM's `LLM.chat`:
        `continue_final_message` continues the final (assistant) message instead of opening a
        new turn (then add_generation_prompt must be False); `tools` are given to the template;
        `chat_template_kwargs` are extra template variables (e.g. {"enable_thinking": False}),
        overriding the named options. A conversation `render_chat` rejects fails alone.
        lora_request: as `generate`'s, per conversation."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            try:
                text, ids = render_chat(
                    self.tokenizer,
                    conv,
                    chat_template=chat_template,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                )
                prompts.append({"prompt": text, "prompt_token_ids": ids})
            except Exception as e:  # a malformed conversation fails alone
                prompts.append(_BadPrompt(f"chat template failed: {e}"))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def iter_generate(
        self,
        prompts,
        sampling_params=None,
        use_tqdm: bool = False,
        stop=None,
        priority=None,
        lora_request=None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yields (input index, finished output) in completion order as each request finishes.

        Closing the iterator early aborts the requests it has not yielded yet. `stop` (a callable
        -> bool) is checked before every engine step: once it returns True, the outputs that have
        already finished are yielded and the iterator ends without stepping again (the rest are
        aborted) -- how a batch job drains on SIGTERM without redoing finished rows.
        """
        prompts = prompt_list(prompts)
        params = self._per_prompt_params(sampling_params, len(prompts))
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        for p in priority:
            self.engine.checker.check_priority(p)
        loras = self._per_prompt_loras(lora_request, len(prompts))
        index: dict[str, int] = {}
        pbar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        t0, out_tokens = time.perf_counter(), 0
        if self.engine_config.on_bad_request == "raise":  # vLLM: fail before anything runs
            prompts = [self._checked(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        try:  # submission inside: if it raises, the requests already queued are aborted too
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = self._submit(prompt, sp, stream=False, priority=priority[i], lora=loras[i])
                index[rid] = i
            while index:
                # The outbox holds only what the last step returned: O(finished), not O(queued).
                for rid in [r for r in self._outbox if r in index]:
                    out = self._outbox.pop(rid)[-1]
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    pbar.update(1)
                    pbar.set_postfix(output_tok_s=f"{out_tokens / (time.perf_counter() - t0):.1f}")
                    yield index.pop(rid), out
                if not index or (stop is not None and stop()):
                    break
                self._step()
        finally:
            pbar.close()
            for rid in index:
                self.engine.abort(rid)
                self._outbox.pop(rid, None)
            self.engine.drain()

    def stream(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        delta: bool = False,
        lora_request=None,
    ) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each step the request produced tokens; the last is finished.

        delta=False: cumulative text and token ids (vLLM's default); delta=True: only what is new.
        """
        sp = self._per_prompt_params(sampling_params, 1)[0]
        lora = self._per_prompt_loras(lora_request, 1)[0]
        if self.engine_config.on_bad_request == "raise":
            prompt = self._checked(0, prompt, sp)
        rid = self._submit(prompt, sp, stream=True, lora=lora)
        seen: dict[int, tuple[int, int]] = {}  # child index -> (tokens, chars) already yielded
        try:
            while True:
                box = self._outbox.pop(rid, None)
                for out in box or []:
                    yield _delta(out, seen) if delta else out
                    if out.finished:
                        return
                if not box:
                    self._step()
        finally:
            self.engine.abort(rid)
            self._outbox.pop(rid, None)
            self.engine.drain()

    def stats(self) -> dict:
        """Engine counters: steps, tokens, preemptions, occupancy, KV utilization, transfers;
        and under "memory" the per-device plan (params, KV pool, slot state, workspace, pages
        per data shard: `jaxserve.runner.memory`)."""
        return {**self.engine.stats(), "memory": self.engine.runner.memory_plan()}

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (with `enable_prefix_caching`), so the next requests
        recompute their prompts, e.g. to time a workload from a cold cache. Returns False, and
        changes nothing, while requests are unfinished (vLLM's `LLM.reset_prefix_cache`)."""
        return self.engine.scheduler.reset_prefix_cache()

    # -- internals --------------------------------------------------------------------------------
    def _step(self) -> None:
        if not self.engine.has_unfinished():
            raise RuntimeError("engine has no work but outputs are still awaited")
        for out in self.engine.step():
            self._outbox.setdefault(out.request_id, []).append(out)

    def _per_prompt_params(self, sampling_params, n: int) -> list:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams | dict):
            return [sampling_params] * n
        if isinstance(sampling_params, list | tuple):
            if len(sampling_params) != n:
                raise ValueError(
                    f"sampling_params has {len(sampling_params)} entries for {n} prompts"
                )
            return list(sampling_params)
        raise ValueError(
            f"sampling_params must be a SamplingParams, a dict or a list of them, "
            f"got {type(sampling_params).__name__}"
        )

    def _checked(self, i: int, prompt, sp) -> dict:
        """Prompt i parsed and checked as the engine will (on_bad_request='raise'): ValueError
        naming it and the problem, else {"prompt", "prompt_token_ids"} (tokenized once)."""
        text, ids, sp, error = self._prepare(prompt, sp)
        if error is None:
            error = self.engine.checker.check_request(ids, sp)[1]
        if error is not None:
            raise ValueError(f"prompt {i}: {error}")
        return {"prompt": text, "prompt_token_ids": ids}

    def _prepare(self, prompt, sp):
        """(text, token ids, SamplingParams, error) of one prompt and its parameters."""
        try:
            text, ids, error = self._parse_prompt(prompt)
        except Exception as e:  # the last line of defence: one prompt fails alone
            text, ids, error = None, None, f"cannot read the prompt: {type(e).__name__}: {e}"
        if error is None and isinstance(sp, dict):
            try:
                sp = SamplingParams.from_dict(sp)
            except ValueError as e:
                error = f"invalid sampling parameters: {e}"
            except (TypeError, RecursionError) as e:  # the last line of defence: it fails alone
                error = f"invalid sampling parameters: {type(e).__name__}: {e}"
        return text, ids, sp, error

    def _per_prompt_loras(self, lora_request, n: int) -> list:
        """One LoRARequest (or None) per prompt; ValueError for a wrong count, or an adapter
        without enable_lora (vLLM's rule: checked before anything runs)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * n
        elif isinstance(lora_request, list | tuple):
            loras = list(lora_request)
            if len(loras) != n:
                raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
        else:
            raise ValueError(
                "lora_request must be a jaxserve.lora.LoRARequest, a list of them (one per "
                f"prompt) or None, got {type(lora_request).__name__}"
            )
        for lora in loras:
            if lora is not None and (
                not isinstance(lora, LoRARequest) or not self.engine_config.enable_lora
            ):
                self.engine.checker.read_lora(lora)  # raises, naming the problem
        return loras

    def _submit(self, prompt, sp, stream: bool, priority: int = 0, lora=None) -> str:
        rid = self.engine.next_request_id()
        text, ids, sp, error = self._prepare(prompt, sp)
        if error is not None:
            self._outbox.setdefault(rid, []).append(
                RequestOutput.from_error(
                    rid,
                    text,
                    ids or [],
                    error,
                    time.monotonic(),
                    sp.n if isinstance(sp, SamplingParams) else 1,
                )
            )
            return rid
        self.engine.add_request(
            rid, text, ids, sp, stream=stream, priority=priority, lora_request=lora
        )
        return rid

    def _parse_prompt(self, prompt) -> tuple[str | None, list[int] | None, str | None]:
        """(text, token ids, error) of one prompt (`inputs.prompts.parse_prompt`'s rules)."""
        if isinstance(prompt, _BadPrompt):
            return None, None, prompt.error
        try:
            text, ids = parse_prompt(prompt, self.tokenizer)
        except PromptError as e:
            return e.text, None, str(e)
        return text, ids, None


class _BadPrompt:
    def __init__(self, error: str):
        self.error = error


def _delta(out: RequestOutput, seen: dict[int, tuple[int, int]]) -> RequestOutput:
    """The part of a cumulative snapshot not yielded before."""
    outs = []
    for c in out.outputs:
        n_tok, n_chr = seen.get(c.index, (0, 0))
        outs.append(
            CompletionOutput(
                c.index,
                c.text[n_chr:],
                c.token_ids[n_tok:],
                c.finish_reason,
                c.stop_reason,
                c.logprobs[n_tok:] if c.logprobs is not None else None,
                c.cumulative_logprob,
            )
        )
        seen[c.index] = (len(c.token_ids), len(c.text))
    return RequestOutput(
        out.request_id,
        out.prompt,
        out.prompt_token_ids,
        outs,
        out.finished,
        out.metrics,
        out.error,
        out.prompt_logprobs,
    )
