"""evaluate.py: pass^k and pass@k by hand, evaluation of generated tasks with the scripted user, of tau2 tasks
with an LLM user behind a fake OpenAI-compatible endpoint (including one that fails) and tau2's policy in the agent's
system prompt, and BFCL v3 multi-turn (--bench bfcl) through bfcl-eval's own backends and checker."""

import ast
import collections
import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import env
import evaluate
import rollout
import sft
import util
from util import read_jsonl, run_main, run_py

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread for the module


def test_pass_hat_k_hand_made():
    table = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_hat_k(table, 1) == pytest.approx((0.5 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 2) == pytest.approx((1 / 6 + 1 + 0) / 3)
    assert evaluate.pass_hat_k(table, 4) == pytest.approx(1 / 3)
    assert evaluate.pass_hat_k({"a": [1, 0]}, 3) is None  # fewer trials than k
    assert evaluate.pass_hat_k({"a": [1, 1, 1], "b": [0, 1, 1]}, 2) == pytest.approx((1 + 1 / 3) / 2)


def test_pass_at_k_hand_made():
    """At least one success in k trials drawn without replacement: 1 - C(n-c, k) / C(n, k), a mean over tasks."""
    table = {"a": [1, 0, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0]}
    assert evaluate.pass_at_k(table, 1) == pytest.approx(evaluate.pass_hat_k(table, 1))  # both are the mean reward
    assert evaluate.pass_at_k(table, 2) == pytest.approx((0.5 + 1 + 0) / 3)  # a: 1 - C(3,2)/C(4,2) = 1/2
    assert evaluate.pass_at_k(table, 4) == pytest.approx(2 / 3)
    assert evaluate.pass_at_k({"a": [1, 0]}, 3) is None
    assert evaluate.pass_at_k(table, 2) >= evaluate.pass_hat_k(table, 2)


def test_study_intervals_carry_run_to_run_spread():
    """tests/demo_study.py's two intervals: resampling tasks alone cannot see that runs disagree; resampling the
    runs too must (the control: runs that agree give both intervals the same width)."""
    from demo_study import bootstrap
    bootstrap, bootstrap_runs = functools.partial(bootstrap, n=2000), functools.partial(bootstrap, n=2000, runs=True)
    tasks = [0.0] * 30 + [100.0] * 30  # one run's per-task differences: mean +50
    agree = [tasks, tasks, tasks]
    disagree = [[x - 40 for x in tasks], [x + 40 for x in tasks], tasks]  # run means +10, +90, +50
    width = lambda ci: ci[2] - ci[1]
    assert bootstrap(disagree)[0] == bootstrap_runs(disagree)[0] == pytest.approx(50)
    assert width(bootstrap(disagree)) == pytest.approx(width(bootstrap(agree)))  # blind to the runs' spread
    assert width(bootstrap_runs(disagree)) > width(bootstrap(disagree)) + 20
    assert width(bootstrap_runs(agree)) == pytest.approx(width(bootstrap(agree)), abs=3)


def test_validation_set_is_new_training_side_work_with_unseen_users(tmp_path, monkeypatch):
    """tests/demo_study.py's validation set: tasks of every kind in turn over the training users that equal no
    training task, then shop and tasks re-drawn by one mapping, so every gold action still finds its records (the
    control: on the shop as it was, the re-drawn gold writes find none)."""
    import random
    import demo_study
    import synth
    data = tmp_path / "data"
    db, train, _ = synth.prepare_data(str(data), seed=3, n_train=60, n_test=10)
    with monkeypatch.context() as m:  # without the re-draw: whose tasks they are, and that they are new
        m.setattr(sft, "redraw_ids", lambda x, rng, **kw: x)
        shop, path = demo_study.validation_set(str(data), 3, n=30)
        raw = env.load_tasks(path)
    emails = {u["email"]: uid for uid, u in db["users"].items()}
    train_users = set(synth.split_users(db, random.Random(3))["train"])
    owners = {emails[e] for t in raw for e in emails if e in t["user_scenario"]["instructions"]["known_info"]}
    assert owners and owners <= train_users
    assert len(raw) == 30 and not {demo_study.task_key(t) for t in raw} & {demo_study.task_key(t) for t in train}
    kinds = collections.Counter(t["kind"] for t in raw)  # balanced like the held-out tasks (30 over 9 kinds: 3 or 4)
    assert set(kinds) == set(synth.TASK_KINDS) and max(kinds.values()) - min(kinds.values()) <= 1
    (data / "validation" / "tasks.jsonl").unlink()
    shop, path = demo_study.validation_set(str(data), 3, n=30)
    new_db, tasks = env.load_db(shop), env.load_tasks(path)
    assert [t["kind"] for t in tasks] == [t["kind"] for t in raw]
    assert {k: len(v) for k, v in new_db.items()} == {k: len(v) for k, v in db.items()}
    said = " ".join(json.dumps(t["user_scenario"]) for t in tasks)
    assert not [e for e in emails if e in said]  # every user re-drawn
    failed = lambda d, t: sum("error" in str(r).lower()[:40]  # noqa: E731
                              for r in env.replay_actions(env.canonical_db(d), t["evaluation_criteria"]["actions"]))
    writes = [t for t in tasks if t["evaluation_criteria"]["actions"]]
    assert writes and all(failed(new_db, t) == failed(db, r) for t, r in zip(tasks, raw))
    assert sum(failed(db, t) for t in writes) >= len(writes)  # control: the shop as it was knows none of the ids


def test_evaluate_cli(world):
    out = world.root / "eval"
    r = run_py("evaluate.py", "--models", f"base={world.sft / 'init'}", f"sft={world.sft}", "--data-dir", world.data,
               "--k", "2", "--max-turns", "3", "--max-new-tokens", "24", "--out", out)
    tasks = env.load_tasks(world.data / "test_tasks.jsonl")
    kinds = sorted({t["kind"] for t in tasks})
    lines = r.stdout.splitlines()
    assert ("| model | world | tasks | pass^1 [95% CI] | pass^2 [95% CI] | pass^1, errored = 0 (tau2's way) | "
            "pass^2, errored = 0 (tau2's way) | figures |") in lines
    for name in ("base", "sft"):
        assert any(line.startswith(f"| {name} | shop | {len(tasks)} | ") for line in lines), r.stdout
        for kind in kinds:
            assert any(line.startswith(f"| {name} | shop / {kind} | ") for line in lines), (kind, r.stdout)
    res = json.loads((out / "results.json").read_text())
    assert set(res) == {"base", "sft"} and all(set(s) == {"shop"} for s in res.values())
    for name, s in res.items():
        s = s["shop"]
        a = s["all"]
        assert a["n"] == len(tasks) and a["errored"] == 0
        assert 0.0 <= a["pass^2"] <= a["pass^1"] <= a["pass@2"] <= 1.0 and a["pass^1"] == pytest.approx(a["reward"])
        assert set(s) == {"all", "figures", *kinds}
        rows = read_jsonl(out / f"{name}_shop.jsonl")
        assert len(rows) == 2 * len(tasks)
        assert sorted(x["task_id"] for x in rows) == sorted(t["id"] for t in tasks for _ in range(2))
        assert all("ids" not in x and "messages" in x for x in rows)
    assert (out / "results.md").read_text().strip() in r.stdout
    assert f"sft / shop: pass^1 {res['sft']['shop']['all']['pass^1']:.3f} over {len(tasks)} tasks, pass@2 " in r.stdout


class FakeOpenAI(util.FakeOpenAIServer):
    """/chat/completions on 127.0.0.1; reply(body) -> (HTTP status, message text). Records every request body."""

    def __init__(self, reply):
        self.reply, self.bodies = reply, []
        super().__init__()

    def answer(self, path, body):
        self.bodies.append(body)
        status, text = self.reply(body)
        return status, ({"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
            if status == 200 else {"error": text})


@pytest.fixture
def fake_server():
    servers = []

    def start(reply):
        servers.append(FakeOpenAI(reply))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def tau2_args(world, tmp_path, **over):
    if not (TAU2 / "tasks.json").is_file():
        pytest.skip(f"tau2 retail data absent ({TAU2})")
    # max_len: tau2's policy.md alone is thousands of the tiny tokenizer's tokens, and a prompt that fills the
    # episode ends it before the agent's first turn
    return dict(tasks=str(TAU2 / "tasks.json"), db=str(TAU2 / "db.json"), n_tasks=2, k=2, max_turns=3,
                max_new_tokens=24, max_len=8192, models=[f"sft={world.sft}"], out=str(tmp_path / "eval"), **over)


def test_evaluate_tau2_llm_user(world, tmp_path, fake_server):
    srv = fake_server(lambda body: (200, "I want to return my order. ###STOP###"))
    res = run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft_retail.jsonl")
    assert len(rows) == 4
    assert all(not x["errored"] and x["end_reason"] == "user_stop" for x in rows), [(x["errored"], x["end_reason"], x.get("error")) for x in rows]
    assert all(x["messages"][1] == {"role": "user", "content": "I want to return my order. ###STOP###"} for x in rows)
    a = res["sft"]["retail"]["all"]
    assert a["n"] == 2 and a["errored"] == 0 and a["pass^1"] is not None and a["pass^2"] is not None
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["sft"]["retail"]["all"]["n"] == 2
    tasks = env.load_tasks(TAU2 / "tasks.json")[:2]
    assert len(srv.bodies) == 4  # one opening line per episode, then the user stopped
    # tau2's own user guidelines (found beside its tasks.json), then each task's own scenario
    guidelines = env.load_guidelines(env.guidelines_beside(TAU2 / "tasks.json"))
    assert "User Simulation Guidelines" in guidelines
    for t in tasks:  # each user model sees its own task's scenario (the two tasks differ only near the end)
        want = {"role": "system", "content": env.system_prompt(t, guidelines)}
        assert sum(b["messages"][0] == want for b in srv.bodies) == 2


def test_evaluate_tau2_without_user_fails_clearly(world, tmp_path):
    """tau2 tasks have no script: the scripted user cannot play them; say so (not a KeyError)."""
    with pytest.raises((ValueError, SystemExit), match="script"):
        run_main(evaluate, **tau2_args(world, tmp_path, user=None))


def fast_backoff(monkeypatch):
    monkeypatch.setattr(rollout, "OpenAIChatBackend", functools.partial(rollout.OpenAIChatBackend, backoff=0.001))


def test_evaluate_failing_user_endpoint_mixed(world, tmp_path, fake_server, monkeypatch):
    """The user model fails for one task only: its episodes are errored and left out of pass^k."""
    fast_backoff(monkeypatch)
    bad = env.load_tasks(TAU2 / "tasks.json")[0]["user_scenario"]["instructions"]["reason_for_call"] \
        if (TAU2 / "tasks.json").is_file() else None
    srv = fake_server(lambda body: (500, "boom") if bad in body["messages"][0]["content"]
                      else (200, "Thanks, bye. ###STOP###"))
    res = run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    rows = read_jsonl(tmp_path / "eval" / "sft_retail.jsonl")
    assert len(rows) == 4
    errored = [x for x in rows if x["errored"]]
    assert len(errored) == 2 and all(x["end_reason"] == "user_error" for x in errored)
    a = res["sft"]["retail"]["all"]
    assert a["errored"] == 2 and a["n"] == 1  # the failing task has no trials left


def test_evaluate_failing_user_endpoint_all(world, tmp_path, fake_server, monkeypatch, capsys):
    """An endpoint that always answers 500: every episode errored, none scored; evaluate reports and exits
    non-zero, in one line with the counts and the first reason (the mixed run above exits 0)."""
    fast_backoff(monkeypatch)
    srv = fake_server(lambda body: (500, "boom"))
    with pytest.raises(SystemExit) as e:
        run_main(evaluate, **tau2_args(world, tmp_path, user=srv.url))
    msg = str(e.value.code)
    assert msg.startswith("evaluate.py: every episode errored (4 of 4), the first because user simulator failed")
    assert "InternalServerError" in msg and "\n" not in msg
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    rows = read_jsonl(tmp_path / "eval" / "sft_retail.jsonl")
    assert len(rows) == 4 and all(x["errored"] and x["end_reason"] == "user_error" for x in rows)
    assert all(x["reward"] == 0.0 and x["reward_info"] == {} for x in rows)  # not scored
    a = res["sft"]["retail"]["all"]
    assert a["errored"] == 4 and a["n"] == 0
    assert a["pass^1"] is None and a["pass^2"] is None  # no trials: nothing to average, not 0
    # how many errored, and why (the user simulator's message, numbers blanked so one cause counts once)
    (reason, n), = a["errored_reasons"].items()
    assert n == 4 and "InternalServerError" in reason and "boom" in reason and srv.url.split(":")[0] in reason
    assert f"sft: 4 of 4 episodes errored (not scored): 4x {reason}" in capsys.readouterr().out
    assert all("InternalServerError" in x["error"] for x in rows)  # each transcript says why


# ----------------------------------------------------------------------------------------------------
# --bench bfcl: BFCL v3's multi-turn categories through rollout.run_episodes, calls run in bfcl-eval's
# backends, scored by bfcl-eval's multi_turn_checker (skipped where bfcl-eval is not installed)


INSTALL = "pip install --no-deps -r requirements-bfcl.txt"


needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                reason=f"bfcl-eval is not installed ({INSTALL})")


@pytest.fixture(scope="module")
def bfcl_world():
    return evaluate.BFCL(max_turns=100)


@pytest.fixture(scope="module")
def entries(bfcl_world):
    return [t["entry"] for t in bfcl_world.tasks]


def gold_call(text, docs):
    """A gold call string 'f(a=1)' (some gold calls pass their one argument by position) -> our parsed call."""
    node = ast.parse(text, mode="eval").body
    params = list(docs[node.func.id]["parameters"]["properties"])
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return {"name": node.func.id, "arguments": args}


class GoldAgent:
    """Answers each user turn with its gold calls as Hermes <tool_call> text (all in one message), then ends the
    turn in words. `drop_last` leaves out the last call of every turn that has calls (a wrong agent)."""

    def __init__(self, entry, drop_last=False):
        self.entry, self.drop_last = entry, drop_last
        held = entry.get("missed_function", {}).values()
        self.docs = {d["name"]: d for d in entry["function"]} | {d["name"]: d for ds in held for d in ds}

    def act(self, messages):
        turn = sum(m["role"] == "user" for m in messages) - 1  # the user's turns so far: this is the last one's
        calls = self.entry["ground_truth"][turn]
        if messages[-1]["role"] != "user" or not calls:
            return "Done."
        calls = calls[:-1] if self.drop_last else calls
        return "".join(f"<tool_call>{json.dumps(gold_call(c, self.docs))}</tool_call>" for c in calls) or "Done."


def play_bfcl(world, entries, run_name, make_agent):
    """Every entry once through run_episodes on the BFCL world, each scored by bfcl-eval's checker. -> episodes."""
    world.begin(run_name)
    tasks = [{"id": e["id"], "kind": e["category"], "entry": e} for e in entries]
    return util.scored(world, rollout.run_episodes(rollout.TextAgents(make_agent), world, tasks), tasks)


def play_gold(world, entries, run_name, drop_last=False):
    eps = play_bfcl(world, entries, run_name, lambda t, s: GoldAgent(t["entry"], drop_last))
    return eps, [ep.reward_info for ep in eps]


@needs_bfcl
def test_gold_answers_pass_every_entry(bfcl_world, entries):
    """The gold calls of all 800 entries, played through our adapter (parsed as our tool calls, executed as call
    strings built from them, read back from the transcript), pass bfcl-eval's checker: 200/200 per category."""
    eps, rows = play_gold(bfcl_world, entries, "gold")
    summary = bfcl_world.summary(eps)
    failed = [(ep.task_id, r["error_type"], r["error_message"]) for ep, r in zip(eps, rows) if not r["valid"]]
    assert failed == []
    assert all(summary[c] == {"n": 200, "correct": 200, "accuracy": 1.0} for c in evaluate.BFCL_CATEGORIES)
    assert summary["overall"]["accuracy"] == 1.0
    assert sum(ep.tool_errors for ep in eps) == 0 and all(ep.end_reason == "user_stop" for ep in eps)
    # the checker got BFCL's format: per turn, per step, call strings; here one step per turn with gold calls
    for ep, r in zip(eps[:50], rows):
        assert [len(steps) for steps in r["decoded"]] == [int(bool(g)) for g in ep.state.entry["ground_truth"]]


@needs_bfcl
def test_wrong_calls_fail_the_checker(bfcl_world, entries):
    """A control: the same gold agent leaving out the last call of every turn fails (almost) every entry."""
    eps, rows = play_gold(bfcl_world, entries[:20], "gold_short", drop_last=True)
    assert sum(r["valid"] for r in rows) <= 2
    assert {r["error_type"] for r in rows if not r["valid"]} <= {"multi_turn:instance_state_mismatch",
                                                                 "multi_turn:execution_response_mismatch",
                                                                 "multi_turn:empty_turn_model_response"}


@needs_bfcl
def test_replaying_again_starts_from_the_initial_state(bfcl_world, entries):
    """bfcl-eval caches backend instances by model name and entry id; a second run under the same name must not
    see the first run's files, orders or cars."""
    for _ in range(2):
        _, rows = play_gold(bfcl_world, entries[:10], "again")
        assert all(r["valid"] for r in rows)


class ScriptAgent:
    """Says the texts of a list in turn, then 'Done.'."""

    def __init__(self, texts):
        self.texts = list(texts)

    def act(self, messages):
        return self.texts.pop(0) if self.texts else "Done."


@needs_bfcl
def test_bad_calls_become_error_results(bfcl_world, entries):
    """An unknown function, a bad argument name, non-object arguments, broken JSON, and a call that fails inside
    the backend each get an error result, and the episode goes on; only calls that ran reach the checker."""
    e = next(x for x in entries if x["involved_classes"] == ["GorillaFileSystem"])
    call = lambda name, args: f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"  # noqa
    texts = [call("rm_rf", {}) + call("__import__", {"name": "os"}), call("cd", {"folder name": "x"}),
             call("cd", {"class": "x"}), call("cd", ["x"]), "<tool_call>{not json</tool_call>",
             call("cd", {"folder": "no_such_dir"}), call("cd", {"nope": 1}), call("ls", {})]
    ep, = play_bfcl(bfcl_world, [e], "bad", lambda t, s: ScriptAgent(texts))
    results = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert len(results) == 9 and ep.end_reason == "user_stop"
    assert results[0].startswith("Error: unknown function 'rm_rf'") and "unknown function '__import__'" in results[1]
    assert "'folder name' is not a valid argument name" in results[2] and "'class' is not" in results[3]
    assert "must be a JSON object" in results[4] and "could not parse" in results[5]
    assert "No such directory" in results[6] or "error" in results[6].lower()  # the backend's own answer
    assert results[7].startswith("Error during execution")  # an unexpected keyword, caught by bfcl-eval
    assert "current_directory_content" in results[8]
    assert ep.tool_errors == 7
    # only the calls that ran are the model's result, one step per message, in the first turn
    decoded = ep.reward_info["decoded"]
    assert decoded[0] == [["cd(folder='no_such_dir')"], ["cd(nope=1)"], ["ls()"]]


@needs_bfcl
def test_call_strings_hold_only_literals():
    """What reaches bfcl-eval's eval(): a known name and keyword arguments whose values are literals, whatever
    the strings inside them say."""
    evil = "x'); __import__('os').system('echo pwned'); ('"
    s = evaluate.call_string("cd", {"folder": evil, "n": [1, 2.5, None, True, {"k": "v"}]}, {"cd"})
    node = ast.parse(s, mode="eval").body
    assert isinstance(node, ast.Call) and node.func.id == "cd" and not node.args
    assert [k.arg for k in node.keywords] == ["folder", "n"]
    assert ast.literal_eval(node.keywords[0].value) == evil
    for name, args in [("os.system", {}), ("cd", {"a=1,b": 2}), ("cd", {"x": float("nan")}), ("cd", "x"),
                       ("cd", {"x": type("S", (str,), {})("y")})]:
        with pytest.raises(ValueError):
            evaluate.call_string(name, args, {"cd"})


@needs_bfcl
def test_tool_schemas_use_json_schema_types(entries):
    json_types = {"object", "string", "number", "integer", "boolean", "array", "null"}

    def types(node):
        if isinstance(node, dict):
            return {v for k, v in node.items() if k == "type" and isinstance(v, str)} | {
                t for v in node.values() for t in types(v)}
        return {t for v in node for t in types(v)} if isinstance(node, list) else set()
    world = evaluate.BFCLState(entries[0], "schema")
    tool = world.shown[0]
    assert set(tool) == {"type", "function"} and tool["type"] == "function"
    assert set(tool["function"]) == {"name", "description", "parameters"}  # BFCL's "response" left out
    assert tool["function"]["parameters"]["type"] == "object"
    for e in entries[::50] + [x for x in entries if x.get("missed_function")][:5]:
        w = evaluate.BFCLState(e, "schema")
        assert types([t["function"]["parameters"] for t in w.shown + [s for ss in w.held.values() for s in ss]]) \
            <= json_types


@needs_bfcl
def test_miss_func_turn_brings_the_held_out_docs(entries):
    """The turn where held-out functions come back says so in BFCL's words: with the docs in the message for a
    local model (its tools stay put), as new tools for an endpoint (BFCL's FC mode)."""
    prompts = evaluate.bfcl()["prompts"]
    e = next(x for x in entries if x.get("missed_function"))
    turn = int(next(iter(e["missed_function"])))
    held = [d["name"] for d in e["missed_function"][str(turn)]]
    local = evaluate.BFCLState(e, "held")
    text = local.user_turns()[turn]
    assert text.endswith(prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC) and all(n in text for n in held)
    local.user.turn = turn
    assert [t["function"]["name"] for t in local.tools()] == [t["function"]["name"] for t in local.shown]
    fc = evaluate.BFCLState(e, "held", fc=True)
    assert fc.user_turns()[turn] == prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
    fc.user.turn = turn - 1
    assert not set(held) & {t["function"]["name"] for t in fc.tools()}
    fc.user.turn = turn
    assert set(held) <= {t["function"]["name"] for t in fc.tools()}


@pytest.fixture(scope="module")
def bfcl_ckpt(tmp_path_factory, entries):
    """A tiny random model whose tokenizer has seen a few BFCL turns with tool calls."""
    convs = []
    for e in entries[::100]:
        w = evaluate.BFCLState(e, "tiny")
        agent = GoldAgent(w.entry)
        msgs = [{"role": "user", "content": w.user_turns()[0]}, env.parse_assistant(agent.act(
            [{"role": "user", "content": ""}])), {"role": "tool", "content": "{}"},
            {"role": "assistant", "content": "Done."}]
        convs.append({"messages": msgs, "tools": w.shown})
    tok, model = sft.make_tiny(convs, 400, 32, 2, 2, seed=0)
    return rollout.save_checkpoint(str(tmp_path_factory.mktemp("bfcl_tiny")), 0, model, tok)


def eos_bonus(monkeypatch):
    """A random model almost never ends its turn; a bonus on the end-of-turn logit makes it answer in a few
    tokens, so an episode walks through all of its entry's user turns."""
    real = evaluate.load_agent

    def load(*a, **kw):
        gen, tok, chat = real(*a, **kw)
        eos = tok.eos_token_id

        def hook(module, inputs, out):
            out = out.clone()
            out[..., eos] += 6.0
            return out
        gen.model.lm_head.register_forward_hook(hook)
        return gen, tok, chat
    monkeypatch.setattr(evaluate, "load_agent", load)


@needs_bfcl
def test_tiny_model_plays_every_category(bfcl_ckpt, tmp_path, monkeypatch, capsys):
    eos_bonus(monkeypatch)
    out = tmp_path / "eval"
    res = evaluate.main(["--bench", "bfcl", "--models", f"tiny={bfcl_ckpt}", "--n", "2", "--max-new-tokens", "12",
                         "--max-turns", "24", "--max-len", "3000", "--temperature", "1.0", "--out", str(out)])
    cats = evaluate.BFCL_CATEGORIES
    figures = res["tiny"]["bfcl"]["figures"]
    assert set(figures) == set(cats) | {"overall"}
    assert all(figures[c]["n"] == 2 and 0.0 <= figures[c]["accuracy"] <= 1.0 for c in cats)
    rows = util.read_jsonl(out / "tiny_bfcl.jsonl")
    assert [r["kind"] for r in rows] == [c for c in cats for _ in range(2)]
    assert all(set(r["reward_info"]) == {"valid", "error_type", "error_message", "decoded"} for r in rows)
    assert all("ids" not in r and r["messages"][0]["role"] == "user" for r in rows)  # no system prompt, as BFCL
    assert sum(r["end_reason"] == "user_stop" for r in rows) >= 4  # most episodes reach their last turn
    table = (out / "results.md").read_text().strip()
    assert table.splitlines()[0] == ("| model | world | tasks | pass^1 [95% CI] | pass^1, errored = 0 (tau2's way) "
                                     "| figures |")
    assert all(f"multi_turn_{c}" in table for c in ("base", "miss_func", "miss_param", "long_context"))
    assert table in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text()) == res


