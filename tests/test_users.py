"""The generated shop and tasks (env.generate_shop / generate_tasks) and the scripted user (env.ScriptedUser),
played against the oracle agent (synth.OracleAgent) through rollout.run_episodes in text-only mode."""

import collections
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import env
import rollout
import synth

SEED = 0
PER_KIND = 5  # tasks of each kind from each split in the oracle sweep


@pytest.fixture(scope="module")
def db():
    return env.generate_shop(SEED)


@pytest.fixture(scope="module")
def splits(db):
    return env.generate_tasks(db, SEED)


def by_kind(tasks):
    out = collections.defaultdict(list)
    for t in tasks:
        out[t["kind"]].append(t)
    return out


@pytest.fixture(scope="module")
def sample(splits):
    """PER_KIND tasks of every kind from both splits."""
    out = []
    for split in ("train", "test"):
        kinds = by_kind(splits[split])
        for k in env.TASK_KINDS:
            out += kinds[k][:PER_KIND]
    return out


def scripted(t, s):
    return env.ScriptedUser(t, s)


def oracle(t, s):
    return synth.OracleAgent(t, s)


def play(tasks, db, make_agent=oracle, seed=SEED, **kw):
    return rollout.run_episodes(None, None, tasks, db, make_user=scripted, make_agent=make_agent, seed=seed, **kw)


@pytest.fixture(scope="module")
def oracle_eps(sample, db):
    before = env.db_hash(db)
    eps = play(sample, db)
    assert env.db_hash(db) == before, "run_episodes changed the caller's db"
    return eps


def user_texts(ep):
    return [m["content"] for m in ep.messages if m["role"] == "user"]


def writes(ep):
    """(name, arguments) of every write the agent called, in order."""
    return [(c["function"]["name"], c["function"]["arguments"]) for m in ep.messages if m["role"] == "assistant"
            for c in m.get("tool_calls", []) if c["function"]["name"] in env.WRITE_TOOLS]


# ---------------------------------------------------------------------------------------------------- generator


def test_shop_deterministic_and_sized(db):
    assert env.generate_shop(SEED) == db
    # ... also across processes, whose string hashing (so set order) differs
    code = "import env, json; print(env.db_hash(env.generate_shop(0)))"
    for hash_seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", code], cwd=Path(env.__file__).parent, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}, timeout=60)
        assert r.stdout.strip() == env.db_hash(env.generate_shop(0)), r.stderr[-2000:]
    assert env.generate_shop(SEED + 1) != db
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
    assert env.generate_tasks(db, SEED) == splits
    for split in ("train", "test"):
        assert set(by_kind(splits[split])) == set(env.TASK_KINDS), split
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


# ---------------------------------------------------------------------------------------------------- oracle sweep


def test_oracle_solves_every_kind(sample, oracle_eps):
    assert {t["kind"] for t in sample} == set(env.TASK_KINDS)
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
        assert ep.db["orders"][oid]["status"] == "pending"  # the cancel was never done
    assert n == 2 * PER_KIND


# ---------------------------------------------------------------------------------------------------- wrong writes


class Tamper:
    """The oracle, except that its write's arguments are changed by `edit(task, name, args)`, and/or an extra
    write is made right after it."""

    def __init__(self, task, seed, db, edit=None, extra=None):
        self.o, self.task, self.db, self.edit, self.extra = synth.OracleAgent(task, seed), task, db, edit, extra
        self.after_write = False

    def act(self, messages):
        if self.after_write and self.extra:
            self.after_write = False
            name, args = self.extra
            return synth.tool_call_text(name, **args)
        text = self.o.act(messages)
        msg = rollout.parse_assistant(text)
        calls = msg.get("tool_calls", [])
        if calls and calls[0]["function"]["name"] in env.WRITE_TOOLS:
            self.after_write = True
            name, args = calls[0]["function"]["name"], dict(calls[0]["function"]["arguments"])
            if self.edit:
                args = self.edit(self.db, name, args)
            return synth.tool_call_text(name, **args)
        return text


def wrong_args(db, name, args):
    if "reason" in args:
        args["reason"] = next(r for r in env.REASONS if r != args["reason"])
    elif "order_id" in args:
        o = db["orders"][args["order_id"]]
        args["order_id"] = next(k for k, v in db["orders"].items()
                                if v["status"] == o["status"] and k != o["order_id"])
    else:
        args["address1"] = "1 Wrong Way"
    return args


def one_per_write_kind(splits):
    kinds = by_kind(splits["train"])
    return [kinds[k][0] for k in env.TASK_KINDS if k != "info"]


def test_wrong_write_arguments_give_zero(db, splits):
    tasks = one_per_write_kind(splits)
    eps = play(tasks, db, make_agent=lambda t, s: Tamper(t, s, db, edit=wrong_args))
    for t, ep in zip(tasks, eps):
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "db", (t["kind"], ep.reward_info)
        assert len(writes(ep)) == 1
        if t["kind"] in ("cancel", "user_address"):  # the wrong write itself succeeded
            res = [m for m in ep.messages if m["role"] == "tool"][-1]
            assert not res["content"].startswith("Error"), res


