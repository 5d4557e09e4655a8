"""A reward model: our decoder as the backbone and a scalar head read at one token per row.

Two checkpoint formats load (``load_reward_model``):

- transformers' sequence classifiers (``config.json`` ``architectures``
  ``XxxForSequenceClassification`` for a family our decoder loads): the backbone's weights
  ``model.*`` as in the causal LM, no ``lm_head``, and ``score.weight`` [1, H] without a
  bias. The score is read where transformers reads it: at each row's rightmost token that
  is not ``pad_token_id`` (the last token when the config has none). ``save_reward_model``
  writes this format, so a model ``orbitrl rm`` trained loads in transformers as
  ``AutoModelForSequenceClassification``.
- orbitrl's first format: a causal-LM directory plus ``reward_head.safetensors``
  (``weight`` [1, H], ``bias`` [1]), read at the last token.

A family without native code (``model/hf_fallback.py``) loads, trains and saves through
transformers: its sequence classifier's backbone behind ``HFDecoder`` and its ``score``, or
its causal LM with a fresh head, saved as transformers' sequence classifier of that family.

A (prompt, completion) becomes token ids one way for training and scoring alike
(``reward_ids``): through the tokenizer's chat template as a user turn and the assistant's
reply when it has one (what reward models on the Hub expect), else the two texts joined.
Trained by ``train/rm.py`` (``orbitrl rm``); a reward source through ``rl/reward_model.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from orbitrl.errors import OrbitError
from orbitrl.model.config import FAMILIES, is_native
from orbitrl.model.decoder import Decoder
from orbitrl.model.hf_fallback import HFDecoder, load_hf_model
from orbitrl.model.tokenizer import save_tokenizer
from orbitrl.model.weights import export_state_dict, load_model, to_dtype

HEAD_FILE = "reward_head.safetensors"
# model_type -> transformers' sequence classifier (tests check it against transformers)
SEQCLS = {"llama": "LlamaForSequenceClassification",
          "mistral": "MistralForSequenceClassification",
          "qwen2": "Qwen2ForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
          "mixtral": "MixtralForSequenceClassification",
          "qwen2_moe": "Qwen2MoeForSequenceClassification",
          "qwen3_moe": "Qwen3MoeForSequenceClassification",
          "smollm3": "SmolLM3ForSequenceClassification",
          "olmo2": "Olmo2ForSequenceClassification", "olmo3": "Olmo3ForSequenceClassification",
          "phi3": "Phi3ForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification",
          "gemma3_text": "Gemma3TextForSequenceClassification",
          "gpt_oss": "GptOssForSequenceClassification",
          "deepseek_v3": "DeepseekV3ForSequenceClassification"}


class ScalarRewardModel(nn.Module):
    """A backbone and a scalar head.

    Args:
        backbone: the decoder (its ``lm_head`` is never used; None when loaded from a
            classifier).
        score: ``nn.Linear(H, 1)``.
        pad_id: the classifier's ``pad_token_id`` (rows are padded with it and read at the
            rightmost other token, as transformers reads them); None: each row's last token.
    """

    def __init__(self, backbone: Decoder, score: nn.Linear, pad_id: int | None):
        super().__init__()
        self.backbone, self.score, self.pad_id = backbone, score, pad_id

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """Rewards [B] (fp32) of token rows, right-padded into one forward."""
        B, T, dev = len(rows), max(map(len, rows)), self.device
        ids = torch.full((B, T), self.pad_id or 0, dtype=torch.long)
        sid = torch.full((B, T), -1, dtype=torch.long)  # -1: padding
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            sid[i, :len(r)] = 0
        ids, sid = ids.to(dev), sid.to(dev)  # (built on the host: one copy each)
        pos = torch.arange(T, device=dev).expand(B, T)
        h = self.backbone(ids, positions=pos, seq_ids=sid, return_hidden=True)  # [B, T, H]
        if self.pad_id is None:
            last = torch.tensor([len(r) - 1 for r in rows], device=dev)
        else:  # transformers' rule: the rightmost token that is not padding
            last = (torch.arange(T, device=dev) * (ids != self.pad_id)).argmax(-1)
        return self.score(h[torch.arange(B, device=dev), last]).squeeze(-1).float()

    @torch.no_grad()
    def scores(self, rows: list[list[int]], batch_size: int = 16) -> list[float]:
        """Rewards of many rows, ``batch_size`` rows per forward (sorted by length first, so
        each forward pads little), in the rows' order."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out = [0.0] * len(rows)
        for c in range(0, len(order), max(1, batch_size)):
            chunk = order[c:c + max(1, batch_size)]
            for i, r in zip(chunk, self([rows[i] for i in chunk]).tolist()):
                out[i] = r
        return out


