"""Stateless optimizers fused into backward: no moments, no full gradient buffer.

Each parameter is updated inside its ``register_post_accumulate_grad_hook`` the moment its
gradient is complete, and the gradient is freed right there, so at most one layer's
gradients exist at any time. ``FusedSGD`` is plain SGD; ``FusedAdaLomo`` keeps an
Adafactor-style factored second moment (one row and one column vector per matrix, no first
moment) and normalises each tensor's update (AdaLomo, Lv et al. 2023).

Both are drop-in ``torch.optim.Optimizer`` objects (param_groups, lr schedulers,
state_dict) driven by ``opt.step(closure)``, where ``closure`` runs forward + backward and
returns the loss (torch's LBFGS convention). They raise ``OrbitError`` on options they
cannot honour.

Gradient clipping under a fused update: the norm of the whole gradient is only known
after backward ends, but the update of the first parameters happens in the middle of it.
Three modes, chosen by ``two_pass`` and ``max_grad_norm`` (``build_optimizer(clip=...)``
maps the trainer's ``train.clip`` onto them):

- ``two_pass=True`` (exact global clip, ``clip="global"``): pass 1 runs the closure with hooks
  that only add each gradient's squared norm to a running sum and free it; the optimizer
  then knows the exact global norm (and whether the loss or any gradient is non-finite),
  and pass 2 runs the closure again and applies ``g * min(1, max_norm / (norm + 1e-6))`` --
  the same factor as ``torch.nn.utils.clip_grad_norm_``. A non-finite loss or gradient found
  in pass 1, or a ``veto(norm)`` that refuses the norm, skips pass 2: the step is counted in
  ``stats.skipped`` / ``stats.vetoed`` and no parameter changes. Cost: one extra forward +
  backward per step (``stats.measure_s``/``apply_s``; ``benchmarks/bench_training_memory.py``).
  The RNG state is replayed so both passes see the same dropout/sampling.
- ``two_pass=False, max_grad_norm=None`` (one pass, grouped update normalization,
  ``clip="grouped"``, AdaLomo's own scheme): no global norm is needed before updating,
  because ``FusedAdaLomo`` already bounds every tensor's update by its own RMS (the update
  ``u`` is divided by ``max(1, RMS(u) / clip_threshold)`` and scaled by the weight's RMS), so
  one tensor's change is at most ``lr * max(eps2, RMS(W)) * clip_threshold`` in RMS whatever
  the gradient's size. One forward + backward per step. (``FusedSGD`` has no such bound: it
  runs unclipped here.)
- ``two_pass=False`` with a ``max_grad_norm`` (one pass, approximate global clip): the clip
  factor comes from the previous step's measured norm (the first step runs two-pass to
  obtain one).

Both one-pass modes cannot undo updates already applied earlier in the same backward, so a
bad gradient cannot leave all parameters unchanged; they require ``nonfinite="stop"``. Each
gradient's squared norm is added to the step's running sum as it arrives (one host sync per
tensor) and updates stop at the first tensor whose gradient is non-finite (counted in
``stats.partial``) or at which the caller's ``veto(norm)`` refuses the norm so far (counted in
``stats.vetoed``): that tensor and all tensors after it in the backward keep their values and
moments (``stats.held`` counts them), the tensors before it keep their update. The norm so
far, ``sqrt(sum of the squared norms of the gradients seen)``, is a lower bound of the
step's global norm that grows to it at the last tensor, so a veto that rises with the norm
(the trainer's heartbeat: refuse above 5x the running mean) stops only steps the two-pass
veto would also have refused, and stops every one of them at the latest at the last tensor;
how early depends on the spike's size: a step whose norm is s times the running mean is
stopped once the gradients seen hold ``(5 / s)^2`` of its squared norm -- for a norm
jumping from 3 to 300, after 0.25% of it, in practice at the first tensor (backward
reaches the output layers first, and a spike from the loss shows in every tensor). A
stopped step is not counted in ``stats.steps``; restoring an earlier state after it is the
caller's job.

Gradient accumulation (``accumulation_steps=k``): summing micro-batch gradients would need
the full gradient buffer that a fused update exists to avoid. Here each micro-batch's
``step(closure)`` applies its own update with learning rate ``lr / k``, clipped by that
micro-batch's own norm: over k micro-batches the update is ``lr * mean_i clip(g_i)``
(equal to the accumulated update to first order in lr; later micro-batches see the
weights after the earlier ones). ``stats.steps`` counts optimizer steps (every k
micro-batches), so a scheduler stepped every ``k`` calls behaves as with accumulation.

Sharded parameters (FSDP2 DTensors, see ``orbitrl.distributed.fsdp``): the hook fires on each
rank's shard once the summed gradient of that shard has arrived, and updates that shard
only. Everything that is a sum over the whole tensor (the squared norm for clipping,
AdaLomo's column means, the row mean, the RMS of the update and of the weight) is summed
over ranks by ``reduce_sum`` (set by the caller to an all-reduce), so every rank computes
the update the one-process optimizer would (in one pass each tensor's squared gradient
norm is summed over ranks as it arrives, one scalar all-reduce per tensor, so every rank
takes the same stop decision); ``SHARDED_STATE`` names the state tensors that
follow the parameter's dim-0 sharding (held as local shards), the rest are replicated.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from orbitrl.model.dtensor import is_dtensor
from orbitrl.errors import OrbitError


@dataclass
class FusedStats:
    micro_steps: int = 0      # step(closure) calls that applied an update
    steps: int = 0            # optimizer steps = micro_steps // accumulation_steps
    skipped: int = 0          # non-finite loss/grad: nothing applied
    partial: int = 0          # one-pass only: stopped at a non-finite gradient
    held: int = 0             # one-pass only: tensors left unchanged by a stop
    vetoed: int = 0           # the caller's ``veto(norm)`` refused (one pass: stopped) the step
    last_grad_norm: float = float("nan")
    last_clip_coef: float = 1.0
    backward_passes: int = 0
    measure_s: float = 0.0    # seconds spent in norm-measuring passes (the clipping cost)
    apply_s: float = 0.0      # seconds spent in update-applying passes
    # sums of squares since the last ``take_update_size()``: of the applied changes and of
    # the weights they were applied to (the update's size relative to the weights)
    update_sq: float = 0.0
    weight_sq: float = 0.0


_REFUSED_TORCH_FLAGS = ("foreach", "fused", "differentiable", "capturable")


class FusedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement ``_update(p, g, group, coef, lr)`` in fp32.

    Args (shared by subclasses):
        max_grad_norm: global gradient-norm clip (None disables clipping; non-finite
            detection still runs in two-pass mode).
        two_pass: exact clipping and atomic skip of non-finite steps (see module doc).
        nonfinite: "skip" (two-pass only) or "stop" (one-pass: stop updating, count partial).
        accumulation_steps: micro-batches per optimizer step (lr / k per micro-batch).

    Attributes set by the caller:
        veto: ``(global grad norm) -> True`` to refuse the step (two-pass: the exact norm,
            before any update; one pass: the norm so far, after each tensor).
        reduce_sum: in-place sum over ranks, for sharded parameters.
    """

    def __init__(self, params, defaults, *, max_grad_norm: float | None = 0.3,
                 two_pass: bool = True, nonfinite: str = "skip",
                 accumulation_steps: int = 1):
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise OrbitError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        if nonfinite not in ("skip", "stop"):
            raise OrbitError(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")
        if not two_pass and nonfinite == "skip":
            raise OrbitError("one-pass fused updates cannot leave parameters unchanged on a "
                             "non-finite gradient (earlier parameters are already updated "
                             "in that backward); use two_pass=True, or nonfinite='stop' and "
                             "restore the last good state on stats.partial")
        if two_pass and nonfinite == "stop":
            raise OrbitError("nonfinite='stop' is the one-pass policy; two_pass=True always "
                             "skips the whole step")
        if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
            raise OrbitError(f"accumulation_steps must be an integer >= 1, got "
                             f"{accumulation_steps}")
        self.max_grad_norm = max_grad_norm
        self.two_pass = two_pass
        self.nonfinite = nonfinite
        self.accumulation_steps = int(accumulation_steps)
        self.stats = FusedStats()
        self._phase = "idle"
        self._sq: torch.Tensor | None = None
        self._dsq: torch.Tensor | None = None  # this pass: sum of squared changes
        self._wsq: torch.Tensor | None = None  # this pass: sum of squared weights (before)
        self._coef = 1.0
        self._stop: str | None = None  # one pass: why updates stopped in this backward
        self.veto = None  # optional (global grad norm) -> True to refuse this update
        self.reduce_sum = None  # optional in-place sum over ranks, for sharded parameters
        self._prev_norm: float | None = None
        self._group_of: dict[int, dict] = {}
        self._handles = []
        super().__init__(params, defaults)

    # -- wiring -----------------------------------------------------------------------
    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if not p.requires_grad:
                raise OrbitError("a fused optimizer was given a parameter with "
                                 "requires_grad=False; pass only trainable parameters")
            self._group_of[id(p)] = group
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def remove_hooks(self):
        """Detach from the parameters (e.g. before switching to another optimizer)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- the hook: runs inside backward, once per parameter per backward -----------------
    @torch.no_grad()
    def _hook(self, p: torch.Tensor):
        key = p  # the registered parameter (a DTensor when sharded): state and group key
        g = p.grad
        if g is None:
            return
        if g.is_sparse:
            raise OrbitError("fused optimizers do not support sparse gradients")
        phase = self._phase
        sharded = is_dtensor(p)
        if sharded:  # this rank's shard of the parameter and of its summed gradient
            p, g = p.to_local(), g.to_local()
        if phase == "idle":
            raise OrbitError("backward ran outside optimizer.step(closure): a fused optimizer "
                             "updates inside backward, so call opt.step(closure) where "
                             "closure does forward + backward and returns the loss")
        if phase == "measure":
            self._sq += g.float().pow(2).sum()
        elif phase == "apply":
            self._update(p, g, self._group_of[id(key)], self._coef, self._lr(key),
                         **self._shard_kw(key, sharded))
        else:  # "oneshot": check each gradient's norm, then update (or stop)
            sq = g.float().pow(2).sum()
            if sharded:  # the whole tensor's: every rank takes the same decision
                sq = self._allsum(sq)
            self._sq += sq
            if self._stop is None:
                self._stop = self._check(float(self._sq))  # one host sync per tensor
            if self._stop is None:
                self._update(p, g, self._group_of[id(key)], self._coef, self._lr(key),
                             **self._shard_kw(key, sharded))
            else:
                self.stats.held += 1
        key.grad = None

    def _check(self, sq_so_far: float) -> str | None:
        """One pass, after a tensor's gradient: why updates must stop here ("nonfinite" /
        "veto"), or None. ``sq_so_far``: the squared global norm of the gradients seen."""
        if not math.isfinite(sq_so_far):
            return "nonfinite"
        if self.veto is not None and self.veto(math.sqrt(sq_so_far)):
            return "veto"
        return None

    def _shard_kw(self, key, sharded: bool) -> dict:
        if not sharded:
            return {}
        return {"state_key": key, "full_shape": tuple(key.shape), "allsum": self._allsum}

    def _allsum(self, t: torch.Tensor) -> torch.Tensor:
        if self.reduce_sum is not None:
            self.reduce_sum(t)
        return t

    def _lr(self, p) -> float:
        return self._group_of[id(p)]["lr"] / self.accumulation_steps

    def _clip_coef(self, norm: float) -> float:
        if self.max_grad_norm is None:
            return 1.0
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _run(self, closure, phase: str):
        self._phase = phase
        t0 = time.perf_counter()
        try:
            with torch.enable_grad():
                loss = closure()
        finally:
            self._phase = "idle"
        dt = time.perf_counter() - t0
        self.stats.backward_passes += 1
        if phase == "measure":
            self.stats.measure_s += dt
        else:
            self.stats.apply_s += dt
        return loss

    # -- the public step ----------------------------------------------------------------
    def step(self, closure=None):
        """Run ``closure`` (forward + backward, returns the loss) with the fused update.

        Returns:
            The loss of the (last) pass, as returned by the closure.
        """
        if closure is None:
            raise OrbitError("fused optimizers need step(closure): the update happens inside "
                             "backward, so the optimizer must run it")
        dev = self._device()
        self._sq = torch.zeros((), dtype=torch.float32, device=dev)
        if self.two_pass or (self._prev_norm is None and self.max_grad_norm is not None):
            rng = _rng_state()
            loss = self._run(closure, "measure")
            norm = float(self._allsum(self._sq).sqrt())
            self.stats.last_grad_norm = norm
            if not (_finite(loss) and math.isfinite(norm)):
                self.stats.skipped += 1
                return loss
            if self.veto is not None and self.veto(norm):
                self.stats.vetoed += 1
                return loss
            self._coef = self._clip_coef(norm)
            _set_rng_state(rng)
            self._sq = torch.zeros((), dtype=torch.float32, device=dev)
            self._zero_update_sums(dev)
            loss = self._run(closure, "apply")
            self._fold_update_sums()
        else:
            self._coef = 1.0 if self._prev_norm is None else self._clip_coef(self._prev_norm)
            self._stop = None
            self._zero_update_sums(dev)
            loss = self._run(closure, "oneshot")
            norm = float(self._sq.sqrt())  # per-tensor sums were already summed over ranks
            self.stats.last_grad_norm = norm
            self._fold_update_sums()  # what was applied before a stop counts too
            if self._stop == "veto":
                self.stats.vetoed += 1
                return loss
            if self._stop is not None or not _finite(loss):
                self.stats.partial += 1
                return loss
        self._prev_norm = norm
        self.stats.last_clip_coef = self._coef
        self.stats.micro_steps += 1
        self.stats.steps = self.stats.micro_steps // self.accumulation_steps
        return loss

    def _fold_update_sums(self):
        sums = self._allsum(torch.stack([self._dsq, self._wsq]))  # shards: one sum over ranks
        self.stats.update_sq += float(sums[0])
        self.stats.weight_sq += float(sums[1])

    def _zero_update_sums(self, dev):
        self._dsq = torch.zeros((), dtype=torch.float32, device=dev)
        self._wsq = torch.zeros((), dtype=torch.float32, device=dev)

    def _note(self, w_sq: torch.Tensor, d_sq: torch.Tensor):
        """Record one tensor's update: the squared norms of its value before and of the
        change (computed from reductions, no temporary of the tensor's size)."""
        self._wsq += w_sq
        self._dsq += d_sq

    def take_update_size(self) -> dict:
        """Norm of the changes applied since the last call, absolute and relative to the
        weights they were applied to; resets the sums."""
        d, w = math.sqrt(self.stats.update_sq), math.sqrt(self.stats.weight_sq)
        self.stats.update_sq = self.stats.weight_sq = 0.0
        return {"update_norm": d, "update_rel": d / max(w, 1e-12)}

    def _device(self):
        for g in self.param_groups:
            for p in g["params"]:
                return p.device  # a DTensor reports its local device
        return torch.device("cpu")

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none=True)

    def state_dict(self):
        sd = super().state_dict()
        sd["fused"] = {"stats": asdict(self.stats), "prev_norm": self._prev_norm}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        fused = state_dict.pop("fused", None)
        super().load_state_dict(state_dict)
        self.load_fused_state(fused)

    def load_fused_state(self, fused: dict | None):
        """The fused step's own counters and last norm (``state_dict()["fused"]``), for a
        caller that restores the per-parameter state itself (a sharded checkpoint)."""
        if fused:
            self.stats = FusedStats(**fused["stats"])
            self._prev_norm = fused["prev_norm"]

    SHARDED_STATE: tuple = ()  # state keys held as dim-0 shards of a sharded parameter

    def _update(self, p, g, group, coef, lr, **shard):  # pragma: no cover - abstract
        raise NotImplementedError


