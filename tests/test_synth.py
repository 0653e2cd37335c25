"""synth.py: the generated shop and tasks, the oracle agent, synthesis end to end (env tools, MCP, LLM-simulated
tools, a teacher LLM), and the MCP server."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import env
import rollout
import sft
import synth
import util
from synth import MCPToolClient
from util import PER_KIND, by_kind, read_jsonl, sub_env, user_texts, writes

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"


# ----------------------------------------------------------------------------------------------------
# the generated shop and tasks, and the oracle agent


@pytest.fixture(scope="module")
def db(shop):
    return shop  # tests/conftest.py's generated shop (seed 0)


def test_shop_deterministic_and_sized(db):
    assert synth.generate_shop(SEED) == db
    # ... also across processes, whose string hashing (so set order) differs
    code = "import env, synth; print(env.db_hash(synth.generate_shop(0)))"
    for hash_seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", code], cwd=Path(env.__file__).parent, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}, timeout=60)
        assert r.stdout.strip() == env.db_hash(synth.generate_shop(0)), r.stderr[-2000:]
    assert synth.generate_shop(SEED + 1) != db
    assert 10 <= len(db["products"]) <= 20
    assert 20 <= len(db["users"]) <= 100
    assert 0 < len(db["orders"]) <= 400


def test_shop_in_tau2_schema(db):
    """canonical_db (the pydantic-dump equivalent) keeps every value: products and users come out exactly as
    stored, orders exactly plus the 7 optional keys as null."""
    canon = env.canonical_db(db)
    rt = json.loads(json.dumps(db))
    assert rt == db, "the shop is not plain JSON"
    assert canon["products"] == rt["products"]
    assert canon["users"] == rt["users"]
    stripped = {oid: {k: v for k, v in o.items() if not (k in env.ORDER_OPTIONAL and v is None)}
                for oid, o in canon["orders"].items()}
    assert stripped == rt["orders"]
    assert all(set(env.ORDER_OPTIONAL) <= set(o) for o in canon["orders"].values())
    assert env.db_hash(db) == env.db_hash(rt)


def test_shop_referential_integrity(db):
    variants = {iid: (p, v) for p in db["products"].values() for iid, v in p["variants"].items()}
    for pid, p in db["products"].items():
        assert p["product_id"] == pid
        for iid, v in p["variants"].items():
            assert v["item_id"] == iid and isinstance(v["available"], bool) and isinstance(v["price"], float)
    for uid, u in db["users"].items():
        assert u["user_id"] == uid
        for oid in u["orders"]:
            assert db["orders"][oid]["user_id"] == uid
        for pmid, pm in u["payment_methods"].items():
            assert pm["id"] == pmid
    owned = [oid for u in db["users"].values() for oid in u["orders"]]
    assert sorted(owned) == sorted(db["orders"]) and len(set(owned)) == len(owned)
    for o in db["orders"].values():
        pms = db["users"][o["user_id"]]["payment_methods"]
        assert all(p["payment_method_id"] in pms for p in o["payment_history"])
        for it in o["items"]:
            p, v = variants[it["item_id"]]
            assert (it["product_id"], it["name"], it["options"]) == (p["product_id"], p["name"], v["options"])


def test_tasks_every_kind_disjoint_users(db, splits):
    assert synth.generate_tasks(db, SEED) == splits
    for split in ("train", "test"):
        assert set(by_kind(splits[split])) == set(synth.TASK_KINDS), split
        ids = [t["id"] for t in splits[split]]
        assert len(set(ids)) == len(ids)
    users = {s: {t["script"]["user_id"] for t in splits[s]} for s in ("train", "test")}
    assert users["train"] and users["test"] and not users["train"] & users["test"]


def test_tasks_gold_actions_valid(db, splits):
    """Every gold action of every task runs without error on the shop, and every write changes the db."""
    before = env.db_hash(db)
    for t in splits["train"] + splits["test"]:
        acts = t["evaluation_criteria"]["actions"]
        d = copy.deepcopy(db)
        for a, (content, err) in zip(acts, env.replay_actions(d, acts)):
            assert not err, (t["id"], a, content)
        s = t["script"]
        assert db["users"][s["user_id"]]["address"]["zip"] == s["zip"]
        assert s["email"] in (None, db["users"][s["user_id"]]["email"])
        has_write = any(a["name"] in env.WRITE_TOOLS for a in acts)
        assert has_write == (t["kind"] != "info"), t["id"]
        assert (env.db_hash(d) != before) == has_write, t["id"]
    assert env.db_hash(db) == before


def test_oracle_solves_every_kind(sample, oracle_eps):
    assert {t["kind"] for t in sample} == set(synth.TASK_KINDS)
    for t, ep in zip(sample, oracle_eps):
        assert ep.task_id == t["id"] and ep.kind == t["kind"]
        assert not ep.errored
        assert ep.reward == 1.0, (t["id"], t["kind"], ep.reward_info)
        assert ep.end_reason == "user_stop", (t["id"], ep.end_reason)
        assert ep.messages[-1]["role"] == "user" and ep.messages[-1]["content"].endswith(env.STOP)
        assert ep.tool_errors == 0
        gold = [(a["name"], a["arguments"]) for a in t["evaluation_criteria"]["actions"] if a["name"] in env.WRITE_TOOLS]
        assert writes(ep) == gold


def test_oracle_restates_the_request_first(sample, oracle_eps):
    """The oracle's first reply names the first request in fixed words (what a small model copies later) and
    asks for identification; the scripted user answers it with identification, never with a yes."""
    verbs = {"cancel": "cancel order", "switch": "cancel order", "modify_items": "change an item in order",
             "exchange": "exchange an item in order", "modify_address": "to a new address",
             "user_address": "change your default address", "modify_payment": "with your",
             "return": "return the", "info": "what you paid for order"}
    for t, ep in zip(sample, oracle_eps):
        first = ep.messages[2]
        assert first["role"] == "assistant" and first["content"].startswith("I can help you "), first
        assert verbs[t["kind"]] in first["content"], (t["kind"], first["content"])
        oid = t["script"]["phases"][0]["reads"][0]["arguments"]["order_id"] if t["kind"] != "user_address" else ""
        assert oid in first["content"]
        assert env.ASKS_ID.search(first["content"]) and not env.ASKS_YES.search(first["content"])
        assert not ep.messages[3]["content"].lower().startswith("yes")


def test_switch_changes_mind_only_second_write(sample, oracle_eps):
    n = 0
    for t, ep in zip(sample, oracle_eps):
        if t["kind"] != "switch":
            continue
        n += 1
        first, second = t["script"]["phases"]
        users = user_texts(ep)
        changed = [i for i, u in enumerate(users) if "changed my mind" in u or "second thought" in u]
        assert len(changed) == 1, users
        assert any(s in users[changed[0]] for s in second["say"])
        w = second["write"]
        assert writes(ep) == [(w["name"], w["arguments"])]
        assert first["write"]["name"] == "cancel_pending_order"
        oid = first["write"]["arguments"]["order_id"]
        assert ep.state["orders"][oid]["status"] == "pending"  # the cancel was never done
    assert n == 2 * PER_KIND


# ----------------------------------------------------------------------------------------------------
# synth.py end to end, tools simulated by an LLM, a teacher LLM


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


@pytest.mark.slow
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
    assert synth.SimulatedShop(db, stub).call(d, "cancel_pending_order", args) == (
        "Error: the simulated cancel_pending_order returned malformed output (not JSON).", True)
    assert d["orders"][oid]["status"] == "cancelled"  # the real call ran anyway
    p = stub.prompts[0]
    # the memory holds the order's record (as it was before the call: what a simulator must answer from) and the call
    assert f'{{"order_id": "{oid}", "user_id": "{db["orders"][oid]["user_id"]}"' in p
    assert json.dumps({"name": "cancel_pending_order", "arguments": args}) in p
    good = json.dumps({"order_id": oid, "status": "cancelled"})
    assert synth.SimulatedShop(db, Stub(good)).call(copy.deepcopy(db), "cancel_pending_order", args) == \
        (good, False)
    text, err = synth.SimulatedShop(db, Stub(RuntimeError("down"))).call(copy.deepcopy(db), "get_order_details",
                                                                         {"order_id": oid})
    assert err and text.startswith("Error: tool simulator failed") and "down" in text
    # unknown tools are refused by the real tool before any simulation
    stub = Stub(good)
    assert synth.SimulatedShop(db, stub).call(copy.deepcopy(db), "refund_everything", {}) == \
        env.call_tool(db, "refund_everything", {})
    assert stub.prompts == []


@pytest.mark.parametrize("args", [{"id": "#W0000001"}, {}, {"order_id": 3}, "not json"])
def test_llm_tool_simulator_refuses_bad_arguments(db, args):
    stub = Stub(json.dumps({"order_id": "#W0000001", "status": "pending"}))
    text, err = synth.SimulatedShop(db, stub).call(copy.deepcopy(db), "get_order_details", args)
    assert (text, err) == env.call_tool(copy.deepcopy(db), "get_order_details", args)
    assert stub.prompts == []


def test_llm_tool_simulator_with_tiny_model(db, train_tasks, conversations):
    tok, model = sft.make_tiny(conversations[:6], 400, 32, 2, 2, SEED)
    backend = Recording(rollout.HFChatBackend(model, tok))
    sim = synth.SimulatedShop(db, backend, max_new_tokens=24, max_turns=12)
    tasks = train_tasks[:4]
    eps = util.scored(sim, rollout.run_episodes(rollout.TextAgents(synth.OracleAgent), sim, tasks), tasks)
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
        teacher = rollout.ChatAgent(rollout.OpenAIChatBackend(fake.url, "m", backoff=0.01))
        text = teacher.act(msgs, env.TOOL_SCHEMAS)
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
        parsed = env.parse_assistant(text)
        assert parsed["content"] == ""
        assert [c["function"] for c in parsed["tool_calls"]] == [
            {"name": "get_user_details", "arguments": {"user_id": msgs[-1]["content"]}}]
        assert "error" not in parsed["tool_calls"][0]
        assert env.parse_assistant(teacher.act(msgs, env.TOOL_SCHEMAS)) == {"role": "assistant",
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
# the MCP server and client: a transparent transport for env's tools (same schemas, same results)


ADDR = {"address1": "1 Elm Street", "address2": "Suite 2", "city": "Austin", "country": "USA", "state": "TX", "zip": "78701"}


SHIRT_BLUE = {"name": "T-Shirt", "product_id": "100", "item_id": "1001", "price": 50.88,
              "options": {"color": "blue", "size": "M"}}


def tiny_db():
    """Two users, one product, a pending and a delivered order, in tau2's retail schema."""
    variants = {"1001": {"item_id": "1001", "options": {"color": "blue", "size": "M"}, "available": True, "price": 50.88},
                "1002": {"item_id": "1002", "options": {"color": "red", "size": "L"}, "available": True, "price": 53.0}}
    return {
        "products": {"100": {"name": "T-Shirt", "product_id": "100", "variants": variants}},
        "users": {
            "ann_lee_1": {"user_id": "ann_lee_1", "name": {"first_name": "Ann", "last_name": "Lee"}, "address": ADDR,
                          "email": "ann.lee@example.com",
                          "payment_methods": {"gift_card_7": {"source": "gift_card", "id": "gift_card_7", "balance": 20.0},
                                              "credit_card_8": {"source": "credit_card", "id": "credit_card_8",
                                                                "brand": "visa", "last_four": "4242"}},
                          "orders": ["#W0000001", "#W0000002"]},
            "bo_ng_2": {"user_id": "bo_ng_2", "name": {"first_name": "Bo", "last_name": "Ng"}, "address": ADDR,
                        "email": "bo.ng@example.com",
                        "payment_methods": {"paypal_9": {"source": "paypal", "id": "paypal_9"}}, "orders": []},
        },
        "orders": {
            "#W0000001": {"order_id": "#W0000001", "user_id": "ann_lee_1", "address": ADDR, "items": [SHIRT_BLUE],
                          "status": "pending", "fulfillments": [],
                          "payment_history": [{"transaction_type": "payment", "amount": 50.88,
                                               "payment_method_id": "gift_card_7"}]},
            "#W0000002": {"order_id": "#W0000002", "user_id": "ann_lee_1", "address": ADDR, "items": [SHIRT_BLUE],
                          "status": "delivered",
                          "fulfillments": [{"tracking_id": ["123456789012"], "item_ids": ["1001"]}],
                          "payment_history": [{"transaction_type": "payment", "amount": 50.88,
                                               "payment_method_id": "credit_card_8"}]},
        },
    }


