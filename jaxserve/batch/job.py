"""The batch job's main loop: rows in, durable output rows out, in completion order.

Dataflow:

    rows (InputRow, validated)  - keys already done with the same request (resume) are skipped
      -> bad rows: an error row is written at once
      -> render, one row at a time, bounded (RENDER_TIMEOUT_S, RENDER_MAX_CHARS): the chat template
         for `messages` rows, and tokenization of text prompts, so a template that loops forever or
         a tokenizer that raises fails that row only: {"prompt", "prompt_token_ids"}
      -> llm.iter_generate(prompts, sampling_params)  yields (index, RequestOutput) as each finishes
      -> output row {id, key, fingerprint, line, text, finish_reason, usage, ...} -> writer.write

Every failure of one row becomes that row's error row: rendering (any exception, a timeout, an
oversized prompt), building its output row, or encoding it as JSON. An OS error on the output
(disk full, file too large, permission) is not a row's fault: it stops the job (OutputError), and
a rerun resumes.

Stopping (SIGINT / SIGTERM): the signal handler only sets `StopFlag`. The engine step under way
completes; `LLM.iter_generate(..., stop=...)` then yields every row that has already finished
(all are written) and ends without another step, aborting the requests still running, so nothing
new is admitted. Only rows that had not finished are redone by the next run. A second signal raises
KeyboardInterrupt at once (rows already written stay written).

Host code only: no jax import here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from jaxserve.batch.errors import OutputError
from jaxserve.batch.reader import InputRow
from jaxserve.batch.summary import JobStats
from jaxserve.inputs.chat import render_chat

log = logging.getLogger(__name__)

RENDER_TIMEOUT_S = 10.0  # most seconds one row's chat template + tokenization may take
RENDER_MAX_CHARS = 4 << 20  # longest rendered prompt, in characters


class StopFlag:
    """Set by SIGINT/SIGTERM; the job loop checks it after every finished row."""

    def __init__(self):
        self.signum: int | None = None

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGINT/SIGTERM inside the `with` block; the previous handlers come back after."""
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second signal {signal.Signals(signum).name}: stopping now")
        self.signum = signum
        log.warning(
            "%s received: finishing the current step, then stopping (send again to stop now)",
            signal.Signals(signum).name,
        )

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None


def error_row(row: InputRow, error: str) -> dict[str, Any]:
    return {
        "id": row.id,
        "key": row.key,
        "fingerprint": row.fingerprint,
        "line": row.line,
        "text": None,
        "finish_reason": "error",
        "usage": None,
        "error": error,
    }


def output_row(row: InputRow, out: Any, *, token_ids: bool = False) -> dict[str, Any]:
    """The output JSON object for one finished `RequestOutput`."""
    comps = list(out.outputs or ())
    if out.error is not None or not comps or comps[0].finish_reason == "error":
        return error_row(row, f"line {row.line}: {out.error or 'generation failed'}")
    first = comps[0]
    rec = {
        "id": row.id,
        "key": row.key,
        "fingerprint": row.fingerprint,
        "line": row.line,
        "text": first.text,
        "finish_reason": first.finish_reason,
        "usage": {
            "prompt_tokens": len(out.prompt_token_ids or ()),
            "completion_tokens": sum(len(c.token_ids) for c in comps),
        },
    }
    if first.stop_reason is not None:
        rec["stop_reason"] = first.stop_reason
    if token_ids:
        rec["token_ids"] = [int(t) for t in first.token_ids]
    if first.logprobs is not None:
        rec["logprobs"] = _plain(first.logprobs)
    if len(comps) > 1:
        rec["choices"] = [
            {"text": c.text, "finish_reason": c.finish_reason}
            | ({"token_ids": [int(t) for t in c.token_ids]} if token_ids else {})
            for c in comps
        ]
    return rec


class RenderTimeout(BaseException):
    """Raised inside a row's rendering when it runs out of time. A BaseException, so a template
    or tokenizer that catches Exception cannot swallow it."""


def bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() with at most `timeout_s` seconds of Python execution, else RenderTimeout.

    In the main thread a SIGALRM timer raises it; elsewhere a watchdog thread raises it in this
    thread (PyThreadState_SetAsyncExc). Both interrupt Python code (a Jinja template is compiled to
    Python), not one long call into native code.
    """
    if threading.current_thread() is threading.main_thread():

        def on_alarm(signum, frame):
            raise RenderTimeout

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    tid = threading.get_ident()
    done = threading.Event()

    def watchdog():
        if not done.wait(timeout_s):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(tid), ctypes.py_object(RenderTimeout)
            )

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        return fn()
    finally:
        done.set()


def render_prompt(
    row: InputRow,
    tokenizer: Any,
    use_chat_template: bool,
    *,
    timeout_s: float = RENDER_TIMEOUT_S,
    max_chars: int = RENDER_MAX_CHARS,
) -> Any:
    """The prompt given to the engine: a str (no tokenizer), or {"prompt", "prompt_token_ids"}.

    Chat rows are rendered like `LLM.chat`: the template's text, tokenized without adding special
    tokens again (the template already holds them). Text prompts are tokenized as `LLM.generate`
    does, here, so a tokenizer error fails this row, not the batch. Raises ValueError (or anything
    the template or tokenizer raises, or RenderTimeout) for this row.
    """
    if row.prompt_token_ids is not None:
        return {"prompt_token_ids": list(row.prompt_token_ids)}
    messages = row.messages
    if messages is None and use_chat_template:
        messages = [{"role": "user", "content": row.prompt}]
    if messages is None:
        if tokenizer is None:
            return row.prompt
        ids = bounded(lambda: tokenizer(row.prompt)["input_ids"], timeout_s)
        return {"prompt": row.prompt, "prompt_token_ids": [int(t) for t in ids]}
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model's tokenizer has no chat template, so this row cannot be rendered"
        )

    text, ids = bounded(lambda: render_chat(tokenizer, messages, max_chars=max_chars), timeout_s)
    return {"prompt": text, "prompt_token_ids": [int(t) for t in ids]}


def render_error(row: InputRow, e: BaseException, timeout_s: float) -> str:
    """The error text of a row whose rendering raised `e`."""
    if isinstance(e, RenderTimeout):
        return f"line {row.line}: chat template / tokenizer took over {timeout_s:g} s; row failed"
    if isinstance(e, ValueError):
        return f"line {row.line}: {_short(e)}"
    return f"line {row.line}: chat template or tokenizer failed: {type(e).__name__}: {_short(e)}"


def _short(e: BaseException) -> str:
    s = str(e)
    return s if len(s) <= 300 else s[:297] + "..."


def run_job(
    llm: Any,
    rows: list[InputRow],
    writer: Any,
    *,
    done_keys: set[str] = frozenset(),
    tokenizer: Any = None,
    use_chat_template: bool = False,
    output_token_ids: bool = False,
    stop: StopFlag | None = None,
    progress: bool = True,
    print_outputs: bool = False,
    stats: JobStats | None = None,
    render_timeout_s: float = RENDER_TIMEOUT_S,
    render_max_chars: int = RENDER_MAX_CHARS,
    loras: dict | None = None,
) -> JobStats:
    """Runs every row whose key is not in `done_keys`, writing one output row per input row.
    loras: {name: LoRARequest} a row's `lora` field selects from (a name not in it is that
    row's error).

    Counts go into `stats` (a new JobStats when None) as rows finish, so a caller that is
    interrupted mid-job still holds the totals so far. Raises OutputError when the output cannot
    be written (the job must stop; a rerun resumes).
    """
    stop = stop or StopFlag()
    stats = stats if stats is not None else JobStats()
    stats.start_time = time.monotonic()  # throughput counts from here, not from the model load
    todo = [r for r in rows if r.key not in done_keys]
    bar = tqdm(total=len(todo), unit="row", disable=not progress, dynamic_ncols=True)

    def finish(row: InputRow, make: Callable[[], dict[str, Any]], out: Any = None) -> None:
        try:
            record = make()
            writer.write(record)
        except OutputError:  # the output itself failed: not this row's fault, stop the job
            raise
        except Exception as e:  # last line of defence: this row's output could not be built
            log.exception("line %d: could not write its output row", row.line)
            record = error_row(
                row, f"line {row.line}: output row failed: {type(e).__name__}: {_short(e)}"
            )
            writer.write(record)
        if record.get("error") is not None:
            stats.add_error()
        else:
            usage = record["usage"]
            metrics = getattr(out, "metrics", None)
            stats.add_output(usage["prompt_tokens"], usage["completion_tokens"], metrics)
        if print_outputs:  # above the bar, one block per finished row
            body = record["error"] if record.get("error") is not None else record["text"]
            text = f"--- {record['id']} ({record.get('finish_reason')})\n{body}"
            tqdm.write(text.encode("utf-8", "backslashreplace").decode("utf-8"))
        bar.update(1)
        bar.set_postfix_str(f"{stats.tokens_per_s():.1f} tok/s, {stats.num_failed} failed")

    runnable, prompts, params, adapters = [], [], [], []
    loras = loras or {}
    for row in todo:
        error = row.error
        if error is None and row.lora is not None and row.lora not in loras:
            given = ", ".join(sorted(loras)) or "none"
            error = (
                f"line {row.line}: lora {row.lora!r} is not an adapter of this job "
                f"(--lora_modules gave: {given})"
            )
        if error is None:
            try:
                prompt = render_prompt(
                    row,
                    tokenizer,
                    use_chat_template,
                    timeout_s=render_timeout_s,
                    max_chars=render_max_chars,
                )
            except (Exception, RenderTimeout) as e:  # a template may raise anything
                error = render_error(row, e, render_timeout_s)
        if error is not None:
            finish(row, lambda row=row, error=error: error_row(row, error))
            continue
        runnable.append(row)
        prompts.append(prompt)
        params.append(row.sampling)
        adapters.append(None if row.lora is None else loras[row.lora])

    if runnable and not stop.requested:
        kw = {"lora_request": adapters} if any(a is not None for a in adapters) else {}
        outputs = llm.iter_generate(prompts, params, stop=lambda: stop.requested, **kw)
        try:
            for index, out in outputs:
                row = runnable[index]
                make = lambda row=row, out=out: output_row(row, out, token_ids=output_token_ids)
                finish(row, make, out)
        finally:
            close = getattr(outputs, "close", None)
            if close is not None:
                close()
    bar.close()
    return stats


def _plain(x: Any) -> Any:
    """Logprobs (dicts keyed by token id, dataclasses, numpy) as plain JSON values."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x))
    if hasattr(x, "tolist"):
        return x.tolist()
    return x
