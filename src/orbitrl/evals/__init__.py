"""Capability evaluations: HumanEval pass@k through the code sandbox, GSM8K-format math
scored by math-verify. Greedy and sampled completions come from the rollout engine
(batched, the n samples of a prompt share its KV blocks); see docs/eval.md."""