def _finite(loss) -> bool:
    if isinstance(loss, torch.Tensor):
        return bool(torch.isfinite(loss.detach()).all())
    return loss is None or math.isfinite(float(loss))


def _rng_state():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _refuse_torch_flags(kw: dict, name: str):
    for k, v in kw.items():
        if k in _REFUSED_TORCH_FLAGS and v not in (None, False):
            raise OrbitError(f"{name}: {k}={v!r} is not supported (the update is already "
                             "fused into backward, one parameter at a time)")
        if k not in _REFUSED_TORCH_FLAGS:
            raise OrbitError(f"{name}: unknown option {k!r}")


def _write(p: torch.Tensor, new_fp32: torch.Tensor):
    """Store an fp32 result into p (a no-op when it was computed in place on fp32 p).
    Low-precision p is rounded to nearest (no stochastic rounding)."""
    if new_fp32 is not p:
        p.copy_(new_fp32)


class FusedSGD(FusedOptimizer):
    """Plain SGD (coupled weight decay, as ``torch.optim.SGD``) fused into backward.

    Args:
        params: trainable parameters or param groups.
        lr: learning rate (about 1/10 to 1/20 of AdamW's at scale).
        weight_decay: L2 term added to the (clipped) gradient, like ``torch.optim.SGD``.
        momentum, dampening, nesterov, maximize: accepted only at their stateless defaults
            (momentum would be a full-size state); anything else raises.
        max_grad_norm, two_pass, nonfinite, accumulation_steps: see ``FusedOptimizer``.
    """

    def __init__(self, params, lr: float = 1e-3, *, weight_decay: float = 0.0,
                 momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 maximize: bool = False, max_grad_norm: float | None = 0.3,
                 two_pass: bool = True, nonfinite: str = "skip",
                 accumulation_steps: int = 1, **torch_flags):
        _refuse_torch_flags(torch_flags, "FusedSGD")
        if momentum or dampening or nesterov:
            raise OrbitError("FusedSGD is stateless: momentum/dampening/nesterov would need a "
                             "full-size buffer per parameter; use FusedAdaLomo or AdamW")
        if maximize:
            raise OrbitError("FusedSGD: maximize=True is not supported; negate the loss")
        if not lr > 0 or weight_decay < 0:
            raise OrbitError(f"FusedSGD: need lr > 0 and weight_decay >= 0 (got {lr}, "
                             f"{weight_decay})")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay),
                         max_grad_norm=max_grad_norm, two_pass=two_pass,
                         nonfinite=nonfinite, accumulation_steps=accumulation_steps)

    def _update(self, p, g, group, coef, lr, **_shard):
        # elementwise: a shard updates exactly like its slice of the whole tensor
        d = g.float() * coef if coef != 1.0 else g.float()  # may alias g: freed after
        pf = p.float()  # p itself when fp32
        if group["weight_decay"]:
            d = d.add(pf, alpha=group["weight_decay"])
        self._note(torch.linalg.vector_norm(pf).square(),
                   torch.linalg.vector_norm(d).square() * lr * lr)
        _write(p, pf.add_(d, alpha=-lr))


