"""Multi-turn rollout: trajectories of model turns and environment observations.

Each sample is one trajectory, and one engine sequence from its first token to its last:
a turn ends at the tool-call end marker (a stop string) or at eos; the sequence is parked
with its KV kept (``SamplingParams.keep_kv``); the environment's step runs in a worker
thread (``envs.calls``) while the engine decodes the other trajectories; its observation's
tokens are appended with ``Engine.resume``, which prefills only them. With ``env.kv_wait:
swap`` the parked KV is copied to host memory for the wait and back when the turn resumes.

The sample's completion is everything after the prompt (model and environment tokens);
``loss_mask`` marks the model's tokens (1) and the environment's (0), so loss and KL see
only what the policy sampled. A trajectory whose environment fails or passes its time
limit ends there and is dropped with its group (GRPO needs whole groups), counted in the
step's metrics; the step trains on the rest.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field, replace

from orbitrl.engine import Request, SamplingParams
from orbitrl.envs import get_env
from orbitrl.envs.base import as_step_result
from orbitrl.envs.calls import EnvCalls
from orbitrl.envs.tool_env import syntax_of, tools_of
from orbitrl.envs.tools import describe_tools, tool_schemas
from orbitrl.errors import OrbitError
from orbitrl.ledger.kv import waiting_kv_bytes
from orbitrl.rl.types import Sample


@dataclass
class Trajectory:
    index: int
    group: int
    row: dict
    env: object
    messages: list = field(default_factory=list)  # chat messages so far (template results)
    seq: object = None  # the engine Sequence
    tokens: list = field(default_factory=list)  # after the prompt: model and env tokens
    mask: list = field(default_factory=list)    # 1 model token, 0 environment token
    logprobs: list = field(default_factory=list)  # 0.0 on environment tokens
    turns: int = 0
    prefill: list = field(default_factory=list)  # tokens prefilled per resumed turn
    history: list = field(default_factory=list)  # tokens in context at each resume
    env_reward: float = 0.0
    turn_rewards: list = field(default_factory=list)  # (index of the turn's end, reward)
    info: dict = field(default_factory=dict)
    wait_s: float = 0.0
    end: str = ""  # "" running; done | max_turns | length | env_error | env_timeout
    text: str = ""  # the last model turn's text (what the verifier scores)
    last_finish: str = ""
    log: list = field(default_factory=list)  # (role, text) per turn


class TurnFormat:
    """Prompts and observations as token ids: the chat template (tool messages) or the
    plain ``env.result_template`` text."""

    def __init__(self, tok, env_cfg, chat: bool, schemas: list):
        self.tok, self.env, self.chat, self.schemas = tok, env_cfg, chat, schemas
        self.system: str | None = None  # the tools' system message ("" none), at first use
        mode = env_cfg.tool_results
        if mode == "auto":
            mode = "template" if chat and getattr(tok, "chat_template", None) else "plain"
        if mode == "template" and not getattr(tok, "chat_template", None):
            raise OrbitError("config key 'env.tool_results': template needs a tokenizer "
                             "with a chat template")
        self.mode = mode

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.schemas or None,
                                            add_generation_prompt=gen, tokenize=False)

    def prompt(self, obs: str, encode) -> tuple[list[int], list]:
        messages = [{"role": "user", "content": obs}]
        if not self.chat:
            return list(encode(obs)), messages
        if self.schemas and self.system is None:
            self.system = self._system_message(messages)
        if self.system:
            messages = [{"role": "system", "content": self.system}] + messages
        return self.ids(self.render(messages, True)), messages

    def _system_message(self, messages: list) -> str:
        """``env.tools_prompt``: "" when the chat template lists the tools itself, else the
        system message that describes them (``envs.tools.describe_tools``)."""
        e = self.env
        bare = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=False)
        ignored = bare == self.render(messages, True)  # e.g. SmolLM2's template
        if e.tools_prompt == "template" or (e.tools_prompt == "auto" and not ignored):
            if ignored:
                warnings.warn("env.tools: the model's chat template ignores `tools`; the "
                              "prompt does not list them (env.tools_prompt: system "
                              "describes them in a system message)", stacklevel=3)
            return ""
        return describe_tools(self.schemas, e.tool_call_start, e.tool_call_end,
                              e.tool_call_format)

    def observation(self, traj: Trajectory, obs: str, so_far: str) -> list[int]:
        """The tokens that follow the model's turn: the rendered tool message (and the
        template's closing of the assistant turn and opening of the next), or the plain
        result text."""
        if self.mode == "plain":
            return self.ids(self.env.result_template.replace("{result}", obs))
        msgs = traj.messages + [{"role": "tool", "content": obs}]
        full = self.render(msgs, True)
        if full.startswith(so_far):
            return self.ids(full[len(so_far):])
        closed = self.render(traj.messages, False)  # the template re-rendered the history
        turn = traj.messages[-1]["content"]
        at = closed.rfind(turn)
        if at < 0 or not full.startswith(closed):
            raise OrbitError("env.tool_results template: the chat template re-renders the "
                             "conversation; use env.tool_results: plain")
        return self.ids(closed[at + len(turn):] + full[len(closed):])


class TurnLoop:
    """Runs a batch of trajectories through the engine and their environments.

    Args:
        engine: the rollout Engine; tok: its tokenizer; encode: prompt text -> ids.
        cfg: the run's Config (``env.*``, ``data.chat_template``).
        schemas: the tools' JSON schemas (listed by chat templates that take ``tools``).
    """

    def __init__(self, engine, tok, encode, cfg, schemas: list | None = None):
        self.engine, self.tok, self.encode, self.cfg, self.ecfg = engine, tok, encode, cfg, cfg.env
        self.factory = get_env(self.ecfg.name)
        self.fmt = TurnFormat(tok, self.ecfg, cfg.data.chat_template, schemas or [])

        self.syntax = syntax_of(self.ecfg)  # observations are cut and their markers escaped
        limit = self.ecfg.max_total_tokens or engine.max_model_len
        self.max_total = min(limit, engine.max_model_len - 1)
        self.calls = EnvCalls(cfg.env.time_limit_s, cfg.env.workers)  # workers persist

    def run(self, rows: list[dict], params: SamplingParams, seed: int, first: int = 0,
            deadline_s: float | None = None) -> tuple[list[Trajectory], dict]:
        """n trajectories per row (``params.n``); returns them (dropped ones marked) and
        the counters of the batch."""
        t0 = time.perf_counter()
        calls, leaked = self.calls, self.calls.leaked
        stats = dict(env_errors=0, env_timeouts=0, kv_swapped_bytes=0, env_wait_s=0.0,
                     engine_idle_s=0.0)
        self.n = params.n
        trajs = self._reset(rows, params.n, calls, stats)
        self._start(trajs, rows, params, seed, first)
        self._loop(trajs, calls, stats, t0, deadline_s)
        calls.cancel_all()
        stats["env_threads_leaked"] = calls.leaked - leaked
        return trajs, stats

    # ---- start ---------------------------------------------------------------------
    def _reset(self, rows, n, calls: EnvCalls, stats) -> list[Trajectory]:
        trajs = []
        for g, row in enumerate(rows):
            for j in range(n):
                t = Trajectory(len(trajs), g, row, None)
                try:
                    t.env = self.factory(self.ecfg, self.cfg)
                except Exception as e:  # noqa: BLE001 - counted, the trajectory dropped
                    t.end, stats["env_errors"] = "env_error", stats["env_errors"] + 1
                    t.info["error"] = f"{type(e).__name__}: {e}"
                    trajs.append(t)
                    continue
                calls.submit(("reset", len(trajs)), t.env.reset, row)
                trajs.append(t)
        first_obs: dict[int, str] = {}
        while calls.pending:
            for r in calls.poll(wait_s=0.05):
                t = trajs[r.key[1]]
                if r.error or not isinstance(r.value, str):
                    self._fail(t, r.error or "reset must return the prompt text", stats)
                else:
                    first_obs.setdefault(t.group, r.value)
        for t in trajs:
            t.info["first"] = first_obs.get(t.group)
        return trajs

    def _start(self, trajs, rows, params, seed, first) -> None:
        n = params.n
        turn_max = self.ecfg.turn_max_tokens or params.max_tokens
        stop = tuple(params.stop) + (self.ecfg.tool_call_end,)
        reqs = []
        for g in range(len(rows)):
            group = trajs[g * n:(g + 1) * n]
            obs = group[0].info.pop("first", None)
            for t in group[1:]:
                t.info.pop("first", None)
            if obs is None or any(t.end for t in group):
                for t in group:
                    t.end = t.end or "dropped"
                reqs.append((Request(prompt_ids=[0]), None))
                continue
            ids, messages = self.fmt.prompt(obs, self.encode)
            for t in group:
                t.messages = [dict(m) for m in messages]
                t.info["prompt_ids"], t.info["first_text"] = ids, obs
            p = replace(params, max_tokens=min(turn_max, max(1, self.max_total - len(ids))),
                        stop=stop, keep_kv=True, seed=seed * 100003 + first + g)
            reqs.append((Request(prompt_ids=ids), p))
        live = [(i, r, p) for i, (r, p) in enumerate(reqs) if p is not None]
        outs = self.engine.begin([(r, p) for _, r, p in live])
        self._index = {k: i for k, (i, _, _) in enumerate(live)}  # engine index -> group
        for o in outs:
            if o.error is not None:
                raise OrbitError(f"rollout request {self._index[o.index]}: {o.error}")

    # ---- the loop ------------------------------------------------------------------
    def _loop(self, trajs, calls: EnvCalls, stats, t0: float, deadline_s) -> None:
        eng, n = self.engine, self.n
        while eng.scheduler.has_work() or calls.pending:
            if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                self._abort(trajs, calls, stats)
                break
            if eng.scheduler.has_work():
                if eng.memory_hook is not None:
                    eng.memory_hook(eng)
                for seq in eng.step():
                    self._turn_done(trajs[self._index[seq.req_index] * n + seq.sample], seq,
                                    calls, stats)
                self._price_wait(stats)
                results = calls.poll()
            else:
                w = time.perf_counter()
                results = calls.poll(wait_s=0.05)
                while results and calls.pending:  # idle anyway: gather the calls ending
                    more = calls.poll(wait_s=0.002)  # now, resumed in one prefill step
                    if not more:
                        break
                    results += more
                stats["engine_idle_s"] += time.perf_counter() - w
            for r in results:
                self._env_done(trajs[r.key[1]], r, stats)

    def _price_wait(self, stats) -> None:
        """The KV of trajectories waiting for their environments: measured (blocks held
        by parked sequences, bytes on the host) against the ledger's price of the same
        contexts (``ledger.kv.waiting_kv_bytes``), at the wait's peak."""
        parked = self.engine.scheduler.parked
        if not parked:
            return
        eng = self.engine
        held = {b for s in parked if s.swap is None for b in s.block_table}
        device = len(held) * eng.block_bytes
        host = sum(sum(t.numel() * t.element_size() for t in s.swap)
                   for s in parked if s.swap is not None)
        if device + host <= stats.get("kv_wait_device_bytes", 0) + stats.get(
                "kv_wait_host_bytes", 0):
            return
        price = waiting_kv_bytes([s.num_computed for s in parked], eng.pool.block_size,
                                 eng.block_bytes, self.ecfg.kv_wait)
        stats.update(kv_wait_device_bytes=device, kv_wait_host_bytes=host,
                     kv_wait_device_bytes_predicted=price["device"],
                     kv_wait_host_bytes_predicted=price["host"])

    def _abort(self, trajs, calls, stats) -> None:
        """The rollout watchdog: everything unfinished is dropped and its KV released (the
        turns the engine's step in flight finished are recorded first)."""
        for seq in self.engine.reset_decode():
            self._turn_done(trajs[self._index[seq.req_index] * self.n + seq.sample], seq,
                            calls, stats)
        self.engine.abort()
        self.engine.stats["watchdog_events"] = self.engine.stats.get("watchdog_events", 0) + 1
        calls.cancel_all()
        for t in trajs:
            if not t.end:
                t.end = "aborted"

    def _turn_done(self, t: Trajectory, seq, calls: EnvCalls, stats) -> None:
        """A model turn ended: record it, then end the trajectory or ask its environment."""
        if t.seq is None:
            t.seq = seq
        if "_prefill_from" in t.info:
            t.prefill.append(seq.prefilled - t.info.pop("_prefill_from"))
        k = len(seq.completion_ids)
        t.tokens += seq.completion_ids
        t.mask += [1] * k
        t.logprobs += seq.logprobs
        t.turns += 1
        t.last_finish = seq.finish_reason
        raw = self.tok.decode(seq.completion_ids, skip_special_tokens=True)
        t.text = seq.text if seq.text is not None else raw
        t.messages.append({"role": "assistant", "content": raw})
        t.log.append(("model", raw))
        if t.turns >= self.ecfg.max_turns and self.ecfg.tool_call_end in raw:
            return self._end(t, "max_turns")
        calls.submit(("step", t.index), t.env.step, raw)
        if self.ecfg.kv_wait == "swap":
            stats["kv_swapped_bytes"] += self.engine.swap_parked(seq)

    def _env_done(self, t: Trajectory, r, stats) -> None:
        """An environment answered (or failed, or ran past its time limit)."""
        if t.end:
            return
        t.wait_s += r.seconds
        stats["env_wait_s"] += r.seconds
        if r.error:
            return self._fail(t, r.error, stats)
        try:
            res = as_step_result(r.value)
        except OrbitError as e:
            return self._fail(t, str(e), stats)
        t.env_reward += res.reward
        if res.reward:  # the turn it answers ends at the last token so far (a model token)
            t.turn_rewards.append((len(t.tokens) - 1, float(res.reward)))
        for k, v in res.info.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                t.info[k] = t.info.get(k, 0) + v
        if res.done or res.observation is None:
            return self._end(t, "done")
        self._observe(t, res.observation)

    def _observe(self, t: Trajectory, obs: str) -> None:
        """Append the observation's tokens and resume the sequence (or end at a limit)."""
        obs = self.syntax.sanitize(obs, self.ecfg.max_output_chars)  # any environment's
        so_far = "" if self.fmt.mode == "plain" else self.tok.decode(  # (template mode only)
            t.info["prompt_ids"] + t.tokens, skip_special_tokens=False)
        ids = self.fmt.observation(t, obs, so_far)
        total = len(t.info["prompt_ids"]) + len(t.tokens) + len(ids)
        if total + 1 >= self.max_total:
            return self._end(t, "length")
        t.messages.append({"role": "tool", "content": obs})
        t.log.append(("env", self.tok.decode(ids, skip_special_tokens=False)))
        t.tokens += ids
        t.mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        before = t.seq.prefilled
        t.history.append(total)
        turn_max = self.ecfg.turn_max_tokens or self.cfg.rollout.max_tokens
        self.engine.resume(t.seq, ids, max_tokens=min(turn_max, self.max_total - total))
        t.info["_prefill_from"] = before

    def _end(self, t: Trajectory, why: str) -> None:
        t.end = why
        if t.seq is not None and t.seq.status.name == "PARKED":
            self.engine.release(t.seq)

    def _fail(self, t: Trajectory, error: str, stats) -> None:
        timeout = error == "timeout"
        stats["env_timeouts" if timeout else "env_errors"] += 1
        t.info["error"] = error
        self._end(t, "env_timeout" if timeout else "env_error")


