"""Types shared along the step: prompts -> engine -> samples -> rewards -> trainer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One completion of one prompt, as the engine produced it and the trainer consumes it.

    ``rollout_logprobs[j]`` is the log-probability the engine sampled ``completion_ids[j]``
    with (same temperature as the trainer's recomputation); ``policy_version`` is the
    optimizer step the sampling weights came from (with separate pools, that of the oldest
    token: a sample in flight at a weight update continues under the new weights, and
    ``token_versions`` holds each token's).
    """
    group: int                   # index of the prompt within the step
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    text: str
    fields: dict = field(default_factory=dict)  # the dataset row (answer, ...)
    policy_version: int = 0
    reward: float = 0.0
    routing: object = None  # mixtures: [S, prompt + completion, k] experts the engine used
    token_versions: list | None = None  # separate pools: the policy version of each token
    loss_mask: list | None = None  # trajectories: 1 per model token, 0 per environment token
    env_reward: float = 0.0  # trajectories: the environment's rewards over its turns
    # trajectories: (completion index of the turn's last model token, that turn's reward)
    # for each turn the environment rewarded (PPO places them there: token-level rewards)
    turn_rewards: list | None = None
    info: dict = field(default_factory=dict)  # trajectories: turns, tool calls, waits

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class StepAbandoned(Exception):
    """A stop request (``RLTrainer.should_stop``, SIGTERM) ended the step in flight before
    anything was applied; the trainer is as it was before the step."""


@dataclass
class Rollout:
    """One step's samples as the engine produced them (rollout.py), with the verifiers'
    rewards once ``Scorer.judge`` has run (in the producer thread when overlapped, so their
    seconds hide behind training too); with dynamic sampling's refill, every round's
    samples after the first round's (refill.py ``merge``)."""
    samples: list[Sample]
    gen_tokens: int                  # tokens the engine generated
    watchdog: int                    # watchdog events during this rollout
    timeline: list                   # the engine's (sequences, tokens, seconds) per step
    governor: dict                   # the KV governor's counters
    data_after: tuple                # the data cursor's position after this step's prompts
    rewards: object = None           # rewards.RewardResult, from Scorer.judge
    seconds: dict = field(default_factory=dict)  # rollout (and reward) phase seconds
    env: dict = field(default_factory=dict)  # multi-turn: the step's trajectory metrics
    trajectories: list = field(default_factory=list)  # multi-turn: records to log
    refill: dict = field(default_factory=dict)  # dynamic sampling's rounds and counts (refill.py)


@dataclass
class Scored:
    """The kept samples of one step, ready for the update (score.py builds it).

    Per micro-batch k (``parts[k]`` packed, ``sizes[k]`` samples): ``old[k]`` the old policy's
    logprobs [B_k, T_k] (None: the update's own forward gives them) and ``ref[k]`` the
    anchor's (None: no KL term). Over the whole batch [B, T]: ``adv`` the advantages,
    ``mask`` the loss mask (the overlong filter's zeros included; the packed micro-batches'
    own masks stay the completion masks), PPO's ``values`` and ``returns``."""
    parts: list                      # [PackedBatch] one per micro-batch
    sizes: list[int]
    old: list
    ref: list
    adv: object                      # torch.Tensor [B, T]
    mask: object                     # torch.Tensor [B, T]
    kl_coef: float
    temperature: float
    values: object = None            # torch.Tensor [B, T] (PPO)
    returns: object = None           # torch.Tensor [B, T] (PPO)
    metrics: dict = field(default_factory=dict)  # the logprob mismatch, when measured
    tokens: int = 0                  # prompt + completion tokens of the kept samples

    @property
    def scoring_passes(self) -> int:
        """No-grad forwards of the batch this step ran: the old policy's (none when the
        update's forward gives it) and the reference's."""
        return int(bool(self.old) and self.old[0] is not None) + (self.ref[0] is not None)


@dataclass
class StepScore:
    """What scoring one rollout gave: the row's reward and sampling metrics and the batch
    to train on (None: nothing kept here and on every rank, the step is skipped).
    ``anything``: some rank had samples (False: the watchdog dropped every group)."""
    metrics: dict
    batch: Scored | None
    anything: bool = True


@dataclass
class Update:
    """The result of one update: whether the optimizer applied it (the policy version
    advances) and its metrics (norms, losses, ratios, skip counts)."""
    applied: bool
    metrics: dict