NEW_ADDR = {"address1": "9 Oak Road", "address2": "", "city": "Boston", "state": "MA", "country": "USA", "zip": "02110"}


CALLS = [
    ("find_user_id_by_email", {"email": "ANN.LEE@example.com"}),
    ("get_user_details", {"user_id": "ann_lee_1"}),
    ("get_order_details", {"order_id": "#W0000001"}),
    ("get_product_details", {"product_id": "100"}),
    ("cancel_pending_order", {"order_id": "#W0000001", "reason": "no longer needed"}),   # write
    ("get_order_details", {"order_id": "#W0000001"}),                                    # shows the write
    ("get_user_details", {"user_id": "ann_lee_1"}),                                      # refunded gift card
    ("cancel_pending_order", {"order_id": "#W0000001", "reason": "no longer needed"}),   # tau2 error
    ("modify_user_address", {"user_id": "bo_ng_2", **NEW_ADDR}),
    ("get_order_details", {}),                                                           # missing argument
    ("get_order_details", {"order_id": "#W0000002", "verbose": True}),                   # extra argument
    ("get_order_details", {"order_id": 2}),                                              # wrong type
    ("get_order_details", {"order_id": "#W9999999"}),                                    # not found
    ("refund_everything", {"order_id": "#W0000002"}),                                    # unknown tool
    ("calculate", {"expression": "50.88 * 2"}),
    ("list_all_product_types", {}),
]


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "db.json"
    path.write_text(json.dumps(tiny_db()))
    return path


