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
from rollout import SYSTEM_PROMPT, run_episodes

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
        return self.rng.choice([
            "I can help with that. First, could you give me your email address, or your name and zip code?",
            "Sure. To verify your identity, please provide your email, or your first and last name and zip code.",
        ])

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
