"""Autoregressive text decoding over a context: an understanding answer or think-mode reasoning (docs/bagel.md §5.2)."""

from __future__ import annotations

import torch

from ..errors import CancelledError
from ..kv.cache import CacheSession, StepInfo
from ..kv.token_types import TokenType
from . import contexts as C
from .checkpoint.loader import LoadedBagel
from .contexts import Context
from .numerics import check_logits
from .request import NO_HOOKS, RunHooks
from .sampling import next_token


@torch.inference_mode()
def decode_text(
    loaded: LoadedBagel,
    ctx: Context,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 0.3,
    generator: torch.Generator | None = None,
    hooks: RunHooks = NO_HOOKS,
    draw_discarded_sample: bool = False,
    session: CacheSession | None = None,
    branch: str = "gen",
) -> tuple[str, list[int]]:
    """Decode an answer from ``ctx`` (modified in place: the fed tokens are cached).

    Starts with an ``<|im_start|>`` query at ``ctx.rope``; stops when ``<|im_end|>`` is predicted
    (not kept) or after ``max_new_tokens`` generated tokens. (The official ``max_length`` counts
    forwards including the start token: official ``max_length = M`` equals ``max_new_tokens = M-1``.)
    ``draw_discarded_sample``: when sampling stops at the length limit, consume the one extra
    multinomial draw the official loop makes (and discards) from ``generator``, so that later draws
    from the same generator (the latent noise after a think text) match the official RNG stream.
    ``hooks``: progress and ``steer`` (the next token id) after every token, cancel polled before every token.
    ``session``/``branch``: the cache session is told where each decoded token begins and ends.

    Returns:
        ``(text, generated ids)``; text is decoded and cut as the official ``gen_text`` does.
    """
    tok = loaded.tokenizer
    ids: list[int] = []
    current, current_type = tok.bos_token_id, TokenType.BOUNDARY
    vocab = 0
    for step in range(max_new_tokens):
        if hooks.cancelled():
            raise CancelledError(f"text decoding cancelled after {step} of at most {max_new_tokens} tokens")
        info = StepInfo(phase="decode", step=step, total=max_new_tokens, branches=(branch,))
        if session is not None:
            session.begin_step(info)
        try:
            logits = C.decode_step(loaded, ctx, current, step, current_type)
        finally:
            if session is not None:
                session.end_step(info)
        check_logits(logits, step=step, max_new_tokens=max_new_tokens, dtype=loaded.dtype)
        vocab = logits.shape[-1]
        current = hooks.steered(
            step, logits, next_token(logits, do_sample=do_sample, temperature=temperature, generator=generator)
        )
        current_type = TokenType.DECODED_TEXT
        hooks.report(step + 1, max_new_tokens)
        if current == tok.eos_token_id:
            break
        ids.append(current)
    else:
        if draw_discarded_sample and do_sample and vocab:
            # the official loop samples once more after the last kept token; the token is dropped
            # but its draw advances the generator (same size, so the same amount of randomness)
            torch.multinomial(torch.ones(vocab), num_samples=1, generator=generator)
    return answer_text(loaded, ids), ids


def answer_text(loaded: LoadedBagel, ids: list[int]) -> str:
    """Generated ``ids`` as text, cut at ``<|im_end|>`` as the official ``gen_text`` does."""
    tok = loaded.tokenizer
    text = tok.decode([tok.bos_token_id, *ids])
    text = text.split("<|im_end|>")[0]
    if "<|im_start|>" in text:
        text = text.split("<|im_start|>")[1]
    return text


__all__ = ["answer_text", "decode_text"]
