"""One forward pass of the model over a scheduled batch, flattened into one row [1, N].

The runner holds the model object, not its weights: every step calls the model's modules as
they are at that moment, so after an optimizer step (or an adapter swap) the next rollout
samples the updated policy with nothing copied or synced.
"""

from __future__ import annotations

import torch

from orbitrl.engine.paged_attention import KVCache, PagedAttention
from orbitrl.engine.sequence import Sequence
from orbitrl.model.moe import Routing, record_routing, wants_routing


class ModelRunner:
    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        cfg = model.config
        self.windows, self.scale = cfg.sliding_windows, cfg.head_dim ** -0.5

    @torch.no_grad()
    def run(self, items: list[tuple[Sequence, int]]):
        """Compute ``num_new`` tokens of each sequence. Returns (logits [S, V] fp32, the S
        sequences that computed their last token and so sample next, in row order)."""
        # decode tokens first: PagedAttention batches them in one call
        items = [it for it in items if it[1] == 1] + [it for it in items if it[1] != 1]
        ids, pos, rows, done = [], [], [], []
        for seq, n in items:
            c = seq.num_computed
            ids += seq.token_ids[c:c + n]
            pos += range(c, c + n)
            if c + n == len(seq):
                rows.append(len(ids) - 1)
                done.append(seq)
        dev = self.model.device
        attn = PagedAttention.build(self.cache, self.windows, self.scale,
                                    [(s.block_table, s.num_computed, n) for s, n in items])
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([pos], dtype=torch.long, device=dev)
        # mixtures with routing replay: each token's experts, kept per sequence for training
        routing = Routing(record=True) if wants_routing(self.model) else None
        hidden = self.model(ids_t, positions=pos_t, attn=attn, return_hidden=True,
                            routing=routing)[0]
        if routing is not None:
            record_routing(items, routing)
        if not rows:
            return None, done
        last = hidden.index_select(0, torch.tensor(rows, device=dev))
        return self.model.lm_head(last).float(), done
