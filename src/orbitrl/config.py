"""Typed configuration: one dataclass per section, one YAML file, ``--set a.b=c`` overrides.

Every knob lives here once. An unknown key or a value of the wrong type is a one-line
:class:`OrbitError` naming the key (and the file it came from).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from orbitrl.errors import OrbitError

BUILTIN_MODEL = "builtin:tiny-arith"


def _require(section, name: str, keys, ok, what: str):
    """One-line error for the first of ``keys`` whose value fails ``ok``."""
    for key in keys:
        if not ok(getattr(section, key)):
            raise OrbitError(f"config key '{name}.{key}' must be {what}, got "
                             f"{getattr(section, key)}")


@dataclass
class ModelSection:
    path: str = BUILTIN_MODEL  # a model directory, a Hugging Face Hub id (org/name, or org/name@revision; from the local cache, downloaded when the network allows: docs/models.md), or builtin:NAME
    revision: str = ""  # Hub revision (branch, tag or commit) for a Hub id in model.path that names none; empty: main
    base_dtype: Literal["auto", "fp32", "bf16", "int8", "nf4mix", "nf4"] = "auto"  # frozen base storage (adapter mode); nf4mix: nf4 for the MLP's gate and up projections, int8 for attention and the down projection (4 bits break those first); auto: the widest of the compute dtype, int8, nf4mix and nf4 whose predicted peak stays within a quarter of the memory free at start (ledger/runtime.py choose_base_dtype; nf4 under torchrun)
    dtype: Literal["fp32", "bf16"] = "fp32"  # compute dtype (fp32 on CPUs)
    device: str = "auto"  # auto, cpu, cuda or cuda:N
    # keep the frozen base's projections dequantized (compute dtype) when they fit in this
    # many MB: no dequantization per call for small models (0: always per call)
    dequant_cache_mb: int = 256
    # fp32 on a CPU: attention computed in fp64 and rounded back, in the engine and the
    # trainer, so rollout logprobs equal the trainer's (docs/moe.md); false: plain fp32
    attention_fp64: bool = True

    def __post_init__(self):
        _require(self, "model", ("dequant_cache_mb",), lambda v: v >= 0, ">= 0")


@dataclass
class LoraSection:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: ["all-linear"])
    experts: Literal["none", "per_expert", "shared"] = "none"  # mixtures: whether targets may select routed experts' projections: per_expert (an adapter each) or shared (one per projection and layer, used by every expert)

    def __post_init__(self):
        if self.rank <= 0:
            raise OrbitError(f"config key 'lora.rank' must be positive, got {self.rank}")


@dataclass
class TrainSection:
    mode: Literal["adapter", "full"] = "adapter"
    # auto: AdamW for adapters, the stateless fused AdaLomo-style update for full mode
    optimizer: Literal["auto", "adamw", "sgd", "adalomo"] = "auto"
    lr: float = 1e-4  # safe across models; the built-in model's orbitrl.yaml sets its own
    min_lr: float = 0.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 0.3  # global clip: AdamW, and fused updates with clip=global
    # grouped (AdaLomo's own scheme): one forward + backward, each tensor's update normalized
    # by its own RMS, no global clip; updates stop at the first tensor whose gradient is
    # non-finite or passes 5x its running norm (tensors updated before it keep their change).
    # global: exact global clip at max_grad_norm by a second forward + backward (about 2x
    # the step); a spiking step is skipped before anything changes.
    clip: Literal["auto", "grouped", "global"] = "auto"  # auto: grouped for adalomo (1 pass), global for sgd (2)
    max_steps: int = 200
    max_seconds: float = 0.0  # 0 = no wall-clock budget
    micro_batch_tokens: int = 0  # tokens per forward/backward micro-batch; 0 = auto: adapter mode, the most whose saved activations stay within the weights' bytes (at least 256 MB), shared by the side-by-side workers, at most 4096; full mode 4096 (its fused update steps per micro-batch) (ledger/runtime.py auto_micro_batch_tokens)
    recompute: Literal["auto", True, False] = "auto"  # activation checkpointing: each decoder layer keeps its input and reruns in backward; auto: on in full mode when the micro-batch's saved activations would exceed the weights' bytes (at least 256 MB), off in adapter mode (the micro-batch is cut instead) (ledger/runtime.py resolve_recompute)
    tiers: int = 0  # full mode: 0 off; k >= 1 keeps the decoder layers (and the reference's) in host memory, pinned on CUDA, and copies each to the device just before use, k layers ahead on a side stream; implies recompute
    offload_activations: bool = False  # each recomputed decoder layer's saved input (all that recompute keeps for backward) copied to host memory, pinned on CUDA, in forward and back in backward; the shared rotary tables stay; implies recompute (refused with train.recompute false); on a CPU the host copies are separate buffers and save nothing (model/decoder.py ActivationOffload)
    hand_back_memory: bool = True  # release the allocator's cache between phases
    threads: int = 1  # intra-op CPU threads per Python thread (0: torch's default)
    workers: int = 0  # scoring and training micro-batches side by side on this many CPU threads, one core each (rl/parallel.py; the batch is cut into at least this many); 0 = auto: the cores (at most 2); always 1 on a GPU, under torchrun, in full mode, for mixtures, PPO, LoRA dropout, rollout.overlap or threads != 1
    seed: int = 0
    deterministic: bool = False

    def __post_init__(self):
        opt = self.optimizer
        if opt == "auto":
            opt = "adamw" if self.mode == "adapter" else "adalomo"
        if self.clip == "grouped" and opt != "adalomo":
            raise OrbitError(f"config key 'train.clip' must be global or auto with optimizer "
                             f"{opt} (grouped relies on AdaLomo's per-tensor update "
                             f"normalization), got grouped")
        _require(self, "train", ("tiers",), lambda v: v >= 0, ">= 0")
        if self.offload_activations and self.recompute is False:
            raise OrbitError("config key 'train.offload_activations' needs recompute (it moves "
                             "the layer inputs recompute keeps; without it each layer saves "
                             "its own activations): set train.recompute true or auto")
        _require(self, "train", ("workers", "micro_batch_tokens"), lambda v: v >= 0,
                 ">= 0 (0 = auto)")
        if self.tiers and self.mode != "full":
            raise OrbitError("config key 'train.tiers' needs train.mode full (adapters train "
                             "with AdamW, whose gradients outlive a layer's visit)")
        if self.tiers and self.optimizer == "adamw":
            raise OrbitError("config key 'train.tiers' needs a fused optimizer (train.optimizer "
                             "auto, sgd or adalomo): a layer leaves the device right after "
                             "its update")


@dataclass
class RolloutSection:
    n: int = 8
    prompts_per_step: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 8
    kv_dtype: Literal["model", "fp8"] = "model"
    kv_budget_mb: float = 0.0  # 0 = auto: what training's predicted need leaves, up to the cap
    min_available_mb: float = 1024.0  # free memory kept; the KV pool throttles below it
    block_size: int = 16
    timeout_s: float = 300.0  # watchdog: a rollout past this drops its unfinished samples
    overlap: bool = False  # one step off-policy: rollout of step k+1 runs beside training k
    queue_size: int = 1  # overlap, and schedule.shape async: rollouts generated ahead of training at most (the data queue's bound)
    threads: int = 0  # intra-op CPU threads of a rollout; 0 = auto: every core when the rollout runs alone on packed weights (a colocated one-process CPU run, rollout.packed_weights in use, train.threads 1), else train.threads
    packed_weights: Literal["auto", "on", "off"] = "auto"  # CPU, fp32: the engine's oneDNN-packed copies of the plain fp32 projections (engine/packed.py), made for each rollout and freed after it; auto: as many as fit below the predicted training peak (the copy never raises the run's peak; colocated one-process runs only), on: all of them (priced in the rollout phase), off: none; what the budget leaves out runs on oneDNN over its plain weight, and the trainer multiplies the same weights on oneDNN too, and the rollout attends in fp64 (model/gemm.py: the logprobs round as the trainer's)

    def __post_init__(self):
        _require(self, "rollout", ("kv_budget_mb", "min_available_mb"), lambda v: v >= 0,
                 ">= 0")
        _require(self, "rollout", ("queue_size",), lambda v: v >= 1, ">= 1")
        _require(self, "rollout", ("threads",), lambda v: v >= 0, ">= 0 (0 = auto)")


@dataclass
class AlgoSection:
    name: Literal["grpo", "ppo", "rloo", "reinforce++"] = "grpo"
    clip_low: float = 0.1
    clip_high: float = 0.1
    std_norm: bool = True  # False = Dr. GRPO
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "token-mean"
    seq_level_ratio: bool = False  # GSPO
    dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal are dropped and replaced by groups of fresh prompts (docs/lifecycle.md)
    dynamic_sampling_rounds: int = 3  # dynamic sampling: extra rollout rounds per step at most, each drawing as many fresh prompts as the batch lacks informative groups; when spent, the step trains on what it kept (0 = drop only)
    overlong: Literal["none", "filter", "shape"] = "none"
    overlong_buffer: int = 4
    kl_coef: float = 0.01
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    adaptive_kl: bool = False
    target_kl: float = 0.05  # adaptive KL: the per-token mean KL (kl_estimator) steered toward
    kl_horizon: int = 1000  # adaptive KL: a step moves the coef by at most 20% x min(1, samples / this)
    tis_cap: float = 2.0  # the cap of the rollout/trainer mismatch correction (algo.mismatch): tis and seq_tis weights are at most this; mis keeps tokens whose ratio lies in [1 / tis_cap, tis_cap]
    mismatch: Literal["tis", "mis", "seq_tis", "off", False] = "tis"  # correction of the gap between the engine's logprobs and the trainer's, per token from r = exp(trainer - rollout): tis min(r, tis_cap); mis 1 inside [1 / tis_cap, tis_cap], else 0 (the token is dropped); seq_tis min(exp(mean log r over the sequence), tis_cap) on every token of the sequence; off 1 (YAML reads a bare off as false: the same) (rl/losses.py mismatch_weights)
    dual_clip: float = 0.0  # dual-clip PPO (Ye et al. 2020, verl's clip_ratio_c): > 1 bounds a negative-advantage token's clipped loss by dual_clip x (-A); 0 = off
    entropy_coef: float = 0.0  # entropy bonus: the loss minus entropy_coef x the policy's entropy at the completion tokens, aggregated as the loss (algo.loss_agg); 0 = off (the entropy is still logged)
    epochs: int = 1
    gamma: float = 1.0  # PPO: GAE discount
    lam: float = 0.95  # PPO: GAE lambda
    value_lr: float = 1e-3  # PPO: the critic's learning rate (critic.*)
    value_clip: float = 0.2  # PPO: value clipping range
    vf_coef: float = 0.5  # PPO: weight of the value loss
    critic_max_grad_norm: float = 1.0  # PPO: the critic's gradient is clipped to this global norm before each of its steps (one per micro-batch)
    anchor_refresh_steps: int = 200
    anchor_kl_threshold: float = 0.3
    check: bool = False  # assert RL invariants in the loop (KL 0 and ratio 1 at step 0)

    def __post_init__(self):
        _require(self, "algo", ("kl_horizon",), lambda v: v >= 1, ">= 1")
        _require(self, "algo", ("dynamic_sampling_rounds",), lambda v: v >= 0, ">= 0")
        _require(self, "algo", ("target_kl", "tis_cap"), lambda v: v > 0, "> 0")
        if self.mismatch in (False,):  # `mismatch: off` in YAML, or --set algo.mismatch=off
            self.mismatch = "off"
        _require(self, "algo", ("dual_clip",), lambda v: v == 0 or v > 1, "0 (off) or > 1")
        _require(self, "algo", ("entropy_coef",), lambda v: v >= 0, ">= 0")
        _require(self, "algo", ("critic_max_grad_norm",), lambda v: v > 0, "> 0")
        if self.mismatch == "mis":
            _require(self, "algo", ("tis_cap",), lambda v: v >= 1,
                     ">= 1 with algo.mismatch mis (it keeps ratios in [1 / tis_cap, tis_cap])")


@dataclass
class CriticSection:
    """PPO's value function (algo.name ppo; its learning rate is algo.value_lr, its clip
    algo.critic_max_grad_norm) (docs/training.md#the-critic-ppo-rlcriticpy)."""
    kind: Literal["model", "head"] = "model"  # model: a value network of its own (a decoder and a scalar head on its final hidden states, its own forward and backward); head: an MLP on the policy's detached hidden states (no forward of its own)
    path: str = ""  # model: its starting weights, a model directory or Hub id (a one-label sequence-classification checkpoint, e.g. from orbitrl rm, starts the head too); empty: the policy's starting weights
    mode: Literal["auto", "adapter", "full"] = "auto"  # model: LoRA (lora.*) on a frozen base, or every weight; auto: train.mode. An adapter critic with the policy's path and base format shares the policy's frozen base on one process
    base_dtype: Literal["auto", "fp32", "bf16", "int8", "nf4mix", "nf4"] = "auto"  # an adapter critic's frozen base format; auto: model.base_dtype (the shared base)
    optimizer: Literal["auto", "adamw", "sgd", "adalomo"] = "auto"  # auto: AdamW for an adapter critic, the stateless fused AdaLomo-style update for a full one
    tiers: int = 0  # a full critic: k >= 1 keeps its decoder layers in host memory and copies each to the device k layers ahead, as train.tiers (needs a fused critic.optimizer)

    def __post_init__(self):
        _require(self, "critic", ("tiers",), lambda v: v >= 0, ">= 0")
        if self.tiers and (self.mode == "adapter" or self.optimizer == "adamw"):
            raise OrbitError("config key 'critic.tiers' needs a full critic (critic.mode full "
                             "or auto with train.mode full) and a fused critic.optimizer")


@dataclass
class DataSection:
    task: str = "arith"  # built-in task used when train/heldout are empty
    train: str = ""
    heldout: str = ""
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: bool = False  # each prompt as a user turn under the model's chat template
    system_prompt: str = ""  # with chat_template: a system turn before every prompt (empty: none, the template's own default applies)
    enable_thinking: Literal["auto", "on", "off"] = "auto"  # with chat_template: the template's enable_thinking variable (Qwen3's thinking switch; other templates ignore it); auto: the template's default
    heldout_size: int = 200


@dataclass
class EvalSection:
    """Held-out evaluation (docs/eval.md): before and after the run, and every ``every``
    steps during it; accuracy by a strict grader, the training reward beside it."""
    grader: Literal["auto", "exact", "answer", "reward"] = "auto"  # how held-out accuracy is judged: exact (the stripped completion is the answer), answer (the final answer, extracted strictly, equals it), reward (the training reward); auto: exact for the built-in arithmetic tasks, reward for code, else answer
    every: int = 0  # held-out accuracy and reward every N steps during the run (metrics.jsonl, the bar, the report); 0 = before and after only
    rows: int = 0  # held-out rows per in-run evaluation (the first N); 0 = all
    max_seconds: float = 0.0  # an in-run evaluation stops taking new rows after this many seconds (at least one chunk of rows is judged); 0 = no limit
    warn_gap: float = 0.3  # warn when the held-out training reward passes the strict accuracy by more than this (the policy may be exploiting the reward)

    def __post_init__(self):
        _require(self, "eval", ("every", "rows"), lambda v: v >= 0, ">= 0")
        _require(self, "eval", ("max_seconds", "warn_gap"), lambda v: v >= 0, ">= 0")


@dataclass
class SandboxSection:
    """Limits of the sandbox that runs programs for code-execution rewards (docs/sandbox.md)."""

    # auto: bwrap, else unshare; rlimits (no namespaces, so no network isolation) only if asked
    backend: Literal["auto", "bwrap", "unshare", "rlimits"] = "auto"  # isolation mechanism
    python: str = ""  # interpreter for programs; empty = this one if the sandbox uid can run it, else python3 from /usr
    workers: int = 0  # programs run at once; 0 = one per CPU core
    time_limit_s: float = 2.0  # per test: wall clock, and CPU time rounded up to whole seconds
    deadline_s: float = 60.0  # per batch: programs still queued or running then are scored 0 ('deadline')
    memory_mb: int = 512  # address space per program
    output_kb: int = 1024  # stdout (and stderr) read per program; more is killed
    file_mb: int = 16  # everything a program may write, in all: one budget over its work dir, /tmp and /dev/shm (and at most file_mb x 1024 files); also its largest file
    open_files: int = 64  # file descriptors per program
    max_procs: int = 16  # processes and threads per program
    uid_base: int = 61000  # run as uid_base + worker slot when started as root

    def __post_init__(self):
        _require(self, "reward.sandbox", ("time_limit_s", "deadline_s"), lambda v: v > 0,
                 "positive")
        _require(self, "reward.sandbox", ("memory_mb", "output_kb", "file_mb", "open_files",
                                          "max_procs"), lambda v: v >= 1, "at least 1")
        _require(self, "reward.sandbox", ("workers",), lambda v: v >= 0,
                 "0 (one per core) or positive")
        _require(self, "reward.sandbox", ("uid_base",), lambda v: 0 < v < 2**31 - 4096,
                 "an unprivileged uid")


@dataclass
class RewardSection:
    name: str = "exact_match"  # registered name, pkg.module:func, or rm:PATH (a reward model: a directory, a Hub id or builtin:NAME; docs/reward_models.md)
    extra: list = field(default_factory=list)  # more reward sources, summed
    weights: list = field(default_factory=list)  # one weight per source (default all 1)
    timeout_s: float = 5.0  # per call; a reward past it scores 0 and is counted
    rm_batch_size: int = 16  # rm: sources score this many sequences per forward (right-padded)
    strip_thinking: bool = True  # every reward but the format ones scores the reply after the last </think> (a reply that opens <think> and never closes it has none: empty; nor has one that never closes the <think> a chat template opens at the end of its generation prompt, as DeepSeek-R1's distilled models' do); false: the whole completion
    sandbox: SandboxSection = field(default_factory=SandboxSection)  # code rewards only

    def __post_init__(self):
        _require(self, "reward", ("rm_batch_size",), lambda v: v >= 1, "at least 1")
        self.sandbox.__post_init__()


@dataclass
class CheckpointSection:
    every: int = 50
    keep: int = 2


@dataclass
class DistSection:
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on GPUs, gloo on CPUs
    timeout_s: float = 300.0  # a collective waiting longer (dead or hung rank) fails the run
    reshard_after_forward: bool = True  # free each gathered layer after its forward
    prefetch_layers: int = 1  # layers all-gathered ahead of the one computing (0: on demand; the design keeps 2 in flight where memory allows)
    rollout_weights: Literal["sharded", "gathered"] = "sharded"  # gathered: whole while generating

    def __post_init__(self):
        _require(self, "dist", ("timeout_s",), lambda v: v > 0, "> 0")
        _require(self, "dist", ("prefetch_layers",), lambda v: v >= 0, ">= 0")


@dataclass
class ScheduleSection:
    """Roles over ranks (docs/pools.md): who generates, who trains, how weights and samples
    move between them. ``colocated`` is one pool doing both, as without this section."""
    shape: Literal["colocated", "separated", "one_step", "async"] = "colocated"  # separated: rollout ranks generate step k while training ranks wait, then train while they wait; one_step: rollout of step k+1 beside training of step k; async: rollout never waits for a whole step, weights swap between engine steps
    rollout_ranks: int = 1  # ranks that run the engine (the last ones); the others train (FSDP2 among them)
    max_staleness: int = 8  # a sample is trained at most this many policy versions after its oldest token was sampled
    stale_policy: Literal["wait", "drop"] = "wait"  # wait: prompts are not handed out until their samples cannot exceed max_staleness; drop: handed out rollout.queue_size steps ahead and groups past the bound dropped (counted as stale_dropped_groups)
    partial: Literal["continue", "cut"] = "continue"  # a sample in flight at a weight update: continue on its KV under the new weights, or cut (KV dropped) and resumed by re-prefill under them; either way each token carries its version
    sync_bucket_mb: float = 512.0  # full mode: weights stream in buckets of this size, at most two in flight
    sync_delta: bool = False  # send each bucket as the elements that changed since the last sync (index + value) when that is smaller than the bucket, whole otherwise (never more than a full copy)

    def __post_init__(self):
        _require(self, "schedule", ("rollout_ranks",), lambda v: v >= 1, ">= 1")
        _require(self, "schedule", ("max_staleness",), lambda v: v >= 1, ">= 1")
        _require(self, "schedule", ("sync_bucket_mb",), lambda v: v > 0, "> 0")


@dataclass
class LogSection:
    every: int = 1  # a metrics row (metrics.jsonl, TensorBoard, wandb) every N steps
    tensorboard: bool = False
    wandb: bool = False
    progress: bool = True
    align_every: int = 0  # check-alignment (engine vs trainer distributions) every N steps, logged as align_*; 0 = off; one process only
    align_prompts: int = 4  # the step's first N prompts are the check's prompt set
    memory_every: int = 10  # host per-phase memory peaks (mem_<phase>_measured_bytes, the summary's measured peaks) on steps 0, 1 and every N-th only: each probe trims the heap (and so does the step's host hand-back), whose pages the next phase faults back in (1 = every step; a GPU measures every step)

    def __post_init__(self):
        _require(self, "log", ("every",), lambda v: v >= 1, ">= 1")
        _require(self, "log", ("align_every",), lambda v: v >= 0, ">= 0 (0 = off)")
        _require(self, "log", ("align_prompts",), lambda v: v >= 1, ">= 1")
        _require(self, "log", ("memory_every",), lambda v: v >= 1, ">= 1")


@dataclass
class MoeSection:
    """Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE); ignored by dense ones."""
    routing_replay: bool = True  # the engine records each token's experts, training replays them (weights from the current router)
    aux_loss_coef: float = 0.001  # load-balancing loss weight in the policy loss (0: off)
    z_loss_coef: float = 0.0  # router z-loss weight (squared logsumexp of router logits)
    replay_check_every: int = 10  # every N steps a forward without replay logs logprob_mismatch_max_noreplay and routing_flip_frac (0: never)

    def __post_init__(self):
        _require(self, "moe", ("aux_loss_coef", "z_loss_coef", "replay_check_every"),
                 lambda v: v >= 0, ">= 0")


@dataclass
class EnvSection:
    """Multi-turn rollouts (docs/envs.md): each sample is a trajectory of model turns and
    environment observations; empty ``name`` keeps single-turn rollouts."""
    name: str = ""  # environment: "" (single-turn), "tools" (tool calling), a registered name or pkg.module:factory
    max_turns: int = 4  # model turns per trajectory at most
    max_total_tokens: int = 0  # trajectory tokens (prompt, turns, observations) at most; 0 = the model's context
    turn_max_tokens: int = 0  # tokens per model turn at most; 0 = rollout.max_tokens
    time_limit_s: float = 30.0  # per environment call (reset or step); past it the trajectory ends and is counted
    workers: int = 16  # environment calls running at once (threads)
    kv_wait: Literal["resident", "swap"] = "resident"  # a trajectory's KV while its environment runs: kept on the device, or swapped to host memory and back
    tools: list = field(default_factory=lambda: ["calculator"])  # tools env: calculator, python (the reward.sandbox), or pkg.module:func
    tool_call_start: str = "<tool_call>"  # marker opening a tool call
    tool_call_end: str = "</tool_call>"  # marker closing a tool call (also where a turn stops)
    tool_call_format: Literal["json", "plain"] = "json"  # json: {"name", "arguments"}; plain: name:args or args (the first tool)
    tool_results: Literal["auto", "template", "plain"] = "auto"  # results as tool messages through the chat template (auto: when data.chat_template is on), or as result_template text
    tools_prompt: Literal["auto", "template", "system"] = "auto"  # how the model is told of its tools (chat prompts): template (the chat template renders `tools`), system (a system message describing each tool and the call syntax, for templates that ignore `tools`, e.g. SmolLM2's); auto: template when it renders them, else system
    result_template: str = "<tool_response>\n{result}\n</tool_response>\n"  # plain results: the text appended after a tool-calling turn
    max_output_chars: int = 2048  # a tool's output is cut to this many characters
    log_trajectories: int = 2  # trajectories per step written to trajectories.jsonl

    def __post_init__(self):
        _require(self, "env", ("max_turns", "workers", "max_output_chars"), lambda v: v >= 1,
                 ">= 1")
        _require(self, "env", ("max_total_tokens", "turn_max_tokens", "log_trajectories"),
                 lambda v: v >= 0, ">= 0")
        _require(self, "env", ("time_limit_s",), lambda v: v > 0, "> 0")
        if "{result}" not in self.result_template:
            raise OrbitError("config key 'env.result_template' must contain {result}")
        if not self.tool_call_start or not self.tool_call_end:
            raise OrbitError("config keys 'env.tool_call_start' / 'env.tool_call_end' must "
                             "be non-empty")


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoraSection = field(default_factory=LoraSection)
    train: TrainSection = field(default_factory=TrainSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    critic: CriticSection = field(default_factory=CriticSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    reward: RewardSection = field(default_factory=RewardSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    dist: DistSection = field(default_factory=DistSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    log: LogSection = field(default_factory=LogSection)
    moe: MoeSection = field(default_factory=MoeSection)
    env: EnvSection = field(default_factory=EnvSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check(value: Any, tp: Any, key: str, source: str) -> Any:
    """Coerce/check one value against a type annotation; raise naming the key."""
    where = f" in {source}" if source else ""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(typing.get_args(tp)):
            value = "on" if value else "off"  # YAML reads on / off as booleans
        if value not in typing.get_args(tp):
            choices = ", ".join(map(str, typing.get_args(tp)))
            raise OrbitError(f"config key '{key}'{where}: {value!r} is not one of {choices}")
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _check(value, args[0], key, source)
    if tp is bool:
        if not isinstance(value, bool):
            raise OrbitError(f"config key '{key}'{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise OrbitError(f"config key '{key}'{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise OrbitError(f"config key '{key}'{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise OrbitError(f"config key '{key}'{where}: expected a string, got {value!r}")
        return str(value)
    if tp is list or origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise OrbitError(f"config key '{key}'{where}: expected a list, got {value!r}")
        return value
    return value


def _apply(obj: Any, data: dict, prefix: str, source: str):
    if not isinstance(data, dict):
        raise OrbitError(f"config key '{prefix.rstrip('.') or '<root>'}'"
                         f"{' in ' + source if source else ''}: expected a mapping")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            near = ", ".join(sorted(names))
            raise OrbitError(f"config key '{key}'{' in ' + source if source else ''} does "
                             f"not exist (known under '{prefix.rstrip('.') or '<root>'}': {near})")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur):
            _apply(cur, v, key + ".", source)
        else:
            setattr(obj, k, _check(v, hints[k], key, source))


def _revalidate(cfg: Config):
    for f in dataclasses.fields(cfg):
        sec = getattr(cfg, f.name)
        if hasattr(sec, "__post_init__"):
            sec.__post_init__()
    _combinations(cfg)


def _combinations(cfg: Config):
    """Keys of different sections that cannot go together (one line naming them)."""
    a, shape = cfg.algo, cfg.schedule.shape
    if a.dynamic_sampling and a.dynamic_sampling_rounds and shape != "colocated":
        # the rollout ranks get each step's prompts in one order ahead of training
        raise OrbitError(f"config key 'algo.dynamic_sampling_rounds' must be 0 with "
                         f"schedule.shape {shape} (refill rounds run on the colocated engine; "
                         f"separate pools drop flat groups only)")


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", parsed c); the value is read as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise OrbitError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=1e-4")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _read_yaml(p: Path) -> dict:
    if not p.exists():
        raise OrbitError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" (line {line + 1})" if line is not None else ""
        raise OrbitError(f"{p}: not valid YAML{at}") from None
    except UnicodeDecodeError:
        raise OrbitError(f"{p}: not a text file") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise OrbitError(f"{p}: expected a YAML mapping of sections, got {type(data).__name__}")
    return data


def builtin_run_settings(model_path: str) -> Path | None:
    """The run settings a built-in model ships (``builtin/NAME/orbitrl.yaml``): the
    defaults are chosen to be safe across models, and the shipped tiny model is tuned
    apart (a larger learning rate, for one). None for any other model."""
    if not str(model_path).startswith("builtin:"):
        return None
    f = Path(__file__).resolve().parent / "builtin" / str(model_path).split(":", 1)[1] / \
        "orbitrl.yaml"
    return f if f.is_file() else None


def load_config(path: str | Path | None = None, overrides: Optional[list[str]] = None,
                base: Optional[dict] = None) -> Config:
    """Build a Config from defaults, then a built-in model's own settings (when the run's
    model is built in), then ``base``, then a YAML file, then overrides."""
    layers: list[tuple[dict, str]] = []
    if base:
        layers.append((base, ""))
    if path:
        p = Path(path)
        layers.append((_read_yaml(p), str(p)))
    for item in overrides or []:
        key, value = parse_override(item)
        nested: dict = {}
        cur = nested
        parts = key.split(".")
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
        layers.append((nested, "--set"))
    model_path = BUILTIN_MODEL
    for data, _ in layers:
        m = data.get("model")
        if isinstance(m, dict) and "path" in m:
            model_path = m["path"]
    tuned = builtin_run_settings(model_path)
    if tuned is not None:
        layers.insert(0, (_read_yaml(tuned), str(tuned)))
    cfg = Config()
    for data, source in layers:
        _apply(cfg, data, "", source)
    _revalidate(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path):
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