def server_pids(db_path):
    """Pids of our children whose command line names db_path (Linux /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and str(db_path) in cmd:
            pids.append(int(proc.name))
    return pids


def test_mcp_matches_in_process(db_path):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the server process")
    local = env.load_db(db_path)
    with MCPToolClient(db_path) as client:
        pids = server_pids(db_path)
        assert len(pids) == 1
        assert client.list_tools() == env.TOOL_SCHEMAS

        results = []
        for name, args in CALLS:
            remote, expected = client.call_tool(name, args), env.call_tool(local, name, args)
            assert remote == expected, (name, args)
            results.append(remote)
        # The sequence really exercises state and errors, not just reads of an unchanged db.
        assert results[2] != results[5] and '"cancelled"' in results[5][0]
        assert [is_error for _, is_error in results] == [i in (7, 9, 10, 11, 12, 13) for i in range(len(CALLS))]
        assert client.get_db() == json.loads(json.dumps(local))

        # Non-dict arguments (MCP carries objects only) still answer exactly as env does.
        for name, args in [("get_order_details", '{"order_id": "#W0000002"}'), ("get_order_details", "#W0000002"),
                           ("get_order_details", ["#W0000002"]), ("list_all_product_types", None),
                           ("no_such_tool", 3)]:
            assert client.call_tool(name, args) == env.call_tool(local, name, args), (name, args)

        # reset(): a new episode on the same server starts from the pristine db.
        client.reset()
        fresh = env.load_db(db_path)
        assert client.get_db() == fresh
        assert client.call_tool("get_order_details", {"order_id": "#W0000001"}) == \
            env.call_tool(fresh, "get_order_details", {"order_id": "#W0000001"})
    assert not Path(f"/proc/{pids[0]}").exists(), "server process survived close()"


def test_episodes_are_isolated_and_expire(db_path):
    command = [sys.executable, str(REPO / "synth.py"), "--mcp-server", "--max-episodes", "1"]
    with MCPToolClient(db_path, command=command) as client:
        cancel = ("cancel_pending_order", {"order_id": "#W0000001", "reason": "ordered by mistake"})
        first = client.episode
        assert client.call_tool(*cancel)[1] is False
        client.reset()
        assert client.call_tool(*cancel)[1] is False   # a fresh copy: the order is pending again
        client.episode = first                          # evicted by the second episode (cap 1)
        content, is_error = client.call_tool("get_order_details", {"order_id": "#W0000001"})
        assert is_error and "expired" in content


def test_tau2_gold_actions_over_mcp():
    """tau2's own db and gold actions (real sizes, floats, errors): same results and end state over MCP."""
    retail = REPO.parent / "shared" / "tau2" / "retail"
    if not (retail / "db.json").exists():
        pytest.skip("../shared/tau2/retail absent")
    initial = env.load_db(retail / "db.json")
    tasks = env.load_tasks(retail / "tasks.json")[:6]
    with MCPToolClient(retail / "db.json") as client:
        for task in tasks:
            client.reset()
            local = json.loads(json.dumps(initial))
            for action in task["evaluation_criteria"]["actions"]:
                name, args = action["name"], action["arguments"]
                assert client.call_tool(name, args) == env.call_tool(local, name, args), (task["id"], name)
            assert client.get_db() == local, task["id"]  # plain equality: stricter than db_hash, and cheaper


