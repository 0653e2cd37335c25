"""
synth.py: cold-start data (MUA-RL's first stage). Plays the train tasks with an agent and a simulated user and keeps
only the conversations that pass every check (README: "What synth.py keeps"), as OpenAI-format JSONL for sft.py.

    python synth.py                                   # oracle agent, scripted user, real tool execution
    python synth.py --tools mcp                       # tool results from a real MCP server (subprocess, stdio)
    python synth.py --tools llm --tool-llm PATH       # an LLM simulates every tool from a slice of the db
    python synth.py --agent http://localhost:8000/v1 --agent-model Qwen/Qwen3-8B   # a teacher LLM plays the agent
    python synth.py --judge http://localhost:8002/v1 --judge-model deepseek-ai/DeepSeek-R1   # an LLM judge too
    python synth.py --domain telecom --split train    # tau2's train split on tau2's code (gold replay or --agent URL)
    python synth.py --tau1 retail --split train        # tau-bench v1 retail's 500 train tasks (the paper's domain)

Writes data/shop.json and data/{train,test}_tasks.jsonl once (a generated shop in tau2's retail schema, its splits)
and data/sft.jsonl, a conversation a line: {"task_id", "kind", "reward", "tools", "messages"[, "judge"]}.
"""
import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import sys
import threading
import uuid
from collections import Counter, OrderedDict
from pathlib import Path

from tqdm import tqdm

import env
from rollout import (ChatAgent, TextAgents, add_user_args, all_errored, ask_judge, chat_backend, check_flags,
                     run_episodes, short_reason, user_backend)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default="data", help="where the generated shop, its task splits and sft.jsonl go")
    g.add_argument("--out", default=None, help="the kept conversations (default: <data-dir>/sft.jsonl)")
    g.add_argument("--n-tasks", type=int, default=None, help="play only the first n train tasks (default: all)")
    g.add_argument("--n-users", type=int, default=60, help="users of the generated shop (only when made anew)")
    g.add_argument("--n-train", type=int, default=400, help="train tasks of the generated shop")
    g.add_argument("--n-test", type=int, default=60, help="test tasks of the generated shop")
    g.add_argument("--domain", default=None, choices=["retail", "airline", "telecom"], help="play a tau2 domain's "
                   "split on tau2's code instead (oracle: the gold replay; out: <data-dir>/sft_<domain>.jsonl)")
    g.add_argument("--tau1", default=None, choices=["retail", "airline"], help="play a tau-bench v1 domain's split "
                   "(../shared/tau1; retail train: the paper's 500 tasks); out: <data-dir>/sft_tau1_<domain>.jsonl")
    g.add_argument("--split", default="train", help="with --domain or --tau1: the task split")
    g.add_argument("--tasks", dest="tasks_file", default=None, help="with --domain: a tau2 tasks.json (e.g. v1.0.x's) "
                   "instead of the installed tau2's; a split_tasks.json beside it picks --split")
    g = p.add_argument_group("agent and tools")
    g.add_argument("--agent", default="oracle", help="'oracle' (gold plan), a model path or an OpenAI-compatible URL")
    g.add_argument("--agent-model", default=None, help="model name at the --agent endpoint")
    g.add_argument("--tools", default="env", choices=["env", "mcp", "llm"],
                   help="tool results from env.py, from the MCP server, or simulated by an LLM")
    g.add_argument("--tool-llm", default=None, help="with --tools llm: a model path or an OpenAI-compatible URL")
    g.add_argument("--tool-model", default=None, help="model name at the --tool-llm endpoint")
    add_user_args(p)
    g = p.add_argument_group("verification (a conversation is kept only if it passes every check)")
    g.add_argument("--judge", default=None, help="an LLM judge: an OpenAI-compatible URL or a model path")
    g.add_argument("--judge-model", default=None, help="model name at the --judge endpoint")
    g = p.add_argument_group("rollout")
    g.add_argument("--max-turns", type=int, default=None, help="agent turns per episode (default 30; with --domain: "
                   "none, tau2's own 200 steps and 10 errors end it, and a value here can only lower that)")
    g.add_argument("--chunk", type=int, default=64, help="episodes played together")
    g.add_argument("--seed", type=int, default=0, help="seeds the generated shop and the users' wording")
    g = p.add_argument_group("MCP server mode")
    g.add_argument("--mcp-server", action="store_true", help="only serve env.py's tools over MCP on stdio")
    g.add_argument("--db", default=None, help="with --mcp-server: the db.json to serve")
    g.add_argument("--max-episodes", type=int, default=16, help="with --mcp-server: episode dbs kept at once")
    args = p.parse_args(argv)
    check_flags(p, args, [("--n-tasks", args.n_tasks is None or args.n_tasks >= 1, ">= 1")] + [
        (f"--{k.replace('_', '-')}", getattr(args, k) is None or getattr(args, k) >= 1, ">= 1")
        for k in ("n_users", "n_train", "n_test", "max_turns", "chunk", "max_episodes")])
    if args.mcp_server:
        if not args.db:
            p.error("--mcp-server needs --db PATH")
        return serve_mcp(args.db, args.max_episodes)
    if args.tools == "llm" and not args.tool_llm:
        p.error("--tools llm needs --tool-llm (a model path or an OpenAI-compatible URL)")
    llm = dict(concurrency=args.llm_concurrency, deadline=args.llm_deadline)
    if args.domain and args.tau1:
        p.error("--tau1 and --domain name two worlds: give one")
    if args.domain or args.tau1:
        return synth_tau2(args, llm)
    try:
        db, train, _ = prepare_data(args.data_dir, args.seed, args.n_users, args.n_train, args.n_test)
    except FileExistsError as e:
        sys.exit(f"synth.py: {e}")
    tasks, out = train[:args.n_tasks], args.out or os.path.join(args.data_dir, "sft.jsonl")
    if not tasks:
        where = os.path.join(args.data_dir, "train_tasks.jsonl")
        sys.exit(f"synth.py: no train tasks in {where}; {out} left as it was")
    # a task whose gold actions fail is not played: doing nothing would match its gold state and score 1
    broken = {t["id"]: gold_failure(t, db) for t in tasks}
    playable = [t for t in tasks if not broken[t["id"]]]
    if args.user == "cooperative":  # the oracle plays the task the cooperative user has in mind: its final request
        playable = [env.cooperative_task(t) for t in playable]
    make_agent = OracleAgent if args.agent == "oracle" else _teacher(args, llm)
    kw = dict(user=user_backend(args.user, args.user_model, **llm), max_turns=args.max_turns or 30,
              guidelines=env.load_guidelines(args.user_guidelines) if args.user_guidelines else None)
    died = None
    try:
        if args.tools == "mcp":
            with MCPToolClient(os.path.join(args.data_dir, "shop.json")) as client:
                world = MCPShop(client, db, **kw)
                eps = synthesize(playable, world, TextAgents(make_agent), chunk=1, seed=args.seed, desc="synth (mcp)")
        else:
            world = (SimulatedShop(db, chat_backend(args.tool_llm, args.tool_model, **llm), **kw)
                     if args.tools == "llm" else env.Shop(db, **kw))
            eps = synthesize(playable, world, TextAgents(make_agent), chunk=args.chunk, seed=args.seed)
    except MCPServerDied as e:  # keep what was finished before the server went away
        died, eps = e, e.episodes
    checks = world.checks if args.tools == "llm" else {}
    why = {id(e): drop_reason(e, checks.get(id(e.state), [])) for e in eps}
    verdicts = {}
    if args.judge:  # the second verifier, asked only about the conversations that passed every other check
        candidates = [(e, t) for e, t in zip(eps, playable) if why[id(e)] is None]
        for (e, _), v in zip(candidates, judge_all(chat_backend(args.judge, args.judge_model, **llm), candidates)):
            verdicts[id(e)] = v
            why[id(e)] = (f"judge failed ({short_reason(v)})" if isinstance(v, Exception)
                          else None if v["verdict"] == "pass" else "judge rejected")
    kept = [e for e in eps if why[id(e)] is None]
    dropped = Counter(f"broken task (its gold replay fails: {broken[t['id']]})" for t in tasks if broken[t["id"]])
    dropped.update(r for r in why.values() if r)
    print(f"tried {len(eps) + len(tasks) - len(playable)}, kept {len(kept)} -> {out if kept else 'nothing written'}")
    for reason, n in dropped.most_common():
        print(f"  dropped {n}: {reason}")
    if args.tools == "llm":
        print("  " + simulator_summary(checks))
    if kept:  # an empty or failed run never replaces an earlier file
        write_conversations(kept, world.tools, out, judged=verdicts if args.judge else None)
    if died:
        sys.exit(f"synth.py: {died}; " + (f"the {len(kept)} conversations kept before it were written to {out}"
                                          if kept else f"nothing was kept before it; {out} left as it was"))
    if all_errored(eps):
        sys.exit(f"synth.py: {all_errored(eps)}; {out} left as it was")
    if not kept:
        sys.exit(f"synth.py: no conversation was kept (reasons above); {out} left as it was")