def trajectory_samples(trajs: list[Trajectory], n: int, version: int, first: int = 0
                       ) -> list[Sample]:
    """Samples of the groups whose n trajectories all ended on their own (done, max turns,
    length); a group with a failed, timed-out or aborted trajectory is dropped whole."""
    ok = ("done", "max_turns", "length")
    out = []
    for g in range(len(trajs) // n):
        group = trajs[g * n:(g + 1) * n]
        if not all(t.end in ok and t.seq is not None for t in group):
            continue
        for t in group:
            finish = t.end if t.end != "done" else (t.last_finish or "stop")
            info = {k: v for k, v in t.info.items() if not k.startswith("_")
                    and k != "prompt_ids"}
            info.update(turns=t.turns, prefill=t.prefill, history=t.history,
                        env_wait_s=t.wait_s, log=t.log)
            out.append(Sample(first + g, t.info["prompt_ids"], t.tokens, t.logprobs, finish,
                              t.text, t.row, version, loss_mask=t.mask,
                              env_reward=t.env_reward, turn_rewards=list(t.turn_rewards),
                              info=info))
    return out


def trajectory_metrics(trajs: list[Trajectory], stats: dict) -> dict:
    """The step's multi-turn columns: turns, tool calls and errors, environment waits,
    swapped KV bytes and prefill tokens per resumed turn (against the history they would
    have re-prefilled)."""
    started = [t for t in trajs if t.turns] or [None]
    k = max(1, len(trajs))
    prefill = [p for t in trajs for p in t.prefill]
    history = [h for t in trajs for h in t.history[:len(t.prefill)]]
    row = {
        "env_turns_mean": sum(t.turns for t in started if t) / max(1, len(started)),
        "env_tool_calls": sum(t.info.get("tool_calls", 0) for t in trajs),
        "env_tool_errors": sum(t.info.get("tool_errors", 0) for t in trajs),
        "env_tool_frac": sum(bool(t.info.get("tool_calls")) for t in trajs) / k,
        "env_answer_hits_frac": sum(bool(t.info.get("answer_hits")) for t in trajs) / k,
        "env_errors": stats["env_errors"], "env_timeouts": stats["env_timeouts"],
        "env_dropped": sum(t.end not in ("done", "max_turns", "length") for t in trajs),
        "env_wait_s": stats["env_wait_s"], "env_engine_idle_s": stats["engine_idle_s"],
        "kv_swapped_bytes": stats["kv_swapped_bytes"],
        **{k: stats.get(k, 0) for k in ("kv_wait_device_bytes", "kv_wait_host_bytes",
                                        "kv_wait_device_bytes_predicted",
                                        "kv_wait_host_bytes_predicted")},
        "prefill_tokens_per_turn": sum(prefill) / len(prefill) if prefill else 0.0,
        "prefill_history_ratio": sum(prefill) / sum(history) if history else 0.0,
    }
    return row


def trajectory_log(trajs: list[Trajectory], count: int, step: int) -> list[dict]:
    """The first ``count`` trajectories as readable records (trajectories.jsonl)."""
    return [{"step": step, "group": t.group, "end": t.end, "turns": t.turns,
             "tool_calls": t.info.get("tool_calls", 0),
             "tool_errors": t.info.get("tool_errors", 0),
             "answer_hits": t.info.get("answer_hits", 0), "env_reward": t.env_reward,
             "prompt": t.info.get("first_text", ""), "turns_text": t.log,
             **({"error": t.info["error"]} if "error" in t.info else {})}
            for t in trajs[:count]]


def chat_tool_pairs(tok, cfg, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Warm-start pairs of the built-in tool task (``{"prompt": "347*58=", "answer":
    "20126"}`` rows) in the chat format a run of ``cfg`` (``env.*``, ``data.chat_template``
    on) puts the model in: the two model turns of a solved trajectory, each as (the tokens
    before it, its tokens), laid out by the same :class:`TurnFormat` the rollouts use (the
    tools in the template or in a system message, the call in ``env``'s syntax, the result
    as the template's tool message), so supervised learning sees the rollout's tokens and
    never trains on the environment's. The call turn ends at ``env.tool_call_end`` (where a
    rollout's turn stops), the answer turn at the end-of-sequence token."""
    env = cfg.env
    tools = tools_of(env, cfg)
    fmt = TurnFormat(tok, env, True, tool_schemas(tools))
    if fmt.mode != "template":
        raise OrbitError("chat tool traces need env.tool_results: template (a chat template "
                         "that renders tool messages)")
    tool = env.tools[0]
    out = []
    for r in rows:
        expr = str(r["prompt"]).rstrip("=")
        first, messages = fmt.prompt(str(r["prompt"]), None)
        args = {"expression": expr} if tool == "calculator" else {"code": f"print({expr})"}
        body = (json.dumps({"name": tool, "arguments": args}) if env.tool_call_format == "json"
                else expr)
        call = env.tool_call_start + body + env.tool_call_end
        call_ids = fmt.ids(call)
        so_far = tok.decode(first + call_ids, skip_special_tokens=False)  # as _observe reads it
        traj = Trajectory(0, 0, r, None, messages=messages + [
            {"role": "assistant", "content": call}])
        after = fmt.observation(traj, str(tools[tool](args)), so_far)
        out.append((first, call_ids))
        out.append((first + call_ids + after, fmt.ids(str(r["answer"])) + [tok.eos_token_id]))
    return out


def trajectories_fn(engine, tok, encode, cfg):
    """``(rows, params, version, seed, first, step, timeout_s) -> (samples, metrics, log)``
    over a TurnLoop of ``cfg.env``: what the Evaluator runs held-out trajectories with (a
    run's Rollouts and ``orbitrl eval`` both build it here). ``timeout_s``: the watchdog's
    limit (None: ``rollout.timeout_s``)."""
    schemas = []
    if cfg.env.name == "tools":
        schemas = tool_schemas(tools_of(cfg.env, cfg))
    loop = TurnLoop(engine, tok, encode, cfg, schemas)

    def run(rows, params, version: int, seed: int, first: int = 0, step: int = 0,
            timeout_s: float | None = None):
        limit = cfg.rollout.timeout_s if timeout_s is None else timeout_s
        trajs, stats = loop.run(rows, params, seed, first, limit or None)
        return (trajectory_samples(trajs, params.n, version, first),
                trajectory_metrics(trajs, stats),
                trajectory_log(trajs, cfg.env.log_trajectories, step))
    return run
