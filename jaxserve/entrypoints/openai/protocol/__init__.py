"""OpenAI's request and response objects (pydantic), apart from the serving code, one module per
endpoint on the shared pieces:

    common.py        the base models (strict requests, null as the default), errors, usage,
                     prompt log-probs, response ids
    sampling.py      the sampling fields every generating request shares (OpenAI's, vLLM's
                     extras) and their SamplingParams keyword arguments
    completion.py    POST /v1/completions
    chat.py          POST /v1/chat/completions: messages, tool calls, streamed deltas
    responses.py     POST /v1/responses: the request, output items, the response object
    models.py        GET /v1/models and vLLM's LoRA adapter load / unload
    tokenization.py  vLLM's /tokenize and /detokenize

The package's __init__ re-exports nothing: import each object from its module.
"""
