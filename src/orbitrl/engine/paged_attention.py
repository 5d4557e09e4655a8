"""The paged KV cache and attention over it: plain PyTorch (the CPU path and the reference)
or the paged Triton kernels.

``KVCache`` holds every layer's K and V slot-major (``k[layer]: [num_slots, Hkv, D]``), in
the model dtype or in fp8 e4m3 with one fp32 scale per (token, kv head). ``PagedAttention``
is the decoder's attention backend for one engine step: it writes the step's new K/V into
their slots, gathers each sequence's context with ``index_select`` and runs SDPA. Decode
tokens (one query per sequence) go through one batched call over padded contexts; prefill
chunks go one sequence at a time; in fp32 on a CPU a GRPO group's shared prompt is
attended once per group (:class:`Cascade`). With ``backend="triton"`` (the CUDA default) the same
calls go to the paged kernels of ``attention_kernels.py`` instead, which read the blocks
in place: decode tokens with their GRPO prefix groups, each prefill chunk over its prefix.
A layer with attention sinks (gpt-oss) hands its [Hq] logits to each call; both paths put
them in the softmax's denominator.

Multi-head latent attention (DeepSeek-V3, ``model/mla.py``): the cache keeps one latent row
per token and layer (``KVCache(value=False)``: ``k`` [num_slots, 1, kv_lora_rank + rope],
no ``v``); the layer passes that row as ``k`` with ``expand=``, which turns gathered rows
into per-head K and V (``kv_b_proj``) before the same gather + SDPA. The Triton kernels
read K and V blocks as stored, so such a model attends with the torch path
(``paged_common.LATENT_REFUSED``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orbitrl.engine import attention_kernels as kernels  # (as a module: tests count its calls)
from orbitrl.engine.paged_common import (FP8, FP8_MAX, LATENT_REFUSED, SOFTCAP_REFUSED,
                                         dequantize)
from orbitrl.errors import OrbitError
from orbitrl.model.attention import decode_attention_exact, sdpa

class KVCache:
    """``value`` False: only ``k`` is kept (MLA's latent rows; ``v`` and ``v_scale`` None)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device, fp8: bool = False,
                 value: bool = True):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.dtype, self.fp8, self.block_size = dtype, fp8, block_size
        # fp8 is stored as uint8 bits: index_copy_ has no float8 kernel on CPU
        store = torch.uint8 if fp8 else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device) if value else None
        self.v_scale = None
        if fp8:
            self.k_scale = torch.ones(shape[:3] + (1,), dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale) if value else None

    def resize(self, num_blocks: int) -> None:
        """Reallocate for ``num_blocks`` blocks, keeping the slots both sizes have (the old
        tensors are released: a throttled pool gives its memory back)."""
        slots = num_blocks * self.block_size
        self.__dict__.pop("_views", None)  # they would keep the old tensors alive
        names = ("k", "v", "k_scale", "v_scale") if self.fp8 else ("k", "v")
        for name in names:
            t = getattr(self, name)
            if t is None:  # (no V: latent rows)
                continue
            if slots >= t.shape[1]:
                fill = 1.0 if name.endswith("scale") else 0
                new = t.new_full((t.shape[0], slots) + t.shape[2:], fill)
                new[:, :t.shape[1]] = t
            else:
                new = t[:, :slots].clone()
            setattr(self, name, new)

    def _fields(self):
        out = (self.k, self.v, self.k_scale, self.v_scale) if self.fp8 else (self.k, self.v)
        return tuple(t for t in out if t is not None)

    def layer(self, layer: int) -> tuple:
        """(K, V) of one layer, ``[num_slots, Hkv, D]`` views kept between calls (a step
        reads and writes each layer's twice; indexing makes a new view every time)."""
        views = self.__dict__.get("_views")
        if views is None or views[0] is not self.k or views[1] is not self.v:
            vs = [None] * self.k.shape[0] if self.v is None else self.v.unbind(0)
            views = self._views = (self.k, self.v, list(zip(self.k.unbind(0), vs)))
        return views[2][layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._fields())

    @staticmethod
    def quantize(x: torch.Tensor):
        """x: [N, H, D] -> (fp8 bits as uint8 [N, H, D], fp32 scale [N, H, 1])."""
        scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        return (x.float() / scale).to(FP8).view(torch.uint8), scale

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None):
        """k, v: [N, Hkv, D] for the N slots ``slots`` (v None without V)."""
        kl, vl = self.layer(layer)
        if self.fp8:
            kq, ks = self.quantize(k)
            kl.index_copy_(0, slots, kq)
            self.k_scale[layer].index_copy_(0, slots, ks)
            if v is not None:
                vq, vs = self.quantize(v)
                vl.index_copy_(0, slots, vq)
                self.v_scale[layer].index_copy_(0, slots, vs)
        else:
            kl.index_copy_(0, slots, k if k.dtype == self.dtype else k.to(self.dtype))
            if v is not None:
                vl.index_copy_(0, slots, v if v.dtype == self.dtype else v.to(self.dtype))

    def read(self, layer: int, idx: torch.Tensor):
        """K, V of slots ``idx`` [M] -> two [M, Hkv, D] tensors in the compute dtype (V None
        without V)."""
        kl, vl = self.layer(layer)
        k = kl.index_select(0, idx)
        v = None if vl is None else vl.index_select(0, idx)
        if self.fp8:
            k = dequantize(k, self.k_scale[layer].index_select(0, idx), self.dtype)
            if v is not None:
                v = dequantize(v, self.v_scale[layer].index_select(0, idx), self.dtype)
        return k, v

    def _slots(self, blocks) -> torch.Tensor:
        b = torch.as_tensor(blocks, dtype=torch.long, device=self.k.device)
        return (b[:, None] * self.block_size + torch.arange(self.block_size, device=b.device)).reshape(-1)

    def copy_blocks(self, pairs: list[tuple[int, int]]):
        """Copy-on-write: block src -> block dst, every layer."""
        if not pairs:
            return
        src, dst = self._slots([p[0] for p in pairs]), self._slots([p[1] for p in pairs])
        for t in self._fields():
            t[:, dst] = t[:, src]

    def save(self, blocks: list[int], num_tokens: int) -> tuple:
        """Host copy of the first ``num_tokens`` slots of ``blocks`` (swap out)."""
        s = self._slots(blocks)[:num_tokens]
        return tuple(t[:, s].to("cpu") for t in self._fields())

    def load(self, blocks: list[int], saved: tuple):
        """Swap in what ``save`` returned into (new) ``blocks``."""
        s = self._slots(blocks)[:saved[0].shape[1]]
        for t, h in zip(self._fields(), saved):
            t[:, s] = h.to(t.device)