def _teacher(a, llm):
    """make_agent for a teacher LLM at --agent: every live episode's turn goes to it in one batch (rollout.act_all)."""
    teacher = chat_backend(a.agent, a.agent_model, **llm)
    return lambda task, seed: ChatAgent(teacher, max_new_tokens=512, seed=seed, deadline=4 * a.llm_deadline)

def drop_reason(ep, checks):
    """Why an episode is not kept (None: kept so far): an errored agent or user, then the first failed or disagreeing
    simulated call (checks: the episode's SimulatedShop.checks), then a wrong database."""
    if ep.errored:
        who = "agent" if ep.end_reason == "agent_error" else "user"
        return f"{who} failed ({short_reason(ep.error or ep.end_reason)})"
    for c in checks:
        if c["status"] == FAILED:
            return f"tool simulator failed ({short_reason(c['detail'])})"
        if c["status"] == DISAGREE:
            return f"simulator disagreed with the real tool (first on {c['tool']}: {c['kind']})"
    return f"wrong database (the episode ended by {ep.end_reason})" if ep.reward != 1.0 else None

def simulator_summary(checks):
    """One line: the simulated calls, and per tool how many disagreed or failed."""
    calls = [c for cs in checks.values() for c in cs]
    per, n = {}, Counter(c["status"] for c in calls)
    for c in calls:
        per.setdefault(c["tool"], Counter())[c["status"]] += 1
    bad = {st: f" ({', '.join(f'{t} {k[st]}/{k.total()}' for t, k in sorted(per.items()) if k[st])})" if n[st] else ""
           for st in (DISAGREE, FAILED)}
    return (f"tool simulator: {len(calls)} calls, {n[AGREE]} agreed with the real tool, "
            f"{n[DISAGREE]} disagreed{bad[DISAGREE]}, {n[FAILED]} failed{bad[FAILED]}")

def synth_tau2(a, llm):
    """--domain: tau2's split on tau2's code (env.Tau2), kept where tau2's evaluator scores 1 on the task's own
    reward basis (of a --tasks file's split, if given); --tau1: a tau-bench v1 split (env.Tau1), kept where its reward
    1. The oracle is the gold replay (env.GoldAgent, one call a message where the world runs only the first, and
    env.GoldUser unless --user)."""
    kw = dict(user=user_backend(a.user, a.user_model, **llm), max_turns=a.max_turns,
              guidelines=env.load_guidelines(a.user_guidelines) if a.user_guidelines else None)
    d = env.Tau1(a.tau1, **kw) if a.tau1 else env.Tau2(a.domain, **kw)
    tasks = d.tasks(a.split, path=a.tasks_file)[:a.n_tasks]
    # a teacher gets the world's tool schemas
    make_agent = (lambda t, s: env.GoldAgent(t, s, d.calls_per_message)) if a.agent == "oracle" else _teacher(a, llm)
    eps = synthesize(tasks, d, TextAgents(make_agent), chunk=a.chunk, seed=a.seed, basis="task",
                     desc=f"synth ({d.name})")  # a teacher gets the world's tool schemas
    kept = [e for e in eps if e.reward == 1.0 and not e.errored]
    out = a.out or os.path.join(a.data_dir, f"sft_{d.name}.jsonl")
    print(f"tried {len(eps)} {d.name} tasks ({a.split} split, {getattr(d, 'version', None) or 'tau-bench v1'}), "
          f"kept {len(kept)} -> {out if kept else 'nothing written'}")
    if not kept:
        sys.exit(f"synth.py: no conversation was kept; {out} left as it was")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    write_conversations(kept, d.tools, out)

