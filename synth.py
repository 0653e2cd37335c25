"""
synth.py: cold-start data. Plays the train tasks with an agent and a simulated user and keeps only the
conversations whose final database is right (reward 1), as OpenAI-format JSONL for sft.py.

    python synth.py                                   # oracle agent, scripted user, real tool execution
    python synth.py --tools mcp                       # tool results from a real MCP server (subprocess, stdio)
    python synth.py --tools llm --tool-llm PATH       # an LLM simulates every tool from a slice of the db
    python synth.py --agent http://localhost:8000/v1 --agent-model Qwen/Qwen3-8B   # a teacher LLM plays the agent
    python synth.py --user-llm http://localhost:8001/v1 --user-model Qwen/Qwen3-8B # an LLM plays the user

Writes data/shop.json, data/train_tasks.jsonl, data/test_tasks.jsonl (the generated shop and its splits,
once) and data/sft.jsonl: one conversation a line: {"task_id", "kind", "reward", "tools", "messages"}.
"""
import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import re
import sys
import threading
import uuid
from pathlib import Path
from collections import Counter

from tqdm import tqdm

import env
from rollout import run_episodes, score_episode

# ----------------------------------------------------------------------------------------------------
# the oracle agent: a policy-following expert that solves a task from its gold plan


def tool_call_text(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


EMAIL = re.compile(r"[\w.+-]+@[\w-]+\.[\w.]+")
NAME_ZIP = re.compile(r"name is (\w+) (\w+)\b.*?zip(?: code)?(?: is)? (\d{5})", re.I | re.S)


def _confirm_text(write, extra, rng):
    """The confirmation question for a write; `extra` is what the ids do not say (an option value, an item name)."""
    a, name = write["arguments"], write["name"]
    ask = rng.choice(["Do you want me to proceed (yes/no)?", "Shall I go ahead (yes/no)?",
                      "Please confirm (yes/no)."])
    if name == "cancel_pending_order":
        what = f"cancel order {a['order_id']} with the reason '{a['reason']}'"
    elif name in ("modify_pending_order_items", "exchange_delivered_order_items"):
        verb = "change" if name.startswith("modify") else "exchange"
        what = (f"{verb} item {a['item_ids'][0]} in order {a['order_id']} for item {a['new_item_ids'][0]} "
                f"({extra}), with {a['payment_method_id']} covering the price difference")
    elif name == "modify_pending_order_address":
        what = f"ship order {a['order_id']} to {a['address1']}, {a['city']}, {a['state']} {a['zip']}"
    elif name == "modify_user_address":
        what = f"change your default address to {a['address1']}, {a['city']}, {a['state']} {a['zip']}"
    elif name == "modify_pending_order_payment":
        what = f"switch the payment of order {a['order_id']} to {a['payment_method_id']}"
    elif name == "return_delivered_order_items":
        what = (f"return item {a['item_ids'][0]} ({extra}) from order {a['order_id']}, "
                f"refunded to {a['payment_method_id']}")
    else:
        raise ValueError(name)
    return f"I will {what}. {ask}"


class OracleAgent:
    """Follows the task's gold plan through real messages: asks for identification and parses the user's
    answer, looks things up one call at a time, states the write and waits for a yes, moves on to the next
    phase when the user changes their mind, and answers information requests."""

    def __init__(self, task, seed=0):
        self.script, self.rng = task["script"], random.Random(seed)
        self.phase, self.todo, self.stage = 0, [], "identify"

    def _phase(self):
        return self.script["phases"][self.phase]

    def _start_phase(self, done_reads=()):
        self.todo = [r for r in self._phase()["reads"] if r not in done_reads]
        self.stage = "reads"

    def act(self, messages):
        last = messages[-1]
        if self.stage == "identify":
            return self._identify(messages)
        if self.stage == "user_details":  # the lookup answered with the user id
            if last["content"].startswith("Error"):
                self.stage = "identify"
                return "I could not find your account. Could you double-check your details?"
            self.stage = "reads_start"
            if self.script["needs_user"]:
                return tool_call_text("get_user_details", user_id=last["content"])
        if self.stage == "reads_start":
            self._start_phase()
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
                done = self._phase()["reads"]
                self.phase += 1
                self._start_phase(done)
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
            "To verify your identity, please provide your email, or your first and last name and zip code.",
        ])
        if any(m["role"] == "assistant" for m in messages):
            return ask
        # the request restated in fixed words next to the user's own: a small model decides the action here,
        # and later turns (hundreds of tokens on) copy it from this sentence instead of the user's free wording
        return f"I can help you {self._phase()['gist']}. {ask}"

    def _propose(self):
        p = self._phase()
        if p["write"] is None:  # an information request: say the answer
            self.stage = "written"
            return p["answer"] + " " + self.rng.choice(["Anything else?", "Can I help with anything else?"])
        self.stage = "await_yes"
        extra = " ".join(k for k in p["confirm_keys"] if k not in json.dumps(p["write"]["arguments"]))
        return _confirm_text(p["write"], extra, self.rng)