def reward_ids(tok, prompt: str, completion: str) -> list[int]:
    """Token ids a reward model reads for one (prompt, completion): with a chat template,
    the conversation of a user turn ``prompt`` and the assistant's reply ``completion``
    (the template's end-of-turn included); without one, ``prompt + completion``; no
    special tokens beyond the template's own."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": completion}],
                                       tokenize=False)
    else:
        text = prompt + completion
    return list(tok(text, add_special_tokens=False)["input_ids"])


def classifier_labels(path: Path) -> int | None:
    """The number of labels of a sequence classifier's config.json (None: not one)."""
    hf = _config(path)
    if not str((hf.get("architectures") or [""])[0]).endswith("ForSequenceClassification"):
        return None
    return len(hf["id2label"]) if hf.get("id2label") else int(hf.get("num_labels", 2))


def load_reward_model(path: str | Path, dtype="float32", device="cpu") -> ScalarRewardModel:
    """A reward model directory in either format (module docstring), in ``dtype`` on
    ``device``; one-line errors name the file."""
    path = Path(path)
    labels = classifier_labels(path)
    if labels is not None and labels != 1:
        raise OrbitError(f"{path / 'config.json'}: a classifier with {labels} labels; a "
                         "reward model has one (num_labels 1: the scalar reward)")
    if labels is None and not (path / HEAD_FILE).exists():
        raise OrbitError(f"{path}: not a reward model (neither a *ForSequenceClassification "
                         f"config.json nor a {HEAD_FILE} scalar head)")
    if not native(path):
        return _load_through_transformers(path, labels, dtype, device)
    extra: dict[str, torch.Tensor] = {}
    backbone = load_model(path, dtype=dtype, device=device, extra=extra)
    H = backbone.config.hidden_size
    if labels is not None:
        sd, where, pad = {"weight": extra.pop("score.weight", None)}, path, \
            _config(path).get("pad_token_id")
        if sd["weight"] is None:
            raise OrbitError(f"{path}: sequence classifier without 'score.weight'")
    else:
        sd, where, pad = load_file(str(path / HEAD_FILE)), path / HEAD_FILE, None
    if extra:
        raise OrbitError(f"{path}: unexpected weight {next(iter(extra))!r} for a reward model")
    want = {"weight": (1, H)} if labels is not None else {"weight": (1, H), "bias": (1,)}
    if {k: tuple(v.shape) for k, v in sd.items()} != want:
        raise OrbitError(f"{where}: expected the head {want}, got "
                         f"{ {k: tuple(v.shape) for k, v in sd.items()} }")
    head = nn.Linear(H, 1, bias="bias" in sd).to(device=device, dtype=to_dtype(dtype))
    head.load_state_dict(sd)
    return ScalarRewardModel(backbone, head, pad)


def native(path: Path) -> bool:
    """Whether the model at ``path`` has native code (False: a causal LM or sequence
    classifier that runs through transformers; anything else stops with one line)."""
    if classifier_labels(path) is not None:
        return _config(path).get("model_type") in FAMILIES
    return is_native(path)


def _score_head(module, source) -> nn.Linear:
    """A transformers sequence classifier's scalar head (``score``, one output, no bias)."""
    head = getattr(module, "score", None)
    if not isinstance(head, nn.Linear) or head.out_features != 1 or head.bias is not None:
        raise OrbitError(f"{source}: the classifier's head is not a bias-free linear 'score' "
                         "with one output; orbitrl reads such reward models only")
    return head


def _load_through_transformers(path: Path, labels: int | None, dtype, device
                               ) -> ScalarRewardModel:
    """A reward model of a family without native code: a transformers sequence classifier
    (its backbone and ``score``), or a causal LM plus orbitrl's head file."""
    if labels is None:  # the first format: the causal LM and reward_head.safetensors
        backbone = load_hf_model(path, str(to_dtype(dtype)).replace("torch.", ""), device)
        sd = load_file(str(path / HEAD_FILE))
        head = nn.Linear(backbone.config.hidden_size, 1).to(device=device, dtype=to_dtype(dtype))
        try:
            head.load_state_dict(sd)
        except RuntimeError as e:
            raise OrbitError(f"{path / HEAD_FILE}: not a scalar head ({e})") from None
        return ScalarRewardModel(backbone, head, None)
    from transformers import AutoModelForSequenceClassification  # fallback families only

    from transformers.utils import logging as hf_logging  # as above

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (its loading bar; the run prints its own lines)
    try:
        hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=to_dtype(dtype))
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    head = _score_head(hf, path / "config.json")
    raw = _config(path)
    return ScalarRewardModel(HFDecoder(hf.to(device), raw).eval(), head, raw.get("pad_token_id"))


