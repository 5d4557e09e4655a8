"""Update: from a ``Scored`` batch to the policy's next version (the third arrow of the step).

Epochs x micro-batches of the policy loss (+ the KL term, + PPO's value loss); then, for
adapters (AdamW), the heartbeat guard before ``opt.step`` and the update's size against the
last good adapters; for full parameters, the fused stateless step during backward
(``train/optim.py``), whose own checks veto or stop a spiking update. Every rank runs the
same micro-batches (``Collective.micro_batches``: a rank out of them runs idle ones), and
the loss is normalised by the global token (or sample) count, so the summed gradient is the
one-process gradient.
"""

from __future__ import annotations

import math

import torch

from orbitrl.config import AlgoSection
from orbitrl.rl.batch import PackedBatch, score
from orbitrl.model.moe import replay_routing, router_losses
from orbitrl.rl.guards import layer_grad_norms
from orbitrl.rl.parallel import Workers, accumulate
from orbitrl.rl.losses import kl_estimate, kl_loss, policy_loss, value_loss
from orbitrl.rl.types import Scored, StepAbandoned, Update
from orbitrl.train.optim import build_optimizer as build_fused, is_fused, lr_at


def actor_loss(model, mb: PackedBatch, old_logp, ref_logp, adv, algo: AlgoSection,
               kl_coef: float, temperature: float, denom: float, norm_len: int,
               mask=None, return_hidden: bool = False):
    """Policy loss (``losses.policy_loss`` with ``algo.*``: clipping, dual-clip, the
    mismatch correction, the entropy bonus) + KL term of one micro-batch; returns (loss,
    metrics), and with ``return_hidden`` the hidden states [M, H] of the completion
    positions, detached (PPO's value head reads them). ``old_logp`` None: the old policy is the
    one computing this forward (nothing changed the weights since the rollout was scored;
    see ``Scorer.old_from_update``), so its logprobs are this forward's, detached. ``mask``
    [B_k, T_k]: the loss mask (default the micro-batch's completion mask)."""
    msk = mb.mask if mask is None else mask
    routing = replay_routing(model, mb.routing, aux=True)  # None for a dense model
    logp, ent, hidden = score(model, mb, temperature, with_entropy=True, return_hidden=True,
                              routing=routing)
    if old_logp is None:
        old_logp = logp.detach()
    loss, m = policy_loss(logp, old_logp, adv, msk, clip_low=algo.clip_low,
                          clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                          ratio_level="sequence" if algo.seq_level_ratio else "token",
                          agg=algo.loss_agg, norm_len=norm_len, denom=denom,
                          rollout_logp=mb.rollout_logp, mismatch=algo.mismatch,
                          tis_cap=algo.tis_cap, entropy=ent, entropy_coef=algo.entropy_coef)
    if ref_logp is not None and kl_coef > 0 and not algo.kl_in_reward:
        kl_l, _ = kl_loss(logp, ref_logp, msk, kind=algo.kl_estimator, agg=algo.loss_agg,
                          norm_len=norm_len, denom=denom)
        loss = loss + kl_coef * kl_l
    router_loss, router_m = router_losses(model, routing)  # mixtures: load balance, z-loss
    loss = loss + router_loss
    m.update(router_m)
    with torch.no_grad():  # (the entropy's metric comes from policy_loss)
        if ref_logp is not None:
            m["kl"] = float((kl_estimate(logp, ref_logp, algo.kl_estimator) * msk).sum()
                            / msk.sum().clamp(min=1))
    return (loss, m, hidden.detach()) if return_hidden else (loss, m)


def critic_loss(critic, mb: PackedBatch, hidden, old_values, returns, mask, algo: AlgoSection,
                denom: float, norm_len: int):
    """PPO's value loss of one micro-batch, weighted by ``algo.vf_coef``: (loss, metrics)."""
    values = mb.pad(critic(mb, hidden))
    v_loss, m = value_loss(values, old_values, returns, mask, clip=algo.value_clip,
                           agg=algo.loss_agg, norm_len=norm_len, denom=denom)
    return algo.vf_coef * v_loss, m


def _with_loss(out):
    """(loss, metrics) with the loss's value among the metrics as ``_loss``."""
    loss, m = out
    return loss, m | {"_loss": float(loss.detach())}