# ----------------------------------------------------------------------------------------------------
# tools over MCP: synth.py is a client of env.py's MCP server (a subprocess over stdio)



class MCPToolClient:
    """Blocking MCP client over a server subprocess (one per client). Also a context manager.

    `command`: the server argv without the db, e.g. ["python", "env.py", "--mcp-server"]; "--db db_path"
    is appended. Default: this file's --serve. Not thread-safe per episode: give each worker its own client.
    """

    def __init__(self, db_path, command=None, timeout=60.0, errlog=None):
        # errlog: where the server's stderr goes (a file or subprocess.DEVNULL); None inherits ours.
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        command = list(command or [sys.executable, str(Path(env.__file__).resolve()), "--mcp-server"])
        params = StdioServerParameters(command=command[0], args=command[1:] + ["--db", str(db_path)],
                                       env=dict(os.environ), cwd=str(Path(__file__).resolve().parent))
        self.timeout = timeout
        self.episode = uuid.uuid4().hex
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        ready = concurrent.futures.Future()
        # The SDK's transport must be entered and exited in one task (anyio cancel scopes), so a single
        # long-lived task owns the connection; requests are separate tasks that share the session.
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
        tools, cursor = [], None
        while True:
            page = self._run(self._client.list_tools(cursor=cursor))
            tools += page.tools
            cursor = page.next_cursor
            if cursor is None:
                break
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}} for t in tools]

    def call_tool(self, name, arguments):
        """(content, is_error) like env.call_tool; never raises, a transport failure is an error string."""
        if arguments is None or isinstance(arguments, str):  # env.call_tool also takes these: decode as it does
            try:
                arguments = json.loads(arguments) if arguments and arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            # MCP carries only JSON objects. env rejects anything else before it reads the db, so its answer
            # on an empty db is exactly what the server would have said.
            return env.call_tool({}, name, arguments)
        try:
            result = self._run(self._client.call_tool(name, arguments, meta={env.EPISODE_KEY: self.episode}))
        except Exception as e:
            return f"Error: MCP call failed: {type(e).__name__}: {e}", True
        text = "".join(c.text for c in result.content if getattr(c, "type", None) == "text")
        return text, bool(result.is_error)

    def get_db(self):
        """The current episode's db (for the reward), as the server holds it."""
        result = self._run(self._client.read_resource(f"{env.DB_URI}/{self.episode}"))
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
        try:
            self._main.result(timeout=15)
        except Exception:  # a failed start was already reported; a dead server has nothing left to stop
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
    recs = []
    if not isinstance(args, dict):
        return recs
    order = db["orders"].get(args.get("order_id", ""))
    if order:
        recs += [order, db["users"].get(order["user_id"])]
    if args.get("user_id") in db["users"]:
        recs.append(db["users"][args["user_id"]])
    if args.get("product_id") in db["products"]:
        recs.append(db["products"][args["product_id"]])
    for u in db["users"].values():
        if u["email"].lower() == str(args.get("email", "")).lower() or (
                u["name"]["last_name"].lower() == str(args.get("last_name", "")).lower()):
            recs.append(u)
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


class LLMToolSimulator:
    """call_tool(db, name, args) whose answer comes from an LLM prompted with the tool's schema, the call and
    the slice of the db it may use. The real tool also runs on the episode's db (which the agent never sees),
    so the kept trajectories are verified by the same reward as everything else."""

    def __init__(self, backend, max_new_tokens=512):
        self.backend, self.max_new_tokens = backend, max_new_tokens
        self.schemas = {s["function"]["name"]: s for s in env.TOOL_SCHEMAS}

    def __call__(self, db, name, args):
        args, err = env.check_call(name, args)
        if err:  # unknown tools and bad arguments are refused before any simulation, as the real tools do
            return err, True
        memory = "\n".join(json.dumps(r) for r in db_slice(db, name, args))  # the state before the call
        env.call_tool(db, name, args)  # the real effect, which the reward checks and the agent never sees
        prompt = TOOL_SIM_PROMPT.format(schema=json.dumps(self.schemas[name]), memory=memory,
                                        call=json.dumps({"name": name, "arguments": args}))
        try:
            text = self.backend.chat([[{"role": "user", "content": prompt}]], self.max_new_tokens, 0.0)[0]
        except Exception as e:  # the simulator failing is a tool error the agent can read, not a crash
            return f"Error: tool simulator failed: {e}", True
        return check_simulated(name, text)


# ----------------------------------------------------------------------------------------------------
# a teacher LLM as the agent


class TeacherAgent:
    """A teacher LLM plays the agent. It sees the conversation and the tool schemas; its tool calls come back
    as Hermes <tool_call> text, the format rollout.parse_assistant reads."""

    def __init__(self, backend, max_new_tokens=512, temperature=0.0):
        self.backend, self.max_new_tokens, self.temperature = backend, max_new_tokens, temperature

    def act(self, messages):
        return self.backend.chat([messages], self.max_new_tokens, self.temperature, tools=env.TOOL_SCHEMAS)[0]


