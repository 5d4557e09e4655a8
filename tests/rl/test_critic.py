"""PPO's critic network (``critic.kind: model``, rl/critic.py): a decoder of its own over
the policy's shared frozen base (or its own base or weights), its own optimizer, its own
ledger terms, its state in checkpoints; it fits the returns and PPO learns with it."""

import math

import pytest
import torch

from orbitrl.config import load_config
from orbitrl.errors import OrbitError
from orbitrl.model.lora import adapter_parameters
from orbitrl.observe.metrics import read_metrics
from orbitrl.rewards import register
from orbitrl.rl.checkpoint.state import restore_scalars, scalar_state
from orbitrl.rl.critic import ValueHead, ValueModel
from orbitrl.rl.run import run_training
from trainer_helpers import make_trainer

SMALL = ["rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=4",
         "data.heldout_size=8", "model.base_dtype=int8", "algo.name=ppo"]


@register("test_length_ppo", override=True)
def _length(prompt, completion, **f):
    return float(len(completion))


def make(*over):
    return make_trainer(*SMALL, "reward.name=test_length_ppo", *over)


def test_adapter_critic_shares_the_policys_frozen_base():
    tr = make()
    critic = tr.critic.module
    assert isinstance(critic, ValueModel)
    policy, dec = tr.model, critic.decoder
    frozen = [p for p in policy.parameters() if not p.requires_grad]
    own = adapter_parameters(dec)
    # every frozen tensor is the policy's own; the adapters are new tensors
    shared = {id(p) for p in dec.parameters() if not p.requires_grad}
    assert shared == {id(p) for p in frozen}
    assert not {id(p) for p in own} & {id(p) for p in adapter_parameters(policy)}
    assert {id(p) for p in tr.critic.parameters()} == {id(p) for p in own} | \
        {id(critic.head.weight)}
    # starting from the policy's adapters (B = 0): the policy's hidden states exactly
    ids = torch.tensor([[1, 5, 9, 4, 7, 3]])
    with torch.no_grad():
        a = policy(ids, return_hidden=True)
        b = dec(ids, return_hidden=True)
    assert torch.equal(a, b)
    # the checkpoint holds the trained tensors only (not the shared base)
    assert set(critic.state_dict()) == {n for n, p in critic.named_parameters()
                                        if p.requires_grad}


def test_critic_trains_on_its_own_and_round_trips_through_a_checkpoint():
    tr = make()
    before = [p.detach().clone() for p in tr.critic.parameters()]
    policy_before = [p.detach().clone() for p in tr.policy.trainable]
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters()
              if not p.requires_grad}
    row = tr.step()
    tr.step()  # (the head starts at zero: the adapters move from the second update)
    assert row["step_skipped"] == 0 and math.isfinite(row["value_loss"])
    after = list(tr.critic.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, after))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, tr.policy.trainable))
    # the shared base is untouched by either update
    assert all(torch.equal(p, frozen[n]) for n, p in tr.model.named_parameters()
               if n in frozen)
    state = scalar_state(tr, {})
    tr2 = make()
    restore_scalars(tr2, state)
    assert all(torch.equal(a, b) for a, b in zip(tr.critic.parameters(),
                                                 tr2.critic.parameters()))
    assert tr2.critic.opt.state_dict()["state"].keys() == \
        tr.critic.opt.state_dict()["state"].keys()


@pytest.mark.parametrize("over, owns_base", [(["critic.base_dtype=fp32"], True),
                                             (["critic.mode=full"], True),
                                             ([], False)])
def test_critic_terms_in_the_ledger(over, owns_base):
    """The prediction carries the critic's entries: an adapter critic over the shared base
    adds its adapters, their gradients and AdamW moments (16 bytes each); its own base or
    full weights add those too; the head-only critic adds nothing."""
    tr = make(*over)
    terms = tr.mem.prediction["terms"]
    adapters = sum(p.numel() for p in adapter_parameters(tr.critic.module.decoder))
    assert terms["train"]["critic:grads"] > 0
    total = terms["train"]["critic:weights"] + terms["train"].get("critic:optimizer", 0)
    if not owns_base:
        assert total + terms["train"]["critic:grads"] == 16 * adapters
    else:  # its own base (fp32) or weights: at least the decoder's bytes
        own = sum(p.numel() * p.element_size() for p in tr.critic.module.decoder.parameters()
                  if over == ["critic.mode=full"] or not p.requires_grad)
        assert 0.9 * own <= terms["train"]["critic:weights"] <= 1.1 * own + 4 * adapters
    head = make("critic.kind=head")
    assert isinstance(head.critic.module, ValueHead)
    assert not any(k.startswith("critic:") for k in head.mem.prediction["terms"]["train"])