# ----------------------------------------------------------------------------------------------------
# nothing lost: a failed, empty or interrupted run never destroys earlier outputs


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A data folder as synth.py leaves it: a small shop, 9 train and 9 test tasks, and an sft.jsonl."""
    data = tmp_path_factory.mktemp("made") / "data"
    synth.prepare_data(str(data), SEED, n_users=30, n_train=9, n_test=9)
    util.run_main(synth, data_dir=data)
    assert len(read_jsonl(data / "sft.jsonl")) == 9
    return data


def copy_of(made, tmp_path):
    import shutil
    shutil.copytree(made, tmp_path / "data")
    return tmp_path / "data"


def exits_nonzero(capsys, **flags):
    with pytest.raises(SystemExit) as e:
        util.run_main(synth, **flags)
    assert e.value.code not in (0, None)
    return str(e.value.code), capsys.readouterr().out


def test_failing_user_endpoint_keeps_the_old_output(made, tmp_path, server, monkeypatch, capsys):
    import functools
    data = copy_of(made, tmp_path)
    before = (data / "sft.jsonl").read_bytes()
    monkeypatch.setattr(rollout, "OpenAIChatBackend", functools.partial(rollout.OpenAIChatBackend, backoff=0.001))
    srv = server([], default=500)
    msg, out = exits_nonzero(capsys, data_dir=data, user=srv.url, n_tasks=3)
    assert "every episode errored (3 of 3), the first because user simulator failed" in msg, msg
    assert "left as it was" in msg and "\n" not in msg
    assert "dropped 3: user failed (user simulator failed" in out and "HTTP N" in out, out  # counted by reason
    assert (data / "sft.jsonl").read_bytes() == before and not (data / "sft.jsonl.tmp").exists()


def test_empty_task_file_or_nothing_kept_keeps_the_old_output(made, tmp_path, capsys):
    data = copy_of(made, tmp_path)
    before = (data / "sft.jsonl").read_bytes()
    msg, _ = exits_nonzero(capsys, data_dir=data, max_turns=1, n_tasks=1)  # a cancel needs more than one turn
    assert "no conversation was kept" in msg
    (data / "train_tasks.jsonl").write_text("")
    msg, _ = exits_nonzero(capsys, data_dir=data)
    assert "no train tasks" in msg and "train_tasks.jsonl" in msg
    assert (data / "sft.jsonl").read_bytes() == before


def test_missing_shop_never_overwrites_task_files(made, tmp_path, capsys):
    data = copy_of(made, tmp_path)
    (data / "shop.json").unlink()
    mine = [json.loads(line) for line in (data / "train_tasks.jsonl").read_text().splitlines()[:3]]
    env.save_tasks(mine, data / "train_tasks.jsonl")  # the user's own 3 tasks
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    msg, _ = exits_nonzero(capsys, data_dir=data)
    assert "shop.json is missing" in msg and "train_tasks.jsonl" in msg
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # nothing written, nothing replaced
    with pytest.raises(FileExistsError):
        synth.prepare_data(str(data))


def test_task_whose_gold_replay_fails_is_dropped_and_counted(made, tmp_path, capsys):
    """A cancel task on an order that is not pending: its gold cancel fails, and so does the oracle's, so 'did
    nothing' matches the gold state and the episode scores 1. It must not become training data."""
    data = copy_of(made, tmp_path)
    tasks = env.load_tasks(data / "train_tasks.jsonl")
    task = next(t for t in tasks if t["kind"] == "cancel")
    oid = next(a for a in task["evaluation_criteria"]["actions"] if a["name"] == "cancel_pending_order")[
        "arguments"]["order_id"]
    shop = json.loads((data / "shop.json").read_text())
    shop["orders"][oid]["status"] = "delivered"
    (data / "shop.json").write_text(json.dumps(shop))
    util.run_main(synth, data_dir=data)
    out = capsys.readouterr().out
    assert "tried 9, kept 8" in out, out
    assert "dropped 1: broken task (its gold replay fails: cancel_pending_order: Error: Non-pending order" in out
    assert task["id"] not in {r["task_id"] for r in read_jsonl(data / "sft.jsonl")}


