"""A command prints orbitrl's own output only: torchao's extension-load warnings and torch's
pytree deprecation notice are filtered at their loggers; other records still pass."""

import logging
import subprocess
import sys

import orbitrl  # noqa: F401  (installs the filters)


def test_train_prints_no_third_party_lines(tmp_path):
    cmd = [sys.executable, "-m", "orbitrl", "train", "--out", str(tmp_path / "run"),
           "--set", "train.max_steps=1", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.n=2", "--set", "rollout.max_tokens=3",
           "--set", "data.heldout_size=4", "--set", "log.progress=false"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    foreign = [ln for ln in (res.stdout + res.stderr).splitlines()
               if "Failed to load" in ln or "Warning" in ln or "warnings.warn" in ln
               or "site-packages" in ln]
    assert not foreign, "\n".join(foreign[:5])
    assert [ln for ln in res.stderr.splitlines() if ln.strip()] == []


def test_generate_prints_its_summary_only(tmp_path):
    """(The CLI freezes the collector before exit; with triton loaded it must not, or
    triton's bindings list every object alive at exit as a leak.)"""
    (tmp_path / "in.jsonl").write_text('{"prompt": "12+34="}\n')
    cmd = [sys.executable, "-m", "orbitrl", "generate", "--model", "builtin:tiny-arith",
           "--prompts", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
           "--n", "2", "--max-tokens", "4", "--chat-template", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("generated "), lines[:5]


def test_only_the_known_messages_are_dropped():
    class Keep(logging.Handler):  # on the loggers themselves: torch's do not propagate
        def __init__(self):
            super().__init__(logging.WARNING)
            self.seen = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    keep = Keep()
    for lg in (ao, pytree):
        lg.addHandler(keep)
    try:
        ao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning("%s is an Enum subclass and is now natively supported ... Calling "
                       "register_constant() on Enum subclasses is deprecated", "<enum 'K'>")
        ao.warning("a different torchao warning")
        pytree.warning("a different pytree warning")
    finally:
        for lg in (ao, pytree):
            lg.removeHandler(keep)
    assert keep.seen == ["a different torchao warning", "a different pytree warning"]