def mean_metrics(metrics: list[dict], epochs: int = 1) -> dict:
    """Micro-batches' metrics into the step's: ``*_max`` the maximum; ``loss`` the sum over
    micro-batches (each is already normalised by the whole batch), averaged over epochs; the
    rest the mean, weighted by each micro-batch's loss tokens (``_tokens``) where given."""
    out = {}
    keys = set().union(*metrics) - {"_tokens"} if metrics else set()
    for k in keys:
        rows = [m for m in metrics if k in m and isinstance(m[k], (int, float))]
        if not rows:
            continue
        vals = [m[k] for m in rows]
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k == "loss":
            out[k] = sum(vals) / max(1, epochs)
        else:
            w = [m.get("_tokens", 1.0) for m in rows]
            out[k] = sum(v * x for v, x in zip(vals, w)) / max(sum(w), 1e-12)
    return out


class Updater:
    """The policy's (and PPO's critic's) optimizer steps.

    Args:
        algo, train: the run's ``algo`` and ``train`` sections; ``max_tokens``:
            ``rollout.max_tokens`` (the length normaliser of the seq-mean-token-sum-norm
            aggregation).
        model, trainable: the policy and its trainable tensors.
        opt: AdamW (adapters) or a fused stateless optimizer (full parameters).
        guard: the GradNormGuard; snapshot: the last good adapters (None in full mode).
        critic: PPO's ``rl.critic.Critic`` (None otherwise): trained after each of the
            actor's micro-batches, by a backward and an optimizer of its own.
        coll: the Collective.
    """

    def __init__(self, algo, train, max_tokens: int, model, trainable, opt, guard, snapshot,
                 critic, coll, workers=None):
        self.algo, self.train, self.max_tokens = algo, train, max_tokens
        self.model, self.trainable = model, trainable
        self.opt, self.guard, self.snapshot = opt, guard, snapshot
        self.critic, self.coll = critic, coll
        self.fused = is_fused(opt)
        # several workers: the micro-batches' forward + backward side by side, each with
        # its own gradients, summed in micro-batch order (rl/parallel.py)
        self.workers = workers or Workers(1)
        self._named = None
        # train/eval switches only change dropout here; with none active they are skipped
        # (each walks every module: about 1 ms a step on the built-in model)
        self.mode_matters = any(isinstance(m, torch.nn.Dropout) and m.p > 0
                                for m in model.modules())
        # the fused optimizer's cumulative counters as of the last step (each step's share
        # is the difference)
        self.fused_applied = self.fused_held = 0

    def state_dict(self) -> dict:
        return {"fused_applied": self.fused_applied, "fused_held": self.fused_held}

    def load_state_dict(self, sd: dict):
        self.fused_applied = sd["fused_applied"]
        self.fused_held = sd.get("fused_held", 0)

    def skip_counts(self) -> dict:
        """Steps skipped (or, one-pass, stopped) so far: spikes and non-finite gradients, from
        the heartbeat and from a fused optimizer's own checks."""
        st = self.opt.stats if self.fused else None
        return {"skipped_spike": self.guard.skipped_spike,
                "skipped_nonfinite": self.guard.skipped_nonfinite +
                (st.skipped + st.partial if st else 0)}

    def __call__(self, scored: Scored, version: int, stop) -> Update:
        """Train on ``scored`` with policy ``version``; ``stop`` is polled between
        micro-batches while nothing is applied yet (True: StepAbandoned)."""
        if self.mode_matters:
            self.model.train()
        t = self.train
        lr = lr_at(version, t.lr, warmup=t.warmup_steps, total=t.max_steps,
                   schedule=t.lr_schedule, min_lr=t.min_lr)
        for g in self.opt.param_groups:
            g["lr"] = lr
        mask = scored.mask
        denom = float(mask.sum()) if self.algo.loss_agg == "token-mean" else float(mask.shape[0])
        # global tokens (or samples): the summed gradient over ranks is the one-process one
        denom = self.coll.all_sum(denom)
        by_mb: dict = {}  # a fused two-pass step runs the closure twice: keep the last
        # every rank runs the same number of micro-batches (each is a collective)
        n_mb = self.coll.micro_batches(len(scored.parts))
        for epoch in range(self.algo.epochs):
            if self.workers.n > 1:
                if stop():
                    raise StepAbandoned()
                self._side_by_side(scored, epoch, version, denom, by_mb, stop)
                continue
            for k in range(n_mb):
                if k >= len(scored.parts):
                    self._idle_micro_batch()
                    continue
                # a stop request leaves before the next micro-batch while nothing is applied
                # yet (a fused update and the critic's step apply as they go)
                if not self.fused and (self.critic is None or (k == 0 and epoch == 0)) \
                        and stop():
                    raise StepAbandoned()
                self._micro_batch(scored, k, epoch, version, denom, by_mb)
        if self.mode_matters:
            self.model.eval()
        out = {"lr": lr, **self._apply(list(by_mb.values()))}
        return Update(applied=out["step_skipped"] == 0, metrics=out)

    def _loss(self, scored: Scored, k: int, epoch: int, version: int, denom: float):
        """(loss, metrics, hidden states or None) of micro-batch ``k``."""
        algo = self.algo
        p = scored.parts[k]
        a, b, T_k = *self._rows(scored, k), p.mask.shape[1]
        loss, m, hidden = actor_loss(self.model, p, scored.old[k], scored.ref[k],
                                     scored.adv[a:b, :T_k], algo, scored.kl_coef,
                                     scored.temperature, denom, self.max_tokens,
                                     mask=scored.mask[a:b, :T_k], return_hidden=True)
        if algo.check and version == 0 and epoch == 0 and k == 0:
            assert abs(m["ratio_mean"] - 1) < 1e-5, \
                f"check: policy ratio at step 0 is {m['ratio_mean']}"
        m["_tokens"] = float(scored.mask[a:b, :T_k].sum())  # the step's means weigh by it
        return loss, m, hidden

    @staticmethod
    def _rows(scored: Scored, k: int) -> tuple[int, int]:
        a = sum(scored.sizes[:k])
        return a, a + scored.sizes[k]

    def _side_by_side(self, scored: Scored, epoch: int, version: int, denom: float,
                      by_mb: dict, stop):
        """Every micro-batch's forward + backward on the workers (AdamW, no critic: the
        weights stay put until ``_apply``); gradients summed in micro-batch order."""
        params = [q for _, q in self._trained()]

        def one(k):
            loss, m, _ = self._loss(scored, k, epoch, version, denom)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            return grads, m | {"loss": float(loss.detach())}

        n, K = self.workers.n, len(scored.parts)
        for start in range(0, K, n):  # n at a time: n micro-batches' gradients held at most
            if start and stop():
                raise StepAbandoned()
            done = self.workers.map(one, range(start, min(start + n, K)))
            accumulate(params, [g for g, _ in done])
            for k, (_, m) in enumerate(done, start):
                by_mb[(epoch, k)] = m

    def _trained(self) -> list:
        """(name, parameter) of every trained tensor (the same ones for the whole run)."""
        if self._named is None:
            self._named = [(n, q) for n, q in self.model.named_parameters() if q.requires_grad]
        return self._named

    def _micro_batch(self, scored: Scored, k: int, epoch: int, version: int, denom: float,
                     by_mb: dict):
        """Forward + backward of micro-batch ``k`` (the fused optimizer steps inside)."""
        held = {}

        def closure():
            loss, m, held["hidden"] = self._loss(scored, k, epoch, version, denom)
            loss.backward()
            by_mb[(epoch, k)] = m | {"loss": float(loss.detach())}
            return loss

        if self.fused:
            self.opt.step(closure)
        else:
            closure()
        if self.critic is not None:
            self._critic_step(scored, k, held["hidden"], denom, by_mb[(epoch, k)])

    def _idle_micro_batch(self):
        """A rank out of micro-batches joins the others' collectives with a zero loss."""
        if self.fused:
            self.opt.step(lambda: self.coll.idle_backward(self.model))
        else:
            self.coll.idle_backward(self.model)
        if self.critic is not None:  # its summed gradients: a zero share from this rank
            self.critic.step(lambda: (sum(p.sum() * 0 for p in self.critic.parameters()), {}))

    def _critic_step(self, scored: Scored, k: int, hidden, denom: float, m: dict):
        """The critic's update after the actor's micro-batch ``k`` (its own backward and
        optimizer; gradients summed over ranks and clipped to
        ``algo.critic_max_grad_norm``); its metrics join the micro-batch's, its weighted
        loss the micro-batch's loss."""
        p = scored.parts[k]
        a, b = self._rows(scored, k)
        T_k = p.mask.shape[1]
        vm = self.critic.step(lambda: _with_loss(critic_loss(
            self.critic, p, hidden, scored.values[a:b, :T_k], scored.returns[a:b, :T_k],
            scored.mask[a:b, :T_k], self.algo, denom, self.max_tokens)))
        m["loss"] += vm.pop("_loss")
        m.update(vm)

    # ---- applying the step -------------------------------------------------------------
    def _apply(self, metrics: list[dict]) -> dict:
        """The guarded optimizer step; the step's metrics (every rank's micro-batches)."""
        metrics = self.coll.gather(metrics)  # every rank aggregates all: the same decisions
        out, ok = self._apply_fused() if self.fused else self._apply_adamw(metrics)
        out["step_skipped"] = 0 if ok else 1
        out.update(self.skip_counts())
        out.update(mean_metrics(metrics, self.algo.epochs))
        return out

    def _apply_fused(self) -> tuple[dict, bool]:
        """The fused optimizer applied (or vetoed, or stopped) the update during backward:
        read what it did."""
        st = self.opt.stats
        norm = st.last_grad_norm
        applied = st.micro_steps - self.fused_applied
        self.fused_applied = st.micro_steps
        ok = applied > 0
        out = {"grad_norm": norm}
        size = self.opt.take_update_size()  # reset even when nothing was applied
        held, self.fused_held = st.held - self.fused_held, st.held
        if not self.opt.two_pass:  # one pass: tensors a stop left unchanged this step
            out["update_held"] = held
        if ok or held:  # a one-pass stop keeps the tensors updated before it
            out.update(size)
        if ok and not held:
            self.guard.accept(norm)  # a one-pass step stopped at a spike stays out of the mean
        return out, ok

    def _apply_adamw(self, metrics: list[dict]) -> tuple[dict, bool]:
        """The heartbeat before ``opt.step``: a spike or a non-finite loss leaves the weights
        and moments as the last good state and drops the gradients."""
        layers = layer_grad_norms(self._trained(), reduce=self.coll.all_sum)  # (no-op: 1 process)
        norm = math.sqrt(sum(v * v for v in layers.values()))
        loss_ok = all(math.isfinite(m["loss"]) for m in metrics)
        ok = self.guard.ok(norm if loss_ok else float("nan"))
        out = {"grad_norm": norm}
        if ok:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.train.max_grad_norm)
            self.opt.step()
            self.guard.accept(norm, layers)
            if self.snapshot is not None:
                out.update(self.snapshot.update_size(self.coll.all_sum))
                self.snapshot.save()
        else:
            out["spike_layer"] = self.guard.worst_layer(layers)[0]
        self.opt.zero_grad(set_to_none=True)
        return out, ok


def build_optimizer(t, params, veto):
    """The policy's optimizer from ``train.*``: AdamW (adapters, by default) or a fused
    stateless one (full parameters). ``veto(norm) -> bool``: the heartbeat the fused one asks
    (two passes: between them, nothing applied, so no snapshot of the full weights is
    needed; one pass, grouped: after each tensor with the norm so far, stopping the update
    once it passes its limit)."""
    name = t.optimizer
    if name == "auto":
        name = "adamw" if t.mode == "adapter" else "adalomo"
    if name == "adamw":
        # the fused kernel (one pass over all tensors; 0.45 ms instead of 2.5 ms for the
        # built-in model's 56 adapter tensors on a CPU core), within an ulp of the loop
        # only over contiguous tensors: the CPU kernel walks a parameter as flat memory from
        # its data pointer (a strided view, e.g. an expert's slice of stacked weights, would
        # have its neighbours' memory updated)
        params = list(params)
        if all(p.is_contiguous() for p in params):
            try:
                return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay,
                                         fused=True)
            except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
                pass
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    opt = build_fused(name, params, t.lr, clip=None if t.clip == "auto" else t.clip,
                      max_grad_norm=t.max_grad_norm)
    opt.veto = veto
    return opt