def write_conversations(kept, tools, out, judged=None):
    """Write JSONL to a temp file renamed over `out` once complete. judged: {id(episode): {"verdict", "reason"}}."""
    with open(out + ".tmp", "w") as f:
        for e in kept:
            row = {"task_id": e.task_id, "kind": e.kind, "reward": e.reward, "tools": tools, "messages": e.messages}
            if judged is not None:
                row["judge"] = {k: judged[id(e)][k] for k in ("verdict", "reason")}
            f.write(json.dumps(row) + "\n")
    os.replace(out + ".tmp", out)


# ----------------------------------------------------------------------------------------------------
# the LLM judge (MUA-RL's second verifier): does the conversation follow the domain policy and serve the request?

JUDGE_PROMPT = """You review a customer-service conversation before it becomes training data for the agent.
Decide whether the agent (1) followed the domain policy below at every step and (2) served the user's request,
using only what the tools returned. The user's request, as the user was told it:
{request}

Domain policy (the agent's system prompt):
{policy}

Conversation:
{transcript}

Answer with one JSON object and nothing else: {{"verdict": "pass" or "fail", "reason": "<one sentence>"}}"""

def judge_prompt(ep, task):
    """The judge's prompt: the task's user scenario, the agent's policy, the transcript as text."""
    msgs = ep.messages
    policy = msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else "(none)"
    lines = []
    for m in msgs[1:] if policy != "(none)" else msgs:
        calls = "".join(f" [calls {c['function']['name']}({json.dumps(c['function']['arguments'])})]"
                        for c in m.get("tool_calls") or [])
        lines.append(f"{m['role']}: {m.get('content') or ''}{calls}")
    request = (task.get("user_scenario") or {}).get("instructions", "")
    return [{"role": "user", "content": JUDGE_PROMPT.format(policy=policy, transcript="\n".join(lines),
             request=json.dumps(request, indent=1) if isinstance(request, dict) else request)}]

def judge_all(backend, episodes):
    """[(episode, task)] -> each one's {"verdict": "pass" | "fail", "reason": str}, or the exception that ended it."""
    accept = lambda o: str(o.get("verdict", "")).lower() in ("pass", "fail")
    out = ask_judge(backend, [judge_prompt(e, t) for e, t in episodes], accept)
    return [v if isinstance(v, Exception) else
            {"verdict": str(v["verdict"]).lower(), "reason": str(v.get("reason", ""))} for v in out]

def gold_failure(task, db):
    """The first failing gold action of task on a fresh copy of db, as 'name: Error: ...', or None."""
    acts = task["evaluation_criteria"]["actions"]
    return next((f"{a['name']}: {content}" for a, (content, is_error)
                 in zip(acts, env.replay_actions(env.canonical_db(db), acts)) if is_error), None)

class MCPServerDied(RuntimeError):
    """The MCP server stopped answering mid-run; `episodes` holds the episodes finished before it did."""
    def __init__(self, message, episodes):
        super().__init__(message)
        self.episodes = episodes

def synthesize(tasks, world, agent, *, chunk, seed, basis="db", desc="synth"):
    """Play every task once, `chunk` episodes together, each scored by the world (the caller keeps reward 1). An
    MCPShop's episode is scored from the db its server holds; if the server dies, MCPServerDied says so."""
    eps = []
    for i in tqdm(range(0, len(tasks), chunk), desc=desc):
        batch = tasks[i:i + chunk]
        for ep, task in zip(run_episodes(agent, world, batch, seed=seed + i), batch):
            if isinstance(world, MCPShop):
                try:
                    if not world.client.alive():  # its tool calls all failed: this episode says nothing
                        raise ConnectionError("connection to the server closed")
                    ep.state = world.client.get_db(ep.state)
                except Exception as e:
                    raise MCPServerDied(f"the MCP server died during episode {len(eps) + 1} of {len(tasks)} "
                                        f"({type(e).__name__}: {e})", eps) from e
            if not ep.errored:
                world.score(ep, task, basis)
            eps.append(ep)
    return eps

def prepare_data(data_dir, seed=0, n_users=60, n_train=400, n_test=60):
    """Generate the shop and its train/test tasks into data_dir (once) and load them."""
    os.makedirs(data_dir, exist_ok=True)
    shop = os.path.join(data_dir, "shop.json")
    files = {n: os.path.join(data_dir, f"{n}_tasks.jsonl") for n in ("train", "test")}
    if not os.path.exists(shop):
        if present := [p for p in files.values() if os.path.exists(p)]:
            raise FileExistsError(f"{shop} is missing but {' and '.join(present)} exist; they belong to the shop "
                                  "they were made for and would not be overwritten. Restore shop.json, or move the "
                                  "task files away to generate a new shop with new tasks")
        db = generate_shop(seed, n_users)
        splits = generate_tasks(db, seed, n_train, n_test)
        with open(shop + ".tmp", "w") as f:
            json.dump(db, f)
        for name, tasks in splits.items():
            env.save_tasks(tasks, files[name] + ".tmp")
            os.replace(files[name] + ".tmp", files[name])
        os.replace(shop + ".tmp", shop)  # last, so a half-written folder is regenerated
    return env.load_db(shop), env.load_tasks(files["train"]), env.load_tasks(files["test"])


# ----------------------------------------------------------------------------------------------------
# a generated shop and tasks over it, so everything runs with no external files

PRODUCTS = {  # name -> (option name, option values, base price); one option each keeps the demo learnable
    "T-Shirt": ("color", ["black", "white", "blue", "red", "green"], 24.0),
    "Water Bottle": ("capacity", ["500ml", "750ml", "1000ml"], 18.0),
    "Desk Lamp": ("power source", ["battery", "USB", "AC adapter"], 45.0),
    "Backpack": ("color", ["black", "grey", "navy", "olive"], 60.0),
    "Sneakers": ("size", ["7", "8", "9", "10", "11"], 80.0),
    "Headphones": ("type", ["over-ear", "on-ear", "in-ear"], 120.0),
    "Coffee Maker": ("capacity", ["4 cups", "8 cups", "12 cups"], 70.0),
    "Yoga Mat": ("thickness", ["4mm", "6mm", "8mm"], 30.0),
    "Wall Clock": ("style", ["modern", "vintage", "minimalist"], 35.0),
    "Notebook": ("paper", ["lined", "dotted", "blank"], 9.0),
    "Umbrella": ("size", ["compact", "standard", "golf"], 22.0),
    "Sunglasses": ("lens", ["polarized", "mirrored", "gradient"], 95.0)}