class FakeAgentServer(util.FakeOpenAIServer):
    """/chat/completions that records every request and answers with no tool call (each turn ends at once)."""

    def __init__(self):
        self.bodies = []
        super().__init__()

    def answer(self, path, body):
        self.bodies.append(body)
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "I cannot do that."}, "finish_reason": "stop"}]}


@needs_bfcl
def test_endpoint_agent_gets_tools_and_held_out_ones_at_their_turn(tmp_path, entries):
    srv = FakeAgentServer()
    try:
        res = evaluate.main(["--bench", "bfcl", "--models", f"remote={srv.url}", "--agent-model", "some/model",
                             "--categories", "miss_func", "--n", "1", "--out", str(tmp_path)])
    finally:
        srv.close()
    e = next(x for x in entries if x["id"] == "multi_turn_miss_func_0")
    turn = int(next(iter(e["missed_function"])))
    held = {d["name"] for d in e["missed_function"][str(turn)]}
    assert len(srv.bodies) == len(e["question"]) and all(b["model"] == "some/model" for b in srv.bodies)
    for t, body in enumerate(srv.bodies):
        names = {tool["function"]["name"] for tool in body["tools"]}
        assert bool(held & names) == (t >= turn), t
        assert "system" not in {m["role"] for m in body["messages"]}
    assert res["remote"]["bfcl"]["figures"]["multi_turn_miss_func"]["n"] == 1
    assert util.read_jsonl(tmp_path / "remote_bfcl.jsonl")[0]["error"] == ""


