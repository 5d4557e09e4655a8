"""The ledger's other auto choices for a run: recomputation (``train.recompute: auto``), the
frozen base's format (``model.base_dtype: auto``) and whether a reference copy is loaded."""

from orbitrl.config import load_config
from orbitrl.ledger import runtime
from orbitrl.ledger.memory import activation_bytes
from orbitrl.ledger.models import from_config

SMOL = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            max_position_embeddings=8192, tie_word_embeddings=True)
GiB = 1 << 30


def cfg(*sets):
    return load_config(None, ["model.path=x", "rollout.n=8", "rollout.prompts_per_step=4",
                              "rollout.max_tokens=16", *sets])


def test_recompute_auto_is_on_where_full_mode_saves_more_than_its_weights():
    full = cfg("train.mode=full")
    assert runtime.resolve_recompute(full, SMOL, 47)  # 32 x 63 tokens: 3.5 GB vs 0.54 GB
    shape = from_config(SMOL)
    saved = activation_bytes(shape, 32 * 63, False, 1, 4, fp64_attention=True)
    assert saved > 5 * shape.total_params * 4  # 3.0 GB priced against 0.54 GB
    # a step small enough that its activations fit beside the weights: off
    assert not runtime.resolve_recompute(cfg("train.mode=full", "rollout.n=2",
                                             "rollout.prompts_per_step=1",
                                             "rollout.max_tokens=4"), SMOL, 8)
    assert not runtime.resolve_recompute(cfg(), SMOL, 47)  # adapters: the batch is cut
    assert not runtime.resolve_recompute(cfg("train.mode=full", "train.recompute=false"),
                                         SMOL, 47)  # explicit: kept
    assert runtime.resolve_recompute(cfg("train.recompute=true"), SMOL, 47)
    assert runtime.resolve_recompute(cfg("train.mode=full", "train.tiers=1",
                                         "train.recompute=false"), SMOL, 47)  # tiers imply it


def test_base_auto_takes_the_widest_format_the_memory_allows():
    c = cfg()
    peaks = {f: runtime.runtime_prediction(cfg(f"model.base_dtype={f}"), SMOL, 47)["peak"]
             for f in ("fp32", "int8", "nf4mix", "nf4")}
    assert peaks["fp32"] > peaks["int8"] > peaks["nf4mix"] > peaks["nf4"]
    share = runtime.BASE_SHARE
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu", 24 * GiB) == "fp32"
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu", int(peaks["fp32"] / share)) == "fp32"
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu",
                                     int(peaks["fp32"] / share) - 1) == "int8"
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu",
                                     int(peaks["int8"] / share) - 1) == "nf4mix"
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu",
                                     int(peaks["nf4mix"] / share) - 1) == "nf4"
    assert runtime.choose_base_dtype(c, SMOL, 47, "cpu", 1) == "nf4"  # nothing fits: nf4
    assert runtime.choose_base_dtype(cfg("train.mode=full"), SMOL, 47, "cpu", 1) == "fp32"
    assert runtime.choose_base_dtype(cfg("model.dtype=bf16"), SMOL, 47, "cuda",
                                     80 * GiB) == "bf16"
    assert c.model.base_dtype == "auto"  # the trial formats never leak into the config


def test_a_reference_is_priced_only_when_a_kl_term_reads_it():
    def host_ref(*sets):
        terms = runtime.runtime_prediction(cfg("train.mode=full", *sets), SMOL, 47)["terms"]
        return terms["train"].get("host:reference:weights", 0)

    assert not runtime.reference_needed(cfg("algo.kl_coef=0"))
    assert runtime.reference_needed(cfg("algo.kl_coef=0.01"))
    assert runtime.reference_needed(cfg("algo.kl_coef=0", "algo.kl_in_reward=true"))
    assert host_ref("algo.kl_coef=0") == 0 and host_ref("algo.kl_coef=0.01") > 100 << 20


