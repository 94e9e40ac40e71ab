"""The generation loop of models whose cache lives outside the paged KV cache (telescoping, Based).

Such a model keeps a small, constant-size state per sequence instead of blocks, so the scheduler and its
paged cache have nothing to manage: the sequences run one after another, each with a cache of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_one_at_a_time(llm, prompt_ids: list[list[int]], params: list, make_cache: Callable[[], object]):
    """Events ``(request, text piece, its _Text)`` as :meth:`yaie.engine.llm.LLM._run` yields them.

    ``make_cache()`` gives a fresh cache for each sequence (the model's ``forward`` takes it as its
    ``cache``); ``llm.last_caches`` keeps them (for tests and memory measurements).
    """
    from yaie.engine.llm import _sample_rows, _Text
    from yaie.engine.scheduler import Request

    model, cfg = llm.model, llm.config
    llm.last_caches = []
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        room = cfg.max_position_embeddings - len(ids)
        if room < 1:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the model takes at most "
                             f"{cfg.max_position_embeddings}")
        request = Request(i, list(ids), min(p.max_tokens, room))
        text = _Text(llm, p)
        cache = make_cache()
        llm.last_caches.append(cache)
        request.state = "running"
        feed = torch.tensor(ids, dtype=torch.int64, device=llm.device)   # the prompt first, then one token
        position = 0
        while True:
            positions = torch.arange(position, position + feed.numel(), device=llm.device)
            hidden = model.forward(feed, positions, cache)
            token = _sample_rows(model.logits(hidden[-1:]), [text])[0]
            position += feed.numel()
            piece = text.push(request, token)
            if text.finish_reason is not None:
                request.state = "finished"
                yield request, piece, text
                break
            yield request, piece, text
            feed = torch.tensor([token], dtype=torch.int64, device=llm.device)
