"""The batch job's main loop: rows in, durable output rows out, in completion order.

Dataflow:

    rows (InputRow, validated)  - keys already in the output (resume) are skipped
      -> bad rows: an error row is written at once
      -> render: prompt str | {"prompt_token_ids"} (chat template applied for `messages` rows)
      -> llm.iter_generate(prompts, sampling_params)  yields (index, RequestOutput) as each finishes
      -> output row {id, line, text, finish_reason, usage, ...} -> writer.write (appended + fsync)

Stopping (SIGINT / SIGTERM): the signal handler only sets `StopFlag`. The engine step under way
completes; `LLM.iter_generate(..., stop=...)` then yields every row that has already finished
(all are written) and ends without another step, aborting the requests still running, so nothing
new is admitted. Only rows that had not finished are redone by the next run. A second signal raises
KeyboardInterrupt at once (rows already written stay written).

Host code only: no jax import here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from typing import Any

from tqdm import tqdm

from jaxserve.batch.reader import InputRow
from jaxserve.batch.summary import JobStats

log = logging.getLogger(__name__)


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


def render_prompt(row: InputRow, tokenizer: Any, use_chat_template: bool) -> Any:
    """The prompt given to the engine: a str, or {"prompt", "prompt_token_ids"}.

    Chat rows are rendered like `LLM.chat`: the template's text, tokenized without adding special
    tokens again (the template already holds them).
    """
    if row.prompt_token_ids is not None:
        return {"prompt_token_ids": list(row.prompt_token_ids)}
    messages = row.messages
    if messages is None and use_chat_template:
        messages = [{"role": "user", "content": row.prompt}]
    if messages is None:
        return row.prompt
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model's tokenizer has no chat template, so this row cannot be rendered"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"prompt": text, "prompt_token_ids": [int(t) for t in ids]}


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
) -> JobStats:
    """Runs every row whose key is not in `done_keys`, writing one output row per input row.

    Counts go into `stats` (a new JobStats when None) as rows finish, so a caller that is
    interrupted mid-job still holds the totals so far.
    """
    stop = stop or StopFlag()
    stats = stats if stats is not None else JobStats()
    stats.start_time = time.monotonic()  # throughput counts from here, not from the model load
    todo = [r for r in rows if r.key not in done_keys]
    bar = tqdm(total=len(todo), unit="row", disable=not progress, dynamic_ncols=True)

    def finish(record: dict[str, Any], out: Any = None) -> None:
        writer.write(record)
        if record.get("error") is not None:
            stats.add_error()
        else:
            usage = record["usage"]
            metrics = getattr(out, "metrics", None)
            stats.add_output(usage["prompt_tokens"], usage["completion_tokens"], metrics)
        if print_outputs:  # above the bar, one block per finished row
            body = record["error"] if record.get("error") is not None else record["text"]
            tqdm.write(f"--- {record['id']} ({record.get('finish_reason')})\n{body}")
        bar.update(1)
        bar.set_postfix_str(f"{stats.tokens_per_s():.1f} tok/s, {stats.num_failed} failed")

    runnable, prompts, params = [], [], []
    for row in todo:
        error = row.error
        if error is None:
            try:
                prompt = render_prompt(row, tokenizer, use_chat_template)
            except ValueError as e:
                error = f"line {row.line}: {e}"
            except Exception as e:  # a chat template may raise anything; it fails this row only
                error = f"line {row.line}: chat template failed: {type(e).__name__}: {e}"
        if error is not None:
            finish(error_row(row, error))
            continue
        runnable.append(row)
        prompts.append(prompt)
        params.append(row.sampling)

    if runnable and not stop.requested:
        outputs = llm.iter_generate(prompts, params, stop=lambda: stop.requested)
        try:
            for index, out in outputs:
                finish(output_row(runnable[index], out, token_ids=output_token_ids), out)
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