def test_offloaded_activations_move_the_layer_inputs_to_the_host_on_a_gpu():
    """``train.offload_activations`` on CUDA: each recomputed layer's saved input (hidden
    x tokens in the activations' dtype) leaves the device's train phase for the host, all but the
    one in flight; on a CPU the host is the device and nothing is saved."""
    shape = from_config(SMOL)
    # long replies: the micro-batch's activations, not the update's copies, set the peak
    on = cfg("train.mode=full", "train.recompute=true", "train.offload_activations=true",
             "rollout.max_tokens=512")
    off = cfg("train.mode=full", "train.recompute=true", "rollout.max_tokens=512")
    pon = runtime.runtime_prediction(on, SMOL, 47, device="cuda", recompute=True)
    poff = runtime.runtime_prediction(off, SMOL, 47, device="cuda", recompute=True)
    spec = runtime.RunSpec.from_config(on, 47, 1, "cuda", True, shape)
    tokens = spec.workload.micro_tokens  # positions of a micro-batch at the cap
    moved = spec.workload.act_bytes * tokens * shape.hidden * (shape.num_layers - 1)
    # the tied embedding's update runs after the backward has freed the activations: the
    # peak is the larger of the backward (activations + the held head gradient) and it
    t = poff["terms"]["train"]
    live = t["activations:saved"] + t["activations:backward"] + t["activations:logits"]
    big = runtime.largest_tensor_params(shape) * 4
    update = runtime.update_copies("adalomo", "grouped") * big
    assert poff["train"] - pon["train"] == min(moved, live + big - update) > 0
    assert pon["rollout"] == poff["rollout"] and pon["score"] == poff["score"]
    cpu_on = runtime.runtime_prediction(on, SMOL, 47, recompute=True)
    cpu_off = runtime.runtime_prediction(off, SMOL, 47, recompute=True)
    assert cpu_on["train"] == cpu_off["train"]


def test_a_tied_embedding_is_updated_after_the_activations_are_freed():
    """Stateless full mode: the head's gradient is held through the backward beside the
    saved activations, the update's copies come after them (the embedding's backward ends
    the pass); an untied head is updated at the start, beside the activations."""
    shape = from_config(SMOL)
    big = runtime.largest_tensor_params(shape) * 4
    copies = runtime.update_copies("adalomo", "grouped")  # full mode's defaults
    t = runtime.runtime_prediction(cfg("train.mode=full", "train.recompute=true"), SMOL, 47,
                                   recompute=True)["terms"]["train"]
    live = t["activations:saved"] + t["activations:backward"] + t["activations:logits"]
    # the head's gradient, the embedding's and their sum at the accumulation, or the update
    assert t["actor:update_workspace"] == max(big, max(3, copies) * big - live)
    untied = dict(SMOL, tie_word_embeddings=False)
    u = runtime.runtime_prediction(cfg("train.mode=full", "train.recompute=true"), untied, 47,
                                   recompute=True)["terms"]["train"]
    assert u["actor:update_workspace"] == copies * big


def test_the_fused_update_copies_follow_the_clip():
    """AdaLomo's grouped clip never scales an fp32 gradient (train/optim.py: coefficient 1,
    ``g.float()`` is ``g``): the gradient and g^2 or u, two tensors of the largest one's
    size; a global clip adds the scaled copy; SGD holds the gradient and its step."""
    assert runtime.update_copies("adalomo", "grouped") == 2
    assert runtime.update_copies("adalomo", "global") == 3
    assert runtime.update_copies("adalomo", "grouped", "bf16") == 3  # g.float() copies
    assert runtime.update_copies("sgd", "global") == 2
    shape = from_config(dict(SMOL, tie_word_embeddings=False))
    big = runtime.largest_tensor_params(shape) * 4
    untied = dict(SMOL, tie_word_embeddings=False)
    grouped = runtime.runtime_prediction(cfg("train.mode=full"), untied, 47)
    glob = runtime.runtime_prediction(cfg("train.mode=full", "train.clip=global"), untied, 47)
    assert grouped["terms"]["train"]["actor:update_workspace"] == 2 * big
    assert glob["terms"]["train"]["actor:update_workspace"] == 3 * big