def test_unknown_category_lists_the_valid_ones(tmp_path):
    with pytest.raises(SystemExit, match="multi_turn_base, multi_turn_miss_func, multi_turn_miss_param, "
                                         "multi_turn_long_context"):
        evaluate.main(["--bench", "bfcl", "--categories", "base", "nope", "--models", "x=y", "--out", str(tmp_path)])


def test_missing_bfcl_eval_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)  # import bfcl_eval now fails, installed or not
    monkeypatch.setattr(evaluate, "_bfcl", {})
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--bench", "bfcl", "--models", "x=y", "--out", str(tmp_path)])
    msg = str(exc.value)
    assert INSTALL in msg and "\n" not in msg


# ----------------------------------------------------------------------------------------------------
# tau2 as tau2 runs it: on tau2's tasks the agent's system prompt holds tau2's domain policy (policy.md
# beside tasks.json, or --policy); the generated shop keeps rollout.SYSTEM_PROMPT


needs_tau2 = pytest.mark.skipif(not (TAU2 / "tasks.json").is_file() or not (TAU2 / "policy.md").is_file(),
                                reason=f"tau2 retail data absent ({TAU2})")


def shop_prompt(policy_file=None, tasks=None):
    """The system prompt of the shop world evaluate.py and grpo.py build from --policy-file and --tasks."""
    empty = {"products": {}, "users": {}, "orders": {}}
    return env.Shop(empty, policy=env.policy_text(policy_file, tasks)).system_prompt