# ----------------------------------------------------------------------------------------------------
# the data folder: the generated shop and its task splits, written once


def prepare_data(data_dir, seed=0, n_users=60, n_train=400, n_test=60):
    """Generate the shop and its train/test tasks into data_dir (once) and load them."""
    os.makedirs(data_dir, exist_ok=True)
    shop = os.path.join(data_dir, "shop.json")
    if not os.path.exists(shop):
        db = env.generate_shop(seed, n_users)
        splits = env.generate_tasks(db, seed, n_train, n_test)
        with open(shop + ".tmp", "w") as f:
            json.dump(db, f)
        for name, tasks in splits.items():
            env.save_tasks(tasks, os.path.join(data_dir, f"{name}_tasks.jsonl"))
        os.replace(shop + ".tmp", shop)  # last, so a half-written folder is regenerated
    return (env.load_db(shop), env.load_tasks(os.path.join(data_dir, "train_tasks.jsonl")),
            env.load_tasks(os.path.join(data_dir, "test_tasks.jsonl")))


def synthesize(tasks, db, args, tools=env.TOOL_SCHEMAS):
    """Play every task once; return all episodes (the caller keeps those with reward 1)."""
    make_user = env.user_factory(args.user_llm, args.user_model)
    if args.agent == "oracle":
        make_agent = lambda task, seed: OracleAgent(task, seed)
    else:
        teacher = TeacherAgent(env.chat_backend(args.agent, args.agent_model))
        make_agent = lambda task, seed: teacher
    kw = dict(make_user=make_user, make_agent=make_agent, tools=tools, max_turns=args.max_turns)
    eps = []
    if args.tools == "mcp":  # one server; each episode is its own db copy on it, scored from the server's db
        with MCPToolClient(os.path.join(args.data_dir, "shop.json")) as client:
            for i, task in enumerate(tqdm(tasks, desc="synth (mcp)")):
                client.reset()
                ep, = run_episodes(None, None, [task], db, seed=args.seed + i, score=False,
                                   call_tool=lambda _db, name, a: client.call_tool(name, a), **kw)
                ep.db = client.get_db()
                eps.append(score_episode(ep, task, db))
        return eps
    call_tool = LLMToolSimulator(env.chat_backend(args.tool_llm, args.tool_model)) if args.tools == "llm" \
        else env.call_tool
    for i in tqdm(range(0, len(tasks), args.chunk), desc=f"synth ({args.tools})"):
        eps += run_episodes(None, None, tasks[i:i + args.chunk], db, seed=args.seed + i, call_tool=call_tool, **kw)
    return eps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", default=None)                   # default: <data-dir>/sft.jsonl
    p.add_argument("--agent", default="oracle")             # "oracle", a model path, or an OpenAI-compatible URL
    p.add_argument("--agent-model", default=None)           # model name at that endpoint
    p.add_argument("--user-llm", default=None)              # None: the scripted user; else a model path or a URL
    p.add_argument("--user-model", default=None)
    p.add_argument("--tools", default="env", choices=["env", "mcp", "llm"])
    p.add_argument("--tool-llm", default=None)              # with --tools llm: a model path or a URL
    p.add_argument("--tool-model", default=None)
    p.add_argument("--n-tasks", type=int, default=None)     # default: every train task
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--chunk", type=int, default=64)         # episodes played together
    p.add_argument("--seed", type=int, default=0)
    # the generated shop (used only when data-dir has none yet)
    p.add_argument("--n-users", type=int, default=60)
    p.add_argument("--n-train", type=int, default=400)
    p.add_argument("--n-test", type=int, default=60)
    args = p.parse_args()
    if args.tools == "llm" and not args.tool_llm:
        p.error("--tools llm needs --tool-llm (a model path or an OpenAI-compatible URL)")
    db, train, _ = prepare_data(args.data_dir, args.seed, args.n_users, args.n_train, args.n_test)
    tasks = train[:args.n_tasks] if args.n_tasks else train
    tools = env.TOOL_SCHEMAS
    if args.tools == "mcp":
        with MCPToolClient(os.path.join(args.data_dir, "shop.json")) as c:
            tools = c.list_tools()  # the schemas the agent sees are the server's
    eps = synthesize(tasks, db, args, tools)
    out = args.out or os.path.join(args.data_dir, "sft.jsonl")
    kept = [e for e in eps if e.reward == 1.0 and not e.errored]
    with open(out + ".tmp", "w") as f:
        for e in kept:
            f.write(json.dumps({"task_id": e.task_id, "kind": e.kind, "reward": e.reward, "tools": tools,
                                "messages": e.messages}) + "\n")
    os.replace(out + ".tmp", out)
    why = Counter("errored" if e.errored else f"{e.reward_info.get('failed') or 'db'} ({e.end_reason})"
                  for e in eps if e not in kept)
    print(f"tried {len(eps)}, kept {len(kept)} -> {out}")
    for reason, n in why.most_common():
        print(f"  dropped {n}: {reason}")


if __name__ == "__main__":
    main()