STREETS = ["Oak St", "Maple Ave", "Pine Rd", "Cedar Ln", "Elm St", "Lake Dr", "Hill Rd", "River Way"]
CITIES = [("Austin", "TX", "787"), ("Denver", "CO", "802"), ("Seattle", "WA", "981"), ("Boston", "MA", "021"),
          ("Phoenix", "AZ", "850"), ("Chicago", "IL", "606")]
TASK_KINDS = ["cancel", "modify_items", "modify_address", "modify_payment", "return", "exchange",
              "user_address", "info", "switch"]
REASONS = {"no longer needed": ["I no longer need it", "I don't need it anymore"],
           "ordered by mistake": ["I ordered it by mistake", "I bought it by accident"]}
SOURCE_WORDS = {"credit_card": "credit card", "paypal": "paypal", "gift_card": "gift card"}

def _digits(rng, n):
    return str(rng.randrange(10 ** (n - 1), 10 ** n))

def _random_address(rng):
    city, state, zip3 = rng.choice(CITIES)
    return {"address1": f"{rng.randrange(10, 999)} {rng.choice(STREETS)}",
            "address2": rng.choice(["", f"Apt {rng.randrange(1, 40)}"]),
            "city": city, "country": "USA", "state": state, "zip": zip3 + _digits(rng, 2)}

def generate_shop(seed=0, n_users=60):
    """A small shop in tau2's retail schema: 12 products, `n_users` users, 2-4 orders each."""
    rng = random.Random(seed)
    db = {"products": {}, "users": {}, "orders": {}}
    for name, (opt, values, base) in PRODUCTS.items():
        pid = _digits(rng, 10)
        variants = {}
        for v in values:
            iid = _digits(rng, 10)
            variants[iid] = {"item_id": iid, "options": {opt: v}, "available": rng.random() > 0.15,
                             "price": round(base * rng.uniform(0.8, 1.25), 2)}
        db["products"][pid] = {"name": name, "product_id": pid, "variants": variants}
    names = set()
    while len(names) < n_users:
        names.add((rng.choice(env.FIRST), rng.choice(env.LAST)))
    for first, last in sorted(sorted(names), key=lambda n: rng.random()):  # sorted first: set order varies by process
        _add_user(db, rng, first, last)
    return db

def _add_user(db, rng, first, last):
    uid = f"{first.lower()}_{last.lower()}_{_digits(rng, 4)}"
    pms = {}
    for source in rng.sample(["credit_card", "paypal", "gift_card"], rng.randrange(1, 3)):
        pm = {"source": source, "id": f"{source}_{_digits(rng, 7)}"}
        if source == "credit_card":
            pm.update(brand=rng.choice(["visa", "mastercard"]), last_four=_digits(rng, 4))
        if source == "gift_card":
            pm["balance"] = float(rng.randrange(0, 300))
        pms[pm["id"]] = pm
    user = {"user_id": uid, "name": {"first_name": first, "last_name": last}, "address": _random_address(rng),
            "email": f"{first.lower()}.{last.lower()}{_digits(rng, 4)}@example.com",
            "payment_methods": pms, "orders": []}
    db["users"][uid] = user
    for _ in range(rng.randrange(2, 5)):
        _add_order(db, rng, user)

def _add_order(db, rng, user):
    oid = "#W" + _digits(rng, 7)
    items = []
    for p in rng.sample(list(db["products"].values()), rng.choice([1, 1, 2])):
        v = rng.choice(list(p["variants"].values()))
        items.append({"name": p["name"], "product_id": p["product_id"], "item_id": v["item_id"],
                      "price": v["price"], "options": dict(v["options"])})
    status = rng.choice(["pending", "pending", "delivered", "delivered", "processed", "cancelled"])
    pm = rng.choice(list(user["payment_methods"]))
    total = round(sum(i["price"] for i in items), 2)
    order = {"order_id": oid, "user_id": user["user_id"], "address": dict(user["address"]), "items": items,
             "status": status, "fulfillments": [], "payment_history": [
                 {"transaction_type": "payment", "amount": total, "payment_method_id": pm}]}
    if status in ("delivered", "processed"):
        order["fulfillments"] = [{"tracking_id": [_digits(rng, 12)], "item_ids": [i["item_id"] for i in items]}]
    if status == "cancelled":
        order["cancel_reason"] = rng.choice(["no longer needed", "ordered by mistake"])
        order["payment_history"].append({"transaction_type": "refund", "amount": total, "payment_method_id": pm})
    db["orders"][oid] = order
    user["orders"].append(oid)

def _act(name, **arguments):
    return {"action_id": "", "name": name, "arguments": arguments}