@pytest.mark.parametrize("tiers", [0, 1])
def test_full_critic_steps_with_a_fused_update_and_an_adamw_head(tiers):
    tr = make("critic.mode=full", f"critic.tiers={tiers}")
    assert tr.critic.fused and tr.critic.head_opt is not None
    assert (getattr(tr.critic.module.decoder, "residency", None) is not None) == bool(tiers)
    dec = [p.detach().clone() for p in tr.critic.module.decoder.parameters()]
    for _ in range(2):
        row = tr.step()
    assert row["step_skipped"] == 0 and math.isfinite(row["value_loss"])
    assert tr.critic.module.head.weight.abs().sum() > 0
    assert any(not torch.equal(a, b) for a, b in zip(dec, tr.critic.module.decoder.parameters()))


def test_critic_keys_are_checked():
    with pytest.raises(OrbitError, match="critic.tiers"):
        load_config(None, ["critic.tiers=1", "critic.mode=adapter"])
    with pytest.raises(OrbitError, match="critic.kind"):
        load_config(None, ["critic.kind=mlp"])


def test_ppo_with_the_critic_network_fits_returns_and_learns(tmp_path):
    """The built-in task's default run, 12 steps, seed 0, one core (test_learning's
    setting): the critic's explained variance rises from 0 (its head starts at zero) and
    PPO reaches GRPO's held-out accuracy within two of 64 rows (measured at seeds 0-3:
    GRPO 0.92-0.95, PPO with the critic network 0.91-0.95; explained variance over the
    first four steps 0.00-0.01, over the last four 0.07-0.12)."""
    common = ["train.max_steps=12", "train.workers=1", "train.seed=0", "data.heldout_size=64",
              "log.progress=false", "checkpoint.every=0"]
    acc = {}
    for algo in ("grpo", "ppo"):
        cfg = load_config(None, [f"algo.name={algo}", *common])
        s = run_training(cfg, tmp_path / algo, echo=lambda *a: None)
        acc[algo] = s["heldout_accuracy_after"]
    ev = [r["explained_var"] for r in read_metrics(tmp_path / "ppo" / "metrics.jsonl")]
    assert len(ev) == 12
    assert sum(ev[-4:]) / 4 > sum(ev[:4]) / 4 + 0.03
    assert acc["ppo"] >= acc["grpo"] - 2 / 64
    assert acc["ppo"] > 0.8


@pytest.mark.parametrize("mode", ["adapter", "full"])
def test_critic_starts_from_a_sequence_classifier(tmp_path, mode):
    """critic.path: a one-label transformers sequence classifier of the policy's vocabulary
    (as orbitrl rm writes) gives the critic its decoder and the head its score row."""
    import json
    import shutil

    import transformers

    from orbitrl.model.builtin import resolve_model_path

    src = resolve_model_path("builtin:tiny-arith")
    hf = json.loads((src / "config.json").read_text())
    conf = transformers.AutoConfig.for_model(**{**hf, "num_labels": 1,
                                                "architectures": None})
    torch.manual_seed(0)
    rm = transformers.AutoModelForSequenceClassification.from_config(conf)
    rm.save_pretrained(tmp_path / "rm")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, tmp_path / "rm" / f.name)
    tr = make(f"critic.path={tmp_path / 'rm'}", f"critic.mode={mode}")
    crit = tr.critic.module
    assert torch.equal(crit.head.weight.detach(), rm.score.weight.detach())
    want = dict(rm.model.named_parameters())
    got = {n.removeprefix("model."): p for n, p in crit.decoder.named_parameters()
           if n.startswith("model.") and "lora_" not in n}
    name = "layers.0.self_attn.q_proj.weight"
    mine = got.get(name, got.get(name.replace(".weight", ".base_layer.weight")))
    if mode == "full":
        assert torch.equal(mine.detach(), want[name].detach())
    assert torch.equal(got["embed_tokens.weight"].detach(), want["embed_tokens.weight"].detach())
    assert tr.step()["step_skipped"] == 0
    three = transformers.AutoModelForSequenceClassification.from_config(
        transformers.AutoConfig.for_model(**{**hf, "num_labels": 3, "architectures": None}))
    three.save_pretrained(tmp_path / "rm3")
    with pytest.raises(OrbitError, match="3 labels"):
        make(f"critic.path={tmp_path / 'rm3'}")


def test_measured_role_bytes_count_the_shared_base_once():
    """summary.json's role_bytes (observe/memory.py role_bytes): an adapter critic over the
    shared base holds its adapters, its head and their AdamW moments, nothing more."""
    from orbitrl.observe.memory import role_bytes

    tr = make()
    tr.step()
    got = role_bytes({"actor": [tr.model, tr.opt],
                      "critic": [tr.critic.module, tr.critic.opt]})
    n = sum(p.numel() for p in tr.critic.parameters())
    tensors = len(tr.critic.parameters())
    assert 12 * n <= got["critic"] <= 12 * n + 16 * tensors  # + AdamW's step counters
    # the actor: the same adapters and moments plus the base the critic shares
    base = sum(p.numel() * p.element_size() for p in tr.model.parameters() if not p.requires_grad)
    assert got["actor"] >= got["critic"] + 0.9 * base
