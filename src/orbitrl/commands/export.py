"""`orbitrl export RUN_DIR --format peft|hf --out DIR`: the run's final policy as PEFT
adapters or as a merged Hugging Face model directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from orbitrl.errors import OrbitError


def add_arguments(parser):
    parser.add_argument("run_dir", help="a run directory written by orbitrl train")
    parser.add_argument("--format", choices=["peft", "hf"], default="peft")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default=None, help="hf export dtype (default: fp32)")


def run(args) -> int:
    from orbitrl.config import load_config  # start-up: kept off --help

    run_dir = Path(args.run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.exists():
        raise OrbitError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_config(cfg_file)
    final = run_dir / "checkpoints" / "final"
    if not final.exists():
        raise OrbitError(f"{final}: missing (the run has not finished; nothing to export)")
    out = Path(args.out)
    if cfg.train.mode == "full" or not (final / "adapter_config.json").exists():
        if args.format == "peft":
            raise OrbitError(f"{run_dir}: no PEFT adapters (a full-parameter run, or LoRA on "
                             "a mixture's routed experts: final holds merged weights); use "
                             "--format hf")
        shutil.copytree(final, out, dirs_exist_ok=True)
        print(f"exported {final} -> {out}")
        return 0
    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.hf_fallback import load_any_model  # start-up: kept off --help
    from orbitrl.model.adapters import (  # start-up: kept off --help
        load_adapters, save_merged, trained_base)
    from orbitrl.model.builtin import resolve_model_path  # start-up: kept off --help

    path = resolve_model_path(cfg.model.path, cfg.model.revision).resolve()
    if args.format == "peft":
        shutil.copytree(final, out, dirs_exist_ok=True)
        _complete_peft_dir(out, path)
        print(f"exported adapters {final} -> {out} (base {path})")
        base = trained_base(final) or cfg.model.base_dtype
        if base not in ("fp32", "auto"):
            print(f"note: trained over a {base} base (recorded in "
                  f"{out / 'orbitrl_base.json'}); over the full-precision weights peft loads, "
                  f"its answers differ: `orbitrl eval --adapter {out}` uses the same base")
        return 0
    model = load_any_model(path)  # merge over the full-precision base
    load_adapters(model, final)
    save_merged(model, out, dtype=args.dtype, tokenizer=load_tokenizer(path))
    print(f"exported merged model -> {out}")
    return 0


def _complete_peft_dir(out: Path, base: Path):
    """Record the base directory and copy its tokenizer where a run's adapters lack them
    (runs written before both were saved), so that peft's
    ``AutoPeftModelForCausalLM.from_pretrained(out)`` loads the directory alone."""
    from orbitrl.model import load_tokenizer  # start-up: kept off --help
    from orbitrl.model.adapters import CONFIG_NAME  # start-up: kept off --help
    from orbitrl.model.tokenizer import save_tokenizer  # start-up: kept off --help

    cfg_file = out / CONFIG_NAME
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OrbitError(f"{cfg_file}: cannot read the adapter config ({e})") from None
    if not cfg.get("base_model_name_or_path"):
        cfg["base_model_name_or_path"] = str(base)
        cfg_file.write_text(json.dumps(cfg, indent=2))
    if not (out / "tokenizer_config.json").exists():
        save_tokenizer(load_tokenizer(base), out)