def _phase(db, user, kind, rng, order=None):
    """One request a user can make (None if this user has nothing to make it about): what they say, the reads and
    write that serve it, what the agent's confirmation must mention, its gist in the oracle's fixed words."""
    uid, pms, orders = user["user_id"], user["payment_methods"], [db["orders"][o] for o in user["orders"]]
    status = {"cancel": "pending", "modify_items": "pending", "modify_address": "pending",
              "modify_payment": "pending", "return": "delivered", "exchange": "delivered"}.get(kind)
    if status:
        candidates = [order] if order else [o for o in orders if o["status"] == status]
        if not candidates or candidates[0]["status"] != status:
            return None
        order = rng.choice(candidates)
    oid = order["order_id"] if order else None
    reads = [_act("get_order_details", order_id=oid)] if oid else []
    if kind == "cancel":
        reason, why = rng.choice(list(REASONS.items()))
        say = [f"I want to cancel my order {oid} because {why[0]}.", f"Please cancel order {oid}, {why[1]}."]
        return dict(say=say, reads=reads, write=_act("cancel_pending_order", order_id=oid, reason=reason),
                    confirm_keys=[oid, "cancel", reason], gist=f"cancel order {oid} ({reason})")
    if kind in ("modify_items", "exchange"):
        item = rng.choice(order["items"])
        others = [v for v in db["products"][item["product_id"]]["variants"].values()  # the product's other variants
                  if v["available"] and v["item_id"] != item["item_id"]]
        new = rng.choice(others) if others else None
        src = rng.choice(list(pms))
        if new is None:
            return None
        (opt, val), = new["options"].items()
        verb = "change" if kind == "modify_items" else "exchange"
        pay = f"Use my {SOURCE_WORDS[pms[src]['source']]} for any price difference."
        say = [f"I'd like to {verb} the {item['name']} in order {oid} for the {val} one. {pay}",
               f"In my order {oid}, please {verb} the {item['name']} to {opt} {val}. {pay}"]
        tool = "modify_pending_order_items" if kind == "modify_items" else "exchange_delivered_order_items"
        write = _act(tool, order_id=oid, item_ids=[item["item_id"]], new_item_ids=[new["item_id"]],
                     payment_method_id=src)
        return dict(say=say, reads=reads + [_act("get_product_details", product_id=item["product_id"])],
                    write=write, confirm_keys=[oid, val], gist=f"{verb} an item in order {oid} for the {val} one")
    if kind in ("modify_address", "user_address"):
        a = _random_address(rng)
        where = f"{a['address1']}{', ' + a['address2'] if a['address2'] else ''}, {a['city']}, {a['state']} {a['zip']}"
        if kind == "modify_address":
            say = [f"Please change the shipping address of order {oid} to {where}.",
                   f"I need order {oid} shipped to a new address: {where}."]
            write = _act("modify_pending_order_address", order_id=oid, **a)
            return dict(say=say, reads=reads, write=write, confirm_keys=[oid, a["address1"]],
                        gist=f"ship order {oid} to a new address")
        say = [f"I moved. Please update my default address to {where}.",
               f"Can you change the address on my account to {where}?"]
        return dict(say=say, reads=[], write=_act("modify_user_address", user_id=uid, **a),
                    confirm_keys=[a["address1"]], gist="change your default address")
    if kind == "modify_payment":
        paid = order["payment_history"][0]
        others = [p for p in pms if p != paid["payment_method_id"]
                  and (pms[p]["source"] != "gift_card" or pms[p]["balance"] >= paid["amount"])]
        if not others:
            return None
        new = rng.choice(others)
        word = SOURCE_WORDS[pms[new]["source"]]
        say = [f"I want to pay for order {oid} with my {word} instead.",
               f"Could you switch the payment method of order {oid} to my {word}?"]
        write = _act("modify_pending_order_payment", order_id=oid, payment_method_id=new)
        return dict(say=say, reads=reads, write=write, confirm_keys=[oid, new],
                    gist=f"pay for order {oid} with your {word}")
    if kind == "return":
        item = rng.choice(order["items"])
        say = [f"I want to return the {item['name']} from order {oid}.",
               f"I'd like to send back the {item['name']} I got in order {oid}."]
        write = _act("return_delivered_order_items", order_id=oid, item_ids=[item["item_id"]],
                     payment_method_id=order["payment_history"][0]["payment_method_id"])
        return dict(say=say, reads=reads, write=write, confirm_keys=[oid, item["name"]],
                    gist=f"return the {item['name']} from order {oid}")
    if kind == "info":
        order = order or rng.choice(orders)
        oid = order["order_id"]
        total = json.dumps(order["payment_history"][0]["amount"])
        say = [f"How much did I pay for order {oid}?", f"Can you tell me the total I paid for order {oid}?"]
        return dict(say=say, reads=[_act("get_order_details", order_id=oid)], write=None,
                    answer=f"You paid {total} for order {oid}.", answer_keys=[total],
                    gist=f"look up what you paid for order {oid}")
    raise ValueError(f"unknown task kind {kind!r}")

def _make_task(db, user, kind, rng):
    phases = [_phase(db, user, "cancel" if kind == "switch" else kind, rng)]
    if kind == "switch" and phases[0]:  # cancel, then at the confirmation prefer another request on the same order
        order = db["orders"][phases[0]["write"]["arguments"]["order_id"]]
        phases.append(_phase(db, user, rng.choice(["modify_address", "modify_payment"]), rng, order))
    if not all(phases):
        return None
    knows_email = rng.random() < 0.6
    first_name, last_name, zipc = user["name"]["first_name"], user["name"]["last_name"], user["address"]["zip"]
    ident = (_act("find_user_id_by_email", email=user["email"]) if knows_email else
             _act("find_user_id_by_name_zip", first_name=first_name, last_name=last_name, zip=zipc))
    last = phases[-1]
    # the user's record is read only when its payment methods are needed, which keeps conversations short
    needs_user = any(p["write"] and "payment_method_id" in p["write"]["arguments"] and p["write"]["name"] !=
                     "return_delivered_order_items" for p in phases)
    actions = [ident] + ([_act("get_user_details", user_id=user["user_id"])] if needs_user else []) + last["reads"]
    actions += [last["write"]] if last["write"] else []
    reason = phases[0]["say"][0]
    if len(phases) > 1:
        reason += (" When the agent asks you to confirm, change your mind: you would rather keep the order. "
                   + phases[1]["say"][0])
    instructions = {"domain": "retail", "reason_for_call": reason,
                    "known_info": (f"Your email is {user['email']}." if knows_email else "")
                    + f" You are {first_name} {last_name}, zip code {zipc}.",
                    "unknown_info": "" if knows_email else "You do not remember your email address.",
                    "task_instructions": "Give your identity only when asked. Confirm only the action you want."}
    return {"id": "", "kind": kind, "user_scenario": {"instructions": instructions},
            "evaluation_criteria": {"actions": actions, "communicate_info": last.get("answer_keys", [])},
            "script": {"needs_user": needs_user, "email": user["email"] if knows_email else None,
                       "first_name": first_name, "last_name": last_name, "zip": zipc, "user_id": user["user_id"],
                       "phases": phases}}

def split_users(db, rng, test_frac=0.2):
    """{"test": user ids, "train": user ids}: the first `test_frac` of the users, shuffled by rng, are test-only."""
    uids = sorted(db["users"])
    rng.shuffle(uids)
    n_test_users = max(1, int(len(uids) * test_frac))
    return {"test": uids[:n_test_users], "train": uids[n_test_users:]}


def generate_tasks(db, seed=0, n_train=400, n_test=60, test_frac=0.2):
    """Tasks of every kind, balanced, over disjoint users: a `test_frac` share of them is test-only (split_users)."""
    rng = random.Random(seed)
    splits = split_users(db, rng, test_frac)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        tasks = out[split] = []
        while len(tasks) < n:
            kind = TASK_KINDS[len(tasks) % len(TASK_KINDS)]
            for _ in range(50):  # not every user can make every request
                t = _make_task(db, db["users"][rng.choice(splits[split])], kind, rng)
                if t:
                    break
            else:
                raise ValueError(f"no {split} user of this shop can make a {kind!r} request in 50 tries; "
                                 "generate a larger shop (n_users)")
            t["id"] = f"{split}_{len(tasks)}"
            for j, a in enumerate(t["evaluation_criteria"]["actions"]):
                a["action_id"] = f"{t['id']}_{j}"
            tasks.append(t)
    return out


