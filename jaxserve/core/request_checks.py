"""Every check a request passes before it is queued: the engine's front-end validation.

    check_priority(priority)        ValueError: a caller's mistake (priority under fcfs, not an int)
    read_lora(lora_request)         (the adapter, None) or (None, why it cannot be used); ValueError
                                    when LoRA is off
    check_request(ids, sp)          (the params with bad_words as token ids, the reason the request
                                    cannot run or None):
                                      sp.checked()               the engine's own validated copy
                                      sp.with_bad_words_ids(tok) bad_words as token sequences
                                      validate(ids, sp)          prompt, lengths, pages, log-probs
                                      structured.check(...)      the grammar compiles (cached)

`LLMEngine.add_request` makes these checks; a bad request becomes its error output, the others are
unaffected. A `RequestChecker` holds only what the checks read (the configuration, the tokenizer,
the grammar cache and the LoRA adapters), never the queue or the slots, so a server thread may
call it while the engine steps (vLLM's front-end validation): a bad request is then a 400 before
a stream starts. Host only.
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.page_allocator import pages_for
from jaxserve.core.request import max_total_len
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.slot_row import make_slot_row
from jaxserve.core.structured_outputs import StructuredOutputManager
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import LoRASlots


class RequestChecker:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        num_pages: int,
        tokenizer,
        eos_token_ids: tuple[int, ...],
        structured: StructuredOutputManager,
        loras: LoRASlots | None,
    ):
        """The engine's own: `config` filled for the model, `num_pages` of the whole KV pool (a
        data shard's is its share), `structured` the engine's grammar cache, `loras` its adapter
        slots (None without LoRAConfig.enable_lora)."""
        self.model_config = model_config
        self.config = config
        self.num_pages = num_pages
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.structured = structured
        self.loras = loras

    def check_priority(self, priority) -> None:
        """ValueError unless `priority` is an int the scheduling policy uses (any int under
        "priority", 0 under "fcfs")."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(
                f"got priority {priority}, but priority scheduling is not enabled "
                "(scheduling_policy='priority')"
            )

    def read_lora(self, lora_request) -> tuple:
        """(the adapter, None) or (None, why it cannot be used); ValueError when LoRA is off or
        `lora_request` is not a LoRARequest (a caller's mistake, as in vLLM)."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a jaxserve.lora.LoRARequest, got {type(lora_request).__name__}"
            )
        if self.loras is None:
            raise ValueError(
                f"got lora_request {lora_request.lora_name!r}, but LoRA is not enabled "
                "(enable_lora=True)"
            )
        try:
            return self.loras.read(lora_request), None
        except ValueError as e:
            return None, str(e)

    def check_request(self, ids, sp) -> tuple[SamplingParams, str | None]:
        """Every check `add_request` makes, without queueing: (the params with bad_words as token
        ids, the reason the request cannot run or None). It reads only the configuration, the
        tokenizer and the grammar cache (see the module docstring)."""
        if isinstance(sp, SamplingParams):
            try:  # the engine's own validated copy (a caller may have set a field since)
                sp = sp.checked()
            except (ValueError, TypeError, RecursionError) as e:
                return sp, str(e)
        if isinstance(sp, SamplingParams) and sp.bad_words:
            try:  # vLLM's update_from_tokenizer: the words as token sequences
                sp = sp.with_bad_words_ids(self.tokenizer)
            except ValueError as e:
                return sp, str(e)
        error = self.validate(ids, sp)
        if error is None and sp.structured_outputs is not None:
            try:  # a schema, regex or grammar that does not compile (compiled once, cached)
                self.structured.check(sp.structured_outputs)
            except ValueError as e:
                error = str(e)
        return sp, error

    def validate(self, ids, sp) -> str | None:
        """The reason this request cannot run, or None (bad_words and grammars aside: see
        `check_request`)."""
        if not isinstance(sp, SamplingParams):
            return f"sampling_params must be a SamplingParams, got {type(sp).__name__}"
        if not isinstance(ids, list | tuple) or len(ids) == 0:
            return "prompt is empty"
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int | np.integer) and 0 <= t < vocab for t in ids):
            return f"prompt_token_ids must be ints in [0, vocab_size={vocab})"
        c = self.config
        max_len = c.scheduler.max_model_len
        if len(ids) >= max_len:
            return (
                f"prompt has {len(ids)} tokens; max_model_len={max_len} leaves no room to "
                f"generate (at most {max_len - 1} prompt tokens)"
            )
        if sp.stop and self.tokenizer is None:
            return "stop strings need a tokenizer; this model has none (use stop_token_ids)"
        if sp.structured_outputs is not None and c.scheduler.decode_steps > 1:
            return (
                "structured_outputs need decode_steps=1 (each token's mask depends on the one "
                f"before it); this engine runs decode_steps={c.scheduler.decode_steps}"
            )
        try:
            sp.verify(len(ids), max_len, vocab, c.requests.max_logprobs)
        except ValueError as e:
            return str(e)
        max_total = max_total_len(len(ids), sp, max_len)
        need = pages_for(max_total - 1, c.cache.page_size)
        pool = self.num_pages // c.parallel.data_parallel_size  # a request lives on one shard
        if need > pool:
            where = "the pool has" if pool == self.num_pages else "a data shard's pool has"
            return (
                f"request can never fit: prompt ({len(ids)}) + max_tokens ({sp.max_tokens}) needs "
                f"{need} KV pages, {where} {pool}"
            )
        try:
            make_slot_row(sp, list(ids), [], self.eos_token_ids, 0, max_len)
        except ValueError as e:
            return str(e)
        return None