@pytest.mark.slow
def test_mcp_server_dying_keeps_finished_episodes(made, tmp_path, monkeypatch, capsys):
    data = copy_of(made, tmp_path)
    (data / "sft.jsonl").unlink()

    class Dying(MCPToolClient):
        def reset(self):  # the third episode starts on a server that has just been killed
            self.resets = getattr(self, "resets", 0) + 1
            if self.resets == 3:
                for pid in mcp_server_pids(str(data)):
                    os.kill(pid, 9)
            return super().reset()

    monkeypatch.setattr(synth, "MCPToolClient", Dying)
    msg, out = exits_nonzero(capsys, data_dir=data, tools="mcp", n_tasks=5)
    assert "MCP server died during episode 3 of 5" in msg, msg
    assert "tried 2, kept 2" in out
    rows = read_jsonl(data / "sft.jsonl")
    assert sorted(r["task_id"] for r in rows) == ["train_0", "train_1"]
    assert mcp_server_pids(str(data)) == []


@pytest.mark.parametrize("flag, value", [("n_tasks", 0), ("max_turns", 0), ("chunk", 0), ("n_train", 0)])
def test_bad_arguments_name_the_flag_and_range(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        util.run_main(synth, data_dir=tmp_path / "data", **{flag: value})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--" + flag.replace("_", "-") + " must be >= 1" in err, err
    assert not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------------------------------
# verification: simulated tools checked against the real ones, and the LLM judge


class FakeToolLLM(util.FakeOpenAIServer):
    """An OpenAI-compatible tool simulator. mode "nonsense": one sentence for every call; "shape": the real
    result in the wrong shape (a string result as a JSON record, a record wrapped in another); "exact": the real
    tool's result, computed on the shop with the prompt's memory records (the state before the call) put in."""

    def __init__(self, mode, shop):
        self.mode, self.shop, self.n = mode, shop, 0
        super().__init__()

    def answer(self, path, body):
        self.n += 1
        prompt = body["messages"][0]["content"]
        call = json.loads(prompt.split("\nCall: ", 1)[1])
        memory = prompt.split("memory:\n", 1)[1].split("\n\nCall: ", 1)[0]
        world = copy.deepcopy(self.shop)
        for rec in (json.loads(line) for line in memory.splitlines() if line.strip()):
            table, key = (("orders", "order_id") if "items" in rec else ("users", "user_id") if "payment_methods" in rec
                          else ("products", "product_id"))
            world[table][rec[key]] = rec
        real, _ = env.call_tool(world, call["name"], call["arguments"])
        text = {"nonsense": "Hi, I'd like to cancel my order please.", "exact": real,
                "shape": json.dumps({"result": real}) if real.startswith("{") else json.dumps({"user_id": real})}
        return 200, {"choices": [{"message": {"role": "assistant", "content": text[self.mode]}}]}


def synth_run(capsys, **flags):
    """synth.main with flags -> (exit message or None, stdout)."""
    try:
        util.run_main(synth, **flags)
        code = None
    except SystemExit as e:
        code = str(e.code)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("mode", ["nonsense", "shape", "exact"])
def test_simulated_tools_must_agree_with_the_real_ones(made, tmp_path, capsys, mode):
    """Nonsense and right-but-misshapen simulations keep nothing, each drop naming the disagreement and the tool
    that first disagreed; a simulator that answers exactly what the real tool does keeps what the oracle keeps."""
    data = copy_of(made, tmp_path)
    oracle_kept = sorted(r["task_id"] for r in read_jsonl(data / "sft.jsonl"))  # --tools env, the same 9 tasks
    assert len(oracle_kept) == 9
    srv = FakeToolLLM(mode, env.load_db(data / "shop.json"))
    try:
        code, out = synth_run(capsys, data_dir=data, tools="llm", tool_llm=srv.url, tool_model="fake",
                              out=tmp_path / "llm.jsonl")
    finally:
        srv.close()
    assert srv.n > 9, out
    summary = next(line for line in out.splitlines() if "tool simulator:" in line)
    if mode == "exact":
        assert code is None and "tried 9, kept 9" in out, out
        assert sorted(r["task_id"] for r in read_jsonl(tmp_path / "llm.jsonl")) == oracle_kept
        assert f"{srv.n} agreed with the real tool, 0 disagreed, 0 failed" in summary, summary
        return
    assert "no conversation was kept" in code and not (tmp_path / "llm.jsonl").exists()
    # the oracle's first call identifies the user, so that is where each episode first disagrees
    kind = "different values" if mode == "nonsense" else "malformed output"
    lines = [line for line in out.splitlines() if "dropped" in line]
    assert sum(int(line.split()[1].rstrip(":")) for line in lines) == 9, out
    assert all("simulator disagreed with the real tool (first on find_user_id_by_" in line and kind in line
               for line in lines), out
    assert "wrong database" not in out and f", 0 agreed with the real tool, {srv.n} disagreed (" in summary, summary
    assert "find_user_id_by_email" in summary and "find_user_id_by_name_zip" in summary
    if mode == "nonsense":  # the oracle goes on with the sentence as the user id: every later call disagrees too
        assert "get_order_details" in summary and "cancel_pending_order" in summary, summary


def test_agreement_rule():
    order = {"order_id": "#W1", "status": "pending", "items": [{"price": 24.0, "name": "Water Bottle"}],
             "address": {"address1": "12 Oak St"}}
    real = (json.dumps(order), False)
    assert synth.agreement(real, real) is None
    # prose may be worded otherwise; numbers agree by value
    reworded = copy.deepcopy(order)
    reworded["items"][0].update(price=24, name="water bottle (1)")
    reworded["address"]["address1"] = "12 Oak Street"
    assert synth.agreement((json.dumps(reworded), False), real) is None
    for change, kind in [(("status", "cancelled"), "different values"), (("order_id", "#W2"), "different values"),
                         (("extra", 1), "different fields")]:
        bad = dict(order, **dict([change]))
        assert synth.agreement((json.dumps(bad), False), real)[0] == kind, change
    price = copy.deepcopy(order)
    price["items"][0]["price"] = 24.5
    assert synth.agreement((json.dumps(price), False), real) == (
        "different values", "items[0].price: simulated 24.5, real 24.0")
    # amounts are facts to the cent: a cent off, or under 1% off, is a different value (a tolerance would pass them)
    for sim_price, real_price in [(24.01, 24.0), (1009.0, 1000.0), (999.99, 1000.0)]:
        near, truth = copy.deepcopy(order), copy.deepcopy(order)
        near["items"][0]["price"], truth["items"][0]["price"] = sim_price, real_price
        assert synth.agreement((json.dumps(near), False), (json.dumps(truth), False)) == (
            "different values", f"items[0].price: simulated {sim_price!r}, real {real_price!r}")
        assert synth.agreement((str(sim_price), False), (str(real_price), False))[0] == "different values"
    missing = {k: v for k, v in order.items() if k != "address"}
    assert synth.agreement((json.dumps(missing), False), real)[0] == "different fields"
    # errors: two agree whatever the wording; one against an answer does not
    assert synth.agreement(("Error: no such order", True), ("Error: Order not found", True)) is None
    assert synth.agreement(("Error: no such order", True), real)[0] == "an error where the real tool answered"
    assert synth.agreement(real, ("Error: Order not found", True))[0] == "an answer where the real tool failed"
    assert synth.agreement(synth.check_simulated("get_order_details", "nonsense"), real)[0] == "malformed output"
    # bare string results: an id exactly, a number by value, prose any wording
    assert synth.agreement(("ann_lee_1234", False), ("ann_lee_1234", False)) is None
    assert synth.agreement(("ann_lee_9999", False), ("ann_lee_1234", False))[0] == "different values"
    assert synth.agreement(("Hi, I'd like to cancel my order please.", False), ("ann_lee_1234", False))
    assert synth.agreement(("24.50", False), ("24.5", False)) is None
    assert synth.agreement(("You are now transferred", False), ("Transfer successful", False)) is None


def test_failing_tool_simulator_is_named_as_the_cause(made, tmp_path, server, monkeypatch, capsys):
    """A tool endpoint answering 500: the drop reason is the simulator, not the database the agent never wrote."""
    import functools
    monkeypatch.setattr(rollout, "OpenAIChatBackend", functools.partial(rollout.OpenAIChatBackend, backoff=0.001))
    srv = server([], default=500)
    code, out = synth_run(capsys, data_dir=copy_of(made, tmp_path), tools="llm", tool_llm=srv.url, n_tasks=4,
                          max_turns=4)
    assert "no conversation was kept" in code
    assert "dropped 4: tool simulator failed (InternalServerError from http://N.N.N.N:N/v1: HTTP N" in out, out
    assert "wrong database" not in out and "0 agreed with the real tool, 0 disagreed, 4 failed" in out, out


class FakeJudge(util.FakeOpenAIServer):
    """An OpenAI-compatible judge: reply(prompt) gives its text, or an int (that HTTP status). Keeps prompts."""

    def __init__(self, reply):
        self.reply, self.prompts = reply, []
        super().__init__()

    def answer(self, path, body):
        self.prompts.append(body["messages"][0]["content"])
        r = self.reply(self.prompts[-1])
        if isinstance(r, int):
            return r, {"error": "judge down"}
        return 200, {"choices": [{"message": {"role": "assistant", "content": r}}]}


PASS = '<think>{"verdict": "fail"} is tempting</think>Sure. {"verdict": "pass", "reason": "followed the policy"}'


@pytest.mark.parametrize("case", ["accept", "reject_one", "fail", "no_verdict"])
def test_judge_is_a_second_verifier(made, tmp_path, monkeypatch, capsys, case):
    """Kept: what passes the database check and the judge, its verdict stored beside it. Rejected, failed (after
    retries) and never-answered judgements are dropped, each with its reason; nothing is kept unjudged."""
    import functools
    monkeypatch.setattr(rollout, "OpenAIChatBackend", functools.partial(rollout.OpenAIChatBackend, backoff=0.001))
    data = copy_of(made, tmp_path)
    tasks = env.load_tasks(data / "train_tasks.jsonl")[:4]
    target = tasks[1]["script"]["user_id"]  # "reject_one" rejects the conversation with this user
    reply = {"accept": lambda p: PASS, "fail": lambda p: 500, "no_verdict": lambda p: "I think it is fine.",
             "reject_one": lambda p: ('{"verdict": "FAIL", "reason": "no confirmation"}' if target in p else PASS)}
    srv = FakeJudge(reply[case])
    try:
        code, out = synth_run(capsys, data_dir=data, n_tasks=4, judge=srv.url, judge_model="fake-judge",
                              out=tmp_path / "judged.jsonl")
    finally:
        srv.close()
    rows = read_jsonl(tmp_path / "judged.jsonl") if code is None else []
    if case == "accept":
        assert "tried 4, kept 4" in out and len(srv.prompts) == 4
        assert all(r["judge"] == {"verdict": "pass", "reason": "followed the policy"} for r in rows)
        # the judge sees the domain policy, the user's request and the whole conversation with its tool calls
        p = next(p for p in srv.prompts if tasks[0]["script"]["user_id"] in p)
        assert env.SYSTEM_PROMPT[:60] in p and tasks[0]["user_scenario"]["instructions"]["reason_for_call"] in p
        assert "[calls find_user_id_by_" in p and "\ntool: " in p and "\nuser: " in p
    elif case == "reject_one":
        assert "tried 4, kept 3" in out and "dropped 1: judge rejected" in out, out
        assert sorted(r["task_id"] for r in rows) == sorted(t["id"] for t in tasks if t is not tasks[1])
    else:
        assert code and "no conversation was kept" in code and not (tmp_path / "judged.jsonl").exists()
        why = "HTTP N" if case == "fail" else "no valid JSON answer in the judge's reply"
        assert f"dropped 4: judge failed (" in out and why in out, out
        assert len(srv.prompts) == (4 * 5 if case == "fail" else 4 * 3)  # the backend's retries; ask_judge's tries


def test_judge_is_not_asked_about_what_the_database_check_dropped(made, tmp_path, capsys):
    srv = FakeJudge(lambda p: PASS)
    try:
        code, out = synth_run(capsys, data_dir=copy_of(made, tmp_path), n_tasks=2, max_turns=1, judge=srv.url)
    finally:
        srv.close()
    assert code and "dropped 2: wrong database" in out and srv.prompts == []


def test_llm_concurrency_reaches_every_endpoint(made, tmp_path, monkeypatch, capsys):
    """--llm-concurrency is handed to every endpoint synth.py builds: the tool simulator, the user, the judge."""
    dead = util.DeadEndpoints()
    monkeypatch.setattr(rollout, "OpenAIChatBackend", dead.Backend)
    code, out = synth_run(capsys, data_dir=copy_of(made, tmp_path), n_tasks=2, tools="llm", tool_llm="http://tool/v1",
                          user="http://user/v1", judge="http://judge/v1", llm_concurrency=5)
    assert "every episode errored (2 of 2)" in code
    assert sorted(dead.made) == [("http://judge/v1", 5), ("http://tool/v1", 5), ("http://user/v1", 5)]
