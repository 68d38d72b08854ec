"""What a request's input becomes before the engine sees it, one rule for every front door (host
only: no jax): `prompts.py` (a prompt -> its text and token ids), `chat.py` (a conversation through
the model's chat template)."""
