"""The paged KV cache and attention over it: plain PyTorch (the CPU path and the reference)
or the paged Triton kernels.

``KVCache`` holds every layer's K and V slot-major (``k[layer]: [num_slots, Hkv, D]``), in
the model dtype or in fp8 e4m3 with one fp32 scale per (token, kv head). ``PagedAttention``
is the decoder's attention backend for one engine step: it writes the step's new K/V into
their slots, gathers each sequence's context with ``index_select`` and runs SDPA. Decode
tokens (one query per sequence) go through one batched call over padded contexts; prefill
chunks go one sequence at a time. With ``backend="triton"`` (the CUDA default) the same
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

    @classmethod
    def build(cls, cache: KVCache, windows: list, scale: float,
              items: list[tuple[list[int], int, int]], exact: bool = True,
              backend: str = "torch", softcap: float | None = None) -> "PagedAttention":
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