class PagedAttention:
    """Attention backend for one step over a flattened batch [1, N].

    Token order: first the decode sequences (one new token each), then the prefill chunks.
    Built by :meth:`build` from each scheduled sequence's (block_table, start, num_new):
    its new tokens occupy positions start .. start + num_new - 1.
    """

    def __init__(self, cache: KVCache, windows: list, scale: float, exact: bool = True,
                 backend: str = "torch", softcap: float | None = None):
        self.cache, self.windows, self.scale = cache, windows, scale
        self.softcap = softcap  # Gemma 2: scores soft-capped (the torch path only)
        if softcap is not None and backend == "triton":
            raise OrbitError(SOFTCAP_REFUSED)
        self.exact = exact  # model.attention.sdpa: fp32 CPU attention in fp64
        # "torch": gather + SDPA (the CPU default and the reference); "triton": the paged
        # kernels of attention_kernels.py read the blocks in place (the CUDA default)
        self.backend = backend
        self._masks: dict = {}
        self._groups = None
        self.cascade = None  # decode rows' shared prompts attended once per group (CPU)

    @classmethod
    def build(cls, cache: KVCache, windows: list, scale: float,
              items: list[tuple[list[int], int, int]], exact: bool = True,
              backend: str = "torch", softcap: float | None = None,
              cascade: bool = False) -> "PagedAttention":
        """``cascade``: decode rows sharing a prompt read it once (:class:`Cascade`, CPU),
        in fp64 with ``exact``."""
        self = cls(cache, windows, scale, exact, backend, softcap)
        dev, bs = cache.k.device, cache.block_size
        ar = torch.arange(bs, device=dev)
        nd = 0
        while nd < len(items) and items[nd][2] == 1:
            nd += 1
        self.num_decode = nd
        mapping = []
        if nd:
            nb = max(len(it[0]) for it in items[:nd])
            bt = torch.tensor([it[0] + [0] * (nb - len(it[0])) for it in items[:nd]],
                              dtype=torch.long, device=dev)
            self.dec_pos = torch.tensor([it[1] for it in items[:nd]], device=dev)  # [B]
            if backend == "triton":  # int32 tables and context lengths for the kernel
                mapping.append(bt.gather(1, (self.dec_pos // bs)[:, None])[:, 0] * bs
                               + self.dec_pos % bs)
                self.dec_bt, self.dec_ctx = bt.int(), (self.dec_pos + 1).int()
                # prefix groups only where neighbours share a first block (a GRPO
                # request's samples); else the kernel's one-pass path
                self.dec_grouped = any(a[0][0] == b[0][0] for a, b in zip(items, items[1:nd]))
            else:
                cmax = max(it[1] for it in items[:nd]) + 1
                slots = (bt[:, :, None] * bs + ar).reshape(nd, -1)[:, :cmax]  # [B, C]
                self.dec_idx = slots.reshape(-1)
                self.dec_shape = (nd, cmax)
                mapping.append(slots.gather(1, self.dec_pos[:, None])[:, 0])
                if cascade and softcap is None and dev.type == "cpu":
                    self.cascade = Cascade.plan(items[:nd], slots, self.dec_pos, bs, exact)
        self.prefills, self.prefill_tables = [], []
        t0 = nd
        for table, start, num_new in items[nd:]:
            ctx = start + num_new
            bt = torch.tensor(table[:-(-ctx // bs)], dtype=torch.long, device=dev)
            slots = (bt[:, None] * bs + ar).reshape(-1)[:ctx]
            mapping.append(slots[start:])
            self.prefills.append((t0, t0 + num_new, start, slots))
            if backend == "triton":
                self.prefill_tables.append(bt.int())
            t0 += num_new
        self.slot_mapping = torch.cat(mapping)
        return self

    def _mask(self, key, window, additive: torch.dtype | None = None):
        """Decode mask [B, 1, 1, C] or prefill mask [1, 1, T, C]; True = may attend. With
        ``additive``, the same mask as 0 / -inf of that dtype (what SDPA turns a bool mask
        into at every call: made once per step for all layers, the same bits)."""
        if additive is not None:
            got = self._masks.get((key, window, additive))
            if got is None:
                m = self._mask(key, window)
                got = self._masks[(key, window, additive)] = torch.zeros(
                    m.shape, dtype=additive, device=m.device).masked_fill_(~m, float("-inf"))
            return got
        if (key, window) not in self._masks:
            if key == "dec":
                kpos = torch.arange(self.dec_shape[1], device=self.dec_pos.device)
                qpos = self.dec_pos[:, None]
                m = kpos[None] <= qpos
                if window is not None:
                    m &= (qpos - kpos[None]) < window
                m = m[:, None, None, :]
            else:
                t0, t1, start, slots = self.prefills[key]
                kpos = torch.arange(slots.numel(), device=slots.device)
                qpos = torch.arange(start, start + t1 - t0, device=slots.device)[:, None]
                m = kpos[None] <= qpos
                if window is not None:
                    m &= (qpos - kpos[None]) < window
                m = m[None, None]
            self._masks[(key, window)] = m
        return self._masks[(key, window)]

    def __call__(self, layer: int, q, k, v, sinks=None, expand=None):
        # q: [1, N, Hq, D]; k, v: [1, N, Hkv, D] -> [1, N, Hq, D]; sinks: [Hq] or None
        # rows past the scheduled tokens are padding (ModelRunner pads a short step's row
        # count): they write nothing, read nothing and come out zero
        if expand is not None:  # MLA: k holds the latent rows, no v
            return self._latent(layer, q, k, expand)
        n, hq, d, hkv = q.shape[1], q.shape[2], q.shape[3], k.shape[2]
        real = self.slot_mapping.numel()
        k, v = k.reshape(n, hkv, d), v.reshape(n, hkv, d)
        self.cache.write(layer, self.slot_mapping, k[:real] if n > real else k,
                         v[:real] if n > real else v)
        window = self.windows[layer]
        if self.backend == "torch" and not self.prefills and self.num_decode:
            # only decode tokens (most steps): their output, zero rows appended for padding
            o = self._decode(layer, q.reshape(n, hq, d), hkv, window, sinks)
            return (o if n == self.num_decode else
                    F.pad(o, (0, 0, 0, 0, 0, n - self.num_decode)))[None]
        q = q[0]
        out = torch.empty_like(q)
        if n > real:
            out[real:].zero_()
        if self.backend == "triton":
            return self._kernels(layer, q, out, window, sinks)[None]
        if self.num_decode:
            out[:self.num_decode] = self._decode(layer, q, hkv, window, sinks)
        for i, (t0, t1, _, slots) in enumerate(self.prefills):
            kc, vc = self.cache.read(layer, slots)
            o = sdpa(q[t0:t1].transpose(0, 1)[None], kc.transpose(0, 1)[None],
                     vc.transpose(0, 1)[None], self._mask(i, window), self.scale, self.exact,
                     enable_gqa=hq != hkv, softcap=self.softcap,
                     sinks=None if sinks is None else sinks[:, None])
            out[t0:t1] = o[0].transpose(0, 1)
        return out[None]

    def _latent(self, layer: int, q, latent, expand):
        """MLA: q [1, N, Hq, D], latent [1, N, 1, R] -> [1, N, Hq, Dv]. The rows go to the
        cache; each context's gathered rows are expanded (``expand``: rows -> per-head K
        [.., Hq, D] and V [.., Hq, Dv]) and attended as any other layer's K and V."""
        if self.backend == "triton":
            raise OrbitError(LATENT_REFUSED)
        n, real = q.shape[1], self.slot_mapping.numel()
        self.cache.write(layer, self.slot_mapping, latent[0, :real], None)
        q, window, outs = q[0], self.windows[layer], []
        if self.num_decode:
            outs.append(self._decode(layer, q, q.shape[1], window, expand=expand))
        for i, (t0, t1, _, slots) in enumerate(self.prefills):
            kc, vc = expand(self.cache.read(layer, slots)[0])
            o = sdpa(q[t0:t1].transpose(0, 1)[None], kc.transpose(0, 1)[None],
                     vc.transpose(0, 1)[None], self._mask(i, window), self.scale, self.exact)
            outs.append(o[0].transpose(0, 1))
        return F.pad(torch.cat(outs), (0, 0, 0, 0, 0, n - real))[None]

    def _decode(self, layer: int, q, hkv: int, window, sinks=None, expand=None):
        """Decode rows' attention over their gathered contexts: q [>= B, Hq, D] ->
        [B, Hq, Dv] (Dv = D but for MLA, whose gathered latent rows ``expand`` turns into
        K and V)."""
        b, c = self.dec_shape
        hq, d = q.shape[1], q.shape[2]
        if self.cascade is not None and window is None and sinks is None and expand is None:
            qd = q[:b].view(b, hkv, hq // hkv, d)
            return self.cascade(self.cache, layer, qd, self.scale).reshape(b, hq, -1)
        kc, vc = self.cache.read(layer, self.dec_idx)
        if expand is not None:
            kc, vc = expand(kc)
        kc, vc = kc.view(b, c, hkv, d), vc.view(b, c, hkv, vc.shape[-1])
        # the G query heads sharing one kv head act as G queries of that head
        qd = q[:b].view(b, hkv, hq // hkv, d)
        sinks = None if sinks is None else sinks.view(hkv, hq // hkv)  # as qd's heads
        if self.exact and q.dtype == torch.float32 and q.device.type == "cpu":
            o = decode_attention_exact(qd, kc, vc, self._mask("dec", window), self.scale,
                                       self.softcap, sinks)
        else:
            o = sdpa(qd, kc.transpose(1, 2), vc.transpose(1, 2),
                     self._mask("dec", window, additive=q.dtype), self.scale, self.exact,
                     softcap=self.softcap, sinks=sinks)
        return o.reshape(b, hq, -1)

    def _kernels(self, layer: int, q, out, window, sinks=None):
        """The paged kernels: decode tokens in one call, the GRPO samples of a prompt
        reading their shared blocks once; each prefill chunk over its paged prefix."""
        c = self.cache
        ks, vs = (c.k_scale[layer], c.v_scale[layer]) if c.fp8 else (None, None)
        kw = dict(block_size=c.block_size, scale=self.scale, window=window, k_scale=ks,
                  v_scale=vs, backend="triton", sinks=sinks)
        if self.num_decode:
            if self._groups is None and self.dec_grouped:  # once per step, for every layer
                self._groups = kernels.shared_prefix_groups(self.dec_bt, self.dec_ctx,
                                                            c.block_size)
            b = self.num_decode
            out[:b] = kernels.paged_decode(q[:b], c.k[layer], c.v[layer], self.dec_bt,
                                           self.dec_ctx, prefix_groups=self._groups, **kw)
        for (t0, t1, start, _), table in zip(self.prefills, self.prefill_tables):
            out[t0:t1] = kernels.paged_prefill(q[t0:t1], c.k[layer], c.v[layer], table, start,
                                               **kw)
        return out


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class Cascade:
    """Decode attention with each GRPO group's shared prompt read once (the CPU's torch
    path, fp32 SDPA): the rows of a request that share leading KV blocks attend to that
    prefix as one batch of ``rows x G`` queries per kv head, and each row to its own
    suffix; the two partial softmaxes are merged through their log-sum-exps.

    Why: the plain path gathers every row's whole context at every layer and step, so a
    group of n samples reads its prompt n times; on SmolLM2 (8 chat prompts x 8 samples)
    the gathers and SDPA were 2.4 s of a 13.3 s rollout on one core, bound by reading K/V.

    Built once per step by :meth:`plan` (None when sharing would save under a quarter of
    the gathered positions); every layer without a sliding window reuses its indices.
    ``exact``: fp32 computed in fp64 and rounded, as the trainer's attention
    (``model.attention.sdpa``): the rollout's logprobs then follow the trainer's where the
    GEMMs do too (``model/gemm.py``)."""

    def __init__(self, groups, rmax, pmax, q_rows, p_idx, p_mask, s_idx, s_mask, back,
                 exact: bool = False):
        self.exact = exact
        # every row in a group of rmax rows, in order (GRPO's n samples of each prompt):
        # the rows are the groups' queries as they lie, no gather and no filler row
        self.whole = groups * rmax == back.numel() and bool(
            (back == torch.arange(back.numel(), device=back.device)).all())
        self.groups, self.rmax, self.pmax = groups, rmax, pmax
        self.q_rows, self.p_idx, self.p_mask = q_rows, p_idx, p_mask
        self.s_idx, self.s_mask, self.back = s_idx, s_mask, back

    @classmethod
    def plan(cls, items, slots, pos, block_size: int, exact: bool = False) -> "Cascade | None":
        """items: the decode rows' (block_table, position, 1); slots: [B, C] their context
        slots; pos: [B] their positions. Groups: runs of adjacent rows with the same first
        block; a group's prefix is its common leading blocks, cut to its rows' shortest
        context less one (every row keeps its own token in its suffix)."""
        b, groups, i = len(items), [], 0
        while i < b:
            j = i + 1
            while j < b and items[j][0][:1] == items[i][0][:1]:
                j += 1
            if j - i > 1:
                tables = [items[r][0] for r in range(i, j)]
                shared = 0
                while all(len(t) > shared and t[shared] == tables[0][shared] for t in tables):
                    shared += 1
                p = min(shared * block_size, min(items[r][1] for r in range(i, j)))
                if p >= block_size:
                    groups.append((i, j, p))
            i = j
        saved = sum((j - i - 1) * p for i, j, p in groups)
        if 4 * saved < b * slots.shape[1]:
            return None
        dev = slots.device
        rmax = max(j - i for i, j, _ in groups)
        pmax = max(p for _, _, p in groups)
        ng = len(groups)
        q_rows, back = [], [ng * rmax] * b  # back: a row's entry, ng * rmax = no prefix
        start = torch.zeros(b, dtype=torch.long)
        plen = torch.zeros(ng, dtype=torch.long)
        first = []
        for g, (i, j, p) in enumerate(groups):
            q_rows += list(range(i, j)) + [j - 1] * (rmax - (j - i))
            back[i:j] = range(g * rmax, g * rmax + j - i)
            start[i:j] = p
            plen[g] = p
            first.append(i)
        ar = torch.arange(pmax)
        p_pos = torch.minimum(ar[None], plen[:, None] - 1)  # padding: a real slot, masked
        p_idx = slots[torch.tensor(first)].gather(1, p_pos.to(dev))
        p_mask = _additive(ar[None] < plen[:, None])
        length = pos.cpu() + 1 - start
        smax = int(length.max())
        ar = torch.arange(smax)
        s_pos = start[:, None] + torch.minimum(ar[None], length[:, None] - 1)
        s_idx = slots.gather(1, s_pos.to(dev))
        s_mask = _additive(ar[None] < length[:, None])
        return cls(ng, rmax, pmax, torch.tensor(q_rows, device=dev), p_idx.reshape(-1),
                   p_mask.to(dev), s_idx.reshape(-1), s_mask.to(dev),
                   torch.tensor(back, device=dev), exact)

    def __call__(self, cache: KVCache, layer: int, q, scale: float):
        """q: [B, Hkv, G, D] -> [B, Hkv, G, D]."""
        b, hkv, g, d = q.shape
        ng, r, p = self.groups, self.rmax, self.pmax
        out_dtype = q.dtype
        wide = self.exact and q.dtype == torch.float32
        if wide:
            q = q.double()
        if self.p_mask.dtype != q.dtype:  # (the masks in the compute dtype, once per step)
            self.p_mask, self.s_mask = self.p_mask.to(q.dtype), self.s_mask.to(q.dtype)
        qg = (q if self.whole else q.index_select(0, self.q_rows)).view(
            ng, r, hkv, g, d).transpose(1, 2)
        kp, vp = cache.read(layer, self.p_idx)
        if wide:
            kp, vp = kp.double(), vp.double()
        op, lp = _FLASH(qg.reshape(ng, hkv, r * g, d), kp.view(ng, p, hkv, d).transpose(1, 2),
                        vp.view(ng, p, hkv, d).transpose(1, 2), attn_mask=self.p_mask,
                        scale=scale)[:2]
        op = op.view(ng, hkv, r, g, d).transpose(1, 2).reshape(ng * r, hkv, g, d)
        lp = lp.view(ng, hkv, r, g).transpose(1, 2).reshape(ng * r, hkv, g)
        if not self.whole:  # back to rows; one more entry (zeros, log-sum-exp -inf) for
            # the rows without a prefix
            op = torch.cat([op, op.new_zeros(1, hkv, g, d)]).index_select(0, self.back)
            lp = torch.cat([lp, lp.new_full((1, hkv, g), float("-inf"))]).index_select(
                0, self.back)
        ks, vs = cache.read(layer, self.s_idx)
        if wide:
            ks, vs = ks.double(), vs.double()
        s = self.s_idx.numel() // b
        os_, ls = _FLASH(q, ks.view(b, s, hkv, d).transpose(1, 2),
                         vs.view(b, s, hkv, d).transpose(1, 2), attn_mask=self.s_mask,
                         scale=scale)[:2]
        m = torch.maximum(lp, ls)
        wp, ws = (lp - m).exp_(), (ls - m).exp_()
        out = (op * wp[..., None] + os_ * ws[..., None]) / (wp + ws)[..., None]
        return out.to(out_dtype)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """[N, C] bool -> [N, 1, 1, C] fp32 mask, 0 where allowed and -inf elsewhere."""
    return torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None, None]