def test_extra_write_gives_zero(db, splits):
    tasks = one_per_write_kind(splits)
    # control: the tamperer with nothing to tamper is the oracle
    assert all(ep.reward == 1.0 for ep in play(tasks, db, make_agent=lambda t, s: Tamper(t, s, db)))

    def make(t, s):
        addr = dict(address1="77 Extra St", address2="", city="Austin", state="TX", country="USA", zip="78701")
        return Tamper(t, s, db, extra=("modify_user_address", dict(user_id=t["script"]["user_id"], **addr)))
    eps = play(tasks, db, make_agent=make)
    for t, ep in zip(tasks, eps):
        assert len(writes(ep)) == 2 and ep.tool_errors == 0, t["kind"]
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "db", (t["kind"], ep.reward_info)


# ---------------------------------------------------------------------------------------------------- what the user reveals


def test_user_without_email_never_says_it(db, sample, oracle_eps):
    """Tasks whose user does not know their email: the email never appears, even when the agent insists."""
    no_email = [t for t in sample if t["script"]["email"] is None]
    assert no_email
    for t, ep in zip(sample, oracle_eps):
        if t["script"]["email"] is None:
            email = db["users"][t["script"]["user_id"]]["email"]
            assert not any(email.lower() in u.lower() for u in user_texts(ep))

    class Pushy:
        def act(self, messages):
            return "What is your e-mail address? I need your email to verify your identity."
    eps = play(no_email, db, make_agent=lambda t, s: Pushy(), max_turns=8)
    for t, ep in zip(no_email, eps):
        u = db["users"][t["script"]["user_id"]]
        texts = user_texts(ep)
        assert not any(u["email"].lower() in x.lower() for x in texts)
        assert any(u["address"]["zip"] in x for x in texts[1:])  # it offers name and zip instead
        assert ep.end_reason == "user_stop"
        assert (ep.reward == 1.0) == (t["kind"] == "info")  # nothing was done, which only an info task wants


def test_identity_only_when_asked(db, sample, oracle_eps):
    for t, ep in zip(sample, oracle_eps):
        u = db["users"][t["script"]["user_id"]]
        said = " ".join(" ".join(p["say"]) for p in t["script"]["phases"])
        secrets = [u["email"]] + ([u["address"]["zip"]] if u["address"]["zip"] not in said else [])
        first = ep.messages[1]["content"]
        assert not any(s in first for s in secrets), first
        assert any(s in first for s in t["script"]["phases"][0]["say"])
        # the first message that identifies the user answers an assistant turn that asked for it
        msgs = ep.messages
        i = next(i for i, m in enumerate(msgs) if m["role"] == "user" and any(s in m["content"] for s in secrets))
        assert msgs[i - 1]["role"] == "assistant" and env.ASKS_ID.search(msgs[i - 1]["content"])

    # an agent that never asks is never told
    class Mute:
        def act(self, messages):
            return "Okay."
    tasks = [t for t in sample if db["users"][t["script"]["user_id"]]["address"]["zip"]
             not in " ".join(" ".join(p["say"]) for p in t["script"]["phases"])][:10]
    eps = play(tasks, db, make_agent=lambda t, s: Mute(), max_turns=10)
    for t, ep in zip(tasks, eps):
        u = db["users"][t["script"]["user_id"]]
        texts = user_texts(ep)
        assert len(texts) >= 3 and ep.end_reason == "user_stop"  # patience ran out
        assert not any(u["email"] in x or u["address"]["zip"] in x for x in texts), texts


def test_wording_seeded(db, sample, oracle_eps):
    again = play(sample, db)
    assert [e.messages for e in again] == [e.messages for e in oracle_eps]
    other = play(sample, db, seed=SEED + 1)
    differ = sum(user_texts(a) != user_texts(b) for a, b in zip(oracle_eps, other))
    assert differ >= len(sample) // 4
    assert all(e.reward == 1.0 for e in other)


def test_confirmation_of_wrong_order_gets_no(db, splits):
    n = 0
    for t in splits["train"][:60]:
        p = t["script"]["phases"][0]
        if t["kind"] == "switch" or not p.get("write") or "order_id" not in p["write"]["arguments"]:
            continue
        oid = p["write"]["arguments"]["order_id"]
        other = next(o for o in db["orders"] if o != oid)
        right = f"I will do this: {' '.join(p['confirm_keys'])}. Shall I go ahead (yes/no)?"
        wrong = right.replace(oid, other)
        assert oid not in wrong
        u = env.ScriptedUser(t, 1)
        u.start()
        no = u.respond(wrong)
        assert no.startswith("No") and not u.done, no
        assert u.respond(right).startswith("Yes")
        assert u.respond("Done.").endswith(env.STOP) and u.done and u.end_reason == "user_stop"
        n += 1
    assert n >= 10


# ---------------------------------------------------------------------------------------------------- communicate_info


def test_info_communicate(db, splits):
    tasks = by_kind(splits["train"])["info"][:PER_KIND] + by_kind(splits["test"])["info"][:PER_KIND]
    assert all(t["evaluation_criteria"]["communicate_info"] for t in tasks)
    eps = play(tasks, db, check_communicate=True)
    for ep in eps:
        assert ep.reward == 1.0 and ep.reward_info["communicate_ok"] is True and ep.end_reason == "user_stop"

    class Vague:
        def act(self, messages):
            return "Let me look into that for you."
    eps = play(tasks, db, make_agent=lambda t, s: Vague(), check_communicate=True)
    for ep in eps:
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "communicate", ep.reward_info
        assert ep.reward_info["db_match"] is True
    # without the check the same transcripts score 1 (the db is untouched, as the gold says)
    eps = play(tasks, db, make_agent=lambda t, s: Vague())
    assert all(ep.reward == 1.0 for ep in eps)