# ----------------------------------------------------------------------------------------------------
# the oracle agent: a policy-following expert that solves a task from its gold plan

EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")
NAME_ZIP = re.compile(r"name is (\w+) (\w+)\b.*?zip(?: code)?(?: is)? (\d{5})", re.I | re.S)

def tool_call_text(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

CONFIRM = {  # what the oracle states before a write; {extra}: what the ids do not say (an option value, an item name)
    "cancel_pending_order": "cancel order {order_id} with the reason '{reason}'",
    "modify_pending_order_items": "change item {item_ids[0]} in order {order_id} for item {new_item_ids[0]} ({extra}), "
                                  "with {payment_method_id} covering the price difference",
    "exchange_delivered_order_items": "exchange item {item_ids[0]} in order {order_id} for item {new_item_ids[0]} "
                                      "({extra}), with {payment_method_id} covering the price difference",
    "modify_pending_order_address": "ship order {order_id} to {address1}, {city}, {state} {zip}",
    "modify_user_address": "change your default address to {address1}, {city}, {state} {zip}",
    "modify_pending_order_payment": "switch the payment of order {order_id} to {payment_method_id}",
    "return_delivered_order_items": "return item {item_ids[0]} ({extra}) from order {order_id}, "
                                    "refunded to {payment_method_id}"}

class OracleAgent:
    """Follows the task's gold plan through real messages: asks for identification and parses the answer, looks
    things up one call at a time, states the write and waits for a yes, follows a change of mind, answers questions."""
    def __init__(self, task, seed=0):
        self.script, self.rng = task["script"], random.Random(seed)
        self.phase, self.todo, self.stage = 0, [], "identify"

    def _phase(self):
        return self.script["phases"][self.phase]

    def act(self, messages):
        last = messages[-1]
        if self.stage == "identify":
            return self._identify(messages)
        if self.stage == "user_details":  # the lookup answered with the user id
            if last["content"].startswith("Error"):
                self.stage = "identify"
                return "I could not find your account. Could you double-check your details?"
            self.todo, self.stage = list(self._phase()["reads"]), "reads"
            if self.script["needs_user"]:
                return tool_call_text("get_user_details", user_id=last["content"])
        if self.stage == "reads" and self.todo:
            r = self.todo.pop(0)
            return tool_call_text(r["name"], **r["arguments"])
        if self.stage == "reads":
            return self._propose()
        if self.stage == "await_yes":
            if last["content"].lower().startswith("yes"):
                self.stage = "written"
                w = self._phase()["write"]
                return tool_call_text(w["name"], **w["arguments"])
            if self.phase + 1 < len(self.script["phases"]):  # the user changed the request
                done, self.phase = self._phase()["reads"], self.phase + 1  # its reads are not repeated
                self.todo, self.stage = [r for r in self._phase()["reads"] if r not in done], "reads"
                reply = self.act(messages)
                return reply if "<tool_call>" in reply else "Sure, no problem. " + reply
            return self._propose()
        if self.stage == "written":
            self.stage = "end"
            return self.rng.choice(["Done. Is there anything else I can help you with?",
                                    "All set, the change is made. Anything else?"])
        return self.rng.choice(["You're welcome. Goodbye!", "Have a nice day!"])

    def _identify(self, messages):
        text = messages[-1]["content"] if messages[-1]["role"] == "user" else ""
        m, e = NAME_ZIP.search(text), EMAIL.search(text)
        if e and "don't" not in text and "can't" not in text:
            self.stage = "user_details"
            return tool_call_text("find_user_id_by_email", email=e.group(0).rstrip("."))
        if m:
            self.stage = "user_details"
            return tool_call_text("find_user_id_by_name_zip", first_name=m.group(1), last_name=m.group(2),
                                  zip=m.group(3))
        ask = self.rng.choice([
            "First, could you give me your email address, or your name and zip code?",
            "To verify your identity, please provide your email, or your first and last name and zip code."])
        if any(m["role"] == "assistant" for m in messages):
            return ask
        return f"I can help you {self._phase()['gist']}. {ask}"  # fixed words, for a small model's later turns to copy

    def _propose(self):
        p = self._phase()
        if p["write"] is None:  # an information request: say the answer
            self.stage = "written"
            return p["answer"] + " " + self.rng.choice(["Anything else?", "Can I help with anything else?"])
        self.stage = "await_yes"
        extra = " ".join(k for k in p["confirm_keys"] if k not in json.dumps(p["write"]["arguments"]))
        ask = self.rng.choice(["Do you want me to proceed (yes/no)?", "Shall I go ahead (yes/no)?",
                               "Please confirm (yes/no)."])
        return f"I will {CONFIRM[p['write']['name']].format(**p['write']['arguments'], extra=extra)}. {ask}"


# ----------------------------------------------------------------------------------------------------
# tools simulated by an LLM (the paper's second pipeline)

TOOL_SIM_PROMPT = """You simulate one tool of a retail shop's backend. Answer with the tool's result only:
a JSON object in the same shape as the records below when the tool returns a record, the bare string when it
returns a string (such as a user id), or "Error: <reason>" when the call must fail. No other text.

Tool schema:
{schema}

Database records you may use as memory:
{memory}

Call: {call}"""

RESULT_KEY = {"get_order_details": "order_id", "get_user_details": "user_id", "get_product_details": "product_id",
              "get_item_details": "item_id", "modify_user_address": "user_id"}

def db_slice(db, name, args):
    """The records a tool call may read: its order and that order's user, its user, its product."""
    if not isinstance(args, dict):
        return []
    order = db["orders"].get(args.get("order_id", ""))
    recs = [order, db["users"].get(order["user_id"])] if order else []
    recs += [db["users"].get(args.get("user_id")), db["products"].get(args.get("product_id"))]
    recs += [u for u in db["users"].values() if u["email"].lower() == str(args.get("email", "")).lower()
             or u["name"]["last_name"].lower() == str(args.get("last_name", "")).lower()]
    if name in ("get_item_details", "list_all_product_types"):
        recs += list(db["products"].values())
    return [r for r in recs if r][:6]

def check_simulated(name, text):
    """A simulated result must have the real tool's shape; anything else becomes a tool error."""
    text = text.strip()
    if text.startswith("Error"):
        return text, True
    if name in ("find_user_id_by_email", "find_user_id_by_name_zip", "calculate", "transfer_to_human_agents"):
        ok = bool(text) and "\n" not in text and not text.startswith("{")
        return (text, False) if ok else (f"Error: the simulated {name} returned malformed output.", True)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return f"Error: the simulated {name} returned malformed output (not JSON).", True
    key = RESULT_KEY.get(name, "order_id" if name != "list_all_product_types" else None)
    if not isinstance(obj, dict) or (key and key not in obj):
        return f"Error: the simulated {name} returned malformed output (expected a record with '{key}').", True
    return json.dumps(obj), False

AGREE, DISAGREE, FAILED = "agreed", "disagreed", "failed"  # the statuses in SimulatedShop.checks

def _leaves(value, path=""):
    """{path: leaf} of a JSON value, e.g. {"items[0].price": 24.0}; a bare value is at path ""."""
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in _leaves(sub, f"{path}.{key}" if path else key).items()}
    if isinstance(value, list):
        return {k: v for n, sub in enumerate(value) for k, v in _leaves(sub, f"{path}[{n}]").items()}
    return {path: value}