def test_system_prompt_without_a_policy_is_the_shops(tmp_path):
    assert shop_prompt() == env.SYSTEM_PROMPT
    assert shop_prompt(None, str(tmp_path / "tasks.jsonl")) == env.SYSTEM_PROMPT  # none beside
    (tmp_path / "rules.md").write_text("Never refund gift cards.\n")
    prompt = shop_prompt(str(tmp_path / "rules.md"))
    assert "<policy>\nNever refund gift cards.\n</policy>" in prompt
    assert shop_prompt("none", str(tmp_path / "tasks.jsonl")) == env.SYSTEM_PROMPT
    with pytest.raises(FileNotFoundError, match="policy file"):
        shop_prompt(str(tmp_path / "missing.md"))


@needs_tau2
def test_policy_beside_tau2_tasks():
    assert env.policy_beside(str(TAU2 / "tasks.json")) == str((TAU2 / "policy.md").resolve())
    prompt = shop_prompt(None, str(TAU2 / "tasks.json"))
    assert (TAU2 / "policy.md").read_text().strip() in prompt
    assert shop_prompt("none", str(TAU2 / "tasks.json")) == env.SYSTEM_PROMPT


@needs_tau2
def test_evaluate_tau2_gives_the_agent_the_policy(policy_ckpt, user_server, tmp_path):
    evaluate.main(["--models", f"tiny={policy_ckpt}", "--tasks", str(TAU2 / "tasks.json"), "--db", str(TAU2 / "db.json"),
                   "--n-tasks", "1", "--k", "1", "--max-turns", "1", "--max-new-tokens", "4", "--max-len", "8192",
                   "--user", user_server.url, "--out", str(tmp_path)])
    ep = util.read_jsonl(tmp_path / "tiny_retail.jsonl")[0]
    policy = (TAU2 / "policy.md").read_text().strip()
    prompt = shop_prompt(None, str(TAU2 / "tasks.json"))
    assert ep["messages"][0] == {"role": "system", "content": prompt}
    assert policy in ep["messages"][0]["content"] and ep["turns"] == 1  # the agent played with it