class FusedAdaLomo(FusedOptimizer):
    """AdaLomo: factored second moment + per-tensor update normalisation, fused into backward.

    Per matrix W [m, n] with clipped gradient g: row r [m] and column c [n] running means of
    g^2 + eps1 (decay ``beta2_t = 1 - t^decay_rate``), v = r c^T / mean(r), u = g / sqrt(v);
    per tensor u /= max(1, RMS(u) / clip_threshold); step size lr * max(eps2, RMS(W)).
    Vectors keep a full (tiny) second moment. No first moment.

    Args:
        lr: relative step size (scaled by each tensor's RMS).
        eps: (eps1 added to g^2, eps2 floor of the parameter-RMS scale).
        decay_rate: beta2 schedule exponent (AdaLomo/Adafactor default -0.8).
        clip_threshold: per-tensor update RMS cap (the grouped update normalization that
            lets ``two_pass=False, max_grad_norm=None`` run without a global clip).
        weight_decay: decoupled, multiplies W by (1 - lr_t * weight_decay).
        max_grad_norm, two_pass, nonfinite, accumulation_steps: see ``FusedOptimizer``.
    """

    def __init__(self, params, lr: float = 1e-3, *, eps=(1e-30, 1e-3),
                 decay_rate: float = -0.8, clip_threshold: float = 1.0,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 0.3,
                 two_pass: bool = True, nonfinite: str = "skip",
                 accumulation_steps: int = 1, **torch_flags):
        _refuse_torch_flags(torch_flags, "FusedAdaLomo")
        if not lr > 0 or weight_decay < 0 or not clip_threshold > 0 or decay_rate >= 0:
            raise OrbitError("FusedAdaLomo: need lr > 0, weight_decay >= 0, "
                             "clip_threshold > 0, decay_rate < 0")
        super().__init__(params, dict(lr=lr, eps=tuple(eps), decay_rate=decay_rate,
                                      clip_threshold=clip_threshold,
                                      weight_decay=weight_decay),
                         max_grad_norm=max_grad_norm, two_pass=two_pass,
                         nonfinite=nonfinite, accumulation_steps=accumulation_steps)

    SHARDED_STATE = ("row", "sq")  # "col" (one value per column) is replicated

    def _update(self, p, g, group, coef, lr, state_key=None, full_shape=None, allsum=None):
        """``p``/``g`` may be a dim-0 shard (``full_shape`` the whole tensor's shape, ``allsum``
        an in-place sum over the ranks); the arithmetic is then the whole tensor's."""
        st = self.state[p if state_key is None else state_key]
        st["step"] = t = st.get("step", 0) + 1
        beta2 = 1.0 - math.pow(t, group["decay_rate"])
        eps1, eps2 = group["eps"]
        # at most one gradient-sized temporary alive at a time (embeddings are large)
        g = g.float() * coef if coef != 1.0 else g.float()
        sq = (g * g).add_(eps1)
        if len(full_shape or g.shape) >= 2:
            if "row" not in st:
                st["row"] = torch.zeros(g.shape[:-1], dtype=torch.float32, device=g.device)
                st["col"] = torch.zeros(g.shape[:-2] + g.shape[-1:], dtype=torch.float32,
                                        device=g.device)
            row, col = st["row"], st["col"]
            row.mul_(beta2).add_(sq.mean(dim=-1), alpha=1 - beta2)
            if allsum is None:
                col.mul_(beta2).add_(sq.mean(dim=-2), alpha=1 - beta2)
                del sq
                r = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
            else:  # rows are split over ranks: column means and the row mean are sums
                m = full_shape[-2]
                col.mul_(beta2).add_(allsum(sq.sum(dim=-2)).div_(m), alpha=1 - beta2)
                del sq
                r = (row / (allsum(row.sum(dim=-1, keepdim=True)) / m)).rsqrt().unsqueeze(-1)
            u = g.mul(r).mul_(col.unsqueeze(-2).rsqrt())
        else:
            if "sq" not in st:
                st["sq"] = torch.zeros_like(g)
            v = st["sq"]
            v.mul_(beta2).add_(sq, alpha=1 - beta2)
            del sq
            u = v.rsqrt().mul_(g)
        # one sum of squares per tensor (this shard's), reused for the RMS clip of u, the
        # RMS step scale of W and the size of the change
        u_sq = torch.linalg.vector_norm(u).square()
        pf = p.float()
        w_sq = torch.linalg.vector_norm(pf).square()
        # one reduce, one host sync
        rms_u, rms_w = _rms(torch.stack([u_sq, w_sq]), u, full_shape, allsum).tolist()
        clip = max(1.0, rms_u / group["clip_threshold"])  # the grouped update normalization
        lr_t = lr * max(eps2, rms_w)
        step = lr_t / clip  # applied to the unnormalized u: no pass over u to divide it
        # change = -(a * W + step * u): its squared norm from these sums and one dot
        a = lr_t * group["weight_decay"]
        d_sq = step * step * u_sq
        if a:
            d_sq = d_sq + a * a * w_sq + 2 * a * step * _dot(pf, u)
        self._note(w_sq, d_sq)
        if group["weight_decay"]:
            pf.mul_(1 - a)
        _write(p, pf.add_(u, alpha=-step))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum of a * b over all elements, without a copy when both share a dense layout
    (row-major, or the column-major head of model/decoder.py); else one temporary."""
    if a.is_contiguous() and b.is_contiguous():
        return torch.dot(a.view(-1), b.view(-1))
    if a.dim() == 2 and a.t().is_contiguous() and b.t().is_contiguous():
        return torch.dot(a.t().reshape(-1), b.t().reshape(-1))  # views: same element order
    return (a * b).sum()


def _rms(sq: torch.Tensor, x: torch.Tensor, full_shape=None, allsum=None) -> torch.Tensor:
    """RMS over the whole tensor from ``sq``, sums of squares of tensors shaped like ``x``
    (this rank's shards when ``allsum`` sums over the ranks; ``sq`` itself is left as it
    is). ``sq`` may hold several such sums: one reduction serves them all."""
    if allsum is None:
        return sq.sqrt() / math.sqrt(x.numel())
    return allsum(sq.clone()).sqrt() / math.sqrt(math.prod(full_shape))


OPTIMIZERS = ("adamw", "sgd", "adalomo")
CLIPS = ("grouped", "global")


def build_optimizer(name: str, params, lr: float, *, clip: str | None = None,
                    max_grad_norm: float | None = 0.3, **kw) -> torch.optim.Optimizer:
    """The optimizer the trainer asks for by name.

    "adamw" is plain ``torch.optim.AdamW`` (adapters, and the full-parameter comparison:
    the caller clips with ``torch.nn.utils.clip_grad_norm_`` and calls ``step()``);
    "sgd" / "adalomo" are the fused stateless ones (call ``step(closure)``).

    Args:
        clip: how a fused update is bounded (see the module doc). "grouped" (AdaLomo only,
            its default): one forward + backward, each tensor's update normalized by its
            own RMS, no global clip, ``max_grad_norm`` unused; updates stop at the first
            non-finite gradient or where ``veto`` refuses the norm so far. "global" (SGD's
            default): exact global clip at ``max_grad_norm`` by two passes; ``veto(norm)``
            can refuse a step before anything is applied.
        max_grad_norm: the global clip ("global"; AdamW's caller clips by itself).
    """
    if name == "adamw":
        if clip not in (None, "global"):
            raise OrbitError(f"clip={clip!r} needs a fused optimizer; AdamW clips globally")
        return torch.optim.AdamW(params, lr=lr, **kw)
    if name not in ("sgd", "adalomo"):
        raise OrbitError(f"unknown optimizer {name!r} (choose from {', '.join(OPTIMIZERS)})")
    clip = clip or ("grouped" if name == "adalomo" else "global")
    if clip == "global":
        kw |= dict(max_grad_norm=max_grad_norm, two_pass=True)
    elif clip == "grouped":
        if name != "adalomo":
            raise OrbitError("clip='grouped' relies on AdaLomo's per-tensor update "
                             "normalization; SGD has none (use clip='global')")
        kw |= dict(max_grad_norm=None, two_pass=False, nonfinite="stop")
    else:
        raise OrbitError(f"unknown clip {clip!r} (choose from {', '.join(CLIPS)})")
    return (FusedSGD if name == "sgd" else FusedAdaLomo)(params, lr=lr, **kw)


def is_fused(opt) -> bool:
    return isinstance(opt, FusedOptimizer)


LR_SCHEDULES = ("constant", "cosine")


def lr_at(step: int, lr: float, *, warmup: int = 0, total: int = 0,
          schedule: str = "constant", min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based), the one schedule of RL
    (``train.lr``, ``warmup_steps``, ``max_steps``, ``lr_schedule``, ``min_lr``; ``rl/update.py``)
    and SFT (``train/sft.py``: cosine to 0): a linear warmup factor ``(step + 1) / warmup``
    over the first ``warmup`` steps (0: none), then constant, or cosine from ``lr`` down to
    ``min_lr`` at step ``total`` (and ``min_lr`` after it). Under warmup the cosine's part
    above ``min_lr`` is scaled."""
    warm = min(1.0, (step + 1) / warmup) if warmup else 1.0
    if schedule == "cosine":
        frac = min(1.0, step / max(1, total))
        return min_lr + (lr - min_lr) * warm * 0.5 * (1 + math.cos(math.pi * frac))
    if schedule != "constant":
        raise OrbitError(f"unknown lr schedule {schedule!r} (choose from "
                         f"{', '.join(LR_SCHEDULES)})")
    return lr * warm