def _as_json(text):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text.strip()  # a bare string result (a user id, "Transfer successful")

def _same_fact(a, b):
    if isinstance(b, str) and re.search(r"\s", b):  # prose: any wording
        return isinstance(a, str)
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return isinstance(a, (int, float)) and not isinstance(a, bool) and a == b
    return type(a) is type(b) and a == b

def agreement(simulated, real):
    """Does a simulated result say what the real tool's does? (content, is_error) each -> None, or (kind, detail): a
    fixed phrase for counting, the first difference. They agree when both refuse, or both answer with the same fields
    and equal facts (numbers by value; booleans, null, ids exactly; a string with whitespace is prose, any wording)."""
    (sim, sim_err), (true, true_err) = simulated, real
    if sim_err and "returned malformed output" in sim and sim.startswith("Error: the simulated"):
        return "malformed output", sim[:200]
    if sim_err != true_err:
        return (("an error where the real tool answered", f"simulated {sim[:120]!r}, real {true[:120]!r}")
                if sim_err else ("an answer where the real tool failed", f"real {true[:120]!r}"))
    if true_err:
        return None
    a, b = _leaves(_as_json(sim)), _leaves(_as_json(true))
    if a.keys() != b.keys():
        missing, extra = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
        return "different fields", f"missing {missing[:3]}, invented {extra[:3]}"
    for path, v in b.items():
        if not _same_fact(a[path], v):
            return "different values", f"{path or 'result'}: simulated {a[path]!r}, real {v!r}"[:240]
    return None

class SimulatedShop(env.Shop):
    """Tool results from an LLM given the tool's schema, the call and its db slice. The real tool also runs on the
    episode's own db (the reward's); checks[id(state)] lists each result's {tool, status, kind, detail} (agreement)."""
    def __init__(self, db, backend, max_new_tokens=512, **kw):
        super().__init__(db, **kw)
        self.backend, self.max_new_tokens, self.checks = backend, max_new_tokens, {}
        self.by_name = {s["function"]["name"]: s for s in env.TOOL_SCHEMAS}

    def call(self, state, name, arguments, side="agent"):
        return self.call_all([(state, name, arguments, side)])[0]

    def call_all(self, requests):
        """[(db, name, args, side)] -> [(content, is_error)], simulated in one batch, real effects applied in order."""
        out, prompts, asked = [None] * len(requests), [], []
        for k, (db, name, args, side) in enumerate(requests):
            args, err = env.check_call(name, args)
            if err or side == "user":  # refused before any simulation, as the real tools do
                out[k] = (err, True) if err else super().call(db, name, args, side)
                continue
            memory = "\n".join(json.dumps(r) for r in db_slice(db, name, args))  # the state before the call
            real = env.call_tool(db, name, args)  # the real effect, which the reward checks and the agent never sees
            prompts.append([{"role": "user", "content": TOOL_SIM_PROMPT.format(schema=json.dumps(self.by_name[name]),
                            memory=memory, call=json.dumps({"name": name, "arguments": args}))}])
            asked.append((k, db, name, real))
        if prompts:
            try:
                replies = self.backend.chat(prompts, self.max_new_tokens, 0.0)
            except Exception as e:  # the simulator failing is a tool error the agent can read, not a crash
                replies = [e] * len(prompts)
            for (k, db, name, real), text in zip(asked, replies):
                if isinstance(text, Exception):
                    out[k] = (f"Error: tool simulator failed: {text}", True)
                    check = dict(tool=name, status=FAILED, kind="", detail=str(text))
                else:
                    out[k] = check_simulated(name, text)
                    kind, detail = agreement(out[k], real) or ("", "")
                    check = dict(tool=name, status=DISAGREE if kind else AGREE, kind=kind, detail=detail)
                self.checks.setdefault(id(db), []).append(check)
        return out


# ====================================================================================================
# Machinery: a first reading stops here. env.py's 16 tools over MCP (stdio): the server (`python synth.py
# --mcp-server --db PATH`), the client --tools mcp plays through, and MCPShop. One server (slow to start, quick to copy
# a db) holds several episode dbs keyed by _meta["mua-rl/episode"], each fresh on first use and read (to be scored) as
# mua-rl://db/<episode>; no key: the session db. Only the `max_episodes` latest are kept (an older one: an error).
# ====================================================================================================

EPISODE_KEY, DB_URI = "mua-rl/episode", "mua-rl://db"