@pytest.mark.parametrize("flag, value, allowed", [("k", 0, ">= 1"), ("temperature", -0.5, ">= 0"),
                                                  ("n_tasks", 0, ">= 1"), ("max_turns", 0, ">= 1")])
def test_bad_arguments_name_the_flag_and_range(flag, value, allowed, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(evaluate, out=tmp_path / "eval", **{flag: value})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--" + flag.replace("_", "-") in err and allowed in err, err


def test_empty_test_tasks_are_refused(world, tmp_path):
    empty = tmp_path / "tasks.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=f"no tasks in {empty}"):
        run_main(evaluate, models=[f"sft={world.sft}"], tasks=empty, db=world.data / "shop.json",
                 out=tmp_path / "eval")


# ----------------------------------------------------------------------------------------------------
# the demo's path from the committed base, end to end

DEMO_SFT_STEPS = 150  # of the demo's 1200: the base learns the protocol and copies ids, not yet to solve tasks


@pytest.mark.slow
def test_demo_path_from_the_committed_base(tmp_path):
    """synth.py, SFT from tests/tiny_base, 2 GRPO steps, evaluation (1 greedy trial of the 60 test tasks), each
    through its command line with the demo's defaults but for the step counts (about 3.5 min). Asserted is only
    what held with a margin on seeds 0, 1 and 2 (2026-12-05, 2 cores): after 150 steps the SFT model copies ids
    (eval_id_acc 0.872 / 0.910 / 0.878, copy_acc 0.90-0.96, eval_loss 0.62-0.77) and makes valid tool calls in
    the held-out episodes (2.8 / 2.6 / 3.4 an episode) where the base makes none; the base solves no task. Task
    success itself needs more steps (pass^1 at 150 steps was 0.0-1.7%), so it is not asserted; nor is
    any gain from GRPO, whose 2 steps must only run and leave a checkpoint that plays."""
    import grpo
    import synth
    data, out = tmp_path / "data", tmp_path / "out"
    run_main(synth, data_dir=data)
    run_main(sft, data=data / "sft.jsonl", out=out / "sft", steps=DEMO_SFT_STEPS, eval_every=DEMO_SFT_STEPS)
    last = read_jsonl(out / "sft" / "metrics.jsonl")[-1]
    assert last["step"] == DEMO_SFT_STEPS, last
    assert last["eval_id_acc"] >= 0.75 and last["copy_acc"] >= 0.75 and last["eval_loss"] <= 0.95, last
    run_main(grpo, model=out / "sft", data_dir=data, out=out / "grpo", steps=2)
    assert [r["step"] for r in read_jsonl(out / "grpo" / "metrics.jsonl")] == [1, 2]
    res = evaluate.main(["--models", f"base={rollout.TINY_BASE}", f"sft={out / 'sft'}", f"grpo={out / 'grpo'}",
                         "--data-dir", str(data), "--k", "1", "--out", str(out / "eval")])
    assert all(r["shop"]["all"]["n"] == 60 and r["shop"]["all"]["errored"] == 0 for r in res.values())
    assert res["base"]["shop"]["all"]["pass^1"] == 0.0 and res["grpo"]["shop"]["all"]["pass^1"] is not None

    def valid_calls(name):  # tool calls that ran without an error, per episode
        eps = read_jsonl(out / "eval" / f"{name}_shop.jsonl")
        return sum(e["tool_calls"] - e["tool_errors"] for e in eps) / len(eps)
    assert valid_calls("base") == 0.0 and valid_calls("sft") >= 1.5


def test_llm_concurrency_reaches_every_endpoint(world, tmp_path, monkeypatch):
    """--llm-concurrency is handed to the user's endpoint and to an endpoint playing the agent."""
    dead = util.DeadEndpoints()
    monkeypatch.setattr(rollout, "OpenAIChatBackend", dead.Backend)
    with pytest.raises(SystemExit, match="every episode errored"):
        run_main(evaluate, data_dir=world.data, n_tasks=2, k=1, max_turns=3, out=tmp_path / "eval",
                 user="http://user/v1", llm_concurrency=5, models="agent=http://agent/v1")
    assert sorted(dead.made) == [("http://agent/v1", 5), ("http://user/v1", 5)]


@needs_bfcl
def test_bfcl_run_whose_every_endpoint_failed_exits_nonzero(tmp_path, monkeypatch):
    """Each entry is scored 0, as BFCL does, but a run that measured nothing says so and exits non-zero."""
    dead = util.DeadEndpoints()
    monkeypatch.setattr(rollout, "OpenAIChatBackend", dead.Backend)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--bench", "bfcl", "--models", "remote=http://agent/v1", "--categories", "base", "--n", "2",
                       "--out", str(tmp_path)])
    assert str(e.value.code).startswith("evaluate.py: every entry's agent endpoint failed (2 of 2), the first "
                                        "because dead endpoint;"), e.value.code
    assert [r["error"] for r in util.read_jsonl(tmp_path / "remote_bfcl.jsonl")] == ["dead endpoint"] * 2


def test_vllm_evaluates_models_one_engine_at_a_time(world, fake_vllm, monkeypatch, tmp_path):
    """Two models under --backend vllm, as on a GPU (CUDA said available): sleep mode (one engine per process)
    stays off in evaluation, each model's engine is shut down before the next one starts, and each engine holds
    an episode plus one turn (--max-len + --max-new-tokens) and gets the run's seed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(evaluate, "require_vllm", lambda: None)
    import util
    run_main(evaluate, models=[f"a={world.sft}", f"b={world.sft}"], backend="vllm", data_dir=world.data, n_tasks=2,
             k=1, max_turns=1, max_len=700, max_new_tokens=24, seed=5, out=tmp_path / "eval")
    ckpt = rollout.resolve_checkpoint(str(world.sft))
    assert util.FakeLLM.events == [("start", ckpt), ("shutdown", ckpt)] * 2
    for kw in util.FakeLLM.made:
        assert kw["enable_sleep_mode"] is False and kw["max_model_len"] == 724 and kw["seed"] == 5
    assert (tmp_path / "eval" / "a_shop.jsonl").is_file() and (tmp_path / "eval" / "b_shop.jsonl").is_file()