def new_reward_model(path: str | Path, tok=None, device="cpu", seed: int = 0
                     ) -> ScalarRewardModel:
    """A reward model to train from a model directory, in fp32: a sequence classifier as
    it is, else the causal LM's backbone (its ``lm_head`` dropped) and a fresh head
    (normal, std 0.02, as transformers initialises one; ``seed``) read past padding
    ``pad_token_id`` of config.json, else the tokenizer ``tok``'s pad token, else its
    end-of-sequence token (the saved classifier needs one to score batches)."""
    path = Path(path)
    if classifier_labels(path) is not None:
        return load_reward_model(path, device=device)
    if native(path):
        backbone = load_model(path, device=device)
        backbone.lm_head = None
    else:  # through transformers (its lm_head stays: transformers' module owns it)
        backbone = load_hf_model(path, "float32", device)
    H = backbone.config.hidden_size
    head = nn.Linear(H, 1, bias=False, device=device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, H, generator=torch.Generator().manual_seed(seed)) * 0.02)
    pads = [backbone.config.hf.get("pad_token_id"), getattr(tok, "pad_token_id", None),
            getattr(tok, "eos_token_id", None)]
    return ScalarRewardModel(backbone, head, next((p for p in pads if p is not None), None))


def save_reward_model(rm: ScalarRewardModel, out: str | Path, tokenizer=None) -> Path:
    """Write ``rm`` as transformers' ``XxxForSequenceClassification`` (one label, its
    ``pad_token_id``, ``model.*`` and ``score.weight`` in model.safetensors) plus the
    tokenizer's files."""
    out, cfg = Path(out), rm.backbone.config
    if rm.score.bias is not None:
        raise OrbitError(f"{out}: a head with a bias has no sequence-classifier form")
    if isinstance(rm.backbone, HFDecoder):
        return _save_through_transformers(rm, out, tokenizer)
    sd = {k: v for k, v in export_state_dict(rm.backbone).items() if k.startswith("model.")}
    sd["score.weight"] = rm.score.weight.detach()
    sd = {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    dtype = str(sd["score.weight"].dtype).replace("torch.", "")
    hf = {**cfg.hf, "architectures": [SEQCLS[cfg.model_type]], "id2label": {"0": "LABEL_0"},
          "label2id": {"LABEL_0": 0}, "pad_token_id": rm.pad_id, "dtype": dtype,
          "torch_dtype": dtype}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def _save_through_transformers(rm: ScalarRewardModel, out: Path, tokenizer=None) -> Path:
    """A reward model without native code as transformers' own sequence classifier of its
    family: the trained backbone's weights and the score head, its config's dropout rates
    as the checkpoint had them."""
    from transformers import AutoModelForSequenceClassification  # fallback families only

    conf = copy.deepcopy(rm.backbone.hf.config)
    for k, v in rm.backbone.dropout.items():
        setattr(conf, k, v)
    conf.num_labels, conf.pad_token_id, conf.architectures = 1, rm.pad_id, None
    conf.id2label, conf.label2id = {0: "LABEL_0"}, {"LABEL_0": 0}
    try:
        seq = AutoModelForSequenceClassification.from_config(conf)
    except ValueError as e:
        raise OrbitError(f"{out}: transformers has no sequence classifier for "
                         f"{conf.model_type!r} ({e})") from None
    seq.base_model.load_state_dict(rm.backbone.hf.base_model.state_dict())
    with torch.no_grad():
        _score_head(seq, out).weight.copy_(rm.score.weight.detach())
    seq.to(rm.score.weight.dtype).save_pretrained(out)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def save_reward_head(path: str | Path, weight: torch.Tensor, bias: torch.Tensor):
    """Write the first format's scalar head beside a model directory's weights."""
    save_file({"weight": weight.detach().reshape(1, -1).contiguous().cpu(),
               "bias": bias.detach().reshape(1).contiguous().cpu()}, str(Path(path) / HEAD_FILE))


def _config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise OrbitError(f"{path}: no config.json (a model directory needs one)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise OrbitError(f"{f}: not valid JSON ({e.msg})") from None