def make_server(db, max_episodes=16):
    """A low-level MCP Server over `db` (the session db, mutated in place by calls without an episode)."""
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError
    pristine = json.dumps(db)  # json round trip is exact for the db (plain JSON values) and 3x faster than deepcopy
    episodes, evicted = OrderedDict(), set()  # episode id -> db, least recently used first; ids evicted
    tools = [types.Tool(name=f["name"], description=f["description"], input_schema=f["parameters"])
             for f in (s["function"] for s in env.TOOL_SCHEMAS)]

    def lookup(episode, create):
        if not episode:
            return db
        if episode in episodes:
            episodes.move_to_end(episode)
            return episodes[episode]
        if episode in evicted:
            raise KeyError(f"episode {episode} expired (the server keeps the {max_episodes} most recent)")
        fresh = json.loads(pristine)
        if create:  # only a call makes an episode live: reading an untouched one must not evict another
            episodes[episode] = fresh
            while len(episodes) > max_episodes:
                evicted.add(episodes.popitem(last=False)[0])
        return fresh

    async def on_list_tools(ctx, params):
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx, params):
        # No awaits below: each call runs atomically even when requests are served concurrently.
        try:
            episode_db = lookup((params.meta or {}).get(EPISODE_KEY), create=True)
        except KeyError as e:
            content, is_error = f"Error: {e.args[0]}", True
        else:
            args = params.arguments if params.arguments is not None else {}  # MCP: omitted = no arguments
            content, is_error = env.call_tool(episode_db, params.name, args)
        return types.CallToolResult(content=[types.TextContent(text=content)], is_error=is_error)

    async def on_list_resources(ctx, params):
        return types.ListResourcesResult(resources=[types.Resource(
            uri=DB_URI, name="db", description="the session's retail db", mime_type="application/json")])

    async def on_list_resource_templates(ctx, params):
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=DB_URI + "/{episode}", name="episode db", mime_type="application/json",
            description=f"the retail db of the episode named by _meta['{EPISODE_KEY}'] in tools/call")])

    async def on_read_resource(ctx, params):
        uri = str(params.uri)
        if uri != DB_URI and not uri.startswith(DB_URI + "/"):
            raise MCPError(types.INVALID_PARAMS, f"unknown resource {uri}")
        try:
            episode_db = lookup(uri[len(DB_URI) + 1:], create=False)
        except KeyError as e:
            raise MCPError(types.INVALID_PARAMS, e.args[0])
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=uri, mime_type="application/json", text=json.dumps(episode_db))])

    return Server("mua-rl-retail", version="0.1", on_list_tools=on_list_tools, on_call_tool=on_call_tool,
                  on_list_resources=on_list_resources, on_list_resource_templates=on_list_resource_templates,
                  on_read_resource=on_read_resource)

def serve_mcp(db_path, max_episodes=16):
    """Serve the retail tools over stdio until stdin closes. stdout is the wire: log to stderr only."""
    import anyio
    from mcp.server.stdio import stdio_server
    server = make_server(env.load_db(db_path), max_episodes)

    async def run():
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    print(f"mcp server pid {os.getpid()} serving {db_path}", file=sys.stderr, flush=True)
    anyio.run(run)

class MCPToolClient:
    """Blocking, not thread-safe MCP client over its own server subprocess; a context manager. command: the server
    argv, "--db db_path" appended (default: this file's --mcp-server); errlog: the server's stderr (None: ours)."""
    def __init__(self, db_path, command=None, timeout=60.0, errlog=None):
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client
        command = list(command or [sys.executable, str(Path(__file__).resolve()), "--mcp-server"])
        params = StdioServerParameters(command=command[0], args=command[1:] + ["--db", str(db_path)],
                                       env=dict(os.environ), cwd=str(Path(__file__).resolve().parent))
        self.timeout, self.episode, self._closed = timeout, uuid.uuid4().hex, False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        ready = concurrent.futures.Future()
        # anyio cancel scopes: the transport is entered and exited in one task, which owns the connection
        self._main = asyncio.run_coroutine_threadsafe(
            self._own_connection(Client(stdio_client(params, errlog=errlog), mode="legacy", cache=None), ready),
            self._loop)
        concurrent.futures.wait([ready, self._main], timeout=timeout, return_when="FIRST_COMPLETED")
        if not ready.done():
            err = self._main.exception() if self._main.done() else TimeoutError(f"no answer in {timeout} s")
            while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:  # anyio task groups wrap it
                err = err.exceptions[0]
            self.close()
            raise RuntimeError(f"cannot start MCP server {command} (its stderr says why): {err!r}") from err

    async def _own_connection(self, client, ready):
        self._stop = asyncio.Event()
        async with client:
            self._client = client
            await client.list_tools()  # primes the session's per-tool cache, saving a round trip on first call
            ready.set_result(None)
            await self._stop.wait()

    def _run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"MCP request timed out after {self.timeout} s")

    def list_tools(self):
        """The server's tools, OpenAI-style like env.TOOL_SCHEMAS."""
        page = self._run(self._client.list_tools())
        tools = list(page.tools)
        while page.next_cursor is not None:
            page = self._run(self._client.list_tools(cursor=page.next_cursor))
            tools += page.tools
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}} for t in tools]

    def call_tool(self, name, arguments, episode=None):
        """(content, is_error) like env.call_tool, in `episode` (default: the current one); never raises."""
        if arguments is None or isinstance(arguments, str):  # env.call_tool also takes these: decode as it does
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments) if arguments and arguments.strip() else {}
        if not isinstance(arguments, dict):
            # MCP carries only objects; env rejects others before reading the db, so it answers as the server would
            return env.call_tool({}, name, arguments)
        try:
            result = self._run(self._client.call_tool(name, arguments, meta={EPISODE_KEY: episode or self.episode}))
        except Exception as e:
            return f"Error: MCP call failed: {type(e).__name__}: {e}", True
        return "".join(c.text for c in result.content if getattr(c, "type", None) == "text"), bool(result.is_error)

    def alive(self):
        """False once the connection to the server has ended (the server exited or was killed)."""
        return not self._closed and not self._main.done()

    def get_db(self, episode=None):
        """An episode's db (default: the current one's), as the server holds it: what its reward is scored on."""
        result = self._run(self._client.read_resource(f"{DB_URI}/{episode or self.episode}"))
        return json.loads(result.contents[0].text)

    def reset(self):
        """Start a new episode: later calls see a fresh copy of the server's db."""
        self.episode = uuid.uuid4().hex
        return self.episode

    def close(self):
        """Stop the session and the server subprocess (the SDK closes its stdin, then signals if needed)."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_client"):
            self._loop.call_soon_threadsafe(self._stop.set)
        else:  # start failed or hangs: cancelling lets the SDK stop the subprocess
            self._main.cancel()
        with contextlib.suppress(Exception):  # a failed start was already reported; a dead server has nothing to stop
            self._main.result(timeout=15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

class MCPShop(env.Shop):
    """The shop on synth.py's MCP server: an episode's state is its key there; calls and tool schemas go there."""
    def __init__(self, client, db, **kw):
        super().__init__(db, tools=client.list_tools(), **kw)
        self.client = client

    def reset(self, task):
        return self.client.reset()

    def call(self, state, name, arguments, side="agent"):
        return super().call(state, name, arguments, side) if side == "user" else \
            self.client.call_tool(name, arguments, episode=state)


if __name__ == "__main__":
    main()
